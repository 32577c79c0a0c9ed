"""engine/metrics.py: the engine's stats() as parley_engine_* Prometheus families (no model needed)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine.metrics import EngineCollector

STATS = {
    "running": 2,
    "waiting": 1,
    "kv_blocks_used": 30,
    "kv_blocks_total": 120,
    "prefix_cache_hit_rate": 0.25,
    "generation_tokens_per_s": 41.5,
    "prompt_tokens_total": 900,
    "generation_tokens_total": 300,
    "requests_aborted_total": 1,
    "requests_finished_total": 7,
    "num_preemptions_total": 3,
    "linear_kernel": "int8pack",
}


def _scrape(collector: EngineCollector) -> dict[str, tuple[str, dict, float]]:
    registry = CollectorRegistry()
    registry.register(collector)
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            out[sample.name] = (family.type, sample.labels, sample.value)
    return out


def test_stats_become_counters_and_gauges():
    m = _scrape(EngineCollector(lambda: STATS))
    assert m["parley_engine_generation_tokens_total"] == ("counter", {}, 300)
    assert m["parley_engine_prompt_tokens_total"][0] == "counter"
    assert m["parley_engine_requests_finished_total"][2] == 7
    assert m["parley_engine_requests_aborted_total"][2] == 1
    assert m["parley_engine_preemptions_total"][2] == 3
    assert m["parley_engine_requests_running"] == ("gauge", {}, 2)
    assert m["parley_engine_requests_waiting"][2] == 1
    assert m["parley_engine_kv_blocks_used"][2] == 30
    assert m["parley_engine_kv_blocks_free"][2] == 90
    assert m["parley_engine_kv_blocks_total"][2] == 120
    assert m["parley_engine_kv_cache_usage_ratio"][2] == pytest.approx(0.25)
    assert m["parley_engine_prefix_cache_hit_rate"][2] == 0.25
    assert m["parley_engine_generation_tokens_per_second"][2] == 41.5
    assert m["parley_engine_model_info"][1] == {"linear_kernel": "int8pack"}


def test_model_name_label_and_missing_keys():
    m = _scrape(EngineCollector(lambda: {"running": 1, "kv_blocks_used": 0}, model_name="smol"))
    assert m == {"parley_engine_requests_running": ("gauge", {"model_name": "smol"}, 1.0)} | {
        "parley_engine_kv_blocks_used": ("gauge", {"model_name": "smol"}, 0.0)
    }


def test_a_failing_stats_function_gives_an_empty_scrape():
    def broken() -> dict:
        raise RuntimeError("engine gone")

    assert _scrape(EngineCollector(broken)) == {}


def test_describe_lets_a_registry_refuse_a_second_engine_collector():
    registry = CollectorRegistry()
    registry.register(EngineCollector(lambda: STATS))
    with pytest.raises(ValueError, match="Duplicated"):
        registry.register(EngineCollector(lambda: STATS))
