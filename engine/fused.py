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
import time
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
            name = f"parley_fused_cpu_{digest}"
            _clear_stale_build_lock(name)
            _module = load(
                name=name,
                sources=[str(_SOURCE)],
                extra_cflags=["-O3", "-march=native", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
        except Exception as e:  # no compiler, no ninja, headers missing: keep the ATen path
            log.warning("fused CPU kernels unavailable (%s: %s); using ATen ops", type(e).__name__, str(e)[:300])
            _module = None
        return _module


STALE_LOCK_S = 300  # a build takes about a minute; a lock this old was left by a process that died


def _clear_stale_build_lock(name: str) -> None:
    """Remove a build lock left behind by a killed build: torch would wait on it forever."""
    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(_get_build_directory(name, verbose=False)) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        log.warning("removing a stale fused-kernel build lock (%.0f s old): %s", age, lock)
        lock.unlink(missing_ok=True)


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
