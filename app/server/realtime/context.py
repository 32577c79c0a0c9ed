"""What every handler of the client's events works with: the connection's state, the outbound half
(every answer to the client goes out through it) and the session the handlers tell in typed values.

The handlers are split by the part of the API they serve (``inbound``: the session, responses and
the routing; ``input_audio``: the input audio buffer; ``items``: the conversation's items). One
``InboundContext`` is shared by all of them so that they see the same session, attached once it
exists, and answer the client the same way.
"""

from __future__ import annotations

from app import protocol
from app.server.realtime.core import RealtimeError
from app.server.realtime.outbound import Outbound
from app.server.realtime.state import Item, RealtimeState
from app.voice.session import VoiceSession


class InboundContext:
    """The state, the outbound half and the session (None until attached), with the answers all handlers give."""

    def __init__(self, state: RealtimeState, outbound: Outbound) -> None:
        self.state = state
        self.outbound = outbound
        self.session: VoiceSession | None = None

    async def answer(self, event: dict) -> None:
        async with self.state.lock:
            await self.outbound.emit(event)

    async def answer_error(self, error: RealtimeError) -> None:
        async with self.state.lock:
            await self.outbound.error(error)

    async def parley(self, message: protocol.ClientMessageType) -> None:
        """A typed client message to the session (never while holding the lock: it answers through outbound)."""
        if self.session is not None:
            await self.session.handle(message)

    def settle_pending(self) -> list[Item]:
        """The client's items not answered yet join the session's history as they are (``RealtimeState``)."""
        return self.state.settle_pending(self.session.history if self.session is not None else None)
