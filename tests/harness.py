"""Shared test helpers: scripted stand-ins (an LLM, a Parley-like /ws server), a voice session driven
frame by frame without a network (real VAD/ASR/TTS), talking over a reply through a real server,
and starting `parley` servers."""

from __future__ import annotations

import asyncio
import contextlib
import json

import numpy as np
import websockets

from app import protocol
from app.audio import float_to_pcm16
from app.bench.launcher import ServerProcess
from app.config import Settings
from app.stages.registry import Models
from app.voice.session import VoiceSession
from app.voice.text import words


class ScriptedLLM:
    """A ``ChatLLM`` with ``LocalScheduling`` (as the engine has) that streams fixed pieces, and records what it
    was asked.

    ``gate`` (if set) must open before the pieces after the first; ``forever`` keeps adding
    " more1", " more2", ...; ``hold`` (an event) keeps the stream open after the pieces until it is set.
    ``context_tokens`` bounds the prompt, counted in words (``count_tokens``).
    """

    name = "scripted"

    def __init__(self, pieces: list[str], gate: asyncio.Event | None = None, forever: bool = False) -> None:
        self.pieces, self.gate, self.forever = pieces, gate, forever
        self.hold: asyncio.Event | None = None
        self.context_tokens: int | None = None
        self.calls: list[list[dict]] = []  # the messages of each request
        self.earlier_replies: list[tuple[str, ...]] = []  # the earlier replies each request was given (for DRY)
        self.request_ids: list[str] = []
        self.closed: list[str] = []
        self.warmed: list[list[dict]] = []
        self.warmed_tools: list = []  # the ToolSpec each warm-up was rendered with (None: none)
        self.warmed_scored: list[bool] = []  # whether each warm-up scored the user's words
        self.pauses: list[tuple[str, str]] = []  # ("pause" | "resume", request id), in order
        self.yields: list[tuple[str, float]] = []  # (request id, max seconds), in order
        self.cores_lent = 0  # how many core_lent() blocks are open now
        self.idle_now = True  # what idle() says: no other conversation's request in the LLM
        self.text_turn_probability = None  # what end_of_turn_probability says (None: no text signal; or raises it)
        self.turn_end_asked: list[tuple[list[dict], str]] = []  # (conversation, words) of each end-of-turn ask
        self.text_turn_gate: asyncio.Event | None = None  # (if set) the end-of-turn verdict waits for it
        self.turn_end_cancelled = 0
        self.reads_turn_end = False  # whether a speculative reply reads the verdict from its prefill (the engine's way)
        self.turn_end_read: list[tuple[list[dict], str]] = []  # (conversation, words) of each verdict a reply read
        self.gate_was_open_early = False
        self.words_logprobs: dict[tuple[str, str], float] = {}  # how a request weighing words scores them (``_weigh``)
        self.weighed: list[tuple[str, float | None]] = []  # (the words, the gain) of each request that weighed them

    def count_tokens(self, messages):
        return sum(len(message["content"].split()) + 4 for message in messages)

    features = frozenset({"alone", "turn_end", "earlier_replies"})  # the engine's, but tools (``ToolScriptedLLM``)

    async def stream(self, request):
        """``pieces``, from the prompt ``request.alone`` chooses (``_weigh``), giving ``request.turn_end`` what
        ``end_of_turn_probability`` would say (after ``text_turn_gate``) with the first piece."""
        messages = self._weigh(request.messages, request.alone) if request.alone is not None else request.messages
        verdict = request.turn_end
        if verdict is not None:
            self.turn_end_read.append(([dict(m) for m in request.messages[:-1]], request.messages[-1]["content"]))
        try:
            first = True
            async for piece in self._pieces(messages, request.request_id, request.earlier_replies):
                if first and verdict is not None:
                    if self.text_turn_gate is not None:
                        await self.text_turn_gate.wait()
                    probability = self.text_turn_probability
                    verdict.set(None if isinstance(probability, Exception) else probability)
                first = False
                yield piece
        finally:
            if verdict is not None:
                verdict.set(None)

    def _weigh(self, messages, alone):
        """``messages`` or ``alone.messages``, as the engine chooses: ``words_logprobs`` maps (the role of the message
        before the user's, the words) to their mean log-probability; anything else: None (cannot tell, so the
        conversation is kept, as the engine does)."""
        words = messages[-1]["content"]
        scores = [
            self.words_logprobs.get((m[-2]["role"] if len(m) > 1 else "", words)) for m in (messages, alone.messages)
        ]
        gain = None if None in scores else scores[0] - scores[1]
        self.weighed.append((words, gain))
        if alone.on_weighed is not None:
            alone.on_weighed(gain)
        return alone.messages if gain is not None and gain < alone.min_gain_nats else messages

    async def _pieces(self, messages, request_id, earlier_replies=()):
        self.calls.append([dict(m) for m in messages])
        self.earlier_replies.append(tuple(earlier_replies))
        self.request_ids.append(request_id)
        try:
            for index, piece in enumerate(self.pieces):
                if index == 1 and self.gate is not None:
                    await asyncio.wait_for(self.gate.wait(), timeout=30)
                    self.gate_was_open_early = True
                yield piece
            count = 0
            while self.forever:  # never the same words twice (a reply that repeats itself is ended)
                await asyncio.sleep(0.05)
                count += 1
                yield f" more{count}"
            if self.hold is not None:
                await self.hold.wait()
        finally:
            self.closed.append(request_id)

    def abort(self, request_id):
        pass

    def pause(self, request_id, max_s):
        self.pauses.append(("pause", request_id))

    def resume(self, request_id):
        self.pauses.append(("resume", request_id))

    def yield_to_others(self, request_id, max_s):
        self.yields.append((request_id, max_s))

    def set_urgent_first_tokens(self, n):
        pass

    def idle(self) -> bool:
        return self.idle_now

    @contextlib.contextmanager
    def core_lent(self):
        self.cores_lent += 1
        try:
            yield
        finally:
            self.cores_lent -= 1

    async def warm(self, messages, tools=None, *, score_words=False):
        """Recorded; with ``score_words``, the words' mean log-probability as ``_weigh`` finds it."""
        self.warmed.append([dict(m) for m in messages])
        self.warmed_tools.append(tools)
        self.warmed_scored.append(score_words)
        if score_words:
            return self.words_logprobs.get((messages[-2]["role"] if len(messages) > 1 else "", messages[-1]["content"]))
        return None

    async def end_of_turn_probability(self, messages, user_text):
        self.turn_end_asked.append((([dict(m) for m in messages]), user_text))
        if self.text_turn_gate is not None:
            try:
                await self.text_turn_gate.wait()
            except asyncio.CancelledError:
                self.turn_end_cancelled += 1
                raise
        if isinstance(self.text_turn_probability, Exception):
            raise self.text_turn_probability
        return self.text_turn_probability

    def turn_end_position(self, messages, tools=None):
        """Where a reply reads the end-of-turn verdict (any position: scripted), when ``reads_turn_end``."""
        return len(messages) if self.reads_turn_end else None

    async def health(self):
        return True, "scripted"

    def close(self):
        pass


class Harness:
    def __init__(self, shared_models, llm, **settings) -> None:
        vad, asr, tts = shared_models
        self.models = Models(vad=vad, asr=asr, llm=llm, tts=tts)
        self.events: list[dict] = []
        self.audio = bytearray()
        self.audio_arrived = asyncio.Event()
        self.session = VoiceSession(self.models, Settings(**settings), self._send_json, self._send_bytes)

    async def _send_json(self, message) -> None:
        self.events.append(json.loads(protocol.encode(message)))

    async def _send_bytes(self, data: bytes) -> None:
        self.audio.extend(data)
        self.audio_arrived.set()

    def types(self) -> list[str]:
        return [e["type"] for e in self.events]

    async def wait_for(self, kind: str, timeout: float = 60, **match) -> dict:
        async def poll():
            while True:
                for event in self.events:
                    if event["type"] == kind and all(event.get(k) == v for k, v in match.items()):
                        return event
                await asyncio.sleep(0.02)

        return await asyncio.wait_for(poll(), timeout)

    async def speak(
        self, audio: np.ndarray, sample_rate: int = 16000, trailing_s: float = 1.0, realtime: bool = False
    ) -> None:
        """Send 20 ms frames (10 frames of silence first); ``realtime`` paces them like a microphone."""
        frame = sample_rate // 50
        padded = np.concatenate(
            [np.zeros(frame * 10, np.float32), audio, np.zeros(int(trailing_s * sample_rate), np.float32)]
        )
        loop = asyncio.get_running_loop()
        started = loop.time()
        for index, offset in enumerate(range(0, len(padded), frame)):
            await self.session.handle_audio(float_to_pcm16(padded[offset : offset + frame]))
            await asyncio.sleep(max(0.0, started + (index + 1) * 0.02 - loop.time()) if realtime else 0)


async def talk_over_a_long_reply(url: str, question: np.ndarray, *, until_answered: bool = False) -> list[dict]:
    """Ask for a long story by text; once its audio plays, speak ``question`` over it.

    Returns the events up to the final transcript of the new turn (``until_answered``: up to its ``turn_done``,
    the connection open until then).
    """
    import websockets

    events: list[dict] = []
    async with websockets.connect(url) as ws:
        await ws.recv()
        await ws.send(json.dumps({"type": "text", "text": "Tell me a long story about a dragon and a princess."}))
        while not isinstance(await asyncio.wait_for(ws.recv(), 60), bytes):
            pass  # wait for the first reply audio: the assistant is now speaking

        async def talk() -> None:
            frames = np.concatenate([question, np.zeros(16000 * 3, np.float32)])
            for index in range(0, len(frames), 320):
                await ws.send(float_to_pcm16(frames[index : index + 320]))
                await asyncio.sleep(0.02)

        talking = asyncio.create_task(talk())
        try:
            kind = "turn_done" if until_answered else "transcript"
            while not any(e["type"] == kind and e.get("final", True) and e["turn_id"] > 1 for e in events):
                message = await asyncio.wait_for(ws.recv(), 60)
                if isinstance(message, str):
                    events.append(json.loads(message))
        finally:
            talking.cancel()
    return events


async def recv_until(connection, kind: type, timeout_s: float = 120) -> tuple[object, int]:
    """What ``connection`` (``app.clients.core.Connection``) receives until an item of ``kind``: that item, and the
    bytes of reply audio on the way; an error on the way fails the test."""
    audio = 0
    while not isinstance(item := await connection.recv(timeout_s=timeout_s), kind):
        assert not isinstance(item, protocol.Error), item
        audio += len(item) if isinstance(item, bytes) else 0
    return item, audio


def assert_barged_in(events: list[dict]) -> None:
    """Turn 1 was interrupted (interrupt + turn_done interrupted) and the new question was heard."""
    from app.voice.text import words

    kinds = [(e["type"], e.get("turn_id")) for e in events]
    assert ("interrupt", 1) in kinds, kinds
    cut = next(e for e in events if e["type"] == "turn_done" and e["turn_id"] == 1)
    assert cut["interrupted"] is True
    final = next(e["text"] for e in events if e["type"] == "transcript" and e["final"] and e["turn_id"] > 1)
    assert "capital" in words(final)


# The latency circuit breaker is tested with a fake clock (tests/unit/server); a test server must
# not refuse sessions because a loaded test machine answers slowly.
NO_BREAKER = ["--breaker-voice-to-voice-ms", "600000", "--breaker-llm-ttft-ms", "600000"]
# Nor because the default cap (two sessions a core, fewer where memory is short: 4 on 2 cores) is
# below the sessions a test opens at once; the cap itself is tested on its own.
TEST_MAX_SESSIONS = ["--max-sessions", "16"]

# a function with an enum and a bounded number (the Realtime API's tool shape), for the real-model tool tests
THERMOSTAT_TOOL = {
    "type": "function",
    "name": "set_thermostat",
    "description": "Set the heating of a room",
    "parameters": {
        "type": "object",
        "properties": {
            "room": {"enum": ["kitchen", "bedroom", "living room"]},
            "celsius": {"type": "number", "minimum": 10, "maximum": 30},
        },
        "required": ["room", "celsius"],
        "additionalProperties": False,
    },
}


def start_server(args: list[str], log_path, ready_path: str = "/healthz", timeout_s: float = 300):
    """Start a `parley` subprocess on a free loopback port; returns (server, base_url). Stop it with ``stop_server``."""
    if args[:1] == ["serve"] and not any(arg.startswith("--breaker") for arg in args):
        args = [*args, *NO_BREAKER]
    if args[:1] == ["serve"] and "--max-sessions" not in args:
        args = [*args, *TEST_MAX_SESSIONS]
    server = ServerProcess(args, log_path, ready_path, timeout_s)
    return server, server.base_url


def stop_server(server: ServerProcess) -> None:
    server.stop()


class ScriptedServer:
    """A Parley-like /ws on 127.0.0.1: sends ``ready``, then ``script(ws, inbox, number)`` drives it.

    ``inbox`` collects what the client sent on that connection (decoded JSON or audio bytes);
    ``arrived`` is set at each new message so a script can wait for a condition without polling.
    """

    def __init__(self, script, ready: bool = True) -> None:
        self.script, self.ready = script, ready
        self.inboxes: list[list] = []
        self.arrived = asyncio.Condition()

    async def wait_until(self, predicate) -> None:
        async with self.arrived:
            await self.arrived.wait_for(predicate)

    async def handler(self, ws) -> None:
        inbox: list = []
        self.inboxes.append(inbox)
        if self.ready:
            await ws.send(protocol.encode(protocol.Ready(input_sample_rate=16_000, output_sample_rate=22_050)))

        async def collect() -> None:
            async for message in ws:
                async with self.arrived:
                    inbox.append(message if isinstance(message, bytes) else json.loads(message))
                    self.arrived.notify_all()

        tasks = [asyncio.create_task(collect()), asyncio.create_task(self.script(ws, inbox, len(self.inboxes)))]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            if tasks[1].done():
                tasks[1].result()  # a failing script fails the test, not silently
        finally:
            for task in tasks:
                task.cancel()

    async def __aenter__(self) -> str:
        self._server = await websockets.serve(self.handler, "127.0.0.1", 0)
        port = next(iter(self._server.sockets)).getsockname()[1]
        return f"ws://127.0.0.1:{port}/ws"

    async def __aexit__(self, *exc) -> None:
        self._server.close()
        await self._server.wait_closed()

    @property
    def received(self) -> list[list]:
        """What each connection sent, in order (one list per connection)."""
        return self.inboxes


def assert_spoken_or_json_held_back(done, audio: int) -> None:
    """The answer after a tool's result: words, heard; or, from a model without tools in its template (SmolLM2
    echoes a call's JSON as its answer), nothing read aloud of the JSON (the runaway guard's ``data`` cut it)."""
    assert "{" not in done.text, done.text
    assert (words(done.text) and audio > 0) or done.metrics.guard_runaway == 1, done
