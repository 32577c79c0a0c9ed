"""Async front: the engine's step loop on its own thread, per-request async token streams.

Why: model work must never run on the server's event loop. Callers on any event loop
add requests and aborts to a queue; a daemon thread drains it between steps, runs
``LLMEngine.step()`` and hands each output to the owning stream with
``loop.call_soon_threadsafe``. When idle, the thread sleeps on a condition variable.
A consumer that stops iterating (break, cancel, GeneratorExit) aborts its request, so
barge-in frees KV blocks without any extra call.

A failure inside one request or one step is handled by ``LLMEngine.step`` (the request,
or the step's requests, finish with an error). If the loop breaks anyway, the thread
fails every open stream with an error output naming the cause, resets the engine (all KV
blocks freed, cached prefixes forgotten) and starts a new loop thread after a backoff
(0.5 s, 1 s, 2 s, ... at most ``max_restarts`` times in ``restart_window_s``; each logged).
``is_running()`` is False while it is down (``down_reason()`` says why), which is what
``/healthz`` reports; after the last allowed restart it stays down and ``generate`` raises.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator, Sequence
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


class RestartPolicy:
    """When a crashed step loop starts again: after a backoff that doubles with each recent crash (0.5 s, 1 s, 2 s,
    ... by default), and not at all once more than ``max_restarts`` crashes fall within ``window_s`` seconds."""

    def __init__(self, max_restarts: int, window_s: float, backoff_s: float) -> None:
        self.max_restarts, self.window_s, self.backoff_s = max_restarts, window_s, backoff_s
        self._crashes: deque[float] = deque()

    @property
    def recent(self) -> int:
        """Crashes in the last ``window_s`` seconds, as of the last one."""
        return len(self._crashes)

    def after_crash(self, now: float) -> float | None:
        """Seconds to wait before the loop starts again after a crash at ``now`` (monotonic); None: it stays down."""
        self._crashes.append(now)
        while self._crashes and now - self._crashes[0] > self.window_s:
            self._crashes.popleft()
        if len(self._crashes) > self.max_restarts:
            return None
        return self.backoff_s * 2 ** (len(self._crashes) - 1)


class AsyncLLMEngine:
    """Thread-backed async wrapper around LLMEngine (the API the voice app uses)."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        engine: LLMEngine | None = None,
        *,
        max_restarts: int = 5,
        restart_window_s: float = 300.0,
        restart_backoff_s: float = 0.5,
    ) -> None:
        self._thread: threading.Thread
        self.engine = engine if engine is not None else self._build_on_loop_thread(config or EngineConfig())
        self.config = self.engine.config
        self.tokenizer = self.engine.tokenizer
        self._restarts = RestartPolicy(max_restarts, restart_window_s, restart_backoff_s)
        self._cond = threading.Condition()
        self._adds: list[tuple[str, list[int] | str, SamplingParams, str]] = []
        self._aborts: list[str] = []
        self._pauses: list[tuple[str, float, bool]] = []  # (request id, max seconds, yield only); 0 resumes it
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count(1)
        self._stop = False
        self._error: BaseException | None = None  # set when the loop is down for good
        self._down: str | None = None  # why the loop is down (restarting, or for good)
        self.restarts_total = 0
        self._stats = self.engine.stats()
        if engine is not None:
            self._thread = self._start_thread()
        else:
            self._built.set()  # the loop thread, already running, may start stepping

    # --- public API ------------------------------------------------------------------
    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> list[int]:
        """Token ids of a chat (list of {"role", "content"}) in the model's own template, each message's
        content tokenized as plain text: ``<|im_start|>`` typed into a message stays text (engine/chat.py
        says what is and is not filtered). ``tools``: OpenAI tool definitions, for a template that renders them."""
        return self.engine.apply_chat_template(messages, add_generation_prompt, tools)

    async def check_grammar(self, grammar: str) -> None:
        """Compile a request's grammar on a worker thread (cached for the request); ValueError if it is
        invalid. The first one also builds the grammar library's view of the vocabulary (a second or so)."""
        await asyncio.to_thread(self.engine.check_grammar, grammar)

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream outputs of one request; the last one has ``finished=True``."""
        async with contextlib.aclosing(self.generate_many([(prompt, params, request_id)])) as outputs:
            async for _, out in outputs:
                yield out

    async def generate_many(
        self, requests: Sequence[tuple[str | list[int], SamplingParams | None, str | None]]
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Several requests (prompt, params, request id) added at once, so the next step schedules them together
        (its token budget allowing); their outputs as they come, as (the request's index, the output). Each
        request's last output has ``finished=True`` (an ``abort`` gives one too). Closing aborts the unfinished.

        Why together: added one by one, the loop may step the first alone, and the second's first token comes a
        step later (a voice reply weighing two prompts waits for both, ``app.stages.llm``). For the same reason
        they are one group (``Request.group``): a step of theirs alone gets a lone reply's threads."""
        if self._stop:
            raise RuntimeError("engine is shut down")
        if self._error is not None:
            raise RuntimeError(self._down or "engine loop crashed") from self._error
        ids = [request_id or f"async-{next(self._ids)}" for _, _, request_id in requests]
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())  # one queue: outputs in the order made
        with self._cond:
            taken = [rid for rid in ids if rid in self._streams] + [rid for rid in ids if ids.count(rid) > 1]
            if taken:
                raise ValueError(f"duplicate request id {taken[0]!r}")
            group = ids[0] if len(ids) > 1 else ""  # one caller's requests, to choose between (Request.group)
            for rid, (prompt, params, _) in zip(ids, requests, strict=True):
                self._streams[rid] = stream
                self._adds.append((rid, prompt, params or SamplingParams(), group))
            self._cond.notify()
        index = {rid: i for i, rid in enumerate(ids)}
        unfinished = set(ids)
        try:
            while unfinished:
                out = await stream.queue.get()
                if isinstance(out, BaseException):
                    raise RuntimeError("engine loop crashed") from out
                if out.finished:
                    unfinished.discard(out.request_id)
                yield index[out.request_id], out
        finally:
            for rid in unfinished:
                self.abort(rid)
            with self._cond:
                for rid in ids:
                    self._streams.pop(rid, None)

    def requests_in_flight(self) -> int:
        """Requests added and not yet finished with (their outputs still streaming), from any thread."""
        with self._cond:
            return len(self._streams)

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; its blocks are freed before the next step runs."""
        with self._cond:
            self._aborts.append(request_id)
            self._cond.notify()

    def pause(self, request_id: str, max_s: float) -> None:
        """From any thread: step no further tokens of ``request_id`` until ``resume`` or ``max_s`` seconds
        pass (``LLMEngine.pause``). A request that is not running is not paused."""
        with self._cond:
            self._pauses.append((request_id, max_s, False))
            self._cond.notify()

    def resume(self, request_id: str) -> None:
        with self._cond:
            self._pauses.append((request_id, 0.0, False))
            self._cond.notify()

    def yield_to_others(self, request_id: str, max_s: float) -> None:
        """From any thread: for at most ``max_s`` seconds, step ``request_id`` only when no other request
        needs a step (``LLMEngine.yield_to_others``)."""
        with self._cond:
            self._pauses.append((request_id, max_s, True))
            self._cond.notify()

    @contextlib.contextmanager
    def core_lent(self) -> Iterator[None]:
        """While open, another model runs on one of the prefill threads' cores: steps keep off it."""
        self.engine.runner.lend_core()
        try:
            yield
        finally:
            self.engine.runner.return_core()

    def set_prefill_threads_first_tokens(self, n: int) -> None:
        """Change ``EngineConfig.prefill_threads_first_tokens`` from now on (the next step reads it)."""
        self.engine.runner.first_tokens = n

    def is_running(self) -> bool:
        """The step loop is alive and not down after a crash (what /healthz reports)."""
        return self._error is None and self._down is None and self._thread.is_alive()

    def down_reason(self) -> str | None:
        """Why the loop is not running (None while it runs)."""
        if self._down is not None:
            return self._down
        if self._stop:
            return "engine is shut down"
        if not self._thread.is_alive():
            return "engine loop thread is not alive"
        return None

    def stats(self) -> dict:
        """Latest engine metrics (a snapshot published by the engine thread after each step)."""
        return dict(self._stats, loop_restarts_total=self.restarts_total)

    def model_info(self) -> dict:
        """What was loaded and how (precision, linear kernel, memory); fixed once built, so safe from any thread."""
        return self.engine.model_info()

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        thread = self._thread
        if thread.is_alive() and threading.current_thread() is not thread:
            thread.join(timeout)

    # --- engine thread -----------------------------------------------------------------
    def _build_on_loop_thread(self, config: EngineConfig) -> LLMEngine:
        """Build the engine on the thread that will step it, and start that thread's loop.

        Why: torch's CPU kernels run on an OpenMP team that belongs to the thread that first
        calls them. Loading and packing the weights on the caller's thread and stepping on
        another left two teams on the cores, and every small matmul of a decode step paid
        for it: on the 2-core development VM (int8, 2 threads) a token took 29-35 ms instead
        of 21 ms, and the first token 90-110 ms instead of 75-90 ms.
        """
        built: list[LLMEngine | BaseException] = []
        ready = threading.Event()
        self._built = threading.Event()

        def build_then_run() -> None:
            try:
                built.append(LLMEngine(config))
            except BaseException as error:  # reported to the constructor below
                built.append(error)
                return
            finally:
                ready.set()
            self._built.wait()
            self._run()

        self._thread = threading.Thread(target=build_then_run, name="parley-engine", daemon=True)
        self._thread.start()
        ready.wait()
        if isinstance(built[0], BaseException):
            raise built[0]
        return built[0]

    def _start_thread(self) -> threading.Thread:
        thread = threading.Thread(target=self._run, name="parley-engine", daemon=True)
        thread.start()
        return thread

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # the loop must not die silently
            self._on_crash(e)

    def _on_crash(self, error: BaseException) -> None:
        """Fail every open stream, reset the engine, and restart the loop on a new thread after a backoff."""
        reason = f"engine loop crashed: {type(error).__name__}: {error}"
        log.exception("%s", reason)
        self._down = reason
        with self._cond:
            streams = list(self._streams)
            self._adds, self._aborts, self._pauses = [], [], []
        message = f"{reason}; the request was stopped"
        for rid in streams:
            self._deliver(RequestOutput(rid, "", (), True, "error", message, error_type="internal"))
        try:
            self.engine.reset(reason)
            self._stats = self.engine.stats()
        except BaseException:
            log.exception("engine reset failed; the engine stays down")
            self._error = error
            return
        policy = self._restarts
        delay = policy.after_crash(time.monotonic())
        if delay is None:
            log.error("engine loop crashed %d times in %.0f s: giving up", policy.recent, policy.window_s)
            self._down = f"{reason} (gave up after {policy.max_restarts} restarts)"
            self._error = error
            return
        log.warning("restarting the engine loop in %.1f s (restart %d)", delay, policy.recent)
        with self._cond:
            self._cond.wait_for(lambda: self._stop, timeout=delay)
            if self._stop:
                return
            self.restarts_total += 1
            self._thread = self._start_thread()
            self._down = None

    def _loop(self) -> None:
        eng = self.engine
        if self.config.num_threads:
            import torch

            torch.set_num_threads(self.config.num_threads)  # also in this thread (OpenMP settings are per thread)
        while True:
            with self._cond:
                while not (self._stop or self._adds or self._aborts or self._pauses or eng.has_work()):
                    self._stats = eng.stats()
                    # wake now and then so the idle rate decays, and when a paused request may run again
                    resume = eng.seconds_to_resume()
                    self._cond.wait(timeout=1.0 if resume is None else min(1.0, resume + 1e-3))
                if self._stop:
                    break
                adds, self._adds = self._adds, []
                aborts, self._aborts = self._aborts, []
                pauses, self._pauses = self._pauses, []
            for rid, max_s, yield_only in pauses:
                if yield_only:
                    eng.yield_to_others(rid, max_s)
                elif max_s > 0:
                    eng.pause(rid, max_s)
                else:
                    eng.resume(rid)
            for rid, prompt, params, group in adds:
                try:
                    eng.add_request(rid, prompt, params, group)
                except Exception as e:  # bad input: fail this request only
                    self._deliver(RequestOutput(rid, "", (), True, "error", str(e), error_type="invalid_request"))
            for rid in aborts:
                eng.abort(rid)
            outputs = eng.step()
            self._stats = eng.stats()
            for out in outputs:
                self._deliver(out)

    def _deliver(self, out: RequestOutput) -> None:
        with self._cond:
            stream = self._streams.get(out.request_id)
        if stream is None:
            return
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)
        except RuntimeError:  # the consumer's loop is closed
            pass
