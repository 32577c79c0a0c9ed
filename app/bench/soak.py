"""`parley bench soak`: weeks of use, compressed: rounds of conversations, hang-ups and bad input against one
voice server, its resident memory read after each round.

Each round is what a busy day brings, many times faster: a spoken question answered; typed questions
answered; users who hang up in the middle of a reply (no close frame); a client sending malformed frames
(bad JSON, unknown types, binary garbage, an oversized frame); every ``--stuck-every`` rounds a client that
stops reading while its reply streams (evicted by the send deadline). After each round the bench waits for
the server to settle (no session, no engine request, no KV block in use) and reads the server's RSS
(``/proc/<pid>/status``).

Reported: RSS after the warm-up round, at the end, the growth over the second half of the rounds (what a
leak shows as: the first rounds fill caches and pools once), and its slope per 100 rounds; and where the
growth from round 1 to the end went, by the server's own ``parley_heap_bytes`` (glibc's allocator: live
allocations, freed memory the arenas hold, large mmapped blocks; the rest of the RSS is memory no allocator
manages: mapped model files, stacks). The server is started by the bench (its pid is needed);
``--server-arg`` passes settings to it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import time
from pathlib import Path

import httpx
import websockets

from app import protocol
from app.bench.launcher import ServerProcess
from app.bench.samples import synthesize_speech
from app.bench.user import speak_turn

QUESTIONS = [
    "What is the capital of France?",
    "How many legs does a spider have?",
    "What is the boiling point of water?",
    "Who wrote Romeo and Juliet?",
]
MALFORMED = [
    "{not json",
    json.dumps({"type": "no_such_type"}),
    json.dumps({"type": "text"}),
    json.dumps({"type": "text", "text": 42}),
    json.dumps({"type": "config", "sample_rate": -5}),
    json.dumps([1, 2, 3]),
    "\x00\x01\x02",
]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def heap_mb(base: str) -> dict[str, float]:
    """The server's ``parley_heap_bytes`` by kind, in MB (empty where its libc has no ``mallinfo2``)."""
    heap = {}
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith('parley_heap_bytes{kind="'):
            kind = line.split('"')[1]
            heap[f"heap_{kind}_mb"] = round(float(line.split()[-1]) / 2**20, 1)
    return heap


def _figure(base: str, name: str) -> float:
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


async def settle(base: str, timeout_s: float = 120) -> bool:
    """Wait until no session, engine request or KV block is left (True), or time out (False)."""
    names = ("parley_sessions", "parley_engine_requests_running", "parley_engine_kv_blocks_used")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(_figure(base, n) == 0 for n in names):
            return True
        await asyncio.sleep(0.5)
    return False


async def typed_turn(ws_url: str, text: str, *, hang_up: bool = False) -> None:
    """Ask ``text``; wait for the turn's end, or hang up (no close frame) once its audio starts."""
    async with websockets.connect(ws_url, max_size=1 << 22) as ws:
        await ws.recv()  # ready
        await ws.send(json.dumps({"type": "text", "text": text}))
        while True:
            message = await asyncio.wait_for(ws.recv(), 120)
            if isinstance(message, bytes):
                if hang_up:
                    ws.transport.abort()
                    return
                continue
            if isinstance(protocol.parse_server_message(message), protocol.TurnDone):
                return


async def malformed_frames(ws_url: str, count: int) -> None:
    """``count`` bad frames on one connection (each gets an error), then one oversized frame (closes it)."""
    async with websockets.connect(ws_url, max_size=1 << 22) as ws:
        await ws.recv()
        for i in range(count):
            frame = MALFORMED[i % len(MALFORMED)]
            await ws.send(frame if i % 5 else frame.encode())
        with contextlib.suppress(websockets.ConnectionClosed):
            await ws.send("x" * (1 << 21))
            while True:
                await asyncio.wait_for(ws.recv(), 10)


def stuck_reader(ws_url: str) -> socket.socket:
    """A raw client that upgrades, asks for a long story and never reads (the caller closes it later)."""
    host, port = ws_url.removeprefix("ws://").split("/")[0].split(":")
    sock = socket.create_connection((host, int(port)))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    key = "dGhlIHNhbXBsZSBub25jZQ=="
    sock.sendall(
        f"GET /ws HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode()
    )
    payload = json.dumps({"type": "text", "text": "Tell me a very long story about a dragon."}).encode()
    mask = os.urandom(4)
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    sock.sendall(bytes([0x81, 0x80 | len(payload)]) + mask + masked)
    return sock


async def one_round(ws_url: str, speech, r: int, args) -> None:
    for _ in range(args.spoken):
        await speak_turn(ws_url, speech, trailing_silence_s=1.0, realtime=False)
    for i in range(args.typed):
        await typed_turn(ws_url, QUESTIONS[(r + i) % len(QUESTIONS)])
    for _ in range(args.hang_ups):
        await typed_turn(ws_url, "Tell me a long story about a dragon.", hang_up=True)
    await malformed_frames(ws_url, args.malformed)


async def soak(base: str, pid: int, args) -> dict:
    ws_url = base.replace("http://", "ws://") + "/ws"
    speech = synthesize_speech(QUESTIONS[0])
    samples: list[dict] = []
    stuck: list[socket.socket] = []
    started = time.monotonic()
    for r in range(args.rounds):
        if args.stuck_every and r % args.stuck_every == 0:
            stuck.append(stuck_reader(ws_url))
        await one_round(ws_url, speech, r, args)
        for sock in stuck:  # the server has evicted it (or it is closed now): either way it goes
            sock.close()
        stuck.clear()
        settled = await settle(base)
        samples.append(
            {
                "round": r + 1,
                "rss_mb": round(rss_mb(pid), 1),
                **heap_mb(base),
                "settled": settled,
                "seconds": round(time.monotonic() - started, 1),
            }
        )
        print(f"round {r + 1:3d}: RSS {samples[-1]['rss_mb']:7.1f} MB{'' if settled else ' (NOT settled)'}", flush=True)
    return summarize(samples, args)


def summarize(samples: list[dict], args) -> dict:
    rss = [s["rss_mb"] for s in samples]
    half = len(rss) // 2
    second = rss[half:]
    slope = _slope(second) * 100 if len(second) > 1 else 0.0
    return {
        "rounds": len(rss),
        "per_round": {
            "spoken": args.spoken,
            "typed": args.typed,
            "hang_ups": args.hang_ups,
            "malformed": args.malformed,
        },
        "stuck_readers": -(-len(rss) // args.stuck_every) if args.stuck_every else 0,
        "rss_after_first_round_mb": rss[0],
        "rss_end_mb": rss[-1],
        "rss_max_mb": max(rss),
        "growth_second_half_mb": round(second[-1] - second[0], 1),
        "slope_mb_per_100_rounds": round(slope, 1),
        "growth_from_round_1_mb": {
            key: round(samples[-1][key] - samples[0][key], 1)
            for key in samples[0]
            if key.endswith("_mb") and key in samples[-1]
        },
        "all_settled": all(s["settled"] for s in samples),
        "samples": samples,
    }


def _slope(ys: list[float]) -> float:
    """Least-squares slope of ``ys`` per step."""
    n = len(ys)
    mean_x, mean_y = (n - 1) / 2, sum(ys) / n
    num = sum((i - mean_x) * (y - mean_y) for i, y in enumerate(ys))
    return num / sum((i - mean_x) ** 2 for i in range(n))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="parley bench soak", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--spoken", type=int, default=1, help="spoken questions answered per round")
    parser.add_argument("--typed", type=int, default=3, help="typed questions answered per round")
    parser.add_argument("--hang-ups", type=int, default=3, help="users hanging up mid-reply per round")
    parser.add_argument("--malformed", type=int, default=40, help="malformed frames per round")
    parser.add_argument("--stuck-every", type=int, default=10, help="a client that stops reading every N rounds")
    parser.add_argument("--json", dest="json_path", help="write the summary here")
    parser.add_argument("--out", default="bench-output", help="folder for the server log")
    parser.add_argument("--server-arg", action="append", default=[], help="extra `parley serve` flag (repeatable)")
    args = parser.parse_args(argv)
    if args.rounds < 2:
        parser.error("--rounds must be at least 2")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    server_args = ["serve", "--breaker-voice-to-voice-ms", "600000", "--breaker-llm-ttft-ms", "600000"]
    with ServerProcess([*server_args, *args.server_arg], out / "soak-server.log", timeout_s=600) as server:
        summary = asyncio.run(soak(server.base_url, server.process.pid, args))
    print(
        f"RSS {summary['rss_after_first_round_mb']} MB after round 1, {summary['rss_end_mb']} MB after "
        f"{summary['rounds']}; second half {summary['growth_second_half_mb']:+} MB "
        f"({summary['slope_mb_per_100_rounds']:+} MB per 100 rounds); settled every round: {summary['all_settled']}"
    )
    growth = summary["growth_from_round_1_mb"]
    print("growth from round 1, MB: " + ", ".join(f"{key.removesuffix('_mb')} {v:+}" for key, v in growth.items()))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(summary, indent=2))
    return 0 if summary["all_settled"] else 1
