"""The one way out to the client: every server event is numbered (``event_id``) and sent here.

Apart from ``Outbound`` so that the parts that write server events (``outbound`` for the user's
speech and the routing, ``responses`` for the responses) share one sender without holding each
other; the inbound half answers through ``Outbound``, which sends with this.
"""

from __future__ import annotations

from typing import Any

from app.server.realtime.core import RealtimeError, SendEvent
from app.server.realtime.state import RealtimeState


class EventSender:
    """``send`` (one JSON-able event at a time) with the state's event ids; ``error`` in the Realtime shape."""

    def __init__(self, state: RealtimeState, send: SendEvent) -> None:
        self.state = state
        self._send = send

    async def emit(self, event: dict[str, Any]) -> None:
        await self._send({"event_id": self.state.next_event_id(), **event})

    async def error(self, error: RealtimeError) -> None:
        """An ``error`` event for ``error``, naming the client event being handled (if it had an id)."""
        await self.emit(
            {
                "type": "error",
                "error": {
                    "type": error.kind,
                    "code": error.code,
                    "message": error.message,
                    "param": error.param,
                    "event_id": self.state.client_event_id,
                },
            }
        )
