"""Per-request sampling: parameters, and one batched sampler that turns logits into tokens.

The order is vLLM's: logprobs come from the raw logits (``token_logprobs``); then a request's
grammar (the tokens it does not allow get -inf: ``engine.structured_output.grammar``), stop tokens
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

from engine.fused import loaded_fused_kernels
from engine.outputs import TokenLogprobs
from engine.structured_output.grammar import GrammarState, LazyGrammar, grammar_bias

# Below this a positive temperature overflows the scaled logits (1e-40 made every row inf, and
# the multinomial draw then failed inside the engine loop); 0 is the way to ask for greedy.
MIN_TEMPERATURE = 1e-3
MAX_SEED = 2**63 - 1
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-MAX_PENALTY, MAX_PENALTY] (OpenAI's range)
MAX_REPETITION_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on one token's bias
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_LOGPROBS = 20  # alternatives reported per token (OpenAI's top_logprobs bound)
# DRY (llama.cpp / text-generation-webui): multiplier 0 is off; bounds as text-generation-webui's
MAX_DRY_MULTIPLIER = 5.0
MAX_DRY_BASE = 4.0
MAX_DRY_ALLOWED_LENGTH = 20
MAX_DRY_MATCH = 50  # a repeat is matched this far back at most (keeps base ** length finite, and the scan short)
MAX_DRY_CONTEXT_TOKENS = 8192  # dry_context holds at most this many token ids in all (the scan is per step)
DRY_SEQUENCE_BREAKERS = ("\n", ":", '"', "*")


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
    ``prompt_logprobs_from``: also report the log-probability of each prompt token from that index on
    (``RequestOutput.prompt_logprobs``), from the raw logits, up to ``prompt_logprobs_to`` (exclusive; None:
    the prompt's end); the prefix cache serves only the tokens before them unless their scores were kept
    (``engine.prompt_scores``), so they are computed (a voice turn scores the user's words: ``app.stages.llm``).
    ``prompt_top_logprobs``: with each scored prompt token, also the log-probabilities of that many likeliest
    tokens at its position, and ``prompt_logprobs_token_ids``: of these tokens, whatever their rank
    (``RequestOutput.prompt_top_logprobs``); both need the position's logits, so such a request computes its
    scored tokens even where their scores were kept (a voice reply reads the end-of-turn verdict at the user's
    last word from its own prefill: ``app.stages.llm``).
    ``dry_*``: llama.cpp's DRY ("don't repeat yourself") penalty, off while ``dry_multiplier`` is 0
    (see ``_apply_dry``); ``dry_context``: token sequences DRY reads too, as if they came before the prompt,
    each apart (no repeat is matched across their ends): text not to be said again that the prompt does not hold,
    a chat's earlier replies it leaves out (``app.stages.llm``). ``grammar``: an llguidance grammar the tokens must follow
    (``engine.structured_output.grammar``); ``lazy_grammar``: one that applies from a trigger on (free text or a
    well-formed call: ``LazyGrammar``). ``skip_special_tokens``: leave special tokens out of the text (a
    tool-call marker that is one, Mistral's ``[TOOL_CALLS]``, must stay in).
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
    prompt_logprobs_from: int | None = None
    prompt_logprobs_to: int | None = None
    prompt_top_logprobs: int | None = None
    prompt_logprobs_token_ids: tuple[int, ...] = ()
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_sequence_breakers: tuple[str, ...] = DRY_SEQUENCE_BREAKERS
    dry_context: tuple[tuple[int, ...], ...] = ()
    grammar: str | None = None
    lazy_grammar: LazyGrammar | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        # Accept lists for convenience but store tuples so the record stays hashable/immutable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        object.__setattr__(self, "dry_sequence_breakers", tuple(self.dry_sequence_breakers))
        object.__setattr__(self, "dry_context", tuple(tuple(int(t) for t in seq) for seq in self.dry_context))
        object.__setattr__(self, "prompt_logprobs_token_ids", tuple(int(t) for t in self.prompt_logprobs_token_ids))
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
        if self.prompt_logprobs_from is not None and self.prompt_logprobs_from < 1:
            raise ValueError("prompt_logprobs_from must be >= 1 (the first token has no log-probability)")
        if self.prompt_logprobs_to is not None and (
            self.prompt_logprobs_from is None or self.prompt_logprobs_to <= self.prompt_logprobs_from
        ):
            raise ValueError("prompt_logprobs_to must come with prompt_logprobs_from, and after it")
        if (
            self.prompt_top_logprobs is not None or self.prompt_logprobs_token_ids
        ) and self.prompt_logprobs_from is None:
            raise ValueError("prompt_top_logprobs and prompt_logprobs_token_ids must come with prompt_logprobs_from")
        if self.prompt_top_logprobs is not None and not 0 <= self.prompt_top_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_top_logprobs must be in [0, {MAX_LOGPROBS}]")
        if len(self.prompt_logprobs_token_ids) > MAX_LOGPROBS or any(t < 0 for t in self.prompt_logprobs_token_ids):
            raise ValueError(f"prompt_logprobs_token_ids holds at most {MAX_LOGPROBS} token ids >= 0")
        if not 0 <= self.dry_multiplier <= MAX_DRY_MULTIPLIER:
            raise ValueError(f"dry_multiplier must be in [0, {MAX_DRY_MULTIPLIER}]")
        if not 1 < self.dry_base <= MAX_DRY_BASE:
            raise ValueError(f"dry_base must be in (1, {MAX_DRY_BASE}]")
        if not 1 <= self.dry_allowed_length <= MAX_DRY_ALLOWED_LENGTH:
            raise ValueError(f"dry_allowed_length must be in [1, {MAX_DRY_ALLOWED_LENGTH}]")
        if any(not b for b in self.dry_sequence_breakers):
            raise ValueError("dry_sequence_breakers must be non-empty strings")
        if sum(map(len, self.dry_context)) > MAX_DRY_CONTEXT_TOKENS or any(t < 0 for s in self.dry_context for t in s):
            raise ValueError(f"dry_context holds at most {MAX_DRY_CONTEXT_TOKENS} token ids >= 0 in all")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def prompt_logits_read(self) -> bool:
        """Whether the scored prompt positions' distributions are reported, not only their tokens' scores."""
        return self.prompt_top_logprobs is not None or bool(self.prompt_logprobs_token_ids)

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def dry(self) -> bool:
        return self.dry_multiplier > 0


def _bias_pairs(bias: Mapping[int, float] | Iterable[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
    items = bias.items() if isinstance(bias, Mapping) else bias
    return tuple(sorted((int(t), float(b)) for t, b in items))


@dataclass
class SamplerRow:
    """One request as the sampler sees it: params, generator (None for greedy) and its tokens so far.

    ``prompt_token_ids`` / ``output_token_ids`` are the request's own lists (the penalties read
    them each step); ``stop_token_ids`` are the ids ``min_tokens`` holds back (its EOS ids
    unless ``ignore_eos``, and ``params.stop_token_ids``); ``dry_breakers`` the ids of the tokens
    whose text holds one of ``params.dry_sequence_breakers``; ``grammar`` the request's matcher
    when its params have a grammar (the engine advances it past each token).
    """

    params: SamplingParams
    generator: torch.Generator | None = field(default=None)
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    stop_token_ids: tuple[int, ...] = ()
    dry_breakers: frozenset[int] = frozenset()
    grammar: GrammarState | None = None
    _prompt_ids: torch.Tensor | None = field(default=None, repr=False)
    _dry_context: list[int] | None = field(default=None, repr=False)

    @property
    def holds_back_stops(self) -> bool:
        return bool(self.stop_token_ids) and len(self.output_token_ids) < self.params.min_tokens

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing to change the logits first: the argmax of the raw logits is its token."""
        p = self.params
        return (
            p.greedy
            and not p.penalized
            and not p.dry
            and not p.logit_bias
            and not self.holds_back_stops
            and self.grammar is None
        )

    def dry_context(self) -> list[int]:
        """``params.dry_context`` as one list, each sequence followed by -1 (no token: a repeat stops there)."""
        if self._dry_context is None:
            self._dry_context = [t for seq in self.params.dry_context for t in (*seq, -1)]
        return self._dry_context

    def prompt_ids(self, vocab: int) -> torch.Tensor:
        """The prompt's distinct token ids (a CPU tensor, found once per request)."""
        if self._prompt_ids is None:
            ids = torch.tensor(list(self.prompt_token_ids), dtype=torch.long)
            self._prompt_ids = torch.unique(ids[(ids >= 0) & (ids < vocab)])
        return self._prompt_ids


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
    errors: list[str | None] = [
        None if fine else "model produced non-finite logits (NaN or inf); request stopped" for fine in ok
    ]
    todo = [i for i, row in enumerate(rows) if ok[i] and not row.plain_greedy]
    if len(todo) == len(rows):
        out = [-1] * len(rows)
    else:
        # argmax needs no float32 copy: widening is monotonic, so the first maximum is the same row entry
        # (every row: a subset would cost a copy; the processed rows are replaced below)
        out = argmax_rows(logits).tolist()
    if todo:
        for i, token in zip(todo, _sample_processed(logits, todo, [rows[i] for i in todo]), strict=True):
            out[i] = token
    return out, errors


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(logits, dim=-1)`` of a [rows, vocab] tensor (the first maximum; a NaN counts as one): the fused
    kernel where a CPU model loaded it, two vector passes instead of ATen's value-at-a-time loop (the default
    brain's 151,936 logits: ~550 us in bfloat16 and ~130 in float32, 3 % of its decode step)."""
    kernels = loaded_fused_kernels() if logits.device.type == "cpu" and logits.dim() == 2 else None
    if kernels is None:
        return torch.argmax(logits, dim=-1)
    return kernels.argmax_rows(logits.contiguous())


def _sample_processed(logits: torch.Tensor, index: list[int], rows: list[SamplerRow]) -> list[int]:
    """Tokens of the rows ``index`` of ``logits`` that need processing (a float32 copy is processed)."""
    x = process_logits(logits[torch.tensor(index, device=logits.device)].float(), rows)  # indexing copies
    tokens = [0] * len(rows)
    greedy = [j for j, r in enumerate(rows) if r.params.greedy]
    drawn = [j for j, r in enumerate(rows) if not r.params.greedy]
    if greedy:
        for j, t in zip(greedy, argmax_rows(_subset(x, greedy)).tolist(), strict=True):
            tokens[j] = t
    if drawn:
        sub = [rows[j] for j in drawn]
        y = warp_logits(_subset(x, drawn), sub)
        for j, t in zip(drawn, _draw(torch.softmax(y, dim=-1), [r.generator for r in sub]), strict=True):
            tokens[j] = t
    return tokens


def process_logits(x: torch.Tensor, rows: list[SamplerRow]) -> torch.Tensor:
    """In place on float32 ``x`` [rows, vocab]: the grammars' masks, stop tokens held back by ``min_tokens``,
    ``logit_bias``, then the penalties and DRY. A greedy row's token is the argmax of the result."""
    _apply_grammars(x, rows)
    _hold_back_stops(x, rows)
    _add_logit_bias(x, rows)
    _apply_penalties(x, rows)
    _apply_dry(x, rows)
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


def _apply_grammars(x: torch.Tensor, rows: list[SamplerRow]) -> None:
    """The tokens a row's grammar does not allow get -inf (the masks of all such rows are filled at once)."""
    at = [j for j, r in enumerate(rows) if r.grammar is not None]
    if not at:
        return
    bias = grammar_bias([rows[j].grammar for j in at], x.shape[1]).to(x.device)
    if len(at) == x.shape[0]:
        x.add_(bias)
    else:
        x.index_add_(0, torch.tensor(at, device=x.device), bias)


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

    Only the logits of tokens a row has seen change, so only those are gathered (a padded
    [rows, seen tokens] index), penalized and written back: a few hundred entries a row instead
    of the whole vocabulary. Output tokens are counted by one scatter; the prompt's distinct
    tokens are found once per request. A token seen several times is gathered several times
    and gets the same new value each time.
    """
    rows_p = [j for j, r in enumerate(rows) if r.params.penalized]
    if not rows_p:
        return
    dev, vocab = x.device, x.shape[1]
    sub = [rows[j] for j in rows_p]
    outputs = [torch.tensor(list(r.output_token_ids), dtype=torch.long) for r in sub]
    seen = [
        torch.cat([r.prompt_ids(vocab), out]) if r.params.repetition_penalty != 1.0 else out
        for r, out in zip(sub, outputs, strict=True)
    ]
    longest = max(len(s) for s in seen)
    if not longest:
        return  # nothing seen yet: no penalty applies
    # padding repeats a row's first seen token (or token 0, whose value then stays as it is)
    index = torch.zeros(len(sub), longest, dtype=torch.long)
    for i, s in enumerate(seen):
        index[i, : len(s)] = s
        index[i, len(s) :] = s[0] if len(s) else 0
    longest_out = max(len(o) for o in outputs)
    out_index = torch.full((len(sub), max(longest_out, 1)), vocab, dtype=torch.long)  # pads to a dropped column
    for i, o in enumerate(outputs):
        out_index[i, : len(o)] = o
    index, out_index = index.to(dev), out_index.to(dev)
    counts = torch.zeros(len(sub), vocab + 1, device=dev)
    counts = counts.scatter_add_(1, out_index, torch.ones(out_index.shape, device=dev)).gather(1, index)
    at = torch.tensor(rows_p, device=dev).unsqueeze(1)
    values = x[at, index]
    rep = torch.tensor([r.params.repetition_penalty for r in sub], device=dev).unsqueeze(1)
    freq = torch.tensor([r.params.frequency_penalty for r in sub], device=dev).unsqueeze(1)
    pres = torch.tensor([r.params.presence_penalty for r in sub], device=dev).unsqueeze(1)
    values = torch.where(values > 0, values / rep, values * rep)  # every gathered token was seen
    x[at, index] = values - freq * counts - pres * (counts > 0)


def _apply_dry(x: torch.Tensor, rows: list[SamplerRow]) -> None:
    """DRY, as text-generation-webui's reference (by its author) and llama.cpp: a token that would
    continue a repeat of the context's end gets ``multiplier * base ** (n - allowed_length)`` taken
    off its logit, n being the length of the repeated sequence (at least ``allowed_length``).

    The repeat: the context (``dry_context``, prompt, output) ends with tokens t[-n:] that also occur earlier,
    followed there by the token to penalize. Matches do not extend across a sequence breaker, and
    a breaker is never penalized; unlike the reference, neither is a stop token (EOS). Per row a
    scan of the context in Python (only rows that use DRY); the penalties are written at once.
    """
    triples = []
    for j, r in enumerate(rows):
        if r.params.dry:
            triples += [(j, t, penalty) for t, penalty in _dry_penalties(r).items()]
    if triples:
        dev = x.device
        r_idx = torch.tensor([j for j, _, _ in triples], device=dev)
        t_idx = torch.tensor([t for _, t, _ in triples], device=dev)
        x.index_put_((r_idx, t_idx), -torch.tensor([v for _, _, v in triples], device=dev), accumulate=True)


def _dry_penalties(row: SamplerRow) -> dict[int, float]:
    """Token id -> DRY penalty for one row (see ``_apply_dry``)."""
    p, breakers = row.params, row.dry_breakers
    ctx = [*row.dry_context(), *row.prompt_token_ids, *row.output_token_ids]
    if len(ctx) < 2 or ctx[-1] in breakers:
        return {}
    last = ctx[-1]
    longest: dict[int, int] = {}  # token -> longest repeat it would continue
    for i in range(len(ctx) - 1):
        if ctx[i] != last or ctx[i + 1] < 0 or ctx[i + 1] in breakers:  # (-1: a dry_context sequence's end)
            continue
        n = 1
        while n < MAX_DRY_MATCH and i - n >= 0:
            before = ctx[-(n + 1)]
            if ctx[i - n] != before or before in breakers:
                break
            n += 1
        following = ctx[i + 1]
        longest[following] = max(n, longest.get(following, 0))
    # In a chat an earlier reply's end ("... glad!" EOS) is in the prompt: a penalized EOS made replies run on
    return {
        t: p.dry_multiplier * p.dry_base ** (n - p.dry_allowed_length)
        for t, n in longest.items()
        if n >= p.dry_allowed_length and t not in row.stop_token_ids
    }


def _apply_min_p(y: torch.Tensor, rows: list[SamplerRow]) -> None:
    """Drop tokens whose probability is below ``min_p`` times the most likely token's."""
    if not any(r.params.min_p > 0 for r in rows):
        return
    probs = torch.softmax(y, dim=-1)
    min_p = torch.tensor([r.params.min_p for r in rows], device=y.device).unsqueeze(1)
    y.masked_fill_(probs < probs.amax(dim=-1, keepdim=True) * min_p, float("-inf"))


_TOP_P_CANDIDATES = 256  # a top-p row without top_k first looks for its cut among this many likeliest tokens


def _apply_top_k_top_p(y: torch.Tensor, rows: list[SamplerRow]) -> None:
    """Keep each row's ``top_k`` largest logits (ties with the k-th kept), then the most likely tokens
    until the mass *before* a token reaches its ``top_p`` (the first is always kept); -inf for the rest.

    Why no sort: sorting a 49k vocabulary costs ~10 ms on a CPU core, while the cut lies among
    the k largest with top_k and nearly always among the few likeliest without. So the rows that
    use either work on one topk of candidates (``_top_k_top_p``).
    """
    vocab = y.shape[1]
    ks = [r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in rows]
    chosen = [j for j in range(len(rows)) if ks[j] < vocab or rows[j].params.top_p < 1.0]
    if not chosen:
        return
    k = [ks[j] for j in chosen]
    # one candidate beyond the largest k: a tie of it with the k-th says the ties may go on beyond
    limit = min(vocab, max(kj + 1 if kj < vocab else _TOP_P_CANDIDATES for kj in k))
    out = _top_k_top_p(_subset(y, chosen), k, [rows[j].params.top_p for j in chosen], limit)
    if len(chosen) == y.shape[0]:
        y.copy_(out)
    else:
        y[torch.tensor(chosen, device=y.device)] = out


def _top_k_top_p(y: torch.Tensor, k: list[int], p: list[float], limit: int) -> torch.Tensor:
    """``_apply_top_k_top_p`` on the ``limit`` largest logits of each row (k = vocab: no top-k).

    A row whose cut these candidates do not settle (ties with the k-th beyond them, or a top-p
    mass they do not reach) is done again with more: all its ties, or eight times as many.
    """
    vocab = y.shape[1]
    dev = y.device
    values, index = torch.topk(y, limit, dim=-1)  # largest first
    no_k = torch.tensor([kj == vocab for kj in k], device=dev).unsqueeze(1)
    at = torch.tensor([min(kj, limit) - 1 for kj in k], device=dev).unsqueeze(1)
    kth = values.gather(1, at).masked_fill(no_k, float("-inf"))
    kept = values.masked_fill(values < kth, float("-inf"))
    # a top_k row's mass lies in its candidates; a top-p-only row's is normalized over the whole row
    probs = torch.softmax(kept, dim=-1)
    if any(kj == vocab for kj in k):
        probs = torch.where(no_k, torch.softmax(y, dim=-1).gather(1, index), probs)
    top_p = torch.tensor([pj if pj < 1.0 else math.inf for pj in p], device=dev).unsqueeze(1)
    drop = (probs.cumsum(dim=-1) - probs) >= top_p
    out = torch.full_like(y, float("-inf")).scatter(1, index, kept.masked_fill(drop, float("-inf")))
    if limit == vocab:
        return out
    # (a -inf k-th: fewer than k tokens are left, all of them among the candidates)
    tied = (values[:, -1:] == kth) & (kth > float("-inf"))
    unsettled = torch.where(no_k, ~drop[:, -1:], tied).squeeze(1).nonzero().squeeze(1).tolist()
    if unsettled:
        at = torch.tensor(unsettled, device=dev)
        ties = (y[at] >= kth[at]).sum(dim=-1).tolist()
        wanted = [limit * 8 if k[i] == vocab else ties[n] + 1 for n, i in enumerate(unsettled)]
        out[at] = _top_k_top_p(y[at], [k[i] for i in unsettled], [p[i] for i in unsettled], min(vocab, max(wanted)))
    return out


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


def position_logprobs(logprobs: torch.Tensor, token: int, params: SamplingParams) -> TokenLogprobs:
    """One scored prompt position, from its log-softmaxed raw logits (a vocabulary row): ``token``'s (the prompt's
    next token) log-probability, the ``prompt_top_logprobs`` likeliest tokens' and the named tokens'."""
    k = params.prompt_top_logprobs or 0
    top_v, top_i = logprobs.topk(k) if k else (logprobs[:0], logprobs[:0].long())
    named = params.prompt_logprobs_token_ids
    named_v = logprobs[torch.tensor(named, dtype=torch.long, device=logprobs.device)].tolist() if named else []
    return TokenLogprobs(
        token,
        float(logprobs[token]),
        tuple(zip(top_i.tolist(), top_v.tolist(), strict=True)),
        tuple(zip(named, named_v, strict=True)),
    )
