"""What the engine keeps for each request beside the scheduler's ``Request``, and how it is built.

Why a module of its own: turning a request's ``SamplingParams`` into the state a step needs (the
token ids it names checked against the vocabulary, its grammar compiled, a seeded generator, the
stop ids ``min_tokens`` holds back, the DRY sequence breakers as token ids, an incremental
detokenizer) is a job of its own, with caches of its own (the decoded vocabulary, the breaker
sets); the engine loop only asks for the result (``LLMEngine.add_request``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from engine.detokenizer import IncrementalDetokenizer
from engine.request import Request
from engine.sampling import SamplerRow, make_generator
from engine.scheduler import RequestRejected
from engine.structured_output.grammar import GrammarCompiler, GrammarState

_BREAKER_SETS_KEPT = 16  # distinct DRY sequence-breaker sets whose token ids are remembered


@dataclass
class RequestState:
    """A running request's output side: its detokenizer and the row the sampler draws it from."""

    request: Request
    detok: IncrementalDetokenizer
    row: SamplerRow

    def text(self, new_token_ids: list[int], finished: bool) -> tuple[str, bool]:
        """The text of the new tokens, and whether one of the request's stop strings ended it."""
        shown = new_token_ids
        if finished and shown and not self.request.params.skip_special_tokens and shown[-1] in self.row.stop_token_ids:
            shown = shown[:-1]  # the stop token ends the text; kept special tokens would show it
        return self.detok.add(shown, finished)


def lazy_trigger(row: SamplerRow, token: int) -> bool:
    """``token`` starts the row's lazy grammar: a trigger anywhere, or an opener as the reply's first token."""
    lazy = row.params.lazy_grammar
    if lazy is None:
        return False
    return token in lazy.triggers or (not row.output_token_ids and token in lazy.openers)


class RequestStateBuilder:
    """Checks a new request's params and builds its ``RequestState`` (one per engine; not thread-safe)."""

    def __init__(
        self, tokenizer, vocab_size: int, grammars: GrammarCompiler, device: torch.device, seed: int | None
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.grammars = grammars
        self.device = device
        self._rng = random.Random(seed)
        self._token_texts: list[str] | None = None  # each token's own text, decoded once (DRY breakers)
        self._breaker_ids: dict[tuple[str, ...], frozenset[int]] = {}

    def check(self, req: Request) -> GrammarState | None:
        """Raise ``RequestRejected`` for a token id outside the vocabulary or a grammar that does not
        compile; return the request's grammar state (None without a grammar)."""
        params = req.params
        vocab = self.vocab_size
        bad = next((t for t in req.prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:  # it would fail the embedding lookup of a whole batch
            raise RequestRejected(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        named = (
            *params.stop_token_ids,
            *(t for t, _ in params.logit_bias),
            *params.prompt_logprobs_token_ids,
            *(t for seq in params.dry_context for t in seq),
        )
        bad = next((t for t in named if t >= vocab), None)
        if bad is not None:  # (a dry_context token following a repeat would be penalized: an index past the row)
            raise RequestRejected(
                f"token id {bad} (stop_token_ids, logit_bias, prompt_logprobs_token_ids, dry_context) is outside "
                f"the vocabulary [0, {vocab})"
            )
        grammar = self.grammar_state(params.grammar)
        if params.lazy_grammar is not None:
            self.grammar_state(params.lazy_grammar.grammar)  # compiled now: a bad one fails the request here
        return grammar

    def build(self, req: Request, grammar: GrammarState | None) -> RequestState:
        """The state of an accepted request (``grammar``: what ``check`` returned for it)."""
        params = req.params
        stops = params.stop_token_ids + (() if params.ignore_eos else req.eos_token_ids)
        row = SamplerRow(
            params,
            make_generator(params, self.device, self._rng.getrandbits(63)),
            req.prompt_token_ids,
            req.output_token_ids,
            stop_token_ids=tuple(dict.fromkeys(stops)),
            dry_breakers=self.dry_breakers(params.dry_sequence_breakers) if params.dry else frozenset(),
            grammar=grammar,
        )
        detok = IncrementalDetokenizer(self.tokenizer, params.stop, params.skip_special_tokens)
        return RequestState(req, detok, row)

    def grammar_state(self, grammar: str | None) -> GrammarState | None:
        if grammar is None:
            return None
        try:
            return self.grammars.state(grammar)
        except ValueError as e:
            raise RequestRejected(f"invalid grammar: {e}") from e

    def dry_breakers(self, breakers: tuple[str, ...]) -> frozenset[int]:
        """Ids of the tokens whose text holds one of ``breakers`` (DRY does not match across them).
        The vocabulary is decoded once (~1 s for 49k tokens, on the first DRY request)."""
        found = self._breaker_ids.get(breakers)
        if found is None:
            if self._token_texts is None:
                self._token_texts = self.tokenizer.batch_decode([[i] for i in range(len(self.tokenizer))])
            found = frozenset(i for i, text in enumerate(self._token_texts) if any(b in text for b in breakers))
            if len(self._breaker_ids) >= _BREAKER_SETS_KEPT:
                self._breaker_ids.clear()
            self._breaker_ids[breakers] = found
        return found
