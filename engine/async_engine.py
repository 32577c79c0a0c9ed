"""Async front: the engine's step loop on its own thread, per-request async token streams.

Why: model work must never run on the server's event loop. Callers on any event loop
add requests and aborts to a queue; a daemon thread drains it between steps, runs
``LLMEngine.step()`` and hands each output to the owning stream with
``loop.call_soon_threadsafe``. When idle, the thread sleeps on a condition variable.
A consumer that stops iterating (break, cancel, GeneratorExit) aborts its request, so
barge-in frees KV blocks without any extra call.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncLLMEngine:
    """Thread-backed async wrapper around LLMEngine (the API the voice app uses)."""

    def __init__(self, config: EngineConfig | None = None, engine: LLMEngine | None = None) -> None:
        self.engine = engine or LLMEngine(config or EngineConfig())
        self.config = self.engine.config
        self.tokenizer = self.engine.tokenizer
        self._cond = threading.Condition()
        self._adds: list[tuple[str, list[int] | str, SamplingParams]] = []
        self._aborts: list[str] = []
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count(1)
        self._stop = False
        self._error: BaseException | None = None
        self._stats = self.engine.stats()
        self._thread = threading.Thread(target=self._loop, name="parley-engine", daemon=True)
        self._thread.start()

    # --- public API ------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a chat (list of {"role", "content"}) in the model's own template."""
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding in some versions
            ids = ids["input_ids"]
        return list(ids)

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream outputs of one request; the last one has ``finished=True``."""
        if self._stop:
            raise RuntimeError("engine is shut down")
        if self._error is not None:
            raise RuntimeError("engine loop crashed") from self._error
        request_id = request_id or f"async-{next(self._ids)}"
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._cond:
            if request_id in self._streams:
                raise ValueError(f"duplicate request id {request_id!r}")
            self._streams[request_id] = stream
            self._adds.append((request_id, prompt, params or SamplingParams()))
            self._cond.notify()
        finished = False
        try:
            while True:
                out = await stream.queue.get()
                if isinstance(out, BaseException):
                    raise RuntimeError("engine loop crashed") from out
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)
            with self._cond:
                self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; its blocks are freed before the next step runs."""
        with self._cond:
            self._aborts.append(request_id)
            self._cond.notify()

    def is_running(self) -> bool:
        """The step loop is alive and has not crashed (what /healthz reports)."""
        return self._error is None and self._thread.is_alive()

    def stats(self) -> dict:
        """Latest engine metrics (a snapshot published by the engine thread after each step)."""
        return dict(self._stats)

    def model_info(self) -> dict:
        """What was loaded and how (precision, linear kernel, memory); fixed once built, so safe from any thread."""
        return self.engine.model_info()

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # --- engine thread -----------------------------------------------------------------
    def _loop(self) -> None:
        eng = self.engine
        if self.config.num_threads:
            import torch

            torch.set_num_threads(self.config.num_threads)  # also in this thread (OpenMP settings are per thread)
        try:
            while True:
                with self._cond:
                    while not (self._stop or self._adds or self._aborts or eng.has_unfinished()):
                        self._stats = eng.stats()
                        self._cond.wait(timeout=1.0)  # wake now and then so the idle rate decays
                    if self._stop:
                        break
                    adds, self._adds = self._adds, []
                    aborts, self._aborts = self._aborts, []
                for rid, prompt, params in adds:
                    try:
                        eng.add_request(rid, prompt, params)
                    except Exception as e:  # bad input: fail this request only
                        self._deliver(RequestOutput(rid, "", (), True, "error", str(e)))
                for rid in aborts:
                    eng.abort(rid)
                outputs = eng.step()
                self._stats = eng.stats()
                for out in outputs:
                    self._deliver(out)
        except BaseException as e:  # the loop must not die silently: fail every open stream
            log.exception("engine loop crashed")
            self._error = e
            with self._cond:
                streams = list(self._streams.values())
            for s in streams:
                s.loop.call_soon_threadsafe(s.queue.put_nowait, e)

    def _deliver(self, out: RequestOutput) -> None:
        with self._cond:
            stream = self._streams.get(out.request_id)
        if stream is None:
            return
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)
        except RuntimeError:  # the consumer's loop is closed
            pass
