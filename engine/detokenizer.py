"""Incremental detokenization with stop strings, for streaming text to a voice pipeline.

Why: decoding token by token splits multi-byte characters (a byte-level BPE token can hold
half an emoji), and a stop string must never be spoken. So text ending in U+FFFD is held
back until the character completes, and the last ``len(longest stop) - 1`` characters
are held back until it is clear they do not start a stop string.
"""

from __future__ import annotations

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...] = (), skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""
        self.emitted = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _step(self, final: bool) -> str:
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and (final or not new_text.endswith(_REPLACEMENT)):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return new_text[len(prefix_text) :]
        return ""

    def add(self, token_ids: list[int], finished: bool) -> tuple[str, bool]:
        """Feed new tokens; return (text to emit now, whether a stop string was hit)."""
        old_len = len(self.text)
        for t in token_ids:
            self.ids.append(t)
            self.text += self._step(final=False)
        if finished:
            self.text += self._step(final=True)
        stopped = False
        if self.stop and len(self.text) > old_len:
            cut = -1
            for s in self.stop:
                idx = self.text.find(s, max(0, old_len - len(s) + 1))
                if idx != -1 and (cut == -1 or idx < cut):
                    cut = idx
            if cut != -1:
                self.text = self.text[:cut]
                stopped = True
        end = len(self.text) if (finished or stopped) else max(self.emitted, len(self.text) - self.holdback)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta, stopped
