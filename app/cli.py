"""The ``parley`` command."""

from __future__ import annotations

import argparse
import logging
import sys


def add_settings_flags(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per setting, so flags, PARLEY_* variables and the TOML file name the same things."""
    from app.config import Settings

    parser.add_argument("--config", metavar="TOML", help="settings file (also PARLEY_CONFIG)")
    for name, field in Settings.model_fields.items():
        parser.add_argument(
            "--" + name.replace("_", "-"), dest=name, metavar=name.split("_")[-1].upper(), help=field.description
        )


def settings_from_args(args: argparse.Namespace):
    import os

    from app.config import Settings, load_settings

    if args.config:
        os.environ["PARLEY_CONFIG"] = args.config
    return load_settings(**{name: getattr(args, name) for name in Settings.model_fields})


# How long an idle OpenMP thread spins before it sleeps, in libgomp's spins (a ``pause`` each: ~26 ns on the 2-core
# EPYC, ~45 ns on a Skylake-or-later Xeon): ~0.8-1.4 ms, where the runtime's default is 300000 (~8-14 ms).
OPENMP_SPINS = 30000


def bound_idle_spinning() -> None:
    """Idle OpenMP threads spin ``OPENMP_SPINS`` before they sleep (``GOMP_SPINCOUNT``), unless the user set a
    policy or a count.

    The LLM (torch) and Whisper (CTranslate2) each bring their own OpenMP runtime (libgomp both), whose threads by
    default spin for ~8 ms after each parallel region, waiting for the next. In the voice server the stages take
    turns on the same few cores, so that spinning took the cores from the next stage: on the 2-core VM the
    first piece's synthesis (Piper alone: ~100 ms for 4 words) took 150-570 ms in the server, beside two
    spinning threads at 100-270 ms of CPU each (app/bench/results/turn_taking.md). Not spinning at all
    (``OMP_WAIT_POLICY=PASSIVE``, the policy until 2026-12-07) cost the engine instead: a decode step is ~150
    parallel regions a few tens of microseconds apart, and a worker put to sleep after each one is woken again
    for the next. The default brain's decode step at 975 cached tokens, 2 threads, in process: 26-29 ms passive
    against 20-21 spinning for 30000 or 300000 spins (22.8 at 3000). A thread still sleeps ~1 ms after the
    engine's last region, so a stage that runs after a step, or between two, gets its core
    (app/bench/results/default_brain.md, "eighth session"). Set before either library loads (the runtime reads it
    once); the engine's own server (``parley engine serve``, one library on its cores) keeps the default.
    """
    import os

    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", str(OPENMP_SPINS))


def _serve(args: argparse.Namespace) -> int:
    bound_idle_spinning()
    import uvicorn
    from pydantic import ValidationError

    from app.server.app import create_app

    try:
        settings = settings_from_args(args)
    except (ValidationError, FileNotFoundError) as error:
        print(f"parley: bad settings: {error}", file=sys.stderr)
        return 2
    if bool(settings.ssl_certfile) != bool(settings.ssl_keyfile):
        print("parley: TLS needs both --ssl-certfile and --ssl-keyfile", file=sys.stderr)
        return 2
    print(f"starting parley on {settings.host}:{settings.port} (loading models first)", flush=True)
    set_log_levels(args.log_level, args.debug_log)
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=args.log_level,
        ws_max_size=1 << 20,
        ssl_certfile=settings.ssl_certfile,
        ssl_keyfile=settings.ssl_keyfile,
    )
    return 0


def set_log_levels(level: str, debug_loggers: list[str]) -> None:
    """``level`` for Parley's own logs too (not only the web server's), and debug for the loggers named (and those
    under them): ``--log-level debug`` logs every WebSocket frame, which busies the event loop enough to move the
    timings it is asked to show; ``--debug-log engine.llm_engine`` gives the engine's steps alone."""
    logging.getLogger().setLevel(level.upper())
    for name in debug_loggers:
        logging.getLogger(name).setLevel(logging.DEBUG)


def _config(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    from app.stages.registry import policy_line

    for key, value in settings.model_dump().items():
        print(f"{key} = {value!r}")
    print(f"# {policy_line(settings)}")
    return 0


def _engine(args: argparse.Namespace) -> int:
    from engine.cli import main as engine_main

    return engine_main(args.rest)


def _peer(rest: list[str]) -> str | None:
    """``bench engine``'s peer: ``vllm``, ``llama-cpp`` (also meant by ``--peer-url``), or None."""
    for i, arg in enumerate(rest):
        name, _, value = arg.partition("=")
        if name == "--peer":
            return value or (rest[i + 1] if i + 1 < len(rest) else "llama-cpp")
        if name == "--peer-url":
            return "llama-cpp"
    return None


def _bench(args: argparse.Namespace) -> int:
    if args.what == "engine":
        peer = _peer(args.rest)
        if peer == "vllm":
            from engine.benchmarks.serving import main as bench_serving  # server against server, OpenAI APIs

            return bench_serving(args.rest)
        if peer is not None:
            from engine.benchmarks.peer import main as bench_peer  # side by side with llama.cpp

            return bench_peer(args.rest)
        from engine.benchmarks.throughput import main as bench_engine

        return bench_engine(args.rest)
    if args.what == "kernels":
        from engine.benchmarks.kernels import main as bench_kernels  # the fused CPU kernels, build against build

        return bench_kernels(args.rest)
    if args.what == "turn-end":
        from app.bench.turn_end import main as bench_turn_end

        return bench_turn_end(args.rest)
    if args.what == "load":
        from app.bench.load import main as bench_load

        return bench_load(args.rest)
    if args.what == "quality":
        from app.bench.quality import main as bench_quality

        return bench_quality(args.rest)
    if args.what == "soak":
        from app.bench.soak import main as bench_soak

        return bench_soak(args.rest)
    if args.what == "wyoming":
        from app.bench.wyoming import main as bench_wyoming

        return bench_wyoming(args.rest)
    from app.bench.voice import main as bench_voice

    return bench_voice(args.rest)


def _doctor(args: argparse.Namespace) -> int:
    from engine.doctor import main as doctor_main

    return doctor_main(args.rest)


def _scale(args: argparse.Namespace) -> int:
    from app.scale.cli import main as scale_main

    return scale_main(args.rest)


def _mic(args: argparse.Namespace) -> int:
    from app.clients.mic import main as mic_main

    return mic_main(args.rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="parley", description="A real-time, fully local voice assistant.")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the voice server (web page at /, WebSocket at /ws)")
    add_settings_flags(serve)
    serve.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    serve.add_argument(
        "--debug-log",
        action="append",
        default=[],
        metavar="LOGGER",
        help="this logger (and those under it) at debug whatever --log-level says, e.g. engine.llm_engine: each "
        "engine step's rows and time (repeat for more)",
    )
    serve.set_defaults(func=_serve)

    engine = commands.add_parser("engine", help="the LLM engine alone: `parley engine serve --help`", add_help=False)
    engine.add_argument("rest", nargs=argparse.REMAINDER)
    engine.set_defaults(func=_engine)

    bench = commands.add_parser(
        "bench", help="benchmarks: `parley bench engine|kernels|voice|load|soak|quality|turn-end|wyoming --help`"
    )
    bench.add_argument("what", choices=["engine", "kernels", "voice", "load", "soak", "quality", "turn-end", "wyoming"])
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(func=_bench)

    scale = commands.add_parser(
        "scale",
        help="the scale-out topology on this machine (LLM server, voice servers, nginx): `parley scale up|down|status`",
        prefix_chars="+",  # every "--flag" is left to app.scale.cli's own parser
    )
    scale.add_argument("rest", nargs=argparse.REMAINDER)
    scale.set_defaults(func=_scale)

    # prefix_chars="+": every "--flag" is left to app.clients.mic's own parser (REMAINDER alone stops at a leading option)
    mic = commands.add_parser("mic", help="talk to a server from this computer: `parley mic --help`", prefix_chars="+")
    mic.add_argument("rest", nargs=argparse.REMAINDER)
    mic.set_defaults(func=_mic)

    doctor = commands.add_parser(
        "doctor",
        help="print the environment and self-test the engine on each device: `parley doctor --help`",
        prefix_chars="+",  # every "--flag" is left to engine.doctor's own parser
    )
    doctor.add_argument("rest", nargs=argparse.REMAINDER)
    doctor.set_defaults(func=_doctor)

    config = commands.add_parser("config", help="print the effective settings")
    add_settings_flags(config)
    config.set_defaults(func=_config)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
