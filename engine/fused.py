"""Loads the fused CPU kernels (``engine/csrc/fused_cpu.cpp``), compiling them on first use.

Why JIT and not a wheel: the package stays pure Python (``pip install -e .`` never needs a
torch build environment), and the kernels are built for this CPU (``-march=native``). The
build runs once per CPU kind and is cached under ``~/.cache/torch_extensions``;
``make setup`` runs it. If no compiler is available, or ``PARLEY_FUSED_KERNELS=0``, the engine keeps its
ATen ops (same results within bf16 rounding, slower to decode: app/bench/results/engine_cpu.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import subprocess
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
            _module = _build_and_load()
        except Exception as e:  # no compiler, no ninja, headers missing: keep the ATen path
            log.warning("fused CPU kernels unavailable (%s: %s); using ATen ops", type(e).__name__, str(e)[:300])
            _module = None
        return _module


def loaded_fused_kernels():
    """The compiled module where a model already loaded it, else None: never builds (for callers such as the sampler
    that only go faster with it, and must not cost a unit test a build)."""
    return _module


def _build_and_load():
    from torch.utils.cpp_extension import _get_build_directory

    log.info("loading fused CPU kernels (first build takes about a minute)")
    source = _SOURCE.read_bytes()
    name = build_name(source, cpu_features(), torch_root())
    build_dir = Path(_get_build_directory(name, verbose=False))
    with _exclusive(build_dir / "parley.lock"):
        # torch's own lock is a file that only its creator removes: a build killed midway
        # (Ctrl-C during the first start) left it behind and every later start waited on it
        # forever. Builders hold the lock above, which the OS releases when a process dies, so
        # a torch lock found here was left by a dead one.
        stale = build_dir / "lock"
        if stale.exists():
            log.warning("removing the build lock of an interrupted fused-kernel build: %s", stale)
            stale.unlink(missing_ok=True)
        return compile_source(name, _stable_copy(source, build_dir))


def compile_source(name: str, path: Path):
    """A kernel source compiled for this CPU and loaded as module ``name`` (also ``parley bench kernels``'s
    other build)."""
    from torch.utils.cpp_extension import load

    _put_ninja_on_path()
    return load(
        name=name,
        sources=[str(path)],
        extra_cflags=["-O3", "-march=native", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        verbose=False,
    )


def build_name(source: bytes, cpu: str, torch_root: str = "") -> str:
    """The build's name, from the kernel source, the CPU it is compiled for and the torch it is built against.

    The source's hash: checkouts with the same kernels and environment share one build, and an edited kernel
    never overwrites the build another checkout is using. The CPU's: the build is ``-march=native``, so one made
    on a CPU with AVX2 or AVX-512 dies with SIGILL on a CPU without them; a cache shared between machines (a home
    directory on NFS, a copied ``~/.cache``, a VM moved to another host) must give each kind of CPU its own
    build. The torch's (``torch_root``): its headers and libraries are in the build command, so two environments
    (two clones, each with its own ``.venv``) sharing one build folder made ninja rebuild it, ~40 s, every time
    the other one had started last; each environment now has its own.
    """
    source_hash = hashlib.sha256(source).hexdigest()[:12]
    cpu_hash = hashlib.sha256(cpu.encode()).hexdigest()[:8]
    torch_hash = hashlib.sha256(torch_root.encode()).hexdigest()[:8]
    return f"parley_fused_cpu_{source_hash}_{cpu_hash}_{torch_hash}"


def torch_root() -> str:
    """This environment's torch folder, as torch's extension builds name it in their commands."""
    import torch

    return os.path.dirname(os.path.abspath(torch.__file__))


def this_build_name() -> str:
    """The build's name for these kernels on this CPU with this environment's torch."""
    return build_name(_SOURCE.read_bytes(), cpu_features(), torch_root())


def cpu_features() -> str:
    """What ``-march=native`` turns on for this CPU: the compiler's predefined macros (``__AVX2__``, ...).

    Asked of the compiler, not read from /proc/cpuinfo: on a VM the kernel's flags can leave out
    what cpuid reports (seen here: no ``avx2`` in /proc/cpuinfo, yet ``-march=native`` defines
    ``__AVX2__`` and its instructions run). Without a compiler nothing can be built either: the
    error says so, and the engine keeps its ATen ops.
    """
    compiler = os.environ.get("CXX", "c++")
    done = subprocess.run(
        [compiler, "-march=native", "-dM", "-E", "-x", "c++", os.devnull],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if done.returncode != 0 or not done.stdout.strip():
        raise RuntimeError(f"{compiler} -march=native failed: {done.stderr.strip()[:200]}")
    return "\n".join(sorted(done.stdout.splitlines()))


@contextlib.contextmanager
def _exclusive(path: Path):
    """Hold an exclusive lock on ``path`` (flock: released by the OS however the holder ends)."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _stable_copy(source: bytes, build_dir: Path) -> Path:
    """The kernel source at a path that is the same for every checkout.

    ninja rebuilds when a build command changes, and the command names the source's path: built
    from each checkout's own file, a second clone, a worktree or a moved checkout spent a minute
    rebuilding the same kernels at its first start. The copy is rewritten only when its bytes
    differ, so its timestamp does not trigger a rebuild either.
    """
    copy = build_dir / "src" / _SOURCE.name
    if not copy.exists() or copy.read_bytes() != source:
        copy.parent.mkdir(parents=True, exist_ok=True)
        tmp = copy.with_suffix(".tmp")
        tmp.write_bytes(source)
        os.replace(tmp, copy)
    return copy


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
