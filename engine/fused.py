"""Loads the fused CPU kernels (``engine/csrc/fused_cpu.cpp``), compiling them on first use.

Why JIT and not a wheel: the package stays pure Python (``pip install -e .`` never needs a
torch build environment), and the kernels are built for this CPU (``-march=native``). The
build takes ~1 minute once and is cached under ``~/.cache/torch_extensions``; ``make setup``
runs it. If no compiler is available, or ``PARLEY_FUSED_KERNELS=0``, the engine keeps its
ATen ops (same results within bf16 rounding, ~1.4x slower decode on a small model).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
from pathlib import Path

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "fused_cpu.cpp"
_lock = threading.Lock()
_module = None
_tried = False


def fused_kernels():
    """The compiled module, or None where it cannot be built (the reason is logged once)."""
    global _module, _tried
    with _lock:
        if _tried:
            return _module
        _tried = True
        if os.environ.get("PARLEY_FUSED_KERNELS", "1").strip().lower() in ("0", "false", "no", "off"):
            log.info("fused CPU kernels disabled by PARLEY_FUSED_KERNELS")
            return None
        try:
            from torch.utils.cpp_extension import load

            _put_ninja_on_path()
            log.info("loading fused CPU kernels (first build takes about a minute)")
            # named by the source's hash: checkouts with the same kernels share one build, and
            # an edited kernel never overwrites the build another checkout is using
            digest = hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:12]
            _module = load(
                name=f"parley_fused_cpu_{digest}",
                sources=[str(_SOURCE)],
                extra_cflags=["-O3", "-march=native", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
        except Exception as e:  # no compiler, no ninja, headers missing: keep the ATen path
            log.warning("fused CPU kernels unavailable (%s: %s); using ATen ops", type(e).__name__, str(e)[:300])
            _module = None
        return _module


def _put_ninja_on_path() -> None:
    """torch runs ``ninja`` from PATH; the pip package puts it next to this interpreter, maybe not on PATH."""
    dirs = [os.path.dirname(sys.executable)]
    try:
        import ninja

        dirs.insert(0, ninja.BIN_DIR)
    except (ImportError, AttributeError):
        pass
    path = os.environ.get("PATH", "").split(os.pathsep)
    os.environ["PATH"] = os.pathsep.join([d for d in dirs if d not in path] + path)


if __name__ == "__main__":  # `python -m engine.fused`: build now (make setup does this)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print("fused CPU kernels:", "ready" if fused_kernels() is not None else "unavailable")
