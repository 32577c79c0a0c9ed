"""Prompt log-probabilities already computed, kept beside the prefix cache (``SamplingParams.prompt_logprobs_from``).

A prompt token's log-probability depends on nothing but the tokens before it, yet reading it needs that
token's logits, which a prefix-cache hit never computes: so a request that scores its prompt's tail has
the cache serve only what comes before the tail (``Request.computed_from``). Without these, a voice reply
whose words were prefilled while the user spoke (``app.voice.warmup``) computed them again to score them:
on 2 CPU cores, ~20 tokens instead of ~5, 96 ms instead of 27 a step. With them, a request that finds
its tail's scores here is served by the prefix cache as any other, and scores only what is new.

Keys are a hash chain over the tokens (one per position: the whole prefix through that token), so a
score is found only after exactly the same tokens. Bounded: the least recently used are dropped.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

DEFAULT_CAPACITY = 1 << 16  # scores kept (one float each): a few MB at most


def prefix_keys(tokens: Sequence[int]) -> list[int]:
    """One key per position: ``keys[i]`` names tokens[0..i] (the token at ``i`` and everything before it)."""
    keys, key = [], 0
    for token in tokens:
        key = hash((key, token))
        keys.append(key)
    return keys


class PromptScoreCache:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._scores: OrderedDict[int, float] = OrderedDict()
        self.hits_total = 0

    def __len__(self) -> int:
        return len(self._scores)

    def lookup(self, keys: Sequence[int], first: int) -> list[float]:
        """The log-probabilities of the tokens at ``first``, ``first + 1``, ... (each after the tokens before it)
        that are known, up to the first that is not."""
        found = []
        for key in keys[first:]:
            score = self._scores.get(key)
            if score is None:
                break
            self._scores.move_to_end(key)
            found.append(score)
        self.hits_total += len(found)
        return found

    def store(self, key: int, logprob: float) -> None:
        """The log-probability of the token ``key`` ends with, after the tokens before it."""
        self._scores[key] = logprob
        self._scores.move_to_end(key)
        while len(self._scores) > self.capacity:
            self._scores.popitem(last=False)

    def clear(self) -> None:
        self._scores.clear()
