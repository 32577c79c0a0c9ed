"""The tools of Model Context Protocol servers, for the LLM to call: the ``mcp`` skill.

An operator names servers in the settings (``mcp_servers``, JSON: ``parse_mcp_servers``): a command to run (a
stdio server, a child process of ours) or a URL (streamable HTTP, e.g. Home Assistant's ``/api/mcp`` with a bearer
token). ``McpHub`` connects to them all when the voice server starts and offers their tools to every conversation
(``McpHub.skill``); ``McpHub.close`` shuts every connection and child process down.

Why one connection per server for the process's life, shared by every conversation: starting a stdio server costs
a second or more, and a tool call must answer while the user waits.

Why each connection lives in a task of its own (``_Connection._serve``): the mcp client's transports are anyio
context managers (task groups, cancel scopes) that must be entered and exited in one task, while a call comes from
whichever conversation's task runs it; so a call is handed to the connection's task, which runs it as a child task
and hands back its result (``_Call``).

Why a server that fails never stops the voice server: each server connects within its own timeout, and one that does
not start is logged and left out; one that dies later fails its calls with words the LLM can read ("the time server
is not reachable"), and the next call after ``retry_after_s`` connects again.

Why everything a server sends is bounded (how many tools, the size of a description, a schema and a result): a
server is a third party, and what it says goes into a small model's prompt.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import shlex
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

import httpx2
import llguidance
from mcp import Client, MCPError, StdioServerParameters, types
from mcp.client.streamable_http import streamable_http_client
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from app import protocol
from app.skills.base import ServerTool, SkillOwner

log = logging.getLogger(__name__)

MAX_TOOLS_PER_SERVER = 64  # offered to the LLM; more would crowd a small model's prompt
MAX_TOOLS_LISTED = 256  # read from one server's listing, before the allow-list
MAX_TOOL_PAGES = 16  # of one listing: a server whose pages never end cannot hang the start
MAX_DESCRIPTION_CHARS = 300
MAX_SCHEMA_CHARS = 6_000  # a tool's parameters as JSON; Home Assistant's largest (area and floor names) fit
MAX_RESULT_CHARS = protocol.MAX_TOOL_OUTPUT_CHARS
MAX_ERROR_CHARS = 1_000
# A server's prompt added to the system prompt (``McpServerSpec.prompt``): Home Assistant's names each exposed device
# and area in a line or two, so a home of ~50 devices fits; a longer one is cut (and says so in the log).
MAX_PROMPT_CHARS = 6_000
STOP_GRACE_S = 10.0  # for a connection to close itself (a stdio server gets 2 s, then SIGTERM, then SIGKILL)
_TOOL_NAME = re.compile(protocol.TOOL_NAME_PATTERN)
_NOT_IN_A_TOOL_NAME = re.compile(r"[^A-Za-z0-9_-]")
_CLIENT_INFO = types.Implementation(name="parley", version="0.1.0")


# ---------------------------------------------------------------- what the settings name
class McpServerSpec(BaseModel):
    """One MCP server as the settings name it: ``command`` (a stdio server: the program and its arguments, run with
    PATH, HOME and the like plus ``env``) or ``url`` (streamable HTTP, sent ``headers``: an Authorization bearer
    token, say); ``tools``: the only tools of it the LLM may call (None: all); ``timeout_s``: for one call;
    ``connect_timeout_s``: for starting and listing its tools; ``prompt``: the name of a prompt the server offers to
    add to the system prompt (Home Assistant's is ``Assist``: how to control the home, and its devices and areas by
    name, which its tools' arguments must name)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1, max_length=64)
    command: tuple[str, ...] | None = None
    env: dict[str, str] | None = Field(default=None, repr=False)  # may hold secrets: never in a log line
    url: str | None = None
    headers: dict[str, str] | None = Field(default=None, repr=False)  # an access token, often
    tools: tuple[str, ...] | None = None
    timeout_s: float = Field(default=8.0, gt=0, le=600)  # under the reply's tool_timeout_s (10): this names the server
    connect_timeout_s: float = Field(default=15.0, gt=0, le=600)
    prompt: str | None = Field(default=None, min_length=1, max_length=128)

    @field_validator("name")
    @classmethod
    def _name_is_words(cls, name: str) -> str:
        name = name.strip()
        if not name:
            raise ValueError("the name is empty")
        return name

    @field_validator("command")
    @classmethod
    def _command_has_a_program(cls, command: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if command is not None and (not command or not command[0].strip()):
            raise ValueError(
                "the command is empty: give the program and its arguments, e.g. ['uvx', 'mcp-server-time']"
            )
        return command

    @field_validator("url")
    @classmethod
    def _url_is_http(cls, url: str | None) -> str | None:
        if url is not None:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"the url must be http:// or https:// with a host, not {url!r}")
        return url

    @model_validator(mode="after")
    def _one_transport(self) -> McpServerSpec:
        if (self.command is None) == (self.url is None):
            raise ValueError("give either 'command' (a stdio server) or 'url' (streamable HTTP), not both nor neither")
        if self.env is not None and self.command is None:
            raise ValueError("'env' is for a 'command' server; an HTTP server takes 'headers'")
        if self.headers is not None and self.url is None:
            raise ValueError("'headers' are for a 'url' server; a command server takes 'env'")
        return self

    @property
    def where(self) -> str:
        """The command or the URL, for a log line: the URL without user, password or query (they may be secret)."""
        if self.command is not None:
            return shlex.join(self.command)
        parts = urlsplit(self.url or "")
        port = f":{parts.port}" if parts.port else ""
        return f"{parts.scheme}://{parts.hostname}{port}{parts.path}"


def parse_mcp_servers(raw: str | Sequence[Mapping[str, Any]] | None) -> tuple[McpServerSpec, ...]:
    """The servers the settings name: JSON text (a list of objects) or the list itself; ``None`` or ``""``: none.

    ValueError says which entry is wrong and why (and never quotes a header or an env value: they may be secret).
    """
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return ()
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"mcp_servers is not valid JSON: {exc}") from None
    if not isinstance(raw, Sequence) or isinstance(raw, str):
        raise ValueError(f"mcp_servers must be a list of servers, not {type(raw).__name__}")
    specs: list[McpServerSpec] = []
    for index, entry in enumerate(raw):
        label = f"mcp_servers[{index}]"
        if isinstance(entry, Mapping) and isinstance(entry.get("name"), str):
            label += f" ({entry['name']!r})"
        if not isinstance(entry, Mapping):
            raise ValueError(f"{label} must be an object with a name and a command or url, not {type(entry).__name__}")
        try:
            specs.append(McpServerSpec.model_validate(dict(entry)))
        except ValidationError as exc:
            raise ValueError(f"{label}: {_pydantic_reasons(exc)}") from None
    seen: set[str] = set()
    for spec in specs:
        if spec.name.casefold() in seen:
            raise ValueError(f"mcp_servers: two servers are named {spec.name!r}; each needs a name of its own")
        seen.add(spec.name.casefold())
    return tuple(specs)


def _pydantic_reasons(exc: ValidationError) -> str:
    """Pydantic's errors without the input values (a header's value is a token)."""
    reasons = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        reasons.append(f"{where}: {message}" if where else message)
    return "; ".join(reasons)


# ---------------------------------------------------------------- what the LLM reads
class McpToolError(RuntimeError):
    """A call that could not be made or answered; its message is what the LLM reads (``ToolRunner`` shows it)."""


class McpStartError(RuntimeError):
    """A server that did not start: the message says which and why, ``reason`` only why."""

    def __init__(self, spec: McpServerSpec, reason: str) -> None:
        super().__init__(f"MCP server {spec.name!r} ({spec.where}) did not start: {reason}")
        self.reason = reason


def result_for_llm(result: types.CallToolResult) -> str | dict[str, str]:
    """A call's result as the LLM reads it: its text, joined (``structuredContent`` as JSON when it has no text),
    at most ``MAX_RESULT_CHARS``; a result the server marks an error is ``{"error": text}``."""
    texts = []
    for block in result.content:
        if isinstance(block, types.TextContent):
            texts.append(block.text)
        elif isinstance(block, types.EmbeddedResource) and isinstance(block.resource, types.TextResourceContents):
            texts.append(block.resource.text)
        else:
            texts.append(f"[{block.type}: not shown]")
    text = "\n".join(texts).strip()
    if not text and result.structured_content is not None:
        text = json.dumps(result.structured_content, ensure_ascii=False, default=str)
    if result.is_error:
        return {"error": _cut(text or "the tool failed and said nothing", MAX_ERROR_CHARS)}
    return _cut(text, MAX_RESULT_CHARS)


def _cut(text: str, max_chars: int) -> str:
    """``text`` at most ``max_chars`` long, cut at a word where one is near."""
    if len(text) <= max_chars:
        return text
    cut = text[: max_chars - 1]
    space = cut.rfind(" ")
    if space > max_chars * 0.8:
        cut = cut[:space]
    return cut.rstrip() + "…"


def _describe(exc: BaseException) -> str:
    """An exception in a few words: the first of a group (anyio wraps a transport's failure in groups)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    if isinstance(exc, FileNotFoundError):
        return f"no such program: {exc.filename or exc}"
    if isinstance(exc, MCPError):
        return exc.message
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _connection_closed(exc: BaseException) -> bool:
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return isinstance(exc, MCPError) and exc.code == types.CONNECTION_CLOSED


class _HttpStatus:
    """What an HTTP server's answers said that the mcp client does not: the last HTTP error (the client reports a
    401 as "Server returned an error response", which does not tell an operator that the token is wrong), and
    whether the server forgot our session (a 404 to a request that names one: it restarted; the spec says to start
    a new session then, and the client does not)."""

    def __init__(self) -> None:
        self.error: str | None = None
        self.session_gone = False

    async def note(self, response: httpx2.Response) -> None:
        if response.status_code < 400:
            return
        self.error = f"HTTP {response.status_code} {response.reason_phrase}".strip()
        if response.status_code in (401, 403):
            self.error += ": check its headers (the access token)"
        if response.status_code == 404 and "mcp-session-id" in response.request.headers:
            self.session_gone = True


# ---------------------------------------------------------------- one server's connection
@dataclass(eq=False)  # each call is itself: kept in sets by identity
class _Call:
    """One call handed to a connection's task: the task running it (once it runs) and where its result goes."""

    tool: str
    arguments: dict[str, Any]
    result: asyncio.Future[types.CallToolResult]
    task: asyncio.Task[None] | None = None


@dataclass(eq=False)
class _Link:
    """One connection attempt's own state: the calls handed to its task (``None``: stop) and its HTTP answers."""

    inbox: asyncio.Queue[_Call | None]
    http_status: _HttpStatus


class _Connection:
    """One server's connection, held by a task of its own (``_serve``: it enters and exits the mcp client), which
    runs the calls handed to it (``call``). A lost connection is made again by a later call, at most every
    ``retry_after_s``."""

    def __init__(self, spec: McpServerSpec, *, retry_after_s: float, monotonic: Callable[[], float]) -> None:
        self.spec = spec
        self._retry_after_s, self._monotonic = retry_after_s, monotonic
        self._runner: asyncio.Task[None] | None = None
        self._link = _Link(asyncio.Queue(), _HttpStatus())
        self._lost: str | None = "it has not connected"  # why calls cannot go through now; None while connected
        self._last_attempt = -math.inf
        self._reconnecting: asyncio.Task[str | None] | None = None
        self._tool_names: frozenset[str] = frozenset()
        self._closed = False
        self.instructions = ""  # the server's prompt named by ``spec.prompt``, as read at the first connection

    async def connect(self) -> tuple[types.Tool, ...]:
        """Start the server (or reach it), within ``connect_timeout_s``, and list its tools; McpStartError says why
        not. A connection before this one is closed first."""
        self._last_attempt = self._monotonic()
        await self._stop_runner(graceful=False)
        ready: asyncio.Future[tuple[types.Tool, ...]] = asyncio.get_running_loop().create_future()
        link = self._link = _Link(asyncio.Queue(), _HttpStatus())
        self._runner = asyncio.create_task(self._serve(link, ready), name=f"mcp:{self.spec.name}")
        self._runner.add_done_callback(_note_unexpected_end)
        try:
            async with asyncio.timeout(self.spec.connect_timeout_s):
                tools = await asyncio.shield(ready)
        except BaseException as exc:
            ready.cancel()
            await self._stop_runner(graceful=False)
            if isinstance(exc, Exception):
                raise McpStartError(self.spec, self._why_not_started(exc, link.http_status)) from None
            raise
        self._lost = None
        self._tool_names = frozenset(tool.name for tool in tools)
        return tools

    async def call(self, tool: str, arguments: dict[str, Any]) -> types.CallToolResult:
        """Call ``tool`` within ``timeout_s``; McpToolError says why it gave no result. Cancelling this (barge-in,
        the reply's own timeout) cancels the call."""
        if self._closed:
            raise McpToolError(f"the {self.spec.name} server is shut down")
        if self._lost is not None or self._runner is None or self._runner.done():
            await self._reconnect()
        call = _Call(tool, arguments, asyncio.get_running_loop().create_future())
        self._link.inbox.put_nowait(call)
        try:
            async with asyncio.timeout(self.spec.timeout_s):
                return await call.result
        except TimeoutError:
            raise McpToolError(f"the {self.spec.name} server gave no answer within {self.spec.timeout_s:g} s") from None
        finally:
            if call.task is not None:
                call.task.cancel()  # a call still running when its caller gave up (does nothing once it is done)

    async def close(self) -> None:
        """Shut the connection down (a stdio server's process too); calls after this fail."""
        self._closed = True
        if self._reconnecting is not None and not self._reconnecting.done():
            self._reconnecting.cancel()
            await asyncio.wait([self._reconnecting])
        await self._stop_runner(graceful=True)

    # ------------------------------------------------------------ the connection's own task
    async def _serve(self, link: _Link, ready: asyncio.Future[tuple[types.Tool, ...]]) -> None:
        """Enter the client, say which tools the server has (``ready``), run calls until told to stop (``None``) or
        the connection fails, and exit the client: all in this one task, as anyio requires."""
        handed: set[_Call] = set()  # taken from the inbox, not yet answered
        reason = "the connection was closed"
        try:
            async with self._client(link.http_status) as client:
                tools = await _list_tools(client)
                if self.spec.prompt is not None and not self.instructions:
                    self.instructions = await _prompt_text(client, self.spec)
                if ready.done():
                    return  # the connect timed out meanwhile
                ready.set_result(tools)
                await self._take_calls(client, link, handed)
        except Exception as exc:
            reason = _describe(exc)
            if not ready.done():
                ready.set_exception(exc)
            elif self._lost is None:
                log.warning("MCP server %r: the connection is lost: %s", self.spec.name, reason)
        finally:
            if not ready.done():
                ready.cancel()
            if self._link is link and self._lost is None:
                self._lost = reason
            while not link.inbox.empty():
                if (queued := link.inbox.get_nowait()) is not None:
                    handed.add(queued)
            for call in handed:
                if not call.result.done():
                    call.result.set_exception(McpToolError(f"the {self.spec.name} server is not reachable ({reason})"))

    async def _take_calls(self, client: Client, link: _Link, handed: set[_Call]) -> None:
        """Run each call handed over as a child task, until told to stop; then cancel the calls still running."""
        async with asyncio.TaskGroup() as calls:
            while (call := await link.inbox.get()) is not None:
                if call.result.done():
                    continue  # its caller gave up while it waited
                handed.add(call)
                call.result.add_done_callback(lambda _, call=call: handed.discard(call))
                call.task = calls.create_task(self._perform(client, call, link))
            for call in handed:
                if call.task is not None:
                    call.task.cancel()

    async def _perform(self, client: Client, call: _Call, link: _Link) -> None:
        """One call; its outcome goes to its caller. A broken connection also stops this connection's task, so the
        next call connects anew."""
        try:
            result = await client.call_tool(call.tool, call.arguments)
        except MCPError as exc:
            if exc.code == types.CONNECTION_CLOSED:
                outcome = self._lose("the connection closed", link)
            elif link.http_status.session_gone:
                outcome = self._lose("it no longer knows our session: it restarted, likely", link)
            else:
                outcome = McpToolError(f"the {self.spec.name} server refused the call: {_cut(exc.message, 500)}")
        except ValidationError:
            outcome = McpToolError(f"the {self.spec.name} server's answer is malformed")
        except Exception as exc:  # a transport's failure: the server went away
            outcome = self._lose(_describe(exc), link)
        else:
            if not call.result.done():
                call.result.set_result(result)
            return
        if not call.result.done():
            call.result.set_exception(outcome)

    def _lose(self, reason: str, link: _Link) -> McpToolError:
        """Mark the connection lost and tell its task to end; the error the failed call's caller reads."""
        if self._lost is None and self._link is link:
            self._lost = reason
            log.warning("MCP server %r: the connection is lost: %s", self.spec.name, reason)
            link.inbox.put_nowait(None)
        return McpToolError(f"the {self.spec.name} server is not reachable ({reason})")

    @contextlib.asynccontextmanager
    async def _client(self, http_status: _HttpStatus) -> AsyncIterator[Client]:
        """The mcp client for the spec's transport, entered (and on exit, exited) in the calling task."""
        spec = self.spec
        if spec.command is not None:
            program, *arguments = spec.command
            params = StdioServerParameters(command=program, args=arguments, env=spec.env)
            async with Client(params, client_info=_CLIENT_INFO) as client:
                yield client
            return
        http = httpx2.AsyncClient(
            headers=spec.headers,
            timeout=httpx2.Timeout(spec.connect_timeout_s, read=300.0),  # the read: a server's event stream stays open
            event_hooks={"response": [http_status.note]},
        )
        async with (
            http,
            Client(streamable_http_client(spec.url or "", http_client=http), client_info=_CLIENT_INFO) as c,
        ):
            yield c

    # ------------------------------------------------------------ connecting again, stopping
    async def _reconnect(self) -> None:
        """Connect again if the last try is ``retry_after_s`` old, else fail at once; callers meanwhile share one try,
        which a caller's cancellation does not stop (the next caller would find it half done)."""
        if self._reconnecting is None or self._reconnecting.done():
            wait_s = self._last_attempt + self._retry_after_s - self._monotonic()
            if wait_s > 0:
                raise McpToolError(
                    f"the {self.spec.name} server is not reachable ({self._lost}); it is tried again in {math.ceil(wait_s)} s"
                )
            self._reconnecting = asyncio.create_task(self._connect_again(), name=f"mcp:{self.spec.name}:reconnect")
        reconnecting = self._reconnecting
        try:
            failure = await asyncio.shield(reconnecting)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # this caller is cancelled (a barge-in): the try goes on for the next one
            failure = "it is shut down"  # close() ended the try: this caller is not cancelled, only failed
        if failure is not None:
            raise McpToolError(f"the {self.spec.name} server is not reachable ({failure})")

    async def _connect_again(self) -> str | None:
        """Why connecting again failed, or None when it worked."""
        names_before = self._tool_names
        try:
            tools = await self.connect()
        except McpStartError as exc:
            log.warning("MCP server %r: connecting again failed: %s", self.spec.name, exc.reason)
            self._lost = exc.reason
            return exc.reason
        log.info("MCP server %r: connected again", self.spec.name)
        if (names := frozenset(tool.name for tool in tools)) != names_before:
            log.warning(
                "MCP server %r: its tools changed since the start (%s); restart to offer them",
                self.spec.name,
                sorted(names),
            )
        return None

    async def _stop_runner(self, *, graceful: bool) -> None:
        """End the connection's task: told to stop (graceful: the client exits as it should: an HTTP session is
        ended, a child process gets its stdin closed), or cancelled (the mcp client still stops a child process)."""
        runner = self._runner
        if runner is None or runner.done():
            return
        if graceful:
            self._link.inbox.put_nowait(None)
            await asyncio.wait([runner], timeout=STOP_GRACE_S)
        if not runner.done():
            runner.cancel()
            await asyncio.wait([runner])

    def _why_not_started(self, exc: Exception, http_status: _HttpStatus) -> str:
        why = f"no answer within {self.spec.connect_timeout_s:g} s" if isinstance(exc, TimeoutError) else _describe(exc)
        if http_status.error:
            why += f" ({http_status.error})"
        elif self.spec.command is not None and _connection_closed(exc):
            why += " (the program ended, or closed its output, before it answered: its stderr says why)"
        return why


def _note_unexpected_end(runner: asyncio.Task[None]) -> None:
    """A connection's task ends by itself or cancelled; anything else (an error outside what ``_serve`` catches) is
    logged here rather than left unretrieved in the task."""
    if not runner.cancelled() and (exc := runner.exception()) is not None:
        log.warning("%s ended with %s", runner.get_name(), _describe(exc))


async def _list_tools(client: Client) -> tuple[types.Tool, ...]:
    """A server's tools, at most ``MAX_TOOLS_LISTED`` of them over at most ``MAX_TOOL_PAGES`` pages."""
    tools: list[types.Tool] = []
    cursor: str | None = None
    for _ in range(MAX_TOOL_PAGES):
        page = await client.list_tools(cursor=cursor)
        tools.extend(page.tools)
        cursor = page.next_cursor
        if not cursor or len(tools) >= MAX_TOOLS_LISTED:
            break
    return tuple(tools[:MAX_TOOLS_LISTED])


async def _prompt_text(client: Client, spec: McpServerSpec) -> str:
    """The text of the server's prompt ``spec.prompt`` (its messages' text, joined), at most ``MAX_PROMPT_CHARS``;
    "" with a line in the log when the server has no such prompt or fails to give it (its tools still serve)."""
    assert spec.prompt is not None
    try:
        result = await client.get_prompt(spec.prompt)
    except (MCPError, ValidationError) as exc:
        log.warning("MCP server %r: its prompt %r was not read: %s", spec.name, spec.prompt, _describe(exc))
        return ""
    texts = [message.content.text for message in result.messages if isinstance(message.content, types.TextContent)]
    text = "\n".join(texts).strip()
    if len(text) > MAX_PROMPT_CHARS:
        log.warning("MCP server %r: its prompt is cut to %d of %d characters", spec.name, MAX_PROMPT_CHARS, len(text))
    return _cut(text, MAX_PROMPT_CHARS)


# ---------------------------------------------------------------- the tools the LLM sees
@dataclass(frozen=True)
class _RemoteTool:
    """A ``ServerTool``'s ``run``: the call goes to the tool's server, by the server's own name for it."""

    connection: _Connection
    tool: str

    async def run(self, arguments: dict[str, Any]) -> str | dict[str, str]:
        if not isinstance(arguments, dict):
            raise McpToolError("the arguments must be a JSON object")
        output = result_for_llm(await self.connection.call(self.tool, arguments))
        if isinstance(output, str) and (words := intent_speech(output)) is not None:
            return {"result": output, "say": words}  # said as it is (``app.voice.tools.spoken_results``)
        return output


def intent_speech(text: str) -> str | None:
    """The words a Home Assistant intent response says of itself (``{"speech": {"plain": {"speech": "Turned on the
    light"}}, "response_type": "action_done", ...}``, what its MCP server's ``HassTurnOn`` returns), or None for any
    other result. Said as the answer: a 0.5B model wrote "Yes" from the response's data."""
    try:
        response = json.loads(text)
    except ValueError:
        return None
    if not isinstance(response, dict) or "response_type" not in response:
        return None
    speech = response.get("speech")
    plain = speech.get("plain") if isinstance(speech, dict) else None
    words = plain.get("speech") if isinstance(plain, dict) else None
    return _cut(words.strip(), MAX_ERROR_CHARS) if isinstance(words, str) and words.strip() else None


def exposed_tools(offers: Sequence[tuple[_Connection, Sequence[types.Tool]]]) -> tuple[ServerTool, ...]:
    """The ``ServerTool``s of the servers' tools that their allow-lists let through and that are fit to offer.

    A name two servers offer is prefixed with each server's name ("time_get_current_time"); every name is made to
    match ``protocol.TOOL_NAME_PATTERN``. A tool that cannot be offered is left out with a warning, never its
    server's other tools.
    """
    chosen = [(connection, tool) for connection, tools in offers for tool in _offered(connection.spec, tools)]
    servers_of: dict[str, set[str]] = {}
    for connection, tool in chosen:
        servers_of.setdefault(_tool_name(tool.name), set()).add(connection.spec.name)
    taken: set[str] = set()
    exposed = []
    for connection, tool in chosen:
        name = _tool_name(tool.name)
        if len(servers_of[name]) > 1:
            name = _tool_name(f"{connection.spec.name}_{tool.name}")
        if not name or name in taken:
            log.warning("MCP server %r: tool %r left out: no name of its own for it", connection.spec.name, tool.name)
            continue
        server_tool = ServerTool(
            name=name,
            run=_RemoteTool(connection, tool.name).run,
            description=_cut(" ".join((tool.description or tool.title or "").split()), MAX_DESCRIPTION_CHARS),
            parameters=json.loads(json.dumps(tool.input_schema)),  # the server's object stays the server's
        )
        try:  # what a tool must be for the LLM's tool list (load_server_tools checks the same)
            protocol.FunctionTool(name=name, description=server_tool.description, parameters=server_tool.parameters)
        except ValidationError as exc:
            log.warning("MCP server %r: tool %r left out: %s", connection.spec.name, tool.name, _pydantic_reasons(exc))
            continue
        taken.add(name)
        exposed.append(server_tool)
    return tuple(exposed)


def _offered(spec: McpServerSpec, tools: Sequence[types.Tool]) -> list[types.Tool]:
    """``tools`` that the spec's allow-list lets through and whose schema is fit, at most ``MAX_TOOLS_PER_SERVER``."""
    if spec.tools is not None:
        missing = sorted(set(spec.tools) - {tool.name for tool in tools})
        if missing:
            log.warning("MCP server %r does not offer the tools %s that its allow-list names", spec.name, missing)
        tools = [tool for tool in tools if tool.name in spec.tools]
    fit = []
    for tool in tools:
        why_not = _schema_unfit(tool.input_schema)
        if why_not:
            log.warning("MCP server %r: tool %r left out: %s", spec.name, tool.name, why_not)
        else:
            fit.append(tool)
    if len(fit) > MAX_TOOLS_PER_SERVER:
        log.warning(
            "MCP server %r offers %d tools; the first %d are kept (name the others in its 'tools' to choose)",
            spec.name,
            len(fit),
            MAX_TOOLS_PER_SERVER,
        )
    return fit[:MAX_TOOLS_PER_SERVER]


def _schema_unfit(schema: Any) -> str | None:
    """Why a tool's input schema cannot be the LLM's ``parameters``, or None."""
    if not isinstance(schema, dict) or schema.get("type") != "object":
        return "its input schema is not an object schema"
    try:
        size = len(json.dumps(schema, ensure_ascii=False))
    except (TypeError, ValueError):
        return "its input schema is not JSON"
    if size > MAX_SCHEMA_CHARS:
        return f"its input schema is {size} characters long (at most {MAX_SCHEMA_CHARS})"
    try:  # a schema the engine's grammars cannot take would fail a forced call of any tool (tool_choice "required")
        grammar_error = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_json_schema(schema))
    except Exception as exc:  # whatever a third party's schema makes the library raise
        grammar_error = str(exc) or type(exc).__name__
    if grammar_error:
        return f"its input schema cannot be a grammar: {_cut(grammar_error, 200)}"
    return None


def _tool_name(raw: str) -> str:
    """``raw`` as a tool name the LLM's API takes: other characters become "_", at most 64 of them."""
    name = _NOT_IN_A_TOOL_NAME.sub("_", raw)[:64]
    return name if _TOOL_NAME.fullmatch(name) else ""


# ---------------------------------------------------------------- the hub and its skill
class McpHub:
    """The MCP servers the settings name: ``start`` connects to them all (each within its own timeout; one that does
    not start is logged and left out), ``tools`` are theirs, ``skill`` offers them to every conversation, ``close``
    shuts everything down. Also an async context manager (start, close)."""

    def __init__(
        self,
        specs: Sequence[McpServerSpec],
        *,
        retry_after_s: float = 30.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._connections = [_Connection(spec, retry_after_s=retry_after_s, monotonic=monotonic) for spec in specs]
        self._tools: tuple[ServerTool, ...] = ()
        self.failures: dict[str, str] = {}  # server name -> why it did not start
        self.skill = McpSkill(self)

    @property
    def tools(self) -> tuple[ServerTool, ...]:
        return self._tools

    @property
    def instructions(self) -> str:
        """The servers' prompts named in the settings (``McpServerSpec.prompt``), for the system prompt."""
        return "\n\n".join(c.instructions for c in self._connections if c.instructions)

    async def start(self) -> None:
        """Connect to every server at once and gather their tools; returns when each has connected or failed."""
        listed = await asyncio.gather(*(self._start(connection) for connection in self._connections))
        offers = [(connection, tools) for connection, tools in zip(self._connections, listed, strict=True) if tools]
        self._tools = exposed_tools(offers)
        if self._connections:
            log.info(
                "MCP: %d of %d servers started; tools: %s",
                len(self._connections) - len(self.failures),
                len(self._connections),
                ", ".join(tool.name for tool in self._tools) or "none",
            )

    async def _start(self, connection: _Connection) -> tuple[types.Tool, ...]:
        try:
            return await connection.connect()
        except McpStartError as exc:
            log.error("%s; its tools are left out", exc)
            self.failures[connection.spec.name] = str(exc)
            return ()

    async def close(self) -> None:
        """Close every connection (a stdio server's process ends); the tools' calls fail from now on."""
        await asyncio.gather(*(connection.close() for connection in self._connections))

    async def __aenter__(self) -> McpHub:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        await self.close()


class McpSkill:
    """The ``mcp`` skill: the hub's tools, the same for every conversation (the connections are shared)."""

    name = "mcp"

    def __init__(self, hub: McpHub) -> None:
        self._hub = hub

    def tools(self, owner: SkillOwner) -> tuple[ServerTool, ...]:
        return self._hub.tools

    def instructions(self) -> str:
        return self._hub.instructions

    def close(self, owner: SkillOwner) -> None:
        """Nothing to end with a conversation: the connections are the hub's, closed with it."""
