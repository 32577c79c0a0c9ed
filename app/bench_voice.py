"""`parley bench voice`: simulated users talk to a real server over the real WebSocket.

Each client holds one conversation and asks several different spoken questions (synthesized
once with the bundled voice and cached), at real-time pace with natural trailing silence,
waits for the reply to finish playing, and asks the next. Voice-to-voice latency and
underruns are measured on the client, as a user would experience them; stage latencies come
from the server's per-turn metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import numpy as np

from app.launcher import ServerProcess
from app.samples import synthesize_speech
from app.text import words
from app.voice_client import VoiceClient

QUESTIONS = [
    "What is the capital of France?",
    "How are you today?",
    "Tell me a fun fact about dogs.",
    "What should I cook for dinner tonight?",
    "Why is the sky blue?",
    "Can you recommend a good book?",
]
STAGES = ["endpoint_ms", "asr_final_ms", "asr_compute_ms", "llm_ttft_ms", "tts_first_audio_ms"]


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


async def run_client(url: str, client_index: int, turns: int, questions: list[tuple[str, np.ndarray]]) -> list[dict]:
    records = []
    async with VoiceClient(url) as client:
        while not client.output_sample_rate:
            await asyncio.sleep(0.01)
        await client.send_silence(0.5 + 0.37 * client_index)  # clients do not all speak at the same instant
        for turn in range(turns):
            text, audio = questions[(client_index + turn) % len(questions)]
            result = await client.ask(audio, trailing_silence_s=1.2)
            done = result.event("turn_done") or {}
            metrics = done.get("metrics", {})
            records.append(
                {
                    "client": client_index,
                    "turn": turn,
                    "question": text,
                    "transcript": result.final_transcript,
                    "transcript_correct": words(result.final_transcript) == words(text),
                    "reply": result.assistant_text,
                    "voice_to_voice_ms": result.voice_to_voice_ms,
                    "reply_audio_s": result.reply_seconds,
                    "underruns": result.underruns,
                    "speech_s": len(audio) / 16000,
                    "server": metrics,
                }
            )
            await client.listen_until_played(result)
    return records


def summarize(records: list[dict], clients: int) -> dict:
    def values(key: str) -> list[float]:
        return [r["server"][key] for r in records if key in r["server"]]

    v2v = [r["voice_to_voice_ms"] for r in records if r["voice_to_voice_ms"] is not None]
    rtf = values("rtf")
    asr_speed = [
        r["speech_s"] / (r["server"]["asr_compute_ms"] / 1000) for r in records if r["server"].get("asr_compute_ms")
    ]
    summary: dict = {
        "clients": clients,
        "turns": len(records),
        "turns_with_audio": len(v2v),
        "voice_to_voice_ms_p50": percentile(v2v, 50),
        "voice_to_voice_ms_p95": percentile(v2v, 95),
        "rtf_min": min(rtf) if rtf else None,
        "rtf_p50": percentile(rtf, 50),
        "underruns": sum(r["underruns"] for r in records),
        "asr_speed_p50": percentile(asr_speed, 50),
        "asr_speed_min": min(asr_speed) if asr_speed else None,
        "transcripts_correct": sum(r["transcript_correct"] for r in records),
        "speculative_turns": sum(1 for r in records if r["server"].get("speculative")),
    }
    for stage in STAGES:
        stage_values = values(stage)
        summary[f"{stage.removesuffix('_ms')}_ms_p50"] = percentile(stage_values, 50)
        summary[f"{stage.removesuffix('_ms')}_ms_p95"] = percentile(stage_values, 95)
    return summary


def print_table(summary: dict) -> None:
    def fmt(value) -> str:
        return "-" if value is None else f"{value:.0f}" if abs(value) >= 10 else f"{value:.2f}"

    print(f"\nclients {summary['clients']}, turns {summary['turns']} ({summary['turns_with_audio']} with audio)")
    print(f"{'figure':<22}{'p50':>10}{'p95':>10}")
    for key in ["voice_to_voice", "endpoint", "asr_final", "asr_compute", "llm_ttft", "tts_first_audio"]:
        print(f"{key + ' (ms)':<22}{fmt(summary[f'{key}_ms_p50']):>10}{fmt(summary[f'{key}_ms_p95']):>10}")
    print(f"{'RTF':<22}{'min ' + fmt(summary['rtf_min']):>10}{'p50 ' + fmt(summary['rtf_p50']):>10}")
    print(
        f"{'ASR speed (x real time)':<22}{'min ' + fmt(summary['asr_speed_min']):>10}{'p50 ' + fmt(summary['asr_speed_p50']):>10}"
    )
    print(
        f"underruns {summary['underruns']}, transcripts correct {summary['transcripts_correct']}/{summary['turns']}, "
        f"speculative replies used {summary['speculative_turns']}"
    )


def plot(records: list[dict], summary: dict, path: Path) -> None:
    """Left: each turn's critical path from end of speech to first reply audio. Right: stage p50s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ordered = sorted(records, key=lambda r: (r["client"], r["turn"]))
    fig, (turns_ax, stages_ax) = plt.subplots(
        1, 2, figsize=(max(9, len(ordered) * 0.4 + 5), 4.5), gridspec_kw={"width_ratios": [2, 1]}
    )
    labels = ["endpoint wait", "transcript wait", "reply wait (LLM + TTS not yet done)"]
    colors = ["#8aa4c8", "#f2b35b", "#d987b5"]
    for index, record in enumerate(ordered):
        server = record["server"]
        endpoint, asr = server.get("endpoint_ms", 0.0), server.get("asr_final_ms", 0.0)
        reply = max(0.0, server.get("voice_to_voice_ms", endpoint + asr) - endpoint - asr)
        bottom = 0.0
        for value, label, color in zip((endpoint, asr, reply), labels, colors, strict=True):
            turns_ax.bar(index, value, bottom=bottom, color=color, label=label if index == 0 else None)
            bottom += value
        if record["voice_to_voice_ms"] is not None:
            turns_ax.plot(
                index, record["voice_to_voice_ms"], "k_", markersize=14, label="at the client" if index == 0 else None
            )
    turns_ax.set_xlabel("turn")
    turns_ax.set_ylabel("ms after the end of the user's speech")
    turns_ax.set_title(f"voice-to-voice, {summary['clients']} client(s)", fontsize=10)
    turns_ax.legend(loc="upper left", fontsize=7)
    names = ["voice_to_voice", "endpoint", "asr_compute", "llm_ttft", "tts_first_audio"]
    medians = [summary.get(f"{name}_ms_p50") or 0.0 for name in names]
    stages_ax.barh(names[::-1], medians[::-1], color="#7cc49a")
    for y, value in enumerate(medians[::-1]):
        stages_ax.text(value, y, f" {value:.0f}", va="center", fontsize=8)
    stages_ax.set_xlabel("p50 ms")
    stages_ax.set_title("stage latencies (p50)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


async def run(url: str, clients: int, turns: int) -> list[dict]:
    questions = [(text, synthesize_speech(text)) for text in QUESTIONS]
    results = await asyncio.gather(*(run_client(url, index, turns, questions) for index in range(clients)))
    return [record for client_records in results for record in client_records]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="parley bench voice", description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=1, help="concurrent simulated users")
    parser.add_argument("--turns", type=int, default=4, help="questions per client")
    parser.add_argument("--url", help="ws://HOST:PORT/ws of a running server (default: start one)")
    parser.add_argument("--out", default="bench-output", help="folder for per-turn JSON and the PNG chart")
    parser.add_argument("--json", dest="json_path", help="write the summary as one JSON object here")
    parser.add_argument("--server-arg", action="append", default=[], help="extra `parley serve` flag (repeatable)")
    args = parser.parse_args(argv)
    if args.clients < 1 or args.turns < 1:
        parser.error("--clients and --turns must be at least 1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    server = None
    url = args.url
    if url is None:
        print("starting parley serve ...", flush=True)
        started = time.monotonic()
        server = ServerProcess(["serve", *args.server_arg], out / "server.log")
        print(f"server ready in {time.monotonic() - started:.1f} s", flush=True)
        url = server.base_url.replace("http://", "ws://") + "/ws"
    try:
        print(f"{args.clients} client(s) x {args.turns} turns against {url} ...", flush=True)
        records = asyncio.run(run(url, args.clients, args.turns))
    finally:
        if server is not None:
            server.stop()
    summary = summarize(records, args.clients)
    print_table(summary)
    stem = f"voice-{args.clients}c"
    (out / f"{stem}-turns.json").write_text(json.dumps(records, indent=2))
    plot(records, summary, out / f"{stem}.png")
    print(f"per-turn records: {out / (stem + '-turns.json')}, chart: {out / (stem + '.png')}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(summary, indent=2))
    if statistics.fmean([r["voice_to_voice_ms"] is not None for r in records]) < 1:
        print("warning: some turns got no reply audio")
    return 0
