"""Stand-ins for testing the Realtime door's parts alone (no server, no model): a session that
records the typed calls it gets, models that list voices and languages, a sender that records
events, and the GA check every sent event must pass.

Beside ``fakes.py`` and ``harness.py`` (``tests`` is on the path): used by the unit tests of the parts and
by ``tests/server/test_realtime.py``.
"""

from __future__ import annotations

import json
import typing
from dataclasses import dataclass, field
from typing import Any

from openai.types.realtime import RealtimeServerEvent

from app.config import Settings
from app.server.realtime.inbound import Inbound
from app.server.realtime.outbound import Outbound
from app.server.realtime.state import RealtimeState
from app.stages.base import Transcription

_GA_EVENTS = {
    typing.get_args(cls.model_fields["type"].annotation)[0]: cls
    for cls in typing.get_args(typing.get_args(RealtimeServerEvent)[0])
}


def check_ga(event: dict) -> None:
    """The event is one the GA API defines, and its fields validate against the SDK's model."""
    assert event["type"] in _GA_EVENTS, f"not a GA server event: {event['type']}"
    _GA_EVENTS[event["type"]].model_validate(event)


class StubSession:
    """What the Realtime door uses of ``VoiceSession``; ``calls`` records each typed call in order:
    a ``protocol`` message (``handle``), ``("feed_audio", samples)`` or ``("tune", changes)``."""

    def __init__(self, settings: Settings | None = None) -> None:
        self.settings = settings or Settings()
        self.busy = False
        self.history: list[dict] = []
        self.calls: list[Any] = []

    async def handle(self, message) -> None:
        self.calls.append(message)

    async def feed_audio(self, samples) -> None:
        self.calls.append(("feed_audio", samples))

    async def respond(self) -> int:
        self.calls.append(("respond", {}))
        return 99

    async def tune(self, **changes: float) -> None:
        self.settings = self.settings.model_copy(update=changes)  # as VoiceSession.tune does
        self.calls.append(("tune", changes))

    def messages(self) -> list:
        """The typed messages only (``handle``)."""
        return [call for call in self.calls if not isinstance(call, tuple)]


class StubASR:
    languages = ["en", "de"]

    def __init__(self, text: str = "What is the capital of France?") -> None:
        self.text = text
        self.heard: list[tuple[int, str | None]] = []  # (16 kHz samples, language) per call

    def transcribe(self, audio, *, language=None):
        self.heard.append((len(audio), language))
        return Transcription(self.text, len(audio) / 16_000, 0.0)


class StubTTS:
    voices = ["amy", "bob"]


@dataclass
class StubModels:
    asr: StubASR = field(default_factory=StubASR)
    tts: StubTTS = field(default_factory=StubTTS)


class Recorder:
    """The client's end of the connection: every event sent, as JSON would carry it."""

    def __init__(self) -> None:
        self.events: list[dict] = []

    async def send(self, event: dict) -> None:
        self.events.append(json.loads(json.dumps(event)))

    def types(self, after: int = 0) -> list[str]:
        return [e["type"] for e in self.events[after:]]

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["type"] == kind]

    def errors(self) -> list[dict]:
        return [e["error"] for e in self.of("error")]


@dataclass
class Parts:
    """One connection's parts on stubs: drive ``inbound`` / ``outbound``, read ``session`` and ``client``."""

    state: RealtimeState
    outbound: Outbound
    inbound: Inbound
    session: StubSession
    client: Recorder
    models: StubModels
    settings: Settings

    async def send(self, **event) -> None:
        """One client event, as the client would write it."""
        await self.inbound.handle_client(json.dumps(event))

    def close(self) -> None:
        self.inbound.close()


def parts(**settings) -> Parts:
    config = Settings(**{"max_audio_rate": 1000.0, **settings})
    models, client, session = StubModels(), Recorder(), StubSession(config)
    state = RealtimeState.new(config, models)
    outbound = Outbound(state, client.send)
    inbound = Inbound(state, outbound, config, models)
    outbound.session = inbound.session = session
    return Parts(state, outbound, inbound, session, client, models, config)
