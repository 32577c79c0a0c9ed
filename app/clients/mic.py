"""``parley mic``: a desktop voice client on sounddevice (PortAudio).

The parts, from the outside in:

* ``SoundDeviceAudio``: the only code that touches PortAudio. A capture thread reads 20 ms
  blocks from the input device (blocking reads, paced to the wall clock when the source is
  faster than real time, e.g. a file-backed ALSA device) and an ``OutputStream`` callback
  pulls reply audio from a ``Player``.
* ``MicClient``: the session logic, audio-free and testable: connect and reconnect (with backoff,
  through the shared client core ``app.clients.core``), stream microphone frames (resampled on the client to the 16 kHz the ASR wants), gate them
  half-duplex, feed reply audio to the player, drop it on ``interrupt``, print the conversation.
* ``main``: flags, friendly errors (exit code 2) and the run loop.

Resampling happens here rather than on the server: the server's CPU is the shared resource
(ASR for every session), soxr on the client is nearly free, the upstream is 2.75x smaller than
44.1 kHz, and devices outside the protocol's 8-96 kHz range still work. The rate is still
declared with ``start``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TextIO
from urllib.parse import urlparse

import numpy as np
import soxr

from app import protocol
from app.audio import StreamResampler, float_to_pcm16, pcm16_to_float
from app.clients.core import FRAME_MS, STAGE_LABELS, Connection, ConnectionRefused, backoff_delays, stay_connected

SEND_RATE = protocol.INPUT_SAMPLE_RATE
HALF_DUPLEX_TAIL_S = 0.2
PLAYBACK_REPORT_S = 0.25
DEFAULT_URL = "ws://127.0.0.1:8000/ws"


class UsageError(Exception):
    """A problem the user can fix (bad URL, no device, no PortAudio): printed, exit code 2."""


# ------------------------------------------------------------------ pure logic
class Player:
    """Reply audio waiting to be played; ``pull`` runs on the audio thread, the rest on the event loop."""

    def __init__(self, device_rate: int) -> None:
        self.device_rate = device_rate
        self._chunks: collections.deque[np.ndarray] = collections.deque()
        self._offset = 0  # samples of _chunks[0] already played
        self._lock = threading.Lock()
        self._resampler = None  # soxr.ResampleStream of the current turn (22.05 kHz -> device rate)
        self.turn_id: int | None = None
        self.played = 0  # device-rate samples of turn_id played so far

    def start_turn(self, turn_id: int, sample_rate: int) -> None:
        with self._lock:
            self.turn_id, self.played = turn_id, 0
        self._resampler = soxr.ResampleStream(sample_rate, self.device_rate, 1, dtype="float32")

    def push(self, pcm: bytes) -> None:
        if self._resampler is not None:  # else: audio without audio_start, nothing to attribute it to
            self._queue(self._resampler.resample_chunk(pcm16_to_float(pcm)))

    def finish_turn(self) -> None:
        """The turn's audio is complete: flush what the resampler still holds (its last few ms)."""
        if self._resampler is not None:
            self._queue(self._resampler.resample_chunk(np.zeros(0, np.float32), last=True))
            self._resampler = None

    def _queue(self, samples: np.ndarray) -> None:
        if len(samples):
            with self._lock:
                self._chunks.append(samples.astype(np.float32, copy=False))

    def pull(self, frames: int) -> np.ndarray:
        """Exactly ``frames`` samples: queued audio, then silence (never blocks on the network)."""
        out = np.zeros(frames, dtype=np.float32)
        filled = 0
        with self._lock:
            while filled < frames and self._chunks:
                head = self._chunks[0]
                take = min(frames - filled, len(head) - self._offset)
                out[filled : filled + take] = head[self._offset : self._offset + take]
                filled += take
                self._offset += take
                if self._offset == len(head):
                    self._chunks.popleft()
                    self._offset = 0
            self.played += filled
        return out

    def clear(self) -> None:
        """Drop everything queued (barge-in); the next callback plays silence."""
        with self._lock:
            if self._chunks:
                self._chunks.clear()
            self._offset = 0
        self._resampler = None

    @property
    def busy(self) -> bool:
        return bool(self._chunks)

    @property
    def played_ms(self) -> float:
        return self.played * 1000 / self.device_rate


class Gate:
    """Decides whether a microphone frame goes to the server or is replaced by silence.

    Half-duplex (default): muted while the reply plays (audio queued, or a reply still streaming)
    and for ``tail_s`` after, because a desktop has no echo cancellation. ``barge_in``: always
    open. Push-to-talk: closed unless ``talking``.
    """

    def __init__(self, barge_in: bool = False, push_to_talk: bool = False, tail_s: float = HALF_DUPLEX_TAIL_S):
        self.barge_in, self.push_to_talk, self.tail_s = barge_in, push_to_talk, tail_s
        self.talking = not push_to_talk

    def open(self, now: float, replying: bool, reply_ended_at: float) -> bool:
        if not self.talking:
            return False
        if self.barge_in:
            return True
        return not replying and now - reply_ended_at >= self.tail_s


class Framer:
    """Resamples capture blocks to ``to_rate`` and cuts them into exact 20 ms frames."""

    def __init__(self, from_rate: int, to_rate: int = SEND_RATE) -> None:
        self.frame = to_rate * FRAME_MS // 1000
        self._resample = StreamResampler(from_rate, to_rate)
        self._pending = np.zeros(0, dtype=np.float32)

    def __call__(self, block: np.ndarray) -> list[np.ndarray]:
        self._pending = np.concatenate([self._pending, self._resample(block)])
        count = len(self._pending) // self.frame
        frames = [self._pending[i * self.frame : (i + 1) * self.frame] for i in range(count)]
        self._pending = self._pending[count * self.frame :]
        return frames


class Console:
    """Prints the conversation as it happens."""

    def __init__(self, out: TextIO = sys.stdout) -> None:
        self.out = out
        self._tty = out.isatty()
        self._replying_to: int | None = None
        self._partial = False

    def say(self, line: str) -> None:
        self._end_lines()
        print(line, file=self.out, flush=True)

    def _end_lines(self) -> None:
        self._end_partial()
        if self._replying_to is not None:  # the reply's line is still open (done, cut short or interrupted)
            self.out.write("\n")
            self._replying_to = None

    def _end_partial(self) -> None:
        if self._partial:
            self.out.write("\r\x1b[K")
            self._partial = False

    def event(self, event: protocol.ServerMessage) -> None:
        if isinstance(event, protocol.Transcript):
            if event.final:
                self.say(f"you: {event.text}")
            elif self._tty:
                self._end_lines()
                self.out.write(f"you: {event.text} ...")
                self.out.flush()
                self._partial = True
        elif isinstance(event, protocol.SpeechDropped):
            self._end_partial()  # not a turn (noise, "um", a "yeah" over the reply): its partial goes
            self.out.flush()
        elif isinstance(event, protocol.AssistantText):
            if self._replying_to != event.turn_id:
                self._end_lines()
                self._replying_to = event.turn_id
                self.out.write("parley: ")
            self.out.write(event.delta)
            self.out.flush()
        elif isinstance(event, protocol.TurnDone):
            self.say(format_latency(event))
        elif isinstance(event, protocol.Notice):
            self.say(f"note ({event.code}): {event.message}")
        elif isinstance(event, protocol.Error):
            self.say(f"server error ({event.code}): {event.message}")


def format_latency(turn_done: protocol.TurnDone) -> str:
    metrics = turn_done.metrics
    stages = ", ".join(
        f"{label} {value:.0f}" for name, label in STAGE_LABELS.items() if (value := getattr(metrics, name)) is not None
    )
    head = f"  [turn {turn_done.turn_id}"
    if turn_done.interrupted:
        head += ", interrupted"
    if metrics.voice_to_voice_ms is not None:
        head += f": voice-to-voice {metrics.voice_to_voice_ms:.0f} ms"
    return head + (f" ({stages})" if stages else "") + "]"


def check_url(url: str) -> str:
    parsed = urlparse(url)
    if parsed.scheme not in ("ws", "wss") or not parsed.hostname:
        raise UsageError(f"bad --url {url!r}: expected ws://host:port/ws or wss://...")
    try:
        parsed.port  # noqa: B018 - validates the port
    except ValueError as error:
        raise UsageError(f"bad --url {url!r}: {error}") from None
    return url


# ------------------------------------------------------------------ the session logic
class MicClient:
    """Streams microphone frames to a Parley server and plays its replies; no audio I/O in here.

    ``frames`` receives float32 capture blocks at ``capture_rate`` (from ``SoundDeviceAudio`` or a
    test); ``player`` is pulled by the output device.
    """

    def __init__(
        self,
        url: str,
        frames: asyncio.Queue[np.ndarray],
        capture_rate: int,
        player: Player,
        gate: Gate,
        console: Console,
        *,
        max_turns: int | None = None,
        backoff: Callable[[], Iterator[float]] = backoff_delays,
    ) -> None:
        self.url, self.frames, self.capture_rate = url, frames, capture_rate
        self.player, self.gate, self.console = player, gate, console
        self.max_turns, self.backoff = max_turns, backoff
        self.turns_done = 0
        self.connections = 0
        self.sent_frames = 0
        self.muted_frames = 0
        self._streaming_turn: int | None = None  # audio_start seen, turn_done not yet
        self._dropped_turn: int | None = None  # interrupted: ignore its late audio
        self._reply_ended_at = -1e9
        self._finished = asyncio.Event()

    @property
    def replying(self) -> bool:
        return self._streaming_turn is not None or self.player.busy

    async def run(self) -> None:
        """Connect, talk, reconnect with backoff; returns after ``max_turns`` replies."""
        try:
            await stay_connected(
                self.url,
                self._converse,
                sample_rate=SEND_RATE,
                finished=self._finished,
                say=self.console.say,
                backoff=self.backoff,
                on_lost=self._reset_reply,
            )
        except ConnectionRefused as error:
            raise UsageError(str(error)) from None

    async def _converse(self, connection: Connection) -> None:
        self.connections += 1
        mode = "barge-in" if self.gate.barge_in else "half-duplex"
        if self.gate.push_to_talk:
            mode += ", push-to-talk: Enter toggles the mic"
        self.console.say(f"connected ({mode}); " + ("speak now" if self.gate.talking else "press Enter to talk"))
        while not self.frames.empty():  # audio captured while disconnected is stale
            self.frames.get_nowait()
        tasks = [
            asyncio.create_task(self._send_loop(connection)),
            asyncio.create_task(self._receive_loop(connection)),
        ]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # re-raise what ended the connection
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    async def _receive_loop(self, connection: Connection) -> None:
        def unknown(error: ValueError) -> None:  # e.g. a newer server's event: say so, keep talking
            self.console.say(f"ignoring a server message this client does not know ({error})")

        async for item in connection.receive(on_unknown=unknown):
            if isinstance(item, bytes):
                self._on_audio(item)
            else:
                self._on_event(item)
            if self._finished.is_set():
                return

    async def _send_loop(self, connection: Connection) -> None:
        framer = Framer(self.capture_rate, SEND_RATE)
        silence = float_to_pcm16(np.zeros(framer.frame, np.float32))
        last_report = 0.0
        while True:
            block = await self.frames.get()
            for frame in framer(block):
                now = time.monotonic()
                if self.gate.open(now, self.replying, self._reply_ended_at):
                    await connection.send_audio(frame)
                    self.sent_frames += 1
                else:
                    await connection.send_audio(silence)  # keeps the server's clock and endpointing running
                    self.muted_frames += 1
            if self.player.busy:
                self._reply_ended_at = time.monotonic()
                if self.player.turn_id is not None and time.monotonic() - last_report >= PLAYBACK_REPORT_S:
                    last_report = time.monotonic()
                    report = protocol.Playback(turn_id=self.player.turn_id, played_ms=self.player.played_ms)
                    await connection.send(report)

    def _on_audio(self, data: bytes) -> None:
        if self._streaming_turn is None or self._streaming_turn == self._dropped_turn:
            return  # late audio of an interrupted turn
        self.player.push(data)

    def _on_event(self, event: protocol.ServerMessage) -> None:
        if isinstance(event, protocol.AudioStart):
            self._streaming_turn = event.turn_id
            self.player.start_turn(event.turn_id, event.sample_rate)
        elif isinstance(event, protocol.Interrupt):
            self._dropped_turn = event.turn_id
            if event.turn_id in (self._streaming_turn, self.player.turn_id):  # streaming, or queued after turn_done
                self._reset_reply()
        elif isinstance(event, protocol.TurnDone):
            if self._streaming_turn == event.turn_id:
                self._streaming_turn = None
                self.player.finish_turn()
                self._reply_ended_at = time.monotonic()
            if event.interrupted:
                self._dropped_turn = event.turn_id
                self._reset_reply()
        elif isinstance(event, protocol.Error) and event.fatal:
            self.console.event(event)
            raise OSError(f"server: {event.message}")
        self.console.event(event)
        if isinstance(event, protocol.TurnDone):
            self.turns_done += 1
            if self.max_turns is not None and self.turns_done >= self.max_turns:
                self._finished.set()

    def _reset_reply(self) -> None:
        self.player.clear()
        self._streaming_turn = None
        self._reply_ended_at = time.monotonic()


# ------------------------------------------------------------------ audio I/O (PortAudio)
def import_sounddevice():
    try:
        import sounddevice
    except OSError as error:  # the Python package is there, libportaudio is not
        raise UsageError(
            f"PortAudio is missing ({error}). Install it: `sudo apt-get install libportaudio2` "
            "(Debian/Ubuntu), `brew install portaudio` (macOS)."
        ) from None
    except ImportError:
        raise UsageError("sounddevice is not installed: pip install 'parley[mic]'") from None
    return sounddevice


def _device_arg(value: str | None) -> int | str | None:
    if value is None:
        return None
    return int(value) if value.strip().isdigit() else value


def pace(audio_s: float, anchor: float, now: float, read_blocked: bool) -> tuple[float, float]:
    """(new anchor, seconds to sleep) for a capture that has delivered ``audio_s`` seconds.

    A hardware device paces itself (its reads block): re-anchor to it, never sleep. A source that
    returns instantly (a file-backed ALSA device) is slowed down to real time.
    """
    if read_blocked:
        return now - audio_s, 0.0
    return anchor, max(0.0, anchor + audio_s - now)


class SoundDeviceAudio:
    """Opens the input and output devices; capture blocks go to ``frames``, output pulls ``player``."""

    def __init__(self, sd, input_device: int | str | None, output_device: int | str | None) -> None:
        self.sd = sd
        try:
            self.input_info = sd.query_devices(input_device, kind="input")
        except (ValueError, sd.PortAudioError) as error:
            what = f"input device {input_device!r}" if input_device is not None else "input device"
            raise UsageError(f"no {what} found ({error}); see `parley mic --list-devices`") from None
        try:
            self.output_info = sd.query_devices(output_device, kind="output")
        except (ValueError, sd.PortAudioError) as error:
            what = f"output device {output_device!r}" if output_device is not None else "output device"
            raise UsageError(f"no {what} found ({error}); see `parley mic --list-devices`") from None
        self.capture_rate = int(self.input_info["default_samplerate"])
        self.output_rate = int(self.output_info["default_samplerate"])
        self.overflows = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._output = None

    def start(self, frames: asyncio.Queue[np.ndarray], player: Player, loop: asyncio.AbstractEventLoop) -> None:
        sd = self.sd
        block = self.capture_rate * FRAME_MS // 1000
        try:
            capture = sd.InputStream(
                device=self.input_info["index"], samplerate=self.capture_rate, channels=1, dtype="int16"
            )

            def callback(outdata, count, _time, _status) -> None:
                outdata[:, 0] = player.pull(count)

            self._output = sd.OutputStream(
                device=self.output_info["index"],
                samplerate=self.output_rate,
                channels=1,
                dtype="float32",
                latency="low",
                callback=callback,
            )
            capture.start()
            self._output.start()
        except sd.PortAudioError as error:
            raise UsageError(f"cannot open the audio devices: {error}") from None

        def put(samples: np.ndarray) -> None:
            if frames.qsize() > 50:  # > 1 s behind (disconnected or stalled): drop the oldest
                frames.get_nowait()
            frames.put_nowait(samples)

        def capture_loop() -> None:
            anchor, audio_s = time.monotonic(), 0.0
            with capture:
                while not self._stop.is_set():
                    started = time.monotonic()
                    data, overflowed = capture.read(block)
                    self.overflows += bool(overflowed)
                    audio_s += block / self.capture_rate
                    now = time.monotonic()
                    anchor, wait = pace(audio_s, anchor, now, read_blocked=now - started > 0.25 * FRAME_MS / 1000)
                    loop.call_soon_threadsafe(put, data[:, 0].astype(np.float32) / 32768.0)
                    if wait:
                        time.sleep(wait)

        self._thread = threading.Thread(target=capture_loop, name="mic-capture", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1)
        if self._output is not None:
            self._output.close(ignore_errors=True)


def list_devices(sd) -> str:
    return str(sd.query_devices())


def _push_to_talk_thread(gate: Gate, console: Console, loop: asyncio.AbstractEventLoop) -> None:
    """Enter toggles talking (hold-to-talk would need raw key events: root or an X/Wayland session)."""

    def toggle() -> None:
        gate.talking = not gate.talking
        console.say("[talking: press Enter when done]" if gate.talking else "[muted: press Enter to talk]")

    def read_keys() -> None:
        for _line in sys.stdin:
            loop.call_soon_threadsafe(toggle)

    threading.Thread(target=read_keys, name="push-to-talk", daemon=True).start()


# ------------------------------------------------------------------ command line
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="parley mic", description="Talk to a Parley server from this computer.")
    parser.add_argument("--url", default=DEFAULT_URL, help=f"the server's voice WebSocket (default {DEFAULT_URL})")
    parser.add_argument("--input-device", metavar="NAME|INDEX", help="microphone (default: the system default)")
    parser.add_argument("--output-device", metavar="NAME|INDEX", help="speaker (default: the system default)")
    parser.add_argument("--list-devices", action="store_true", help="list audio devices and exit")
    parser.add_argument("--barge-in", action="store_true", help="keep the mic open while the reply plays (headphones)")
    parser.add_argument("--push-to-talk", action="store_true", help="mic muted until Enter is pressed (toggle)")
    parser.add_argument(
        "--api-key", metavar="KEY", help="the server's api_key, if it has one (default: $PARLEY_API_KEY)"
    )
    parser.add_argument("--max-turns", type=int, metavar="N", help="exit after N replies")
    parser.add_argument("--exit-after-s", type=float, metavar="S", help="exit after S seconds")
    return parser


async def _run(args: argparse.Namespace, sd) -> int:
    audio = SoundDeviceAudio(sd, _device_arg(args.input_device), _device_arg(args.output_device))
    loop = asyncio.get_running_loop()
    frames: asyncio.Queue[np.ndarray] = asyncio.Queue()
    player = Player(audio.output_rate)
    gate = Gate(barge_in=args.barge_in, push_to_talk=args.push_to_talk)
    console = Console()
    client = MicClient(args.url, frames, audio.capture_rate, player, gate, console, max_turns=args.max_turns)
    console.say(
        f"parley mic: input {audio.input_info['name']!r} at {audio.capture_rate} Hz (sent at {SEND_RATE} Hz), "
        f"output {audio.output_info['name']!r} at {audio.output_rate} Hz"
    )
    audio.start(frames, player, loop)
    if args.push_to_talk:
        _push_to_talk_thread(gate, console, loop)
    try:
        try:
            await asyncio.wait_for(client.run(), args.exit_after_s)
        except TimeoutError:
            if args.max_turns is not None and client.turns_done < args.max_turns:
                console.say(f"stopped after {args.exit_after_s:g} s with {client.turns_done} of {args.max_turns} turns")
                return 1
            console.say(f"stopped after {args.exit_after_s:g} s")
            return 0
        deadline = time.monotonic() + 30
        while player.busy and time.monotonic() < deadline:  # let the last reply finish playing
            await asyncio.sleep(0.05)
        return 0
    finally:
        audio.close()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.api_key:
        os.environ["PARLEY_API_KEY"] = args.api_key  # the client core sends it with every connection
    try:
        if args.max_turns is not None and args.max_turns < 1:
            raise UsageError("--max-turns must be at least 1")
        if not args.list_devices:
            check_url(args.url)
        sd = import_sounddevice()
        if args.list_devices:
            print(list_devices(sd))
            return 0
        return asyncio.run(_run(args, sd))
    except UsageError as error:
        print(f"parley mic: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
