"""What the parts of one conversation share: read at each use, so each sees the session as it is now.

The session (``app.voice.session``) owns it and hands it to its parts (the reply factory, the speculation,
barge-in, the continued turn, the warm-up) instead of a getter each.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from app.config import Settings

if TYPE_CHECKING:
    from app.voice.reply import Reply
    from app.voice.utterance import UtteranceTracker


class TurnState:
    """``settings``: the conversation's (a live ``tune`` replaces them); ``reply``: the released reply the user hears
    (producing or playing); ``language``: the language of the turn being answered, when known; ``tracker``: the
    utterance tracker of the input stream (rebuilt at each ``start``)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.reply: Reply | None = None
        self.language: str | None = None
        self.tracker: UtteranceTracker | None = None
        self._turn_ids = itertools.count(1)

    def next_turn_id(self) -> int:
        return next(self._turn_ids)

    def let_go(self, reply: Reply) -> None:
        """``reply`` is no longer the one the user hears (a continued turn's, withdrawn)."""
        if self.reply is reply:
            self.reply = None
