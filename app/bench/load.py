"""`parley bench load`: add simulated users one by one until the server starts refusing them.

Every ``--step-s`` a new user connects and holds a spoken conversation (the questions and
pacing of ``parley bench voice``). When the server refuses a user (``overloaded``: its
latency circuit breaker, memory red line or session cap), the ramp stops; the users already
admitted go on for ``--settle-s`` more, so that the report shows whether they kept being
served. Reported:

* users admitted at the peak, and users refused (with the gate that refused them);
* users served in real time: every reply produced faster than it plays (RTF >= 1) and the
  user's p95 voice-to-voice (heard at the client) under the breaker's threshold;
* the real-time capacity: the most users at once for which the turns answered while exactly
  that many were connected (and every smaller number) met both conditions. The default
  ``max_sessions`` (``app.server.admission.default_max_sessions``) protects memory; this figure
  is where latency, guarded by the breaker, gives out;
* failed turns among admitted users (errors, or no reply): this must be 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from app import protocol
from app.bench.launcher import ServerProcess
from app.bench.samples import synthesize_speech
from app.bench.user import VoiceClient
from app.bench.voice import QUESTIONS
from app.clients.core import ServerRefused
from engine.metrics import percentile


@dataclass
class User:
    index: int
    joined_at: float
    refused: str | None = None  # the server's reason, when it refused this user
    turns: int = 0
    failed: list[str] = field(default_factory=list)
    voice_to_voice_ms: list[float] = field(default_factory=list)
    rtf: list[float] = field(default_factory=list)
    underruns: int = 0
    underrun_s: float = 0.0  # the silence those underruns left mid-reply
    answered_at: list[float] = field(default_factory=list)  # seconds into the ramp, one per turn
    # the LLM's share of each turn: its request to the first spoken piece (the server's own figure)
    llm_first_piece_ms: list[float] = field(default_factory=list)

    def record(
        self, at_s: float, voice_to_voice_ms: float, rtf: float | None, llm_first_piece_ms: float | None = None
    ) -> None:
        if llm_first_piece_ms is not None:
            self.llm_first_piece_ms.append(llm_first_piece_ms)
        self.turns += 1
        self.answered_at.append(at_s)
        self.voice_to_voice_ms.append(voice_to_voice_ms)
        self.rtf.append(rtf if rtf is not None else 0.0)  # no figure: not shown to be real time

    def served_in_real_time(self, threshold_ms: float) -> bool:
        p95 = percentile(self.voice_to_voice_ms, 95)
        return (
            self.refused is None
            and self.turns > 0
            and not self.failed
            and min(self.rtf, default=0.0) >= 1.0
            and p95 is not None
            and p95 <= threshold_ms
        )


async def converse(
    url: str, user: User, questions: list[tuple[str, np.ndarray]], stop: asyncio.Event, began: float
) -> None:
    try:
        async with VoiceClient(url) as client:
            await client.send_silence(0.3)
            turn = 0
            while not stop.is_set():
                _, audio = questions[(user.index + turn) % len(questions)]
                turn += 1
                try:
                    result = await client.ask(audio, trailing_silence_s=1.2, timeout_s=60)
                except (TimeoutError, ConnectionError) as error:
                    user.failed.append(f"turn {turn}: {error}")
                    return
                error = result.event(protocol.Error)
                done = result.turn_done
                if error is not None or done is None or result.voice_to_voice_ms is None:
                    user.failed.append(f"turn {turn}: {error.message if error else 'no reply audio'}")
                    continue
                user.record(
                    time.monotonic() - began,
                    result.voice_to_voice_ms,
                    done.metrics.rtf,
                    done.metrics.llm_first_piece_ms,
                )
                gaps = result.underrun_gaps
                user.underruns += len(gaps)
                user.underrun_s += sum(gaps)
                await client.listen_until_played(result)
    except ServerRefused as refused:
        user.refused = refused.event.message


async def ramp(url: str, args: argparse.Namespace) -> list[User]:
    questions = [(text, synthesize_speech(text)) for text in QUESTIONS]
    stop = asyncio.Event()
    users: list[User] = []
    tasks: list[asyncio.Task] = []
    began = time.monotonic()
    refused_in_a_row = 0
    for index in range(args.max_users):
        user = User(index, time.monotonic() - began)
        users.append(user)
        tasks.append(asyncio.create_task(converse(url, user, questions, stop, began)))
        await asyncio.sleep(args.step_s)
        admitted = sum(u.refused is None for u in users)
        print(
            f"t={time.monotonic() - began:5.0f} s  users {admitted} admitted, {len(users) - admitted} refused"
            + (f"  (last refusal: {user.refused})" if user.refused else ""),
            flush=True,
        )
        refused_in_a_row = refused_in_a_row + 1 if user.refused else 0
        if refused_in_a_row >= args.refusals_to_stop:
            break
    print(f"ramp over; the admitted users go on for {args.settle_s:g} s", flush=True)
    await asyncio.sleep(args.settle_s)
    stop.set()
    await asyncio.wait(tasks, timeout=90)
    for task in tasks:
        task.cancel()
    return users


MIN_TURNS_PER_LEVEL = 3


def levels(users: list[User], threshold_ms: float) -> list[dict]:
    """The turns answered while exactly k users were connected, for k = 1, 2, ...: their p95
    voice-to-voice, their slowest RTF, and whether that was real time (p95 under ``threshold_ms``,
    RTF >= 1, at least ``MIN_TURNS_PER_LEVEL`` turns)."""
    admitted = sorted((u for u in users if u.refused is None), key=lambda u: u.joined_at)
    joins = [u.joined_at for u in admitted]
    report = []
    for count in range(1, len(admitted) + 1):
        start, end = joins[count - 1], joins[count] if count < len(joins) else float("inf")
        v2v, rtf = [], []
        for user in admitted[:count]:
            for at, ms, factor in zip(user.answered_at, user.voice_to_voice_ms, user.rtf, strict=True):
                if start <= at < end:
                    v2v.append(ms)
                    rtf.append(factor)
        p95 = percentile(v2v, 95)
        rtf_min = min(rtf) if rtf else None
        real_time = (
            len(v2v) >= MIN_TURNS_PER_LEVEL
            and p95 is not None
            and p95 <= threshold_ms
            and rtf_min is not None
            and rtf_min >= 1.0
        )
        report.append(
            {
                "users": count,
                "turns": len(v2v),
                "voice_to_voice_ms_p95": p95,
                "rtf_min": rtf_min,
                "real_time": real_time,
            }
        )
    return report


def real_time_capacity(report: list[dict]) -> int:
    """The most users at once served in real time, with every smaller number served so too."""
    capacity = 0
    for level in report:
        if not level["real_time"]:
            break
        capacity = level["users"]
    return capacity


def summarize(users: list[User], threshold_ms: float) -> dict:
    admitted = [u for u in users if u.refused is None]
    v2v = [value for u in admitted for value in u.voice_to_voice_ms]
    rtf = [value for u in admitted for value in u.rtf]
    llm = [value for u in admitted for value in u.llm_first_piece_ms]
    by_level = levels(users, threshold_ms)
    return {
        "users_tried": len(users),
        "users_admitted": len(admitted),
        "users_refused": len(users) - len(admitted),
        "refusals": sorted({u.refused for u in users if u.refused}),
        "users_served_in_real_time": sum(u.served_in_real_time(threshold_ms) for u in admitted),
        "real_time_capacity": real_time_capacity(by_level),
        "levels": by_level,
        "failed_turns": sum(len(u.failed) for u in admitted),
        "failures": [f for u in admitted for f in u.failed],
        "turns": sum(u.turns for u in admitted),
        "voice_to_voice_ms_p50": percentile(v2v, 50),
        "voice_to_voice_ms_p95": percentile(v2v, 95),
        "llm_first_piece_ms_p50": percentile(llm, 50),
        "llm_first_piece_ms_p95": percentile(llm, 95),
        "rtf_min": min(rtf) if rtf else None,
        "underruns": sum(u.underruns for u in admitted),
        "underrun_s": sum(u.underrun_s for u in admitted),
        "threshold_ms": threshold_ms,
        "per_user": [
            {
                "user": u.index,
                "joined_at_s": round(u.joined_at, 1),
                "refused": u.refused,
                "turns": u.turns,
                "failed": u.failed,
                "voice_to_voice_ms_p95": percentile(u.voice_to_voice_ms, 95),
                "rtf_min": min(u.rtf) if u.rtf else None,
                "answered_at_s": [round(at, 1) for at in u.answered_at],
                "served_in_real_time": u.served_in_real_time(threshold_ms),
            }
            for u in users
        ],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="parley bench load", description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="ws://HOST:PORT/ws of a running server (default: start one)")
    parser.add_argument("--max-users", type=int, default=12, help="stop the ramp here in any case")
    parser.add_argument("--step-s", type=float, default=20.0, help="seconds between two new users")
    parser.add_argument("--settle-s", type=float, default=30.0, help="how long admitted users go on after the ramp")
    parser.add_argument("--refusals-to-stop", type=int, default=2, help="refused users in a row that end the ramp")
    parser.add_argument(
        "--threshold-ms", type=float, default=2000.0, help="p95 voice-to-voice a user must stay under (as the breaker)"
    )
    parser.add_argument("--json", dest="json_path", help="write the summary here")
    parser.add_argument("--out", default="bench-output", help="folder for the server log")
    parser.add_argument("--server-arg", action="append", default=[], help="extra `parley serve` flag (repeatable)")
    args = parser.parse_args(argv)
    if args.max_users < 1 or args.step_s <= 0:
        parser.error("--max-users must be at least 1 and --step-s positive")
    server = None
    url = args.url
    if url is None:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        # the session cap is what this measures, so it must not be what stops the ramp
        server_args = ["serve", "--breaker-voice-to-voice-ms", str(args.threshold_ms)]
        server_args += ["--max-sessions", str(args.max_users), *args.server_arg]
        server = ServerProcess(server_args, out / "server-load.log")
        url = server.base_url.replace("http://", "ws://") + "/ws"
    try:
        users = asyncio.run(ramp(url, args))
    finally:
        if server is not None:
            server.stop()
    summary = summarize(users, args.threshold_ms)
    print(
        f"\nadmitted {summary['users_admitted']} of {summary['users_tried']} users; "
        f"served in real time {summary['users_served_in_real_time']}; refused {summary['users_refused']}; "
        f"failed turns among the admitted: {summary['failed_turns']}"
    )
    print(
        f"voice-to-voice p50 {summary['voice_to_voice_ms_p50'] or 0:.0f} ms, p95 {summary['voice_to_voice_ms_p95'] or 0:.0f} ms; "
        f"RTF min {summary['rtf_min'] or 0:.2f}; underruns {summary['underruns']} ({summary['underrun_s']:.2f} s of silence)"
    )
    print(
        f"the LLM's share (its request to the first spoken piece): p50 {summary['llm_first_piece_ms_p50'] or 0:.0f} ms,"
        f" p95 {summary['llm_first_piece_ms_p95'] or 0:.0f} ms"
    )
    for level in summary["levels"]:
        p95, rtf = level["voice_to_voice_ms_p95"], level["rtf_min"]
        print(
            f"  {level['users']} user(s): {level['turns']} turns, p95 {p95 or 0:.0f} ms, RTF min {rtf or 0:.2f}"
            f" -> {'real time' if level['real_time'] else 'not real time'}"
        )
    print(f"real-time capacity: {summary['real_time_capacity']} user(s) at once")
    for reason in summary["refusals"]:
        print(f"refused: {reason}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(summary, indent=2))
    return 1 if summary["failed_turns"] else 0
