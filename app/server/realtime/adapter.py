"""One Realtime connection, put together: its state, the inbound half and the outbound half."""

from __future__ import annotations

from collections.abc import Callable

from app.config import Settings
from app.server.realtime.core import SendEvent
from app.server.realtime.inbound import Inbound
from app.server.realtime.outbound import Outbound
from app.server.realtime.state import RealtimeState
from app.skills.base import SessionSkills
from app.voice.session import VoiceSession


class RealtimeAdapter:
    """Translates one Realtime connection to and from one ``VoiceSession``.

    ``on_parley`` / ``on_parley_audio`` are the session's ``send_json`` / ``send_bytes``;
    ``handle_client`` / ``handle_binary`` take the client's frames. ``open_session`` makes the session and attaches it.
    """

    def __init__(
        self,
        send: SendEvent,
        settings: Settings,
        models,
        *,
        model: str = "parley",
        on_rate_limited: Callable[[float], None] | None = None,
        skills: SessionSkills | None = None,
    ) -> None:
        """``skills``: the server's (their tools, where the client declares none, and their news said as responses
        of the server's own)."""
        self._settings, self._models, self._skills = settings, models, skills
        self.state = RealtimeState.new(settings, models, model)
        self.outbound = Outbound(self.state, send)
        self.inbound = Inbound(self.state, self.outbound, settings, models, on_rate_limited=on_rate_limited)
        self.on_parley, self.on_parley_audio = self.outbound.on_parley, self.outbound.on_parley_audio
        self.handle_client, self.handle_binary = self.inbound.handle_client, self.inbound.handle_binary
        self.start = self.outbound.start

    def open_session(self) -> VoiceSession:
        """The conversation this connection drives, made as the Realtime API needs it, and attached."""
        session = VoiceSession(
            self._models,
            self._settings,
            self.on_parley,
            self.on_parley_audio,
            client_tool_results="next_response",  # function_call items end the response; response.create answers
            withdraw_unheard=False,  # a cancelled response leaves the client's items as they are
            skills=self._skills,
        )
        self.inbound.session = self.outbound.session = session
        return session

    async def close(self) -> None:
        self.inbound.close()
