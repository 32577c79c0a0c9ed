"""The shared entry of the engine's peer benchmarks (``--peer llama-cpp``, ``--peer vllm``): parse, run, report."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path


def bench_main(
    label: str,
    parser: argparse.ArgumentParser,
    argv: list[str] | None,
    run: Callable[[argparse.Namespace], dict],
    report: Callable[[dict], str],
) -> int:
    """Exit status 0 with the report printed (and written as JSON with ``--json``); 2 with one line naming what
    stopped the run (a peer that died, a file not found); argparse's own for bad arguments and ``--help``."""
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 0
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        result = run(args)
    except (RuntimeError, FileNotFoundError, ValueError, OSError) as e:
        print(f"{label}: {e}", file=sys.stderr)
        return 2
    print(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0
