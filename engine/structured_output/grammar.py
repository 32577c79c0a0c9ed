"""Grammars from JSON schemas (llguidance), and the per-request matchers whose token masks the sampler applies.

Why llguidance: an abi3 wheel with no dependencies that compiles a schema in milliseconds and
fills a mask in microseconds; xgrammar needs triton and compiles each new schema an order of
magnitude slower (figures: app/bench/results/tools_grammar.md). A grammar is the
serialized llguidance grammar (a string: ``SamplingParams.grammar`` stays hashable); the
engine builds one matcher per request from it (``GrammarCompiler.matcher``, a copy of a
cached one), and the sampler adds the rows' masks as biases at once (``grammar_bias``).

JSON is written as ``json.dumps`` writes it (``", "`` and ``": "``, no other whitespace):
the shape models saw in training, and no room for a small model to pad with endless blanks.
Tool calls are wrapped in the model's own format (``tool_call_grammar``), so a forced call
reads to the model as one it wrote itself and to ``engine.openai_api.tool_parser`` as any other call.
"""

from __future__ import annotations

import functools
import json
import sys
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.structured_output.formats import ToolFormat

if TYPE_CHECKING:
    import llguidance

JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_CACHED_GRAMMARS = 64


def _llguidance():
    """llguidance, imported on first use: the engine runs without it until a request has a grammar
    (``parley doctor`` on a bare GPU machine, which has torch and transformers but not llguidance)."""
    import llguidance

    return llguidance


def schema_grammar(schema: dict) -> str:
    """A grammar for one JSON value that matches ``schema`` (``response_format``)."""
    return _llguidance().LLMatcher.grammar_from_json_schema(schema, defaults=JSON_STYLE)


def _call_schema(name: str, parameters: dict, args_key: str) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, args_key: parameters},
        "required": ["name", args_key],
        "additionalProperties": False,
    }


def tool_call_grammar(
    fmt: ToolFormat, tools: Sequence[tuple[str, dict]], parallel: bool, marker_ids: Mapping[str, int]
) -> str:
    """A grammar for calls of ``tools`` ((name, parameters schema) pairs) in ``fmt``: one call, or
    with ``parallel`` one or more. ``marker_ids``: marker text -> id of the markers that are added
    tokens of the tokenizer: the grammar asks for that token (llguidance treats every added
    token as special, so it never matches a marker spelled as text)."""
    one = {"anyOf": [_call_schema(name, params, fmt.args_key) for name, params in tools]}
    if fmt.array:
        calls = {"type": "array", "items": one, "minItems": 1} | ({} if parallel else {"maxItems": 1})
        rules = [f'start: {_marker(fmt.open, marker_ids)} " "? calls', f"calls: %json {_with_style(calls)}"]
    else:
        call = "call"
        if fmt.open and fmt.close:
            call = "block"
            rules = [f'block: {_marker(fmt.open, marker_ids)} "\\n" call "\\n" {_marker(fmt.close, marker_ids)}']
        else:
            rules = []
        between = {"llama3": '"; "', "hermes": '"\\n"'}.get(fmt.name, '"\\n"')
        rules.insert(0, f"start: {call}" + (f" ({between} {call})*" if parallel else ""))
        rules.append(f"call: %json {_with_style(one)}")
    return _llguidance().LLMatcher.grammar_from_lark("\n".join(rules))


# A call to a tool the request did not declare still has a call's shape: it is well-formed, and the caller tells
# the model it has no such tool (a voice assistant asked to play music says it cannot), rather than a grammar of
# declared names only turning "play_music" into the nearest declared tool, an action nobody asked for.
_ANY_NAME = {"type": "string", "minLength": 1, "maxLength": 64}
# ... and its arguments flat and short: a small model given room nests objects until its token cap (a call to
# get_time, which takes none, ran 11 s into {"type": "object", "properties": {"type": ...)
_ANY_ARGUMENTS = {
    "type": "object",
    "additionalProperties": {"anyOf": [{"type": "string", "maxLength": 48}, {"type": "number"}, {"type": "boolean"}]},
    "maxProperties": 4,
}


def _closed(parameters: dict) -> dict:
    """An object schema that says nothing of other properties, closed to them (a model fills in its own schema's
    words otherwise: {"expression": "15% of 80", "required": ["expression"]})."""
    if parameters.get("type") == "object" and "additionalProperties" not in parameters:
        return parameters | {"additionalProperties": False}
    return parameters


@dataclass(frozen=True)
class LazyGrammar:
    """A grammar that applies from a trigger on (llama.cpp's lazy grammars): the reply is free text until it samples
    one of ``triggers`` (a marker token), or opens with one of ``openers`` (tokens that start a bare JSON call,
    ``{``); from that token on it is decoded under ``grammar``, which starts with that token."""

    grammar: str
    triggers: tuple[int, ...] = ()
    openers: tuple[int, ...] = ()


def lazy_call_grammar(fmt: ToolFormat, tools: Sequence[tuple[str, dict]], openers: Sequence[int]) -> LazyGrammar:
    """For a format whose calls a model may also write bare (``json_at_start``: Qwen2.5-Coder-0.5B writes Hermes calls
    without their tags): a reply that opens with ``{`` is decoded as one call, to a declared tool with arguments its
    schema allows or to another name (see ``_ANY_NAME``), and nothing after it. A call in the
    format's own markers stays free (the parser reads it): the model knows that syntax, and text may follow."""
    any_call = {
        "type": "object",
        "properties": {"name": _ANY_NAME, fmt.args_key: _ANY_ARGUMENTS},
        "required": ["name", fmt.args_key],
        "additionalProperties": False,
    }
    declared = [_call_schema(name, _closed(params), fmt.args_key) for name, params in tools]
    one = {"anyOf": [*declared, any_call]}
    rules = ["start: call", f"call: %json {_with_style(one)}"]  # one call: a model may repeat it line after line
    return LazyGrammar(_llguidance().LLMatcher.grammar_from_lark("\n".join(rules)), openers=tuple(openers))


@functools.lru_cache(maxsize=8)
def opener_ids(tokenizer) -> tuple[int, ...]:
    """The tokens whose text starts with ``{``: a reply that opens with one may be a bare JSON call."""
    vocab = tokenizer.get_vocab()
    return tuple(sorted(i for text, i in vocab.items() if tokenizer.convert_tokens_to_string([text]).startswith("{")))


def _with_style(schema: dict) -> str:
    return json.dumps(schema | {"x-guidance": JSON_STYLE})


def _marker(text: str | None, marker_ids: Mapping[str, int]) -> str:
    assert text is not None
    return f"<[{marker_ids[text]}]>" if text in marker_ids else json.dumps(text)


class GrammarCompiler:
    """Matchers for one tokenizer; thread-safe (the API checks grammars off the engine's thread).

    The llguidance tokenizer is built once, on first use (~1-3 s for 49k tokens); each grammar
    is compiled once and copied per request. ``vocab_size``: the logits' width (a model may pad
    its vocabulary past the tokenizer's).
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = max(vocab_size, len(tokenizer))
        self._eos = list(eos_token_ids) or [tokenizer.eos_token_id]
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf  # on first use, as _llguidance()

                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos
                )
            return self._tokenizer

    def state(self, grammar: str) -> GrammarState:
        """A fresh matcher for ``grammar``, as a request's state; ValueError names what is wrong with it."""
        return GrammarState(self.matcher(grammar), self.vocab_size)

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A fresh matcher for ``grammar``; ValueError names what is wrong with it."""
        tokenizer = self.tokenizer()
        with self._lock:
            compiled = self._compiled.get(grammar)
            if compiled is not None:
                self._compiled.move_to_end(grammar)
                return compiled.deep_copy()
        compiled = _llguidance().LLMatcher(tokenizer, grammar, log_level=0)  # unlocked: it may take a while
        if compiled.is_error():
            raise ValueError(compiled.get_error())
        with self._lock:
            self._compiled[grammar] = compiled
            while len(self._compiled) > _CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
            return compiled.deep_copy()


class GrammarState:
    """One request's matcher: its next-token mask (``vocab_size`` tokens wide), and the tokens it accepts."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size

    def accept(self, token: int) -> str | None:
        """Advance past ``token``; an error message if the grammar does not allow it."""
        if self.matcher.consume_token(token):
            return None
        return f"token {token} breaks the request's grammar: {self.matcher.get_error() or 'rejected'}"


_executor: llguidance.LLExecutor | None = None


# one byte of a bitmask -> the bias of its 8 tokens (bit k is token k: 0 when allowed, -inf when not)
_BYTE_BIAS = torch.tensor([[0.0 if b >> k & 1 else float("-inf") for k in range(8)] for b in range(256)])


def grammar_bias(states: Sequence[GrammarState], vocab: int) -> torch.Tensor:
    """[rows, vocab] float32: 0 for the tokens the rows' grammars allow, -inf for the others and for tokens past
    the grammar's vocabulary. llguidance fills one bit per token (rows in parallel); each mask byte becomes
    its 8 biases by one table lookup, which the sampler adds to the logits (a vectorized add, where a
    boolean masked_fill runs a scalar loop)."""
    global _executor
    words = (states[0].vocab_size + 31) // 32
    bits = torch.zeros((len(states), words), dtype=torch.int32)
    if len(states) == 1:
        states[0].matcher.unsafe_compute_mask_ptr(bits.data_ptr(), words * 4)
    else:
        if _executor is None:
            _executor = _llguidance().LLExecutor()
        _executor.unsafe_compute_mask_ptr(
            [(s.matcher, i) for i, s in enumerate(states)], bits.data_ptr(), words * 4, len(states)
        )
    assert sys.byteorder == "little"  # a word's first byte holds its first 8 tokens
    bias = torch.index_select(_BYTE_BIAS, 0, bits.view(torch.uint8).view(-1).int()).view(len(states), words * 32)
    if bias.shape[1] >= vocab:
        return bias[:, :vocab]
    return torch.nn.functional.pad(bias, (0, vocab - bias.shape[1]), value=float("-inf"))
