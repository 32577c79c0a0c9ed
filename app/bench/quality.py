"""`parley bench quality`: do the answers hold up over a conversation? Typed turns to a real server.

Four conversations of 20 typed turns (``app.bench.quality_set``) go through ``/ws`` as a user
would type them, each after a ``reset``; then every fact question (and every follow-up, in full)
is asked alone, after a ``reset`` of its own. Replies come as text only (``config``
``reply_audio: false``: the same LLM path and history, no speech synthesis to wait for), and each
turn waits for its ``turn_done``. One turn per conversation is spoken and cancelled once its first
reply audio arrives (the history keeps what was heard of it). Nothing is timed: the figures are
counts, so a busy machine changes none of them (with the default greedy sampling a run repeats,
but for the few words of the cancelled reply that had played).

Scored (``app.bench.quality_score``):
* facts right, in a conversation and alone (the same questions), and which way they differ;
* user facts recalled ("My name is Maya." ... "What is my name?"), follow-ups right ("And Spain?");
* copied replies: equal or near-equal to an earlier reply of the conversation (``near_copy``);
* answers to an earlier question: a reply without the right answer that gives an earlier one's;
* replies under three words (but to a thanks or goodbye), words per reply;
* after a cancelled reply, whether the next reply says it again;
* how often each reply guard cut a reply (``protocol.GUARD_FIELDS``, summed from ``turn_done``).

Then the how-to requests (``app.bench.quality_howto``: answered, without a page's markup, their length), each in a
fresh conversation. Greedy by default; ``--seeds 0,1,2`` samples (``--temperature``) and runs the whole set once
per seed on a server started with that seed (``llm_seed``), reporting each run and the spread of every figure.

``--spoken-actions`` says the requests to act on aloud instead (the bundled voice, ``--snr-db`` of background
noise), each in a conversation of its own, so an action is shown from speech to skill; ``--conversations 0``
leaves the conversations out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from app import protocol
from app.bench.launcher import ServerProcess
from app.bench.quality_actions import (
    ACTIONS,
    ActionAsk,
    ActionRecord,
    describe_action,
    print_actions,
    summarize_actions,
    with_home,
)
from app.bench.quality_howto import HOW_TOS, HowTo, HowToRecord, describe_how_to, print_how_tos, summarize_how_tos
from app.bench.quality_score import TurnRecord, describe, print_table, score_in_conversation, score_turn, summarize
from app.bench.quality_set import CONVERSATIONS, Ask, alone_questions
from app.clients.core import Connection, open_connection
from app.voice.runaway import SPOKEN_CHARS_PER_S

TURN_TIMEOUT_S = 180.0
CANCEL_WAIT_S = 15.0  # for the interrupted turn_done after a cancel (none comes if the reply had ended)


# ------------------------------------------------------------------ the typed user
@dataclass
class Answer:
    """What the server sent for one typed turn."""

    turn_id: int | None = None
    written: list[str] = field(default_factory=list)
    reply: str = ""
    audio_samples: int = 0
    metrics: protocol.TurnMetrics | None = None
    interrupted: bool = False
    error: str | None = None
    done: bool = False
    calls: list[protocol.ToolDone] = field(default_factory=list)

    @property
    def guards(self) -> dict[str, int]:
        return guard_counts(self.metrics)


def guard_counts(metrics: protocol.TurnMetrics | None) -> dict[str, int]:
    """How often each reply guard cut a reply (``protocol.GUARD_FIELDS``; empty without its ``turn_done``)."""
    return {name: getattr(metrics, name) or 0 for name in protocol.GUARD_FIELDS} if metrics is not None else {}


class TypedUser:
    """Types turns on one ``/ws`` connection and reads the events of each until its ``turn_done``."""

    def __init__(self, connection: Connection) -> None:
        self.connection = connection

    async def _read(self, answer: Answer, until: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not until():
            item = await self.connection.recv(max(0.0, deadline - time.monotonic()))
            if isinstance(item, bytes):
                answer.audio_samples += len(item) // 2
            elif isinstance(item, protocol.Transcript) and item.final and answer.turn_id is None:
                answer.turn_id = item.turn_id
            elif isinstance(item, protocol.AssistantText) and item.turn_id == answer.turn_id:
                answer.written.append(item.delta)
            elif isinstance(item, protocol.ToolDone) and item.turn_id == answer.turn_id:
                answer.calls.append(item)
            elif isinstance(item, protocol.TurnDone) and item.turn_id == answer.turn_id:
                answer.reply, answer.metrics, answer.done = item.text, item.metrics, True
                answer.interrupted = item.interrupted
            elif isinstance(item, protocol.Error):
                if item.fatal:
                    raise OSError(f"the server ended the session: {item.message}")
                answer.error, answer.done = item.message, True

    async def configure(self, **prefs) -> None:
        """Send a ``config`` and wait for it to apply (``reply_audio=False``: replies come as text only)."""
        await self.connection.send(protocol.SessionConfig(**prefs))
        deadline = time.monotonic() + TURN_TIMEOUT_S
        while True:
            item = await self.connection.recv(max(0.0, deadline - time.monotonic()))
            if isinstance(item, protocol.Error):
                raise OSError(f"the server refused {prefs}: {item.message}")
            if isinstance(item, protocol.ConfigApplied):
                return

    async def ask(self, text: str) -> Answer:
        """Type ``text``, read its whole reply, and say any audio of it was heard in full (so the next turn does
        not cut it)."""
        answer = Answer()
        await self.connection.send_text(text)
        await self._read(answer, lambda: answer.done, TURN_TIMEOUT_S)
        if answer.turn_id is not None and answer.audio_samples:
            played_ms = 1000 * answer.audio_samples / self.connection.output_sample_rate
            await self.connection.send(protocol.Playback(turn_id=answer.turn_id, played_ms=played_ms))
        return answer

    async def ask_and_cancel(self, text: str) -> Answer:
        """Type ``text`` and ``cancel`` its reply once its first audio arrives (or it ends, if it has none)."""
        answer = Answer()
        await self.connection.send_text(text)
        await self._read(answer, lambda: answer.audio_samples > 0 or answer.done, TURN_TIMEOUT_S)
        await self.connection.send(protocol.Cancel())
        try:  # the cut reply's turn_done; a reply that had ended and played by then is not cut
            await self._read(answer, lambda: answer.interrupted or answer.error is not None, CANCEL_WAIT_S)
        except TimeoutError:
            pass
        return answer

    async def reset(self) -> None:
        await self.connection.send(protocol.Reset())


async def _turn(user: TypedUser, conversation: int | None, turn: int, ask: Ask) -> TurnRecord:
    if ask.kind == "interrupt":  # spoken, so that what is kept of it is what had played
        await user.configure(reply_audio=True)
        answer = await user.ask_and_cancel(ask.text)
        await user.configure(reply_audio=False)
    else:
        answer = await user.ask(ask.text)
    return TurnRecord(
        conversation,
        turn,
        ask,
        reply=answer.reply,
        written="".join(answer.written).strip(),
        interrupted=answer.interrupted,
        guards=answer.guards,
        error=answer.error,
        history_left_out=answer.metrics is not None and answer.metrics.history_left_out,
        history_gain_nats=None if answer.metrics is None else answer.metrics.history_gain_nats,
        asked_in_full=None if answer.metrics is None else answer.metrics.asked_in_full,
    )


@dataclass
class QualityRun:
    """One run's records: the conversations' turns, the questions alone, the requests to act on, the how-tos."""

    conversations: list[list[TurnRecord]] = field(default_factory=list)
    alone: list[TurnRecord] = field(default_factory=list)
    actions: list[ActionRecord] = field(default_factory=list)
    how_tos: list[HowToRecord] = field(default_factory=list)


async def run(
    url: str,
    conversations: tuple[tuple[Ask, ...], ...],
    seed: int,
    say: Callable[[str], None] = print,
    actions: tuple[ActionAsk, ...] = ACTIONS,
    how_tos: tuple[HowTo, ...] = HOW_TOS,
) -> QualityRun:
    """Every conversation, then its questions alone (in an order ``seed`` shuffles), then the requests to act on
    (``app.bench.quality_actions``) and the how-tos (``app.bench.quality_howto``), each in a fresh conversation, on
    one connection."""
    connection = await open_connection(url)
    user = TypedUser(connection)
    try:
        await user.configure(reply_audio=False)
        talks = []
        for number, asks in enumerate(conversations):
            await user.reset()
            records = []
            for index, ask in enumerate(asks):
                record = await _turn(user, number, index, ask)
                score_in_conversation(record, records)
                records.append(record)
                say(describe(record))
            talks.append(records)
        questions = alone_questions(conversations)
        random.Random(seed).shuffle(questions)
        alone = []
        for index, ask in enumerate(questions):
            await user.reset()
            record = await _turn(user, None, index, ask)
            score_turn(record)
            alone.append(record)
            say(describe(record))
        acts, answered = [], []
        for request in actions:
            await user.reset()
            answer = await user.ask(request.text)
            acts.append(ActionRecord(request, answer.reply, answer.calls, answer.guards, answer.error))
            say(describe_action(acts[-1]))
        for how_to in how_tos:
            await user.reset()
            answer = await user.ask(how_to.text)
            answered.append(HowToRecord(how_to, answer.reply, answer.calls, answer.guards, answer.error))
            say(describe_how_to(answered[-1]))
    finally:
        await connection.close()
    return QualityRun(talks, alone, acts, answered)


async def speak_actions(
    url: str, actions: tuple[ActionAsk, ...], snr_db: float | None, say: Callable[[str], None] = print
) -> list[ActionRecord]:
    """Each request said aloud (the bundled voice, background noise ``snr_db`` under it) in a conversation of its
    own, scored as a typed one from what the wire shows; with what the server heard and the reply audio's length."""
    from app.bench.samples import noise_rms, synthesize_speech, trim_to_speech
    from app.bench.user import VoiceClient

    clips = [trim_to_speech(synthesize_speech(request.text)) for request in actions]
    noise = 0.0 if snr_db is None else noise_rms(clips, snr_db)
    records = []
    for index, (request, clip) in enumerate(zip(actions, clips, strict=True)):
        async with VoiceClient(url, noise_rms=noise, seed=index) as client:
            result = await client.ask(clip, timeout_s=TURN_TIMEOUT_S)
        done = result.event(protocol.TurnDone)
        error = next((event.message for event in result.all(protocol.Error)), None)
        guards = guard_counts(done.metrics if done else None)
        audio_s = len(result.reply_audio) / 2 / result.output_sample_rate if result.output_sample_rate else 0.0
        record = ActionRecord(
            request,
            done.text if done else "",
            result.all(protocol.ToolDone),
            guards,
            error,
            heard=result.final_transcript,
            audio_s=round(audio_s, 1),
        )
        records.append(record)
        say(describe_action(record))
    return records


def speech_seconds(replies: list[str]) -> dict[str, float]:
    """Seconds of speech per reply, p50 and p90, estimated from its length (``app.voice.runaway.SPOKEN_CHARS_PER_S``:
    the replies come as text here), and how many would run past 20 s."""
    seconds = sorted(len(reply) / SPOKEN_CHARS_PER_S for reply in replies)
    if not seconds:
        return {}
    at = lambda q: seconds[min(len(seconds) - 1, int(q * len(seconds)))]  # noqa: E731
    over = sum(s > 20 for s in seconds)
    return {
        "speech_s_per_reply_p50": round(at(0.5), 1),
        "speech_s_per_reply_p90": round(at(0.9), 1),
        "replies_over_20_s": over,
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="parley bench quality", description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="ws://HOST:PORT/ws of a running server (default: start one)")
    parser.add_argument("--server-arg", action="append", default=[], help="extra `parley serve` flag (repeatable)")
    parser.add_argument("--seed", type=int, default=0, help="the order of the questions asked alone")
    parser.add_argument(
        "--seeds",
        help="sample instead of decoding greedily, and run the whole set once per seed (comma-separated: 0,1,2), "
        "each on a server of its own started with --llm-seed SEED --llm-temperature T; each run's figures and "
        "their spread are reported",
    )
    parser.add_argument("--temperature", type=float, default=0.7, help="with --seeds: the sampling temperature")
    parser.add_argument(
        "--conversations", type=int, default=len(CONVERSATIONS), help="how many of the conversations (a smoke run: 1)"
    )
    parser.add_argument(
        "--actions", action=argparse.BooleanOptionalAction, default=True, help="also the requests to act on"
    )
    parser.add_argument("--spoken-actions", action="store_true", help="say the requests to act on aloud")
    parser.add_argument("--snr-db", type=float, help="with --spoken-actions: noise this many dB under the speech")
    parser.add_argument(
        "--how-tos", action=argparse.BooleanOptionalAction, default=True, help="also the how-to requests"
    )
    parser.add_argument(
        "--home", action="store_true", help="connect a stand-in home MCP server (app.bench.home_mcp): lights to switch"
    )
    parser.add_argument("--out", default="bench-output", help="folder for the server log")
    parser.add_argument("--json", dest="json_path", help="write the summary and every turn here")
    return parser


def seeds_of(text: str | None) -> list[int | None]:
    """``--seeds``' list (None: one greedy run)."""
    if not text:
        return [None]
    seeds = [int(part) for part in text.split(",") if part.strip()]
    if not seeds or any(seed < 0 for seed in seeds) or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds: distinct whole numbers >= 0, comma-separated (got {text!r})")
    return seeds


def spread(summaries: list[dict]) -> dict[str, dict[str, float]]:
    """Each figure the runs all have, as numbers: its min, median and max over the runs."""
    keys = [k for k, v in summaries[0].items() if isinstance(v, int | float) and not isinstance(v, bool)]
    figures = {}
    for key in keys:
        values = sorted(s[key] for s in summaries if isinstance(s.get(key), int | float))
        if len(values) == len(summaries):
            figures[key] = {"min": values[0], "median": statistics.median(values), "max": values[-1]}
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not 0 <= args.conversations <= len(CONVERSATIONS):
        parser.error(f"--conversations: 0 to {len(CONVERSATIONS)}")
    if args.spoken_actions and not args.actions:
        parser.error("--spoken-actions needs the actions (not --no-actions)")
    if args.home and args.url is not None:
        parser.error("--home starts the server (it connects the home's MCP server): leave out --url")
    try:
        seeds = seeds_of(args.seeds)
    except ValueError as e:
        parser.error(str(e))
    if args.seeds and args.url is not None:
        parser.error("--seeds starts a server for each seed: leave out --url")
    if args.seeds and not 0 < args.temperature <= 2:
        parser.error("--temperature: above 0 (sampling) and at most 2")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    reports = []
    for seed in seeds:
        sampling = [] if seed is None else ["--llm-seed", str(seed), "--llm-temperature", str(args.temperature)]
        if seed is not None:
            print(f"\n=== seed {seed} (temperature {args.temperature}) ===", flush=True)
        reports.append(_run_once(args, [*args.server_arg, *sampling], out) | {"sampling_seed": seed})
    if len(reports) > 1:
        figures = spread([report["summary"] for report in reports])
        print(f"\nover {len(reports)} seeds (min / median / max):")
        for key, values in figures.items():
            print(f"  {key:<48}{values['min']:>8g}{values['median']:>8g}{values['max']:>8g}")
    if args.json_path:
        whole = reports[0] if len(reports) == 1 else {"runs": reports, "spread": figures}
        Path(args.json_path).write_text(json.dumps(whole, indent=2))
    return 0


def _run_once(args: argparse.Namespace, server_args: list[str], out: Path) -> dict:
    """One run of the whole set (on a server started with ``server_args``, unless ``--url``): printed, and its
    report (the summary and every record) returned."""
    chosen = CONVERSATIONS[: args.conversations]
    server, url = None, args.url
    action_set = with_home(ACTIONS) if args.home else ACTIONS
    home_state = (out / "home-state.json").resolve()
    if args.home:
        home_state.unlink(missing_ok=True)  # (each run's home starts with every light off)
        home = {
            "name": "home",
            "command": [sys.executable, "-m", "app.bench.home_mcp", "--state", str(home_state)],
            "prompt": "Assist",
        }
        server_args = [*server_args, "--mcp-servers", json.dumps([home])]
    if url is None:
        print("starting parley serve ...", flush=True)
        # answers are scored, not speed: the latency breaker must not refuse the spoken requests' connections
        breaker_off = ["--breaker-voice-to-voice-ms", "600000", "--breaker-llm-ttft-ms", "600000"]
        server = ServerProcess(["serve", *breaker_off, *server_args], out / "quality-server.log")
        url = server.base_url.replace("http://", "ws://") + "/ws"
    try:
        print(f"typing {sum(map(len, chosen))} conversation turns, then their questions alone, to {url} ...")
        actions = action_set if args.actions and not args.spoken_actions else ()
        how_tos = HOW_TOS if args.how_tos else ()
        say = lambda line: print(line, flush=True)  # noqa: E731
        done = asyncio.run(run(url, chosen, args.seed, say=say, actions=actions, how_tos=how_tos))
        if args.spoken_actions:
            print(f"saying {len(action_set)} requests to act on (noise: {args.snr_db} dB SNR) ...", flush=True)
            done.actions = asyncio.run(speak_actions(url, action_set, args.snr_db, say=say))
    finally:
        if server is not None:
            server.stop()
    conversations, alone, acts = done.conversations, done.alone, done.actions
    summary = (summarize(conversations, alone) if conversations else {}) | (summarize_actions(acts) if acts else {})
    summary |= summarize_how_tos(done.how_tos) if done.how_tos else {}
    replies = [r.reply for c in conversations for r in c] + [r.reply for r in alone + acts + done.how_tos]
    summary |= speech_seconds(replies)
    if conversations:
        print_table(summary)
    if acts:
        print_actions(summary)
    if done.how_tos:
        print_how_tos(summary)
    if "speech_s_per_reply_p50" in summary:
        print(
            f"seconds of speech per reply (from its length): p50 {summary['speech_s_per_reply_p50']}, "
            f"p90 {summary['speech_s_per_reply_p90']}; over 20 s: {summary['replies_over_20_s']}"
        )
    return {
        "summary": summary,
        "seed": args.seed,
        "spoken_actions": args.spoken_actions,
        "snr_db": args.snr_db,
        "home": json.loads(home_state.read_text()) if args.home and home_state.exists() else None,
        "server_args": server_args,
        "conversations": [[record.to_json() for record in records] for records in conversations],
        "alone": [record.to_json() for record in alone],
        "actions": [record.to_json() for record in acts],
        "how_tos": [record.to_json() for record in done.how_tos],
    }
