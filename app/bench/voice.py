"""`parley bench voice`: simulated users talk to a real server over the real WebSocket.

Each client holds one conversation and asks several different spoken questions (synthesized
once with the bundled voice and cached), at real-time pace with natural trailing silence,
waits for the reply to finish playing, and asks the next. Voice-to-voice latency and
underruns are measured on the client, as a user would experience them: from the acoustic end
of the question (its last frame above the noise floor; the clips are cut there) to the first
audible reply sample (``app.audio.AUDIBLE_LEVEL``; the near-silence a TTS voice starts
with is not counted as heard). The server's own figure, from where its VAD placed the end to
the first reply audio it sent, is reported beside it; stage latencies come from the server's
per-turn metrics.

Sets (``--set``):
* ``plain``: whole questions;
* ``commands``: requests said as commands and statements ("Remind me to ...", "I would like to hear ..."),
  with no question mark and often a falling, finished-sounding end that the end-of-turn model misjudges;
  reports how many turns waited the mid-clause silence (an endpoint of a second or more);
* ``pauses``: questions with a pause in the middle of the sentence (``--pause-s``), which a
  good endpoint does not take for the end of the turn; reports how many were split in two
  (answered as two turns), how many were continued (committed at the pause, then the reply
  withdrawn and the whole answered: ``turn_continued``) and in how many the user heard reply
  audio before they had finished;
* ``backchannels``: while a reply plays, the user says "yeah", "right", "I see", ... (which must not
  stop it) and, every fourth turn, really interrupts (which must).
``--snr-db`` adds background noise under everything the users send; ``--rates`` cycles the
voice's speaking rate (Piper length scales). ``--tools`` makes every reply call a server tool
first (``app.bench.tools``, ``tool_choice`` required), which takes ``--tool-ms``: voice-to-voice
is then the answer's, and ``tool_ms`` (the tool's own time) and ``answer_ms`` are reported.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from app import protocol
from app.bench.launcher import ServerProcess
from app.bench.samples import noise_rms, synthesize_speech, trim_to_speech, with_pause
from app.bench.tools import DEFAULT_TOOL_MS, TOOL_MS_VARIABLE
from app.bench.user import CLIENT_MEASURED, VoiceClient
from app.voice.text import words
from engine.metrics import percentile

QUESTIONS = [
    "What is the capital of France?",
    "How are you today?",
    "Tell me a fun fact about dogs.",
    "What should I cook for dinner tonight?",
    "Why is the sky blue?",
    "Can you recommend a good book?",
]
COMMANDS = [
    "Please say hello to my friend Tom.",
    "I would like to hear a joke about computers.",
    "Remind me to water the plants tonight.",
    "Set a timer for fifteen minutes.",
    "Tell me something interesting about whales.",
    "I want to know more about the moon.",
]
LONG_ENDPOINT_MS = 1000  # an endpoint this long waited the mid-clause silence (endpoint_unfinished_silence_ms)
# Said whole, with a pause stretched into the middle (at the comma, where the voice breathes).
PAUSED_QUESTIONS = [
    "I want to visit Paris, and London next summer.",
    "Can you tell me, what the weather is like in London?",
    "What I would like to know is, how tall the Eiffel Tower is.",
    "My favourite city is Rome, because of the food.",
    "Tell me about dogs, and why they bark at night.",
    "I was thinking about dinner, maybe something with rice.",
    "Could you explain, why the sky is blue?",
    "I need a good book, for a long train ride.",
    "What should I pack, for a weekend in the mountains?",
    "Remind me, how many days are in a leap year?",
]
# Acknowledgements the bundled Piper voice can say. It cannot say "mm-hmm" or "mhm": it reads them
# as words, and Whisper hears "In a month" and "And may Chen" (real hums come out as "Mm-hmm.").
BACKCHANNELS = ["Yeah.", "Right.", "Okay.", "Uh-huh.", "I see.", "Sure.", "Got it.", "Yes."]
INTERRUPTION = "Wait, stop. Tell me about London instead."
PLOT_HINT = "pip install -e '.[plot]'"


@dataclass
class TurnRecord:
    """One question and its reply: what the client measured and the server's own figures."""

    client: int
    turn: int
    question: str
    transcript: str
    reply: str
    speech_s: float
    at_client: protocol.TurnMetrics  # voice-to-voice as heard, reply length, underruns
    server: protocol.TurnMetrics
    split: bool = False  # (pauses) the question became more than one turn
    continued: bool = False  # committed at the pause, then continued (its first reply withdrawn)
    talked_over: bool = False  # reply audio arrived before the question was fully said
    spoken_over: str | None = None  # (backchannels) "backchannel" or "interruption"
    reply_stopped: bool = False  # (backchannels) the reply was interrupted

    @property
    def transcript_correct(self) -> bool:
        return words(self.transcript) == words(self.question)

    def to_json(self) -> dict:
        return {
            "client": self.client,
            "turn": self.turn,
            "question": self.question,
            "transcript": self.transcript,
            "transcript_correct": self.transcript_correct,
            "reply": self.reply,
            "speech_s": self.speech_s,
            "at_client": self.at_client.model_dump(exclude_none=True),
            "server": self.server.model_dump(exclude_none=True),
            "split": self.split,
            "continued": self.continued,
            "talked_over": self.talked_over,
            "spoken_over": self.spoken_over,
            "reply_stopped": self.reply_stopped,
        }


@dataclass(frozen=True)
class Workload:
    """What the simulated users say, and how."""

    kind: str = "plain"  # plain | commands | pauses | backchannels
    questions: tuple[tuple[str, np.ndarray], ...] = ()
    over_reply: tuple[tuple[str, np.ndarray], ...] = ()  # backchannels, then the interruption last
    noise_rms: float = 0.0


def build_workload(kind: str, snr_db: float | None, rates: list[float], pause_s: float) -> Workload:
    texts = {"pauses": PAUSED_QUESTIONS, "commands": COMMANDS}.get(kind, QUESTIONS)
    questions = []
    for index, text in enumerate(texts):
        rate = rates[index % len(rates)]
        audio = trim_to_speech(synthesize_speech(text, length_scale=rate))
        if kind == "pauses":
            audio, _ = with_pause(audio, pause_s)
        questions.append((text, audio))
    over_reply = ()
    if kind == "backchannels":
        over_reply = tuple((text, trim_to_speech(synthesize_speech(text))) for text in [*BACKCHANNELS, INTERRUPTION])
    noise = 0.0 if snr_db is None else noise_rms([audio for _, audio in questions], snr_db)
    return Workload(kind, tuple(questions), over_reply, noise)


ANSWER_TIMEOUT_S = 60.0


async def speak_over_reply(client: VoiceClient, result, audio: np.ndarray) -> bool | None:
    """Say ``audio`` a second into the reply of ``result``; True if the server stopped that reply.

    None when the reply is too short to say it over (it would end before the server could
    judge the words): that is no test of barge-in. Words said over a reply that the server
    takes as a turn (an interruption; a backchannel is not one) are answered: keep the line
    open (silence) until that answer is complete, so the next question does not talk over it. Its events arrive in ``result``,
    which is still the client's current turn.
    """
    done = result.turn_done
    if result.first_audio_received is None or done is None:
        return None
    wait = result.first_audio_received + 1.0 - time.monotonic()
    if wait > 0:
        await client.send_silence(wait)
    # The reply must still be playing when the server judges the words (barge_in_ms, then a
    # short transcription): through a backchannel, and for a second of a longer interruption.
    plays_until = result.first_audio_received + result.reply_seconds
    if plays_until - time.monotonic() < min(len(audio) / client.sample_rate, 1.0) + 0.5:
        return None
    await client.send_audio(audio)
    await client.send_silence(1.5)  # the server decides within barge_in_ms + an endpoint

    def stopped() -> bool:
        return any(isinstance(e, protocol.Interrupt) and e.turn_id == done.turn_id for e in result.events)

    def new_turns() -> set[int]:
        return {e.turn_id for e in result.all(protocol.Transcript) if e.final and e.turn_id != done.turn_id}

    def answered() -> bool:
        finished = {e.turn_id for e in result.all(protocol.TurnDone) if not e.interrupted}
        return new_turns() <= finished

    deadline = time.monotonic() + ANSWER_TIMEOUT_S
    while not answered():
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the words said over turn {done.turn_id}'s reply got no answer in {ANSWER_TIMEOUT_S:g} s"
            )
        await client.send_silence(0.02)
    return stopped()


async def run_client(url: str, client_index: int, turns: int, workload: Workload) -> list[TurnRecord]:
    records = []
    async with VoiceClient(url, noise_rms=workload.noise_rms, seed=client_index) as client:
        await client.send_silence(0.5 + 0.37 * client_index)  # clients do not all speak at the same instant
        for turn in range(turns):
            text, audio = workload.questions[(client_index + turn) % len(workload.questions)]
            result = await client.ask(audio, trailing_silence_s=1.2 if workload.kind != "pauses" else 1.6)
            finals = {e.turn_id for e in result.all(protocol.Transcript) if e.final}
            record = TurnRecord(
                client=client_index,
                turn=turn,
                question=text,
                transcript=result.final_transcript,
                reply=result.assistant_text,
                speech_s=len(audio) / client.sample_rate,
                at_client=result.client_metrics(),
                server=result.server_metrics,
                split=len(finals) > 1,
                continued=bool(result.all(protocol.TurnContinued)),
                talked_over=result.talked_over,
            )
            if workload.kind == "backchannels":
                interrupt = turn % 4 == 3
                backchannels = workload.over_reply[:-1]
                _, over = workload.over_reply[-1] if interrupt else backchannels[(turn - turn // 4) % len(backchannels)]
                stopped = await speak_over_reply(client, result, over)
                if stopped is not None:  # (else the reply was too short to say anything over it)
                    record.spoken_over = "interruption" if interrupt else "backchannel"
                    record.reply_stopped = stopped
            records.append(record)
            await client.listen_until_played(result)
    return records


def figures(records: list[TurnRecord], name: str, *, server: bool = False) -> list[float]:
    """Every turn's ``name`` (a ``TurnMetrics`` field): as measured at the client when the client
    measures it, else (or with ``server``) the server's."""
    at_client = name in CLIENT_MEASURED and not server
    values = [getattr(r.at_client if at_client else r.server, name) for r in records]
    return [float(v) for v in values if v is not None]


def summarize(records: list[TurnRecord], clients: int) -> dict:
    """p50/p90/p95/max of every latency (``<field>_p50``; voice-to-voice as heard at the client, its
    server-side figure as ``server_voice_to_voice_ms_p50``), RTF, ASR speed, underruns, transcript accuracy."""
    rtf = [r.server.rtf for r in records if r.server.rtf is not None]
    asr_speed = [r.speech_s / (r.server.asr_compute_ms / 1000) for r in records if r.server.asr_compute_ms]
    summary: dict = {
        "clients": clients,
        "turns": len(records),
        "turns_with_audio": sum(r.at_client.voice_to_voice_ms is not None for r in records),
        "rtf_min": min(rtf) if rtf else None,
        "rtf_p50": percentile(rtf, 50),
        "underruns": sum(r.at_client.underruns for r in records),
        # a longer gap between two pieces and a stall mid-word both count as one underrun; the silence tells them apart
        "underrun_s": sum(r.at_client.underrun_s or 0.0 for r in records),
        "underrun_s_max": max((r.at_client.underrun_s or 0.0 for r in records), default=0.0),
        "asr_speed_p50": percentile(asr_speed, 50),
        "asr_speed_min": min(asr_speed) if asr_speed else None,
        "transcripts_correct": sum(r.transcript_correct for r in records),
        "speculative_turns": sum(r.server.speculative for r in records),
        # the history weighing (``history_relevance_nats``): turns weighed, answered without the conversation, and
        # chosen by the words heard while the user spoke (the reply started on one prompt)
        "weighed_turns": sum(r.server.history_gain_nats is not None for r in records),
        "history_left_out": sum(r.server.history_left_out for r in records),
        "weighed_from_words_heard": sum(r.server.history_weighed_early for r in records),
        "long_endpoints": sum((r.server.endpoint_ms or 0.0) >= LONG_ENDPOINT_MS for r in records),
        "split_questions": sum(r.split for r in records),
        "continued_questions": sum(r.continued for r in records),
        "talked_over_questions": sum(r.talked_over for r in records),
        "backchannels": sum(r.spoken_over == "backchannel" for r in records),
        "backchannels_stopping_the_reply": sum(r.spoken_over == "backchannel" and r.reply_stopped for r in records),
        "interruptions": sum(r.spoken_over == "interruption" for r in records),
        "interruptions_caught": sum(r.spoken_over == "interruption" and r.reply_stopped for r in records),
    }
    for name in protocol.LATENCY_FIELDS:
        summary.update(_spread(name, figures(records, name)))
        if name in CLIENT_MEASURED:
            summary.update(_spread(f"server_{name}", figures(records, name, server=True)))
    return summary


SPREAD = ("p50", "p90", "p95", "max")


def _spread(key: str, values: list[float]) -> dict[str, float | None]:
    """``<key>_p50``, ``_p90``, ``_p95`` and ``_max`` of ``values`` (None when there are none)."""
    return {
        f"{key}_p50": percentile(values, 50),
        f"{key}_p90": percentile(values, 90),
        f"{key}_p95": percentile(values, 95),
        f"{key}_max": max(values) if values else None,
    }


def print_table(summary: dict) -> None:
    def fmt(value) -> str:
        return "-" if value is None else f"{value:.0f}" if abs(value) >= 10 else f"{value:.2f}"

    print(f"\nclients {summary['clients']}, turns {summary['turns']} ({summary['turns_with_audio']} with audio)")
    print(f"{'figure':<28}" + "".join(f"{column:>10}" for column in SPREAD))
    for name in sorted(protocol.LATENCY_FIELDS, key=lambda name: name not in CLIENT_MEASURED):  # headline first
        rows = [(name, name.removesuffix("_ms"))]
        if name in CLIENT_MEASURED:
            rows = [(name, f"{name.removesuffix('_ms')}, heard"), (f"server_{name}", "  at the server")]
        for key, label in rows:
            print(f"{label + ' (ms)':<28}" + "".join(f"{fmt(summary[f'{key}_{column}']):>10}" for column in SPREAD))
    print(f"{'RTF':<28}{'min ' + fmt(summary['rtf_min']):>10}{'p50 ' + fmt(summary['rtf_p50']):>10}")
    print(
        f"{'ASR speed (x real time)':<28}{'min ' + fmt(summary['asr_speed_min']):>10}{'p50 ' + fmt(summary['asr_speed_p50']):>10}"
    )
    print(
        f"underruns {summary['underruns']} ({summary['underrun_s']:.2f} s of silence in all, "
        f"{summary['underrun_s_max']:.2f} s at most in one reply), transcripts correct {summary['transcripts_correct']}/{summary['turns']}, "
        f"speculative replies used {summary['speculative_turns']}, questions split in two {summary['split_questions']}, "
        f"endpoints of {LONG_ENDPOINT_MS} ms or more (the mid-clause wait) {summary['long_endpoints']}"
    )
    if summary["weighed_turns"]:
        print(
            f"conversation weighed in {summary['weighed_turns']} turns, left out of {summary['history_left_out']}; "
            f"{summary['weighed_from_words_heard']} chosen by the words heard while the user spoke"
        )
    if summary["continued_questions"] or summary["talked_over_questions"]:
        print(
            f"questions committed at a pause and then continued {summary['continued_questions']}, "
            f"with reply audio heard before the question ended {summary['talked_over_questions']}"
        )
    if summary["backchannels"] or summary["interruptions"]:
        print(
            f"backchannels that stopped the reply {summary['backchannels_stopping_the_reply']}/{summary['backchannels']}, "
            f"interruptions caught {summary['interruptions_caught']}/{summary['interruptions']}"
        )


def plot(records: list[TurnRecord], summary: dict, path: Path) -> bool:
    """Left: each turn's critical path from end of speech to first reply audio. Right: stage p50s.

    Returns False (and draws nothing) when matplotlib is not installed (the ``plot`` extra).
    """
    try:
        import matplotlib
    except ImportError:
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ordered = sorted(records, key=lambda r: (r.client, r.turn))
    fig, (turns_ax, stages_ax) = plt.subplots(
        1, 2, figsize=(max(9, len(ordered) * 0.4 + 5), 4.5), gridspec_kw={"width_ratios": [2, 1]}
    )
    labels = ["endpoint wait", "transcript wait", "reply wait (LLM + TTS not yet done)"]
    colors = ["#8aa4c8", "#f2b35b", "#d987b5"]
    for index, record in enumerate(ordered):
        server = record.server
        endpoint, asr = server.endpoint_ms or 0.0, server.asr_final_ms or 0.0
        total = server.voice_to_voice_ms if server.voice_to_voice_ms is not None else endpoint + asr
        reply = max(0.0, total - endpoint - asr)
        bottom = 0.0
        for value, label, color in zip((endpoint, asr, reply), labels, colors, strict=True):
            turns_ax.bar(index, value, bottom=bottom, color=color, label=label if index == 0 else None)
            bottom += value
        heard = record.at_client.voice_to_voice_ms
        if heard is not None:
            turns_ax.plot(index, heard, "k_", markersize=14, label="at the client" if index == 0 else None)
    turns_ax.set_xlabel("turn")
    turns_ax.set_ylabel("ms after the end of the user's speech")
    turns_ax.set_title(f"voice-to-voice, {summary['clients']} client(s)", fontsize=10)
    turns_ax.legend(loc="upper left", fontsize=7)
    medians = [summary.get(f"{name}_p50") or 0.0 for name in protocol.LATENCY_FIELDS]
    labels = [name.removesuffix("_ms") for name in protocol.LATENCY_FIELDS]
    stages_ax.barh(labels[::-1], medians[::-1], color="#7cc49a")
    for y, value in enumerate(medians[::-1]):
        stages_ax.text(value, y, f" {value:.0f}", va="center", fontsize=8)
    stages_ax.set_xlabel("p50 ms")
    stages_ax.set_title("stage latencies (p50)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


async def run(url: str, clients: int, turns: int, workload: Workload) -> list[TurnRecord]:
    results = await asyncio.gather(*(run_client(url, index, turns, workload) for index in range(clients)))
    return [record for client_records in results for record in client_records]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="parley bench voice", description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=1, help="concurrent simulated users")
    parser.add_argument("--turns", type=int, default=4, help="questions per client")
    parser.add_argument("--url", help="ws://HOST:PORT/ws of a running server (default: start one)")
    parser.add_argument("--out", default="bench-output", help="folder for per-turn JSON and the PNG chart")
    parser.add_argument("--json", dest="json_path", help="write the summary as one JSON object here")
    parser.add_argument(
        "--max-sessions", type=int, help="the started server's session cap (default: the server's own default)"
    )
    parser.add_argument("--server-arg", action="append", default=[], help="extra `parley serve` flag (repeatable)")
    parser.add_argument("--set", dest="kind", choices=["plain", "commands", "pauses", "backchannels"], default="plain")
    parser.add_argument("--snr-db", type=float, help="background noise this many dB under the speech (default: none)")
    parser.add_argument("--rates", default="1", help="speaking rates (Piper length scales) to cycle, e.g. 0.85,1,1.2")
    parser.add_argument("--pause-s", type=float, default=0.7, help="the mid-sentence pause of --set pauses")
    parser.add_argument("--tools", action="store_true", help="every reply calls a server tool first (app.bench.tools)")
    parser.add_argument("--tool-ms", type=float, default=DEFAULT_TOOL_MS, help="how long the --tools tool takes")
    args = parser.parse_args(argv)
    if args.clients < 1 or args.turns < 1:
        parser.error("--clients and --turns must be at least 1")
    try:
        rates = [float(rate) for rate in args.rates.split(",")]
    except ValueError:
        parser.error(f"--rates: not numbers: {args.rates!r}")
    if not rates or not all(0.5 <= rate <= 2.0 for rate in rates):
        parser.error("--rates: each between 0.5 and 2.0")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    server = None
    url = args.url
    if url is None:
        print("starting parley serve ...", flush=True)
        started = time.monotonic()
        # default settings, admission included, unless asked (a user refused is counted as a failed turn)
        if args.tools:
            os.environ[TOOL_MS_VARIABLE] = str(args.tool_ms)  # the server inherits it
            args.server_arg += ["--tool-entry-point", "app.bench.tools:tools", "--tool-choice", "required"]
        cap = ["--max-sessions", str(args.max_sessions)] if args.max_sessions else []
        server = ServerProcess(["serve", *cap, *args.server_arg], out / "server.log")
        print(f"server ready in {time.monotonic() - started:.1f} s", flush=True)
        url = server.base_url.replace("http://", "ws://") + "/ws"
    try:
        print(f"{args.clients} client(s) x {args.turns} turns against {url} ...", flush=True)
        workload = build_workload(args.kind, args.snr_db, rates, args.pause_s)
        records = asyncio.run(run(url, args.clients, args.turns, workload))
    finally:
        if server is not None:
            server.stop()
    summary = summarize(records, args.clients)
    summary.update(set=args.kind, snr_db=args.snr_db, rates=rates, tools=args.tools)
    print_table(summary)
    stem = f"voice-{args.kind}{'-tools' if args.tools else ''}-{args.clients}c"
    turns_path, chart_path = out / f"{stem}-turns.json", out / f"{stem}.png"
    turns_path.write_text(json.dumps([record.to_json() for record in records], indent=2))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(summary, indent=2))
    if plot(records, summary, chart_path):
        print(f"per-turn records: {turns_path}, chart: {chart_path}")
    else:
        print(f"per-turn records: {turns_path}; chart skipped: matplotlib is not installed ({PLOT_HINT})")
    if statistics.fmean([r.at_client.voice_to_voice_ms is not None for r in records]) < 1:
        print("warning: some turns got no reply audio")
    return 0
