"""Wyoming events on a TCP stream, read with bounds (the ``wyoming`` package's reader has none).

An event is a JSON header line, then ``data_length`` bytes of more JSON data and ``payload_length``
bytes of payload (PCM audio). The package's ``async_read_event`` reads whatever lengths the peer
names, so one header claiming a 10 GB payload would have the server buffer it: here every part
is bounded, the JSON goes through the server's one bounded parser (``app.protocol.load_json``:
depth, number size, no NaN), and a bad event is a ``WireError`` (sent back as an ``error`` event,
then the connection closes: after a framing error the stream cannot be trusted to realign).
Writing is the package's own (``async_write_event``).
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from wyoming.error import Error
from wyoming.event import Event

from app.protocol import ProtocolError, load_json

MAX_LINE_BYTES = 16 * 1024  # the header line: a type, a version, lengths, perhaps inline data
MAX_DATA_BYTES = 64 * 1024  # an event's JSON data (text to speak or to answer is bounded again by its handler)
MAX_PAYLOAD_BYTES = 256 * 1024  # one payload: an audio chunk (1 s of 48 kHz stereo PCM16 is 188 KiB)
STREAM_LIMIT = MAX_LINE_BYTES + 1  # ``asyncio.start_server(limit=...)``: a longer line stops ``readline``
EVENT_TYPE = re.compile(r"^[a-z][a-z0-9-]{0,47}$")


class WireError(Exception):
    """An event the door cannot take; ``code`` and ``text`` become the ``error`` event sent back."""

    def __init__(self, code: str, text: str) -> None:
        super().__init__(text)
        self.code, self.text = code, text

    def event(self) -> Event:
        return Error(text=self.text, code=self.code).event()


async def read_event(reader: asyncio.StreamReader) -> Event | None:
    """The next event, or None when the peer closed the stream (also mid-event)."""
    try:
        line = await reader.readline()
    except ValueError:  # asyncio's LimitOverrunError, raised as ValueError by readline
        raise WireError("event_too_large", f"event header over {MAX_LINE_BYTES} bytes") from None
    if not line.endswith(b"\n"):
        return None  # closed (a partial line is a peer that left mid-event)
    header = _json_object(line, "header")
    kind = header.get("type")
    if not isinstance(kind, str) or not EVENT_TYPE.match(kind):
        raise WireError("bad_event", "an event's type must be a short lowercase name")
    data = header.get("data") or {}
    if not isinstance(data, dict):
        raise WireError("bad_event", f"{kind}: data must be a JSON object")
    data_length = _length(header, "data_length", MAX_DATA_BYTES, kind)
    payload_length = _length(header, "payload_length", MAX_PAYLOAD_BYTES, kind)
    try:
        if data_length:
            data = {**data, **_json_object(await reader.readexactly(data_length), f"{kind} data")}
        payload = await reader.readexactly(payload_length) if payload_length else None
    except asyncio.IncompleteReadError:
        return None
    return Event(type=kind, data=data, payload=payload)


def _length(header: dict[str, Any], key: str, bound: int, kind: str) -> int:
    value = header.get(key)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise WireError("bad_event", f"{kind}: {key} must be a non-negative integer")
    if value > bound:
        raise WireError("event_too_large", f"{kind}: {key} {value} is over {bound} bytes")
    return value


def _json_object(raw: bytes, what: str) -> dict[str, Any]:
    try:
        value = load_json(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise WireError("bad_json", f"the {what} is not UTF-8") from None
    except ProtocolError as error:
        raise WireError("bad_json", f"the {what}: {error}") from None
    if not isinstance(value, dict):
        raise WireError("bad_json", f"the {what} must be a JSON object")
    return value
