"""Per-request sampling: parameters, and one batched sampler that turns logits into tokens.

The order is vLLM's: logprobs come from the raw logits (``token_logprobs``); then stop tokens
held back until ``min_tokens``, ``logit_bias``, the repetition / frequency / presence
penalties; greedy rows take the argmax there; sampled rows go on through temperature,
``min_p``, top-k / top-p and the draw. Each step is one batched operation over the rows
that use it, and a feature no row of the batch uses is skipped, so a plain greedy batch
still costs one argmax on the raw logits (whose tokens are the same as before).
Sampled rows draw from the request's own seeded generator, so a seeded request gives the
same tokens whatever else is in the batch. A row with a NaN/inf logit is reported as an
error instead of emitting a token.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from engine.outputs import TokenLogprobs

# Below this a positive temperature overflows the scaled logits (1e-40 made every row inf, and
# the multinomial draw then failed inside the engine loop); 0 is the way to ask for greedy.
MIN_TEMPERATURE = 1e-3
MAX_SEED = 2**63 - 1
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-MAX_PENALTY, MAX_PENALTY] (OpenAI's range)
MAX_REPETITION_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on one token's bias
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_LOGPROBS = 20  # alternatives reported per token (OpenAI's top_logprobs bound)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request (temperature 0 means greedy).

    ``repetition_penalty`` divides the positive logits (multiplies the negative ones) of every
    token seen in the prompt or the output; ``presence_penalty`` / ``frequency_penalty`` are
    subtracted once / once per occurrence for tokens of the output only. ``min_p`` drops tokens
    whose probability is below ``min_p`` times the top token's. ``logit_bias`` adds to given
    token ids' logits. ``min_tokens``: the stop tokens (EOS, ``stop_token_ids``) cannot be
    sampled before that many tokens. ``logprobs``: with each token, report its log-probability
    and that of the ``logprobs`` most likely tokens (0: its own only), from the raw logits.
    """

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias); a mapping is accepted
    min_tokens: int = 0
    logprobs: int | None = None

    def __post_init__(self) -> None:
        # Accept lists for convenience but store tuples so the record stays hashable/immutable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError("temperature must be a finite number >= 0")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be between 0 and {MAX_SEED}")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0 (0 disables it)")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be >= 0")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}]")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS_ENTRIES} tokens")
        if any(t < 0 or not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for t, b in self.logit_bias):
            raise ValueError(f"logit_bias maps token ids >= 0 to biases in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}]")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError("min_tokens must be in [0, max_tokens]")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _bias_pairs(bias: Mapping[int, float] | Iterable[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
    items = bias.items() if isinstance(bias, Mapping) else bias
    return tuple(sorted((int(t), float(b)) for t, b in items))


@dataclass
class SamplerRow:
    """One request as the sampler sees it: params, generator (None for greedy) and its tokens so far.

    ``prompt_token_ids`` / ``output_token_ids`` are the request's own lists (the penalties read
    them each step); ``stop_token_ids`` are the ids ``min_tokens`` holds back (its EOS ids
    unless ``ignore_eos``, and ``params.stop_token_ids``).
    """

    params: SamplingParams
    generator: torch.Generator | None = field(default=None)
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    stop_token_ids: tuple[int, ...] = ()
    _prompt_mask: torch.Tensor | None = field(default=None, repr=False)

    @property
    def holds_back_stops(self) -> bool:
        return bool(self.stop_token_ids) and len(self.output_token_ids) < self.params.min_tokens

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing to change the logits first: the argmax of the raw logits is its token."""
        p = self.params
        return p.greedy and not p.penalized and not p.logit_bias and not self.holds_back_stops

    def prompt_mask(self, vocab: int, device: torch.device) -> torch.Tensor:
        """Which tokens the prompt holds, as a [vocab] bool tensor (built once per request)."""
        mask = self._prompt_mask
        if mask is None or mask.shape[0] != vocab or mask.device != device:
            mask = torch.zeros(vocab, dtype=torch.bool, device=device)
            ids = [t for t in self.prompt_token_ids if 0 <= t < vocab]
            if ids:
                mask[torch.tensor(ids, device=device)] = True
            self._prompt_mask = mask
        return mask


def make_generator(params: SamplingParams, device: str | torch.device, fallback_seed: int) -> torch.Generator | None:
    """A private generator per request; unseeded requests get a fresh seed from the engine's RNG."""
    if params.greedy:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed if params.seed is not None else fallback_seed)
    return gen


def sample(logits: torch.Tensor, rows: list[SamplerRow]) -> tuple[list[int], list[str | None]]:
    """Return one token per row, and per row an error message (None when fine).

    ``logits`` is [num_rows, vocab] in any float dtype; it is not modified, and the rows that
    need more than an argmax are processed in float32.
    """
    # Cheap first: a row whose sum is finite has no NaN/inf (one reduction instead of four
    # full passes of isfinite().all(); with 49k-entry rows at batch 8 that was ~5 ms a step).
    # Only rows whose sum is not finite (an overflowing sum included) get the exact check.
    ok = torch.isfinite(logits.sum(dim=-1, dtype=torch.float32)).tolist()
    if not all(ok):
        ok = torch.isfinite(logits).all(dim=-1).tolist()
    # argmax needs no float32 copy: widening is monotonic, so the first maximum is the same row entry
    out = torch.argmax(logits, dim=-1).tolist()
    errors: list[str | None] = [
        None if fine else "model produced non-finite logits (NaN or inf); request stopped" for fine in ok
    ]
    todo = [i for i, row in enumerate(rows) if ok[i] and not row.plain_greedy]
    if todo:
        for i, token in zip(todo, _sample_processed(logits, todo, [rows[i] for i in todo]), strict=True):
            out[i] = token
    return out, errors


def _sample_processed(logits: torch.Tensor, index: list[int], rows: list[SamplerRow]) -> list[int]:
    """Tokens of the rows ``index`` of ``logits`` that need processing (a float32 copy is processed)."""
    x = process_logits(logits[torch.tensor(index, device=logits.device)].float(), rows)  # indexing copies
    tokens = [0] * len(rows)
    greedy = [j for j, r in enumerate(rows) if r.params.greedy]
    drawn = [j for j, r in enumerate(rows) if not r.params.greedy]
    if greedy:
        for j, t in zip(greedy, _subset(x, greedy).argmax(dim=-1).tolist(), strict=True):
            tokens[j] = t
    if drawn:
        sub = [rows[j] for j in drawn]
        y = warp_logits(_subset(x, drawn), sub)
        for j, t in zip(drawn, _draw(torch.softmax(y, dim=-1), [r.generator for r in sub]), strict=True):
            tokens[j] = t
    return tokens


def process_logits(x: torch.Tensor, rows: list[SamplerRow]) -> torch.Tensor:
    """In place on float32 ``x`` [rows, vocab]: stop tokens held back by ``min_tokens``, ``logit_bias``,
    then the penalties. A greedy row's token is the argmax of the result."""
    _hold_back_stops(x, rows)
    _add_logit_bias(x, rows)
    _apply_penalties(x, rows)
    return x


def warp_logits(y: torch.Tensor, rows: list[SamplerRow]) -> torch.Tensor:
    """In place on processed logits of sampled rows: temperature, ``min_p``, top-k / top-p. The token is
    drawn from the softmax of the result."""
    y.div_(torch.tensor([r.params.temperature for r in rows], device=y.device).unsqueeze(1))
    _apply_min_p(y, rows)
    _apply_top_k_top_p(y, rows)
    return y


def _subset(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Rows ``rows`` of ``x``: ``x`` itself when that is all of them, else a copy."""
    return x if len(rows) == x.shape[0] else x[torch.tensor(rows, device=x.device)]


def _hold_back_stops(x: torch.Tensor, rows: list[SamplerRow]) -> None:
    """``min_tokens``: the stop tokens of rows that have not reached it get -inf."""
    vocab = x.shape[1]
    pairs = [(j, t) for j, r in enumerate(rows) if r.holds_back_stops for t in r.stop_token_ids if t < vocab]
    if pairs:
        r_idx, t_idx = torch.tensor(pairs, device=x.device).unbind(1)
        x[r_idx, t_idx] = float("-inf")


def _add_logit_bias(x: torch.Tensor, rows: list[SamplerRow]) -> None:
    vocab = x.shape[1]
    triples = [(j, t, b) for j, r in enumerate(rows) for t, b in r.params.logit_bias if t < vocab]
    if triples:
        r_idx = torch.tensor([j for j, _, _ in triples], device=x.device)
        t_idx = torch.tensor([t for _, t, _ in triples], device=x.device)
        bias = torch.tensor([b for _, _, b in triples], device=x.device)
        x.index_put_((r_idx, t_idx), bias, accumulate=True)


def _apply_penalties(x: torch.Tensor, rows: list[SamplerRow]) -> None:
    """Repetition (prompt + output tokens), frequency and presence (output tokens) penalties, as vLLM.

    Output tokens are counted by one scatter over a padded [rows, longest output] index;
    the prompt's tokens come from a mask built once per request.
    """
    rows_p = [j for j, r in enumerate(rows) if r.params.penalized]
    if not rows_p:
        return
    dev, vocab = x.device, x.shape[1]
    sub = [rows[j] for j in rows_p]
    xp = _subset(x, rows_p)
    outputs = [list(r.output_token_ids) for r in sub]
    longest = max(len(o) for o in outputs)
    counts = None
    if longest:
        # padding goes to an extra column that is dropped; out-of-vocab ids cannot occur (checked on sampling)
        index = torch.tensor([o + [vocab] * (longest - len(o)) for o in outputs], device=dev)
        counts = torch.zeros(len(sub), vocab + 1, device=dev).scatter_add_(
            1, index, torch.ones(index.shape, device=dev)
        )
        counts = counts[:, :vocab]
    if any(r.params.repetition_penalty != 1.0 for r in sub):
        no_mask = torch.zeros(vocab, dtype=torch.bool, device=dev)
        seen = torch.stack([r.prompt_mask(vocab, dev) if r.params.repetition_penalty != 1.0 else no_mask for r in sub])
        if counts is not None:
            seen |= counts > 0
        rep = torch.tensor([r.params.repetition_penalty for r in sub], device=dev).unsqueeze(1)
        xp = torch.where(seen, torch.where(xp > 0, xp / rep, xp * rep), xp)
    if counts is not None and any(r.params.frequency_penalty or r.params.presence_penalty for r in sub):
        freq = torch.tensor([r.params.frequency_penalty for r in sub], device=dev).unsqueeze(1)
        pres = torch.tensor([r.params.presence_penalty for r in sub], device=dev).unsqueeze(1)
        xp = xp - freq * counts - pres * (counts > 0)
    if len(rows_p) == x.shape[0]:
        x.copy_(xp)
    else:
        x[torch.tensor(rows_p, device=dev)] = xp


def _apply_min_p(y: torch.Tensor, rows: list[SamplerRow]) -> None:
    """Drop tokens whose probability is below ``min_p`` times the most likely token's."""
    if not any(r.params.min_p > 0 for r in rows):
        return
    probs = torch.softmax(y, dim=-1)
    min_p = torch.tensor([r.params.min_p for r in rows], device=y.device).unsqueeze(1)
    y.masked_fill_(probs < probs.amax(dim=-1, keepdim=True) * min_p, float("-inf"))


def _apply_top_k_top_p(y: torch.Tensor, rows: list[SamplerRow]) -> None:
    """Keep each row's ``top_k`` largest logits (ties with the k-th kept), then its ``top_p`` mass.

    Top-p sorts the rows that use either (top-k then reads its threshold off the sort); top-k
    alone needs only a topk of the largest k asked.
    """
    vocab = y.shape[1]
    ks = [r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in rows]
    use_p = [r.params.top_p < 1.0 for r in rows]
    chosen = [j for j in range(len(rows)) if ks[j] < vocab or use_p[j]]
    if not chosen:
        return
    dev = y.device
    yc = _subset(y, chosen)
    kth_at = torch.tensor([ks[j] - 1 for j in chosen], device=dev).unsqueeze(1)
    if any(use_p[j] for j in chosen):
        sorted_logits, order = torch.sort(yc, dim=-1, descending=True)
        sorted_logits.masked_fill_(sorted_logits < sorted_logits.gather(1, kth_at), float("-inf"))
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop tokens once the mass *before* them already reaches top_p (always keep the first).
        top_p = torch.tensor([rows[j].params.top_p if use_p[j] else math.inf for j in chosen], device=dev)
        sorted_logits.masked_fill_((probs.cumsum(dim=-1) - probs) >= top_p.unsqueeze(1), float("-inf"))
        yc = torch.full_like(yc, float("-inf")).scatter(1, order, sorted_logits)
    else:
        kth = torch.topk(yc, max(ks[j] for j in chosen), dim=-1).values.gather(1, kth_at)
        yc = yc.masked_fill(yc < kth, float("-inf"))
    if len(chosen) == y.shape[0]:
        y.copy_(yc)
    else:
        y[torch.tensor(chosen, device=dev)] = yc


def _draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of ``probs`` by inverse CDF: one uniform number from each row's generator."""
    dev = probs.device
    u = torch.stack([torch.rand((), generator=g, device=dev) for g in generators])
    cdf = probs.cumsum(dim=-1)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).clamp_(max=probs.shape[1] - 1)
    # a token without mass is reachable only by rounding at the top end: take the last token with mass
    empty = probs.gather(1, idx) == 0
    if bool(empty.any()):
        last = (probs > 0).int().cumsum(dim=-1).argmax(dim=-1, keepdim=True)
        idx = torch.where(empty, last, idx)
    return idx.squeeze(1).tolist()


def token_logprobs(logits: torch.Tensor, rows: list[SamplerRow], tokens: list[int]) -> list[TokenLogprobs | None]:
    """For rows whose request asks for logprobs: the sampled token's log-probability and the most
    likely tokens', from the raw logits (before any penalty, bias or temperature, as vLLM)."""
    want = [i for i, r in enumerate(rows) if r.params.logprobs is not None and tokens[i] >= 0]
    out: list[TokenLogprobs | None] = [None] * len(rows)
    if not want:
        return out
    dev = logits.device
    lp = torch.log_softmax(logits[torch.tensor(want, device=dev)].float(), dim=-1)
    chosen = lp.gather(1, torch.tensor([tokens[i] for i in want], device=dev).unsqueeze(1)).squeeze(1).tolist()
    n = max(rows[i].params.logprobs or 0 for i in want)
    top_v, top_i = lp.topk(n, dim=-1) if n else (lp[:, :0], lp[:, :0].long())
    top_v, top_i = top_v.tolist(), top_i.tolist()
    for j, i in enumerate(want):
        k = rows[i].params.logprobs or 0
        top = tuple(zip(top_i[j][:k], top_v[j][:k], strict=True))
        out[i] = TokenLogprobs(tokens[i], chosen[j], top)
    return out
