"""Function calls in a voice reply: which tools a reply may call, who runs each call, and what the LLM reads back.

A session's tools are the client's (declared in its ``config``: the client runs them, on a ``tool_call``
event, and answers with a ``tool_result``) or, for a client that declares none, the server's own (an
operator's ``tool_entry_point``, run here). ``ToolRunner`` runs one reply's calls: every call within
``tool_timeout_s`` (a late one fails, and the LLM reads that it did, so the reply goes on), all of them
cancelled with the reply (barge-in, ``cancel``). Where the client's calls are answered in a later
response instead (the Realtime API: function_call items, then ``response.create``), the reply ends at them.

What the LLM reads back is bounded (``MAX_TOOL_OUTPUT_CHARS``, cut like a message too long for the
context) and is the ``content`` of a ``tool`` message: the engine tokenizes every content as plain text
(``engine/chat.py``), as it does a user's words, so a result cannot forge a turn with control tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import inspect
import json
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from app import protocol
from app.skills.base import CANNOT_DO, ServerTool
from app.stages.base import Message, ToolCall, ToolSpec
from app.voice.clock import Clock, RunBlocking
from app.voice.context import TRUNCATION_MARK, cut_at_word

log = logging.getLogger(__name__)

# Rounds of calls one reply may make; the one after the last round is text only (a model that calls and calls
# would otherwise never answer).
MAX_TOOL_ROUNDS = 3

ClientResults = Literal["wait", "next_response"]
Emit = Callable[[protocol.ServerMessage], Awaitable[None]]


# ---------------------------------------------------------------- the server's own tools
@functools.cache
def load_server_tools(entry_point: str | None) -> tuple[ServerTool, ...]:
    """The tools of ``entry_point`` ("module:function"): the function returns ``ServerTool`` values or dicts with
    their fields. Loaded once per process; ValueError says what is wrong with them."""
    if not entry_point:
        return ()
    module_name, _, attribute = entry_point.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"tool_entry_point {entry_point!r} is not 'module:function'")
    factory = getattr(importlib.import_module(module_name), attribute)
    tools = tuple(_server_tool(item) for item in factory())
    names = [tool.name for tool in tools]
    if len(set(names)) != len(names):
        raise ValueError(f"tool_entry_point {entry_point!r} gives two tools of one name: {names}")
    for tool in tools:
        protocol.FunctionTool(name=tool.name, description=tool.description, parameters=tool.parameters)
    return tools


def _server_tool(item: ServerTool | dict[str, Any]) -> ServerTool:
    tool = item if isinstance(item, ServerTool) else ServerTool(**item)
    if not callable(tool.run):
        raise ValueError(f"the tool {tool.name!r} has no callable 'run'")
    return tool


# ---------------------------------------------------------------- what a session's replies may call
def openai_tool(tool: protocol.FunctionTool | ServerTool) -> dict[str, Any]:
    """A tool as Chat Completions takes it."""
    function = {"name": tool.name, "description": tool.description, "parameters": tool.parameters}
    return {"type": "function", "function": function}


def openai_choice(choice: protocol.ToolChoice) -> str | dict[str, Any]:
    if isinstance(choice, protocol.NamedFunction):
        return {"type": "function", "function": {"name": choice.name}}
    return choice


@dataclass(frozen=True)
class SessionTools:
    """The tools a session's next reply may call: the client's, else the server's; ``choice`` and ``parallel``."""

    client: tuple[protocol.FunctionTool, ...] = ()
    server: tuple[ServerTool, ...] = ()
    choice: protocol.ToolChoice = "auto"
    parallel: bool = False

    def spec(self, prompt: list[Message]) -> ToolSpec | None:
        """The reply's ``ToolSpec``: None with no tools and none used in ``prompt`` (the plain text path)."""
        tools = self.client or self.server
        if tools:
            return ToolSpec(tuple(openai_tool(t) for t in tools), openai_choice(self.choice), self.parallel)
        if has_tool_items(prompt):
            return ToolSpec((), "none")  # earlier calls are rendered; none can be made now
        return None

    def client_tool(self, name: str) -> bool:
        """Whether ``name`` is one of the client's tools (its calls are the client's to run)."""
        return any(tool.name == name for tool in self.client)

    def server_tool(self, name: str) -> ServerTool | None:
        """The server's tool ``name``, when the session runs the server's tools."""
        if self.client:
            return None
        return next((t for t in self.server if t.name == name), None)


def has_tool_items(messages: Iterable[Message]) -> bool:
    return any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)


def next_round(spec: ToolSpec, rounds_done: int, max_rounds: int = MAX_TOOL_ROUNDS) -> ToolSpec:
    """After a round of calls the LLM may call again, but not forced (it must be able to answer), nor forever."""
    if rounds_done >= max_rounds:
        return ToolSpec(spec.tools, "none", spec.parallel)
    return ToolSpec(spec.tools, "auto" if spec.choice != "none" else "none", spec.parallel)


# ---------------------------------------------------------------- what the LLM reads back
def _result_objects(results: list[Message]) -> list[dict] | None:
    """Each result read as a JSON object (what the skills and the runner's failures write), or None when any is not
    one (a client's or another server's text)."""
    objects = []
    for message in results:
        try:
            result = json.loads(message.get("content") or "")
        except (TypeError, ValueError):
            return None
        if not isinstance(result, dict):
            return None
        objects.append(result)
    return objects


def spoken_results(results: list[Message]) -> str | None:
    """The words the results say of themselves (each one's ``say``, as the skills give it: a refusal may say why),
    or None when any result has none: then the LLM writes the answer from them."""
    objects = _result_objects(results)
    if objects is None or not all(isinstance(result.get("say"), str) for result in objects):
        return None
    says = [result["say"].strip() for result in objects]
    return " ".join(says) if says and all(says) else None


def failed_round(results: list[Message]) -> bool:
    """Every result is a failure (``{"error": ...}``: the tool raised, timed out, or refused its arguments)."""
    objects = _result_objects(results)
    return bool(objects) and all("error" in result for result in objects)


def unasked_round(results: list[Message]) -> bool:
    """Every result says its call was not asked for (``app.skills.base.unasked``): the model reached for a tool on
    words that wanted none, and the reply is written again without tools."""
    objects = _result_objects(results)
    return bool(objects) and all(result.get("unasked") is True for result in objects)


def output_text(output: Any, max_chars: int = protocol.MAX_TOOL_OUTPUT_CHARS) -> str:
    """A tool's result as the LLM reads it: text (JSON for anything else), cut to ``max_chars`` at a word."""
    text = output if isinstance(output, str) else json.dumps(output, ensure_ascii=False, default=str)
    if len(text) <= max_chars:
        return text
    return cut_at_word(text, max_chars - len(TRUNCATION_MARK)) + TRUNCATION_MARK


def calls_message(text: str, calls: list[ToolCall]) -> Message:
    """The assistant's turn that made ``calls`` (after saying ``text``), as the conversation keeps it."""
    return {"role": "assistant", "content": text, "tool_calls": [call.as_openai() for call in calls]}


def result_message(call_id: str, output: str) -> Message:
    return {"role": "tool", "tool_call_id": call_id, "content": output}


def failure(why: str) -> str:
    return json.dumps({"error": why})


def argument_problem(call: ToolCall) -> str | None:
    """Why a call's arguments cannot be run (not a JSON object), or None. A model can write anything where no
    grammar holds it (vLLM's CPU build streamed a required call's arguments as the string '"santos"'): such a
    call is failed here, for the LLM to read, and never handed to a client."""
    try:
        value = json.loads(call.arguments or "{}")
    except ValueError:
        return f"{call.name}'s arguments are not JSON"
    return None if isinstance(value, dict) else f"{call.name}'s arguments are not a JSON object"


# ---------------------------------------------------------------- the client's answers
class PendingCalls:
    """A session's client calls waiting for their ``tool_result``."""

    def __init__(self) -> None:
        self._waiting: dict[str, asyncio.Future[str]] = {}

    def open(self, call_id: str) -> asyncio.Future[str]:
        future = asyncio.get_running_loop().create_future()
        self._waiting[call_id] = future
        future.add_done_callback(lambda _: self._waiting.pop(call_id, None))
        return future

    def resolve(self, call_id: str, output: str) -> bool:
        """The client's result for ``call_id``; False when no call of that id waits (unknown, timed out, cancelled)."""
        future = self._waiting.get(call_id)
        if future is None or future.done():
            return False
        future.set_result(output)
        return True

    @property
    def waiting(self) -> list[str]:
        return list(self._waiting)


@dataclass
class RoundResult:
    """One round's calls settled: the messages the LLM reads next (results), or None when the reply ends at the
    calls (their results come in a later response); ``tool_s``: the tools' own time."""

    messages: list[Message] | None
    tool_s: float = 0.0


class ToolRunner:
    """Runs one reply's calls (``run``), each where it belongs, and tells the client about each (``emit``)."""

    def __init__(
        self,
        tools: SessionTools,
        pending: PendingCalls,
        *,
        timeout_s: float,
        clock: Clock,
        run_blocking: RunBlocking,
        client_results: ClientResults = "wait",
    ) -> None:
        self._tools, self._pending = tools, pending
        self._timeout_s, self._clock, self._run = timeout_s, clock, run_blocking
        self._client_results = client_results

    def waits_for(self, calls: list[ToolCall]) -> bool:
        """Whether the reply waits for these calls' results (else it ends at them)."""
        return self._client_results == "wait" or not any(self._runs_on_client(c) for c in calls)

    def _runs_on_client(self, call: ToolCall) -> bool:
        return self._tools.client_tool(call.name) and argument_problem(call) is None

    async def run(self, turn_id: int, calls: list[ToolCall], emit: Emit) -> RoundResult:
        """Announce ``calls``, run or await each, and say how each settled; cancelling this cancels them all."""
        started = self._clock.now()
        for call in calls:
            # an unknown tool, or arguments no tool can take: it fails here
            runs_on = "client" if self._runs_on_client(call) else "server"
            await emit(
                protocol.CallTool(
                    turn_id=turn_id, call_id=call.id, name=call.name, arguments=call.arguments, runs_on=runs_on
                )
            )
        if not self.waits_for(calls):
            return RoundResult(None)
        tasks = {call.id: asyncio.ensure_future(self._result(call)) for call in calls}
        try:
            await asyncio.wait(tasks.values(), timeout=self._timeout_s)
        except asyncio.CancelledError:
            for call in calls:
                if not tasks[call.id].done():
                    tasks[call.id].cancel()
                    with contextlib.suppress(Exception):  # the client may be gone already
                        await emit(self._done(turn_id, call, "cancelled"))
            raise
        messages = []
        for call in calls:
            task = tasks[call.id]
            if not task.done():
                task.cancel()
                status, output = "timeout", failure(f"{call.name} gave no result within {self._timeout_s:g} s")
            else:
                status, output = task.result()
            await emit(self._done(turn_id, call, status, output))
            messages.append(result_message(call.id, output))
        return RoundResult(messages, self._clock.now() - started)

    async def _result(self, call: ToolCall) -> tuple[str, str]:
        """(status, what the LLM reads) of one call."""
        if (problem := argument_problem(call)) is not None:
            return "failed", failure(problem)
        if self._tools.client_tool(call.name):
            return "completed", output_text(await self._pending.open(call.id))
        tool = self._tools.server_tool(call.name)
        if tool is None:  # a model that made a tool up: the user hears it cannot do that (said as is: the 0.5B model
            # read an instruction to it out, or wrote its own JSON answer)
            why = f"there is no tool named {call.name!r}"
            return "failed", json.dumps({"error": why, "say": CANNOT_DO})
        try:
            arguments = json.loads(call.arguments or "{}")
            if inspect.iscoroutinefunction(tool.run):
                output = await tool.run(arguments)
            else:
                output = await self._run(lambda: tool.run(arguments))
        except Exception as exc:  # a tool's failure is the LLM's to read, not the turn's end
            log.warning("server tool %s failed: %s", call.name, exc)
            return "failed", failure(f"{call.name} failed: {exc}"[:500])
        return "completed", output_text(output)

    @staticmethod
    def _done(turn_id: int, call: ToolCall, status: str, output: str = "") -> protocol.ToolDone:
        return protocol.ToolDone(turn_id=turn_id, call_id=call.id, name=call.name, status=status, output=output)
