"""The engine's Prometheus metrics: one collector that reads the engine's ``stats()`` at scrape time.

Why a collector and not Counter/Gauge objects: the engine already counts everything in
``LLMEngine.stats()`` (the engine thread publishes a snapshot after each step), so a
scrape just reads that dict; nothing has to be incremented on the hot path, and the
figures cannot drift from what ``stats()`` says. Every metric is named ``parley_engine_*``,
wherever it is exported:

* ``engine/openai_api/api_server.py`` serves it at ``/metrics`` of ``parley engine serve``;
* a server that runs the engine in process registers the same collector in its own
  registry::

      from engine.metrics import EngineCollector
      registry.register(EngineCollector(async_engine.stats))

The constructor takes any callable returning the stats dict (``LLMEngine.stats``,
``AsyncLLMEngine.stats``). Keys it does not find are skipped, so a partial dict is fine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) with linear interpolation (numpy's default method); None when empty.

    The one definition for the engine's and the voice app's figures (benchmarks, the latency breaker).
    """
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


PREFIX = "parley_engine_"


def _stat(key: str) -> Callable[[dict], float | None]:
    def get(stats: dict) -> float | None:
        value = stats.get(key)
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None

    return get


def _kv_blocks_free(stats: dict) -> float | None:
    used, total = _stat("kv_blocks_used")(stats), _stat("kv_blocks_total")(stats)
    return None if used is None or total is None else total - used


def _kv_cache_usage(stats: dict) -> float | None:
    used, total = _stat("kv_blocks_used")(stats), _stat("kv_blocks_total")(stats)
    return None if used is None or not total else used / total


# (kind, name without the prefix, help, value from the stats dict); counters get "_total" on export
METRICS: list[tuple[str, str, str, Callable[[dict], float | None]]] = [
    ("counter", "prompt_tokens", "Prompt tokens of admitted requests.", _stat("prompt_tokens_total")),
    ("counter", "generation_tokens", "Tokens generated.", _stat("generation_tokens_total")),
    (
        "counter",
        "requests_finished",
        "Requests finished, for any reason (stop, length, abort, error).",
        _stat("requests_finished_total"),
    ),
    (
        "counter",
        "requests_aborted",
        "Requests aborted (client gone, barge-in, explicit abort).",
        _stat("requests_aborted_total"),
    ),
    (
        "counter",
        "preemptions",
        "Running requests preempted for lack of KV blocks (recomputed later).",
        _stat("num_preemptions_total"),
    ),
    ("gauge", "requests_running", "Requests in the running batch.", _stat("running")),
    ("gauge", "requests_waiting", "Requests waiting to be scheduled (new or preempted).", _stat("waiting")),
    ("gauge", "kv_blocks_used", "KV cache blocks held by requests.", _stat("kv_blocks_used")),
    ("gauge", "kv_blocks_free", "KV cache blocks no request holds (cached prefixes included).", _kv_blocks_free),
    ("gauge", "kv_blocks_total", "KV cache blocks in the pool.", _stat("kv_blocks_total")),
    ("gauge", "kv_cache_usage_ratio", "Fraction of the KV cache blocks held by requests.", _kv_cache_usage),
    (
        "gauge",
        "prefix_cache_hit_rate",
        "Fraction of looked-up prompt tokens served from the prefix cache.",
        _stat("prefix_cache_hit_rate"),
    ),
    (
        "gauge",
        "generation_tokens_per_second",
        "Tokens generated per second over the last 5 s.",
        _stat("generation_tokens_per_s"),
    ),
]
# string-valued stats, exported as the labels of parley_engine_model_info
INFO_KEYS = ("linear_kernel",)
_FAMILIES = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}


class EngineCollector(Collector):
    """Turns ``stats_fn()`` into ``parley_engine_*`` metric families at every scrape.

    ``stats_fn``: returns the engine's stats dict (``LLMEngine.stats`` / ``AsyncLLMEngine.stats``).
    ``model_name``: when given, every sample carries a ``model_name`` label (as vLLM's do).
    """

    def __init__(self, stats_fn: Callable[[], dict], model_name: str | None = None) -> None:
        self.stats_fn = stats_fn
        self.labels = {"model_name": model_name} if model_name is not None else {}

    def describe(self) -> Iterator[Metric]:
        """Every family this collector may export, without samples (lets a registry refuse duplicate names)."""
        names = list(self.labels)
        for kind, name, help_, _ in METRICS:
            yield _FAMILIES[kind](PREFIX + name, help_, labels=names)
        yield InfoMetricFamily(PREFIX + "model", "How the served model runs.", labels=names)

    def collect(self) -> Iterator[Metric]:
        try:
            stats = dict(self.stats_fn())
        except Exception:  # a scrape must not fail because the engine is gone
            log.exception("engine stats unavailable")
            return
        names = list(self.labels)
        values = list(self.labels.values())
        for kind, name, help_, get in METRICS:
            value = get(stats)
            if value is not None:
                family = _FAMILIES[kind](PREFIX + name, help_, labels=names)
                family.add_metric(values, value)
                yield family
        info = {key: stats[key] for key in INFO_KEYS if isinstance(stats.get(key), str)}
        if info:
            family = InfoMetricFamily(PREFIX + "model", "How the served model runs.", labels=names)
            family.add_metric(values, info)
            yield family
