"""The model-free tests' fixtures; the stand-ins themselves are in tests/fakes.py."""

from __future__ import annotations

import pytest
from fakes import Conversation


@pytest.fixture
def conversation() -> type[Conversation]:
    """The ``Conversation`` class: ``conversation(asr_text=..., llm_pieces=..., **settings)``."""
    return Conversation
