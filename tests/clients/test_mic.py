"""`parley mic`: end to end through PortAudio on a file-backed ALSA device, plus its logic without audio."""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
import textwrap
import time
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
from harness import ScriptedServer
from heard import heard_as

from app import protocol
from app.audio import float_to_pcm16
from app.clients.core import backoff_delays
from app.clients.mic import Console, Framer, Gate, MicClient, Player, SoundDeviceAudio, UsageError, pace
from app.voice.text import words

ROOT = Path(__file__).resolve().parents[2]
QUESTION = "What is the capital of France?"


# ------------------------------------------------------------------ end to end, real PortAudio
def require_portaudio() -> None:
    try:
        import sounddevice  # noqa: F401
    except OSError as error:
        pytest.fail(f"PortAudio is missing ({error}): `make system-deps` or `apt-get install -y libportaudio2`")


def alsa_home(home: Path, capture_raw: Path) -> dict[str, str]:
    """A HOME whose .asoundrc makes the default ALSA device capture from a raw S16_LE mono file (no sound card needed)."""
    home.mkdir(parents=True, exist_ok=True)
    (home / ".asoundrc").write_text(
        textwrap.dedent(f"""\
            pcm.!default {{ type asym playback.pcm "nullout" capture.pcm "filemic" }}
            pcm.nullout {{ type null }}
            pcm.filemic {{ type file slave.pcm "nullcap" file "/dev/null" infile "{capture_raw}" format "raw" }}
            pcm.nullcap {{ type null }}
            """)
    )
    return {**os.environ, "HOME": str(home), "PYTHONUNBUFFERED": "1"}


def device_rate(env: dict[str, str]) -> int:
    """The rate PortAudio reports for the default input (and so the rate `parley mic` captures at)."""
    code = "import sounddevice as sd; print(int(sd.query_devices(kind='input')['default_samplerate']))"
    return int(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout)


@pytest.mark.models
def test_parley_mic_answers_a_spoken_question(live_server, speech, tmp_path, output_dir):
    require_portaudio()
    raw = tmp_path / "mic.raw"
    env = alsa_home(tmp_path / "home", raw)
    rate = device_rate(env)  # 44100 with this .asoundrc: the file plugin takes the rate PortAudio asks for
    # The file plugin is not paced (the client paces itself) and, past the end of the file, repeats its last
    # period: pad with silence on both sides so the question is heard exactly once.
    silence = np.zeros(rate, np.float32)
    raw.write_bytes(float_to_pcm16(np.concatenate([silence, speech(QUESTION, sample_rate=rate), silence, silence])))
    url = live_server.replace("http://", "ws://") + "/ws"

    started = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "app.cli", "mic", "--url", url, "--max-turns", "1", "--exit-after-s", "90"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=150,
    )
    elapsed = time.monotonic() - started
    (output_dir / "mic_stdout.txt").write_text(f"{run.stdout}\n--- stderr\n{run.stderr}\n--- {elapsed:.1f} s\n")
    assert run.returncode == 0, f"parley mic failed ({run.returncode}):\n{run.stdout}\n{run.stderr}"
    lines = run.stdout.splitlines()
    assert f"at {rate} Hz (sent at 16000 Hz)" in lines[0]
    heard = [line.removeprefix("you: ") for line in lines if line.startswith("you: ")]
    assert len(heard) == 1 and heard_as(heard[0], QUESTION), run.stdout
    replies = [line.removeprefix("parley: ") for line in lines if line.startswith("parley: ")]
    assert len(replies) == 1 and words(replies[0]), run.stdout
    assert any(line.startswith("  [turn ") and "voice-to-voice" in line for line in lines), run.stdout
    assert "Traceback" not in run.stderr


def test_parley_mic_without_portaudio_says_so(tmp_path):
    """sounddevice raises OSError when libportaudio is absent; simulate that by hiding the library."""
    (tmp_path / "sitecustomize.py").write_text("import ctypes.util\nctypes.util.find_library = lambda name: None\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    run = subprocess.run(
        [sys.executable, "-m", "app.cli", "mic"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 2
    assert "PortAudio is missing" in run.stderr and "libportaudio2" in run.stderr
    assert "Traceback" not in run.stderr


def test_parley_mic_bad_url_and_no_device_exit_2(tmp_path):
    require_portaudio()
    bad = subprocess.run(
        [sys.executable, "-m", "app.cli", "mic", "--url", "http://localhost:8000"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "bad --url" in bad.stderr and "Traceback" not in bad.stderr

    home = tmp_path / "home"
    env = alsa_home(home, tmp_path / "none.raw")
    missing = subprocess.run(
        [sys.executable, "-m", "app.cli", "mic", "--input-device", "no-such-mic"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 2 and "no input device 'no-such-mic'" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_no_input_device_message():
    class FakeSd:
        class PortAudioError(Exception):
            pass

        def query_devices(self, device=None, kind=None):
            raise self.PortAudioError("Error querying device -1")

    with pytest.raises(UsageError, match="no input device found"):
        SoundDeviceAudio(FakeSd(), None, None)


# ------------------------------------------------------------------ logic without audio
def test_backoff_schedule():
    assert list(islice(backoff_delays(), 7)) == [0.5, 1, 2, 4, 8, 8, 8]


def test_gate_half_duplex_barge_in_and_push_to_talk():
    half = Gate()
    assert half.open(10.0, replying=False, reply_ended_at=0.0)
    assert not half.open(10.0, replying=True, reply_ended_at=0.0)
    assert not half.open(10.1, replying=False, reply_ended_at=10.0)  # within the 200 ms tail
    assert half.open(10.25, replying=False, reply_ended_at=10.0)
    assert Gate(barge_in=True).open(10.0, replying=True, reply_ended_at=10.0)
    ptt = Gate(push_to_talk=True)
    assert not ptt.open(10.0, replying=False, reply_ended_at=0.0)
    ptt.talking = True
    assert ptt.open(10.0, replying=False, reply_ended_at=0.0)


def test_pacing_only_slows_sources_faster_than_real_time():
    assert pace(1.0, anchor=100.0, now=100.2, read_blocked=False) == (100.0, pytest.approx(0.8))  # a file: wait
    assert pace(1.0, anchor=100.0, now=101.5, read_blocked=False) == (100.0, 0.0)  # behind: no wait
    assert pace(1.0, anchor=100.0, now=100.2, read_blocked=True) == (pytest.approx(99.2), 0.0)  # hardware: re-anchor


def test_player_plays_queued_audio_then_silence_and_clear_drops_it():
    player = Player(44100)
    player.start_turn(1, 22050)
    player.push(float_to_pcm16(np.full(2205, 0.5, np.float32)))  # 100 ms at 22.05 kHz
    player.finish_turn()  # flushes the resampler's last few ms
    assert player.busy
    out = np.concatenate([player.pull(441) for _ in range(12)])  # 120 ms at 44.1 kHz
    assert np.abs(out[200:4200]).min() > 0.4 and np.abs(out[-441:]).max() == 0
    assert not player.busy and player.played_ms == pytest.approx(100, abs=1)
    player.start_turn(2, 22050)
    player.push(float_to_pcm16(np.full(22050, 0.5, np.float32)))
    player.clear()
    assert not player.busy and np.abs(player.pull(441)).max() == 0


def test_framer_resamples_to_exact_20ms_frames():
    framer = Framer(44100, 16000)
    frames = [frame for _ in range(50) for frame in framer(np.zeros(882, np.float32))]  # 1 s in 20 ms blocks
    assert {len(frame) for frame in frames} == {320}
    assert 48 <= len(frames) <= 50


def test_console_prints_the_conversation_and_latency():
    out = io.StringIO()
    console = Console(out)
    console.event(protocol.Transcript(turn_id=1, text="hi", final=False))  # partials: tty only
    console.event(protocol.Transcript(turn_id=1, text="Hi there.", final=True))
    for delta in ["Hello", "! How", " can I help?"]:
        console.event(protocol.AssistantText(turn_id=1, delta=delta))
    metrics = protocol.TurnMetrics(voice_to_voice_ms=812.4, endpoint_ms=401.0, asr_final_ms=120.0, llm_ttft_ms=60.0)
    console.event(protocol.TurnDone(turn_id=1, text="Hello! How can I help?", metrics=metrics))
    assert out.getvalue().splitlines() == [
        "you: Hi there.",
        "parley: Hello! How can I help?",
        "  [turn 1: voice-to-voice 812 ms (endpoint 401, asr 120, llm first token 60)]",
    ]


def test_console_takes_back_the_partial_of_speech_the_server_dropped():
    out = io.StringIO()
    out.isatty = lambda: True  # partials are drawn on a terminal only
    console = Console(out)
    console.event(protocol.Transcript(turn_id=1, text="Um, so", final=False))
    console.event(protocol.SpeechDropped(turn_id=1, reason="filler", heard="Um, so"))
    assert out.getvalue() == "you: Um, so ...\r\x1b[K"  # the line is cleared at once


def test_console_ends_a_reply_line_that_was_cut_short():
    out = io.StringIO()
    console = Console(out)
    console.event(protocol.AssistantText(turn_id=1, delta="The capital of"))
    console.say("connection lost (the server is restarting); retrying in 0.5 s")
    console.event(protocol.AssistantText(turn_id=2, delta="Hello"))
    console.event(protocol.AssistantText(turn_id=3, delta="Hi"))  # turn 2 interrupted: no turn_done
    console.event(protocol.TurnDone(turn_id=3, text="Hi", interrupted=False))
    console.event(protocol.Notice(turn_id=4, code="truncated", message="your message was cut to fit"))
    assert out.getvalue().splitlines() == [
        "parley: The capital of",
        "connection lost (the server is restarting); retrying in 0.5 s",
        "parley: Hello",
        "parley: Hi",
        "  [turn 3]",
        "note (truncated): your message was cut to fit",
    ]


async def fake_mic(frames: asyncio.Queue, rate: int = 44100) -> None:
    """A 440 Hz tone in real-time 20 ms blocks, as a capture device would deliver it."""
    block, index = rate // 50, 0
    while True:
        t = (np.arange(block) + index * block) / rate
        frames.put_nowait((0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32))
        index += 1
        await asyncio.sleep(0.02)


async def fake_speaker(player: Player) -> None:
    while True:
        player.pull(player.device_rate // 50)
        await asyncio.sleep(0.02)


async def run_client(url: str, gate: Gate, *, max_turns: int | None = 1, backoff=None, run_for: float = 20):
    """Run a client with a fake mic and speaker until ``max_turns`` replies, or for ``run_for`` seconds."""
    frames: asyncio.Queue = asyncio.Queue()
    player = Player(44100)
    out = io.StringIO()
    kwargs = {"backoff": backoff} if backoff else {}
    client = MicClient(url, frames, 44100, player, gate, Console(out), max_turns=max_turns, **kwargs)
    helpers = [asyncio.create_task(fake_mic(frames)), asyncio.create_task(fake_speaker(player))]
    try:
        await asyncio.wait_for(client.run(), run_for)
    except TimeoutError:
        if max_turns is not None:
            raise
    finally:
        for task in helpers:
            task.cancel()
    return client, out.getvalue()


def loudness_runs(received: list) -> list[tuple[bool, int]]:
    """Audio frames as runs of (loud?, count)."""
    runs: list[tuple[bool, int]] = []
    for frame in (m for m in received if isinstance(m, bytes)):
        loud = bool(np.abs(np.frombuffer(frame, "<i2")).max() > 1000)
        if runs and runs[-1][0] == loud:
            runs[-1] = (loud, runs[-1][1] + 1)
        else:
            runs.append((loud, 1))
    return runs


def reply_script(reply_s: float, after_frames: int = 15):
    async def script(ws, received, _connection) -> None:
        while sum(isinstance(m, bytes) for m in received) < after_frames:
            await asyncio.sleep(0.01)
        await ws.send(json.dumps({"type": "transcript", "turn_id": 1, "text": "Hello?", "final": True}))
        await ws.send(json.dumps({"type": "audio_start", "turn_id": 1, "sample_rate": 22050}))
        await ws.send(float_to_pcm16(np.full(int(22050 * reply_s), 0.2, np.float32)))
        await ws.send(json.dumps({"type": "turn_done", "turn_id": 1, "text": "Hi.", "metrics": {}}))
        # the client exits after this turn once the reply has played; keep listening until then
        await asyncio.sleep(30)

    return script


async def test_half_duplex_sends_silence_while_the_reply_plays_and_after_a_tail():
    server = ScriptedServer(reply_script(0.6))
    async with server as url:
        # the reply plays (0.6 s), then the 200 ms tail, then the mic opens again
        await run_client(url, Gate(), max_turns=None, run_for=2.5)
        received = server.received[0]
        assert received[0] == {"type": "start", "sample_rate": 16000}
        assert {len(m) for m in received if isinstance(m, bytes)} == {640}  # 20 ms at 16 kHz
        runs = loudness_runs(received)
        assert [loud for loud, _ in runs] == [True, False, True], runs
        muted_s = runs[1][1] * 0.02
        assert 0.6 + 0.2 - 0.1 <= muted_s <= 0.6 + 0.2 + 0.4, runs
        assert any(isinstance(m, dict) and m["type"] == "playback" for m in received)


async def test_barge_in_keeps_the_mic_open():
    server = ScriptedServer(reply_script(0.6))
    async with server as url:
        await run_client(url, Gate(barge_in=True), max_turns=None, run_for=1.5)
        assert [loud for loud, _ in loudness_runs(server.received[0])] == [True]


async def test_interrupt_drops_queued_audio_at_once_and_ignores_late_audio():
    cleared_after: list[float] = []
    player_of: list[Player] = []

    async def script(ws, received, _connection) -> None:
        await ws.send(json.dumps({"type": "audio_start", "turn_id": 1, "sample_rate": 22050}))
        await ws.send(float_to_pcm16(np.full(22050 * 5, 0.2, np.float32)))  # 5 s queued
        while not player_of or not player_of[0].busy:
            await asyncio.sleep(0.005)
        sent = time.monotonic()
        await ws.send(json.dumps({"type": "interrupt", "turn_id": 1}))
        while player_of[0].busy and time.monotonic() - sent < 1:
            await asyncio.sleep(0.002)
        cleared_after.append(time.monotonic() - sent)
        await ws.send(float_to_pcm16(np.full(22050, 0.2, np.float32)))  # late audio of the interrupted turn
        await ws.send(json.dumps({"type": "turn_done", "turn_id": 1, "text": "", "interrupted": True}))
        await asyncio.sleep(30)

    server = ScriptedServer(script)
    original = Player.__init__

    def remember(self, rate):
        original(self, rate)
        player_of.append(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Player, "__init__", remember)
        async with server as url:
            _, out = await run_client(url, Gate(barge_in=True))
    assert cleared_after[0] < 0.1
    assert not player_of[0].busy
    assert "interrupted" in out


async def test_interrupt_after_turn_done_still_drops_the_audio_being_played():
    """The server finishes sending long before the client finishes playing: the audio is still queued."""
    frames: asyncio.Queue = asyncio.Queue()
    player = Player(22050)
    client = MicClient("ws://unused", frames, 16000, player, Gate(barge_in=True), Console(io.StringIO()))
    client._on_event(protocol.AudioStart(turn_id=4, sample_rate=22050))
    client._on_audio(float_to_pcm16(np.full(22050 * 3, 0.2, np.float32)))
    client._on_event(protocol.TurnDone(turn_id=4, text="A long answer."))
    assert player.busy and not client._streaming_turn
    client._on_event(protocol.Interrupt(turn_id=4))
    assert not player.busy and np.abs(player.pull(441)).max() == 0


async def test_reconnects_with_backoff_when_the_server_drops_the_connection():
    async def script(ws, received, connection) -> None:
        if connection == 1:
            while not received:  # the client has said `start`: the session is up
                await asyncio.sleep(0.01)
            await ws.close()  # a server restart, as the client sees it
            return
        await ws.send(json.dumps({"type": "turn_done", "turn_id": 1, "text": "Hi.", "metrics": {}}))
        await asyncio.sleep(30)

    server = ScriptedServer(script)
    async with server as url:
        client, out = await run_client(url, Gate(), backoff=lambda: iter([0.05, 0.1, 0.2]))
    assert client.connections == 2
    assert "connection lost (the server closed the connection); retrying in 0.05 s" in out


async def test_cannot_connect_retries_with_growing_delays():
    frames: asyncio.Queue = asyncio.Queue()
    out = io.StringIO()
    client = MicClient("ws://127.0.0.1:9/ws", frames, 16000, Player(16000), Gate(), Console(out))
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(client.run(), 1.8)
    assert "cannot connect" in out.getvalue()
    assert "retrying in 0.5 s" in out.getvalue() and "retrying in 1 s" in out.getvalue()
