"""The server's skills in one conversation (``ConversationSkills``), and the words the assistant says unprompted:
a skill's news (a timer rang, a reminder is due).

Shown at once (a ``notice`` whose ``code`` is the skill's: the page and ``parley mic`` print it) and spoken as a
reply of the server's own words as soon as the user is not busy: never over the user's speech or over a reply
being heard, which would be a barge-in the other way. The conversation keeps what was said, so "what did you
just say?" has an answer. At most ``MAX_WAITING`` wait; one that waited ``MAX_WAIT_S`` is left shown, not said.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable

from app import protocol
from app.skills.base import ServerTool, SessionSkills, SkillOwner
from app.voice.reply import SendJson

log = logging.getLogger(__name__)

MAX_WAITING = 16
MAX_WAIT_S = 120.0
POLL_S = 0.25


class Announcements:
    def __init__(
        self,
        send_json: SendJson,
        say: Callable[[str], Awaitable[None]],
        busy: Callable[[], bool],
        *,
        poll_s: float = POLL_S,
        max_wait_s: float = MAX_WAIT_S,
    ) -> None:
        """``say(text)``: speak the words as a reply; ``busy()``: the user is speaking or hearing a reply."""
        self._send_json, self._say, self._busy = send_json, say, busy
        self._poll_s, self._max_wait_s = poll_s, max_wait_s
        self._waiting: deque[str] = deque()
        self._task: asyncio.Task | None = None
        self._closed = False

    def announce(self, kind: str, text: str) -> None:
        """A skill's ``Announce``: on the event loop, never blocking."""
        if self._closed:
            return
        if len(self._waiting) >= MAX_WAITING:
            log.warning("announcement dropped (%d waiting): %s", len(self._waiting), text)
            return
        self._waiting.append(text)
        asyncio.ensure_future(self._show(kind, text))
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._speak_when_free())

    async def _show(self, kind: str, text: str) -> None:
        with contextlib.suppress(Exception):  # the client may be gone
            await self._send_json(protocol.Notice(code=kind, message=text))

    async def _speak_when_free(self) -> None:
        while self._waiting:
            waited = 0.0
            while self._busy() and waited < self._max_wait_s:
                await asyncio.sleep(self._poll_s)
                waited += self._poll_s
            text = self._waiting.popleft()
            if waited >= self._max_wait_s:
                continue  # shown, not said: the user has been busy all along
            try:
                await self._say(text)
            except Exception:
                log.exception("announcement not said: %s", text)

    async def close(self) -> None:
        self._closed = True
        self._waiting.clear()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


class ConversationSkills:
    """A session's side of the server's skills: their tools for this conversation, that it opened and ended, and
    their news said in it (``Announcements``)."""

    def __init__(
        self,
        skills: SessionSkills | None,
        conversation_id: str,
        send_json: SendJson,
        *,
        say: Callable[[str], Awaitable[None]],
        busy: Callable[[], bool],
        heard: Callable[[], str],
        language: Callable[[], str | None] = lambda: None,
    ) -> None:
        """``heard()``: the user's last words (an action's arguments must come from them), in ``language()``."""
        self._skills = skills
        self._announcements = Announcements(send_json, say, busy)
        self._owner = SkillOwner(conversation_id, self._announcements.announce, heard, language)

    def tools(self) -> tuple[ServerTool, ...]:
        return self._skills.tools(self._owner) if self._skills is not None else ()

    def instructions(self) -> str:
        return self._skills.instructions() if self._skills is not None else ""

    def opened(self) -> None:
        if self._skills is not None:
            self._skills.opened(self._owner)

    async def close(self) -> None:
        if self._skills is not None:
            self._skills.close(self._owner)
        await self._announcements.close()
