"""``app.stages.code_fence``: a reply's opening code fence (and its closing one) taken off, streaming, in pieces of
any size; any other text, backticks included, passes whole."""

from __future__ import annotations

import pytest

from app.stages.code_fence import Unfence

CALL = '{"name": "set_timer", "arguments": {"duration": "ten minutes"}}'


def unfenced(text: str, step: int) -> str:
    unfence = Unfence()
    return "".join(unfence.feed(text[i : i + step]) for i in range(0, len(text), step)) + unfence.finish()


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("```json\n" + CALL + "\n```", CALL),
        ("  ```\n" + CALL + "\n```\n", CALL),
        ("```python\nprint(1)\n```", "print(1)"),
        ("Hello there, `code` here.", "Hello there, `code` here."),
        ("`x` is fine", "`x` is fine"),
        ("Plain text that ends with ```", "Plain text that ends with ```"),
        ("``` not a fence opening", "``` not a fence opening"),
        ("", ""),
    ],
)
def test_an_opening_fence_is_taken_off_and_other_text_passes(text, expected, step):
    assert unfenced(text, step) == expected


def test_plain_text_is_not_held_back():
    unfence = Unfence()
    assert unfence.feed("Sure") == "Sure" and unfence.feed(", ten minutes.") == ", ten minutes."
