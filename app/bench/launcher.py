"""Start `parley` servers as child processes on free loopback ports (benchmarks and tests)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from app.scale.supervisor import free_port, stop_process

ROOT = Path(__file__).resolve().parents[2]


class ServerProcess:
    """``parley <args> --host 127.0.0.1 --port <free>``, ready once ``ready_path`` answers 200.

    ``program``: another server's command line instead of ``parley`` (one that takes ``--host`` and ``--port``
    too, such as ``transformers serve``); ``port``: this one instead of a free one (a server started again where
    its clients know it).

    Unless ``args`` name a ``--data-dir``, the server keeps what must survive a restart (reminders) in a folder of
    its own, removed when it stops: a benchmark's reminders once went to the user's data folder and were announced
    ("You missed a reminder ...") in later runs and in the user's own sessions.
    """

    def __init__(
        self,
        args: list[str],
        log_path: Path,
        ready_path: str = "/healthz",
        timeout_s: float = 180,
        program: list[str] | None = None,
        port: int | None = None,
    ) -> None:
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self._data_dir = None if "--data-dir" in args else tempfile.mkdtemp(prefix="parley-bench-data-")
        data = {} if self._data_dir is None else {"PARLEY_DATA_DIR": self._data_dir}
        self.process = subprocess.Popen(
            [*(program or [sys.executable, "-m", "app.cli"]), *args, "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **data},
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.stop()
                raise RuntimeError(f"server exited early:\n{log_path.read_text()[-3000:]}")
            try:
                if httpx.get(self.base_url + ready_path, timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"server not ready in {timeout_s} s:\n{log_path.read_text()[-3000:]}")

    def stop(self) -> None:
        stop_process(self.process)
        self._log.close()
        if self._data_dir is not None:
            shutil.rmtree(self._data_dir, ignore_errors=True)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
