"""The ``mcp`` skill (``app.skills.mcp``) against real MCP servers: the reference time server (``mcp-server-time``,
a child process over stdio) and an HTTP server made with the mcp library's own ``MCPServer`` (streamable HTTP on a
loopback port, in a thread of this process, behind a bearer token); servers that do not start, die, or hang.

Model-free; no network beyond loopback. Each hub is closed in its test, and checked to leave no child process,
task or thread behind.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import socket
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime

import psutil
import pytest
import uvicorn
from mcp import types
from mcp.server.mcpserver import MCPServer

from app import protocol
from app.skills.base import ServerTool, SkillOwner
from app.skills.mcp import (
    MAX_DESCRIPTION_CHARS,
    MAX_RESULT_CHARS,
    MAX_TOOLS_PER_SERVER,
    McpHub,
    McpServerSpec,
    McpToolError,
    _Connection,
    exposed_tools,
    parse_mcp_servers,
    result_for_llm,
)
from app.stages.base import ToolCall
from app.voice.clock import MonotonicClock
from app.voice.tools import PendingCalls, SessionTools, ToolRunner

TIME_SERVER = [sys.executable, "-m", "mcp_server_time", "--local-timezone", "UTC"]
TOKEN = "parley-test-token"
OWNER = SkillOwner("conversation-1", lambda kind, text: None)


class ManualClock:
    """``monotonic`` for the hub: the reconnect interval passes when a test says so."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


class Snapshot:
    """This process's children, tasks and threads now: what a closed hub must leave as it found (a whole-suite run
    may have other children, e.g. a `parley serve`)."""

    def __init__(self) -> None:
        self.children = set(psutil.Process().children(recursive=True))
        self.tasks = asyncio.all_tasks()
        self.threads = set(threading.enumerate())

    def new_children(self) -> list[psutil.Process]:
        return [child for child in psutil.Process().children(recursive=True) if child not in self.children]

    def assert_nothing_left(self) -> None:
        """After ``close``: no new child process, no task but those there before, no new thread."""
        assert self.new_children() == []
        assert asyncio.all_tasks() <= self.tasks
        assert set(threading.enumerate()) <= self.threads


def by_name(hub: McpHub) -> dict[str, ServerTool]:
    return {tool.name: tool for tool in hub.tools}


# ---------------------------------------------------------------- an HTTP MCP server, in a thread
def http_app() -> MCPServer:
    server = MCPServer("parley-test")

    @server.tool(description="Say the text back")
    async def echo(text: str) -> str:  # async: a sync tool would run on a worker thread of the server's
        return f"echo: {text}"

    @server.tool(description="Sleep a while, then answer")
    async def sleep(seconds: float) -> str:
        SLEEPING.now += 1
        SLEEPING.most = max(SLEEPING.most, SLEEPING.now)
        try:
            await asyncio.sleep(seconds)
        finally:
            SLEEPING.now -= 1
        return "slept"

    return server


class SLEEPING:
    """How many ``sleep`` calls the test server runs at once, and the most it ran (calls side by side show as 2,
    on a machine of any speed)."""

    now = 0
    most = 0


class HttpMcpServer:
    """``MCPServer`` over streamable HTTP on a loopback port; a request without ``Bearer TOKEN`` gets a 401, as Home
    Assistant answers a wrong access token. ``stop`` and ``start`` again keep the port (a server that restarts).

    ``sessions``: the server answers the 2026 protocol's ``server/discover`` "Method not found" (as Home Assistant
    does), so the client falls back to the 2025 handshake, whose HTTP sessions a restart forgets.
    """

    def __init__(self, *, sessions: bool = False) -> None:
        self.sessions = sessions
        self.port = 0
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    def start(self) -> None:
        inner = http_app().streamable_http_app()

        async def app(scope, receive, send) -> None:
            if scope["type"] == "http" and dict(scope["headers"]).get(b"authorization") != f"Bearer {TOKEN}".encode():
                await answer(send, 401, b"401: Unauthorized", b"text/plain")
                return
            if scope["type"] == "http" and scope["method"] == "POST" and self.sessions:
                body, more = b"", True
                while more:
                    message = await receive()
                    body, more = body + message.get("body", b""), message.get("more_body", False)
                request = json.loads(body)
                if request.get("method") == "server/discover":
                    error = {"code": -32601, "message": "Method not found"}
                    await answer(
                        send, 200, json.dumps({"jsonrpc": "2.0", "id": request["id"], "error": error}).encode()
                    )
                    return
                replay = [{"type": "http.request", "body": body, "more_body": False}]

                async def receive_again():
                    return replay.pop() if replay else await receive()

                await inner(scope, receive_again, send)
                return
            await inner(scope, receive, send)

        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=0.3, lifespan="on")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            assert time.monotonic() < deadline, "the test's HTTP MCP server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(10)
            assert not self._thread.is_alive()
            self._server = self._thread = None


async def answer(send, status: int, body: bytes, content_type: bytes = b"application/json") -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", content_type)]})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture
def http_server() -> Iterator[HttpMcpServer]:
    server = HttpMcpServer()
    server.start()
    yield server
    server.stop()


def http_spec(server: HttpMcpServer, name: str = "web", token: str = TOKEN, **fields) -> dict:
    return {"name": name, "url": server.url, "headers": {"Authorization": f"Bearer {token}"}, **fields}


# ---------------------------------------------------------------- the reference server, over stdio
async def test_the_time_server_over_stdio_tells_the_time_and_closes_cleanly():
    before = Snapshot()
    hub = McpHub(parse_mcp_servers([{"name": "time", "command": TIME_SERVER}]))
    await hub.start()
    try:
        assert hub.failures == {}
        tools = by_name(hub)
        assert set(tools) == {"get_current_time", "convert_time"}
        assert hub.skill.name == "mcp" and hub.skill.tools(OWNER) == hub.tools
        current_time = tools["get_current_time"]
        assert inspect.iscoroutinefunction(current_time.run)  # the ToolRunner awaits it on the loop
        assert current_time.parameters["type"] == "object" and "timezone" in current_time.parameters["properties"]
        protocol.FunctionTool(
            name=current_time.name, description=current_time.description, parameters=current_time.parameters
        )

        day_before = datetime.now(UTC).date().isoformat()
        output = await current_time.run({"timezone": "UTC"})
        day_after = datetime.now(UTC).date().isoformat()
        assert isinstance(output, str)
        assert day_before in output or day_after in output  # today's date, whichever side of midnight
        assert json.loads(output)["timezone"] == "UTC"
        wrong = await current_time.run({"timezone": "Nowhere/Atlantis"})  # the server's own error, for the LLM
        assert "Nowhere/Atlantis" in wrong["error"]
        assert len(before.new_children()) == 1
    finally:
        await hub.close()
        hub.skill.close(OWNER)
    before.assert_nothing_left()
    with pytest.raises(McpToolError, match="shut down"):
        await current_time.run({"timezone": "UTC"})


async def test_the_allow_list_hides_tools_and_servers_that_do_not_start_are_left_out(caplog):
    specs = parse_mcp_servers(
        [
            {"name": "missing", "command": ["/nonexistent/parley-mcp-server"]},
            {"name": "quits", "command": [sys.executable, "-c", "import sys; sys.exit('no config, bye')"]},
            {
                "name": "mute",
                "command": [sys.executable, "-c", "import sys; sys.stdin.read()"],
                "connect_timeout_s": 0.5,
            },
            {"name": "time", "command": TIME_SERVER, "tools": ["get_current_time", "get_weather"]},
        ]
    )
    before, started = Snapshot(), time.monotonic()
    with caplog.at_level(logging.WARNING, logger="app.skills.mcp"):
        async with McpHub(specs) as hub:
            assert time.monotonic() - started < 10  # the start waits for none longer than its connect timeout
            assert set(by_name(hub)) == {"get_current_time"}  # convert_time is not allowed
            assert "+00:00" in await by_name(hub)["get_current_time"].run({"timezone": "UTC"})
            assert set(hub.failures) == {"missing", "quits", "mute"}
    assert "no such program: /nonexistent/parley-mcp-server" in hub.failures["missing"]
    assert "ended" in hub.failures["quits"] and "stderr" in hub.failures["quits"]
    assert "no answer within 0.5 s" in hub.failures["mute"]
    for failure in hub.failures.values():
        assert failure in caplog.text and "its tools are left out" in caplog.text
    assert "does not offer the tools ['get_weather']" in caplog.text
    before.assert_nothing_left()


async def test_a_server_that_dies_fails_its_calls_clearly_and_is_started_again_at_most_every_interval():
    clock, before = ManualClock(), Snapshot()
    async with McpHub(parse_mcp_servers([{"name": "time", "command": TIME_SERVER}]), monotonic=clock) as hub:
        current_time = by_name(hub)["get_current_time"]
        (first_process,) = before.new_children()
        first_process.kill()
        first_process.wait(5)
        with pytest.raises(McpToolError, match="the time server is not reachable"):
            await current_time.run({"timezone": "UTC"})
        clock.now += 10  # within the interval (30 s): no new process, an answer at once
        with pytest.raises(McpToolError, match=r"not reachable .*tried again in 20 s"):
            await current_time.run({"timezone": "UTC"})
        assert before.new_children() == []
        clock.now += 20
        assert "+00:00" in await current_time.run({"timezone": "UTC"})
        (second_process,) = before.new_children()
        assert second_process.pid != first_process.pid
    before.assert_nothing_left()


# ---------------------------------------------------------------- streamable HTTP
async def test_an_http_server_answers_with_its_bearer_token_and_a_slow_call_times_out(http_server):
    before = Snapshot()
    specs = parse_mcp_servers([http_spec(http_server, timeout_s=0.5)])
    async with McpHub(specs) as hub:
        assert set(by_name(hub)) == {"echo", "sleep"}
        assert await by_name(hub)["echo"].run({"text": "hello"}) == "echo: hello"

        started = time.monotonic()
        with pytest.raises(McpToolError, match=r"the web server gave no answer within 0.5 s"):
            await by_name(hub)["sleep"].run({"seconds": 5})
        assert time.monotonic() - started < 4.5  # before the call could have ended

        barged_in = asyncio.create_task(by_name(hub)["sleep"].run({"seconds": 5}))
        await asyncio.sleep(0.1)
        barged_in.cancel()  # as a barge-in cancels a reply's calls
        with pytest.raises(asyncio.CancelledError):
            await barged_in

        SLEEPING.most = 0
        both = await asyncio.gather(*(by_name(hub)["sleep"].run({"seconds": 0.3}) for _ in range(2)))
        assert both == ["slept", "slept"] and SLEEPING.most == 2  # side by side, not one after the other
        assert await by_name(hub)["echo"].run({"text": "still there"}) == "echo: still there"
        refused = by_name(hub)["echo"].run({"text": 42})  # wrong arguments: the server's error, for the LLM
        assert "text" in str(await refused)
    before.assert_nothing_left()


async def test_a_wrong_token_fails_that_server_only_and_says_so(http_server, caplog):
    specs = parse_mcp_servers([http_spec(http_server, name="locked", token="wrong"), http_spec(http_server)])
    with caplog.at_level(logging.ERROR, logger="app.skills.mcp"):
        async with McpHub(specs) as hub:
            assert set(hub.failures) == {"locked"}
            assert "HTTP 401" in hub.failures["locked"] and "access token" in hub.failures["locked"]
            assert TOKEN not in hub.failures["locked"] and "wrong" not in caplog.text  # no secret in a log line
            assert await by_name(hub)["echo"].run({"text": "hi"}) == "echo: hi"
    assert "did not start" in caplog.text


async def test_an_http_server_that_goes_away_is_reached_again_when_it_is_back(http_server):
    clock = ManualClock()
    async with McpHub(parse_mcp_servers([http_spec(http_server)]), monotonic=clock, retry_after_s=5) as hub:
        echo = by_name(hub)["echo"]
        assert await echo.run({"text": "one"}) == "echo: one"
        http_server.stop()
        with pytest.raises(McpToolError, match=r"the web server is not reachable \(ConnectError"):
            await echo.run({"text": "two"})
        http_server.start()
        with pytest.raises(McpToolError, match="tried again in 5 s"):
            await echo.run({"text": "three"})
        clock.now += 5
        assert await echo.run({"text": "four"}) == "echo: four"


@pytest.mark.parametrize("sessions", [False, True], ids=["sessionless", "2025-sessions"])
async def test_an_http_server_that_restarts_between_calls_is_reached_again(sessions):
    http_server, clock = HttpMcpServer(sessions=sessions), ManualClock()
    http_server.start()
    try:
        async with McpHub(parse_mcp_servers([http_spec(http_server)]), monotonic=clock, retry_after_s=5) as hub:
            echo = by_name(hub)["echo"]
            assert await echo.run({"text": "one"}) == "echo: one"
            http_server.stop()
            http_server.start()
            if sessions:  # the server forgot our session: the call fails, and the next one connects anew
                with pytest.raises(McpToolError, match="the web server is not reachable .*no longer knows our session"):
                    await echo.run({"text": "two"})
                clock.now += 5
            assert await echo.run({"text": "three"}) == "echo: three"
    finally:
        http_server.stop()


async def test_two_servers_offering_one_name_are_told_apart(http_server):
    specs = parse_mcp_servers([http_spec(http_server, name="a"), http_spec(http_server, name="b.2", tools=["echo"])])
    async with McpHub(specs) as hub:
        assert set(by_name(hub)) == {"a_echo", "b_2_echo", "sleep"}
        assert await by_name(hub)["b_2_echo"].run({"text": "x"}) == "echo: x"


async def test_the_tool_runner_runs_mcp_tools_and_the_llm_reads_their_failures(http_server):
    """The way a reply runs them (``app.voice.tools.ToolRunner``): awaited on the loop, a failure as text."""
    async with McpHub(parse_mcp_servers([http_spec(http_server, timeout_s=0.5)])) as hub:
        runner = ToolRunner(
            SessionTools(server=hub.skill.tools(OWNER)),
            PendingCalls(),
            timeout_s=5,
            clock=MonotonicClock(),
            run_blocking=lambda work: asyncio.to_thread(work),
        )
        events = []

        async def emit(event) -> None:
            events.append(event)

        calls = [ToolCall("c1", "echo", '{"text": "hi"}'), ToolCall("c2", "sleep", '{"seconds": 3}')]
        result = await runner.run(1, calls, emit)
    echoed, slept = (message["content"] for message in result.messages)
    assert echoed == "echo: hi"
    assert json.loads(slept) == {"error": "sleep failed: the web server gave no answer within 0.5 s"}
    assert [event.status for event in events if isinstance(event, protocol.ToolDone)] == ["completed", "failed"]


# ---------------------------------------------------------------- the settings
def test_the_settings_json_parses_into_specs():
    text = json.dumps(
        [
            {"name": "time", "command": ["uvx", "mcp-server-time"], "env": {"TZ": "UTC"}, "timeout_s": 5},
            {
                "name": "home",
                "url": "http://homeassistant.local:8123/api/mcp",
                "headers": {"Authorization": "Bearer secret-token"},
                "tools": ["HassTurnOn", "HassTurnOff"],
            },
        ]
    )
    time_spec, home = parse_mcp_servers(text)
    assert time_spec.command == ("uvx", "mcp-server-time") and time_spec.timeout_s == 5 and time_spec.tools is None
    assert home.tools == ("HassTurnOn", "HassTurnOff") and home.connect_timeout_s == 15
    assert "secret-token" not in repr(home) and "TZ" not in repr(time_spec)
    assert home.where == "http://homeassistant.local:8123/api/mcp"
    assert parse_mcp_servers(None) == parse_mcp_servers("") == parse_mcp_servers("[]") == ()


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ("[{", "not valid JSON"),
        ({"name": "x"}, "must be a list"),
        (["uvx"], r"mcp_servers\[0\] must be an object"),
        ([{"name": "t", "command": ["a"], "url": "http://h/mcp"}], r"mcp_servers\[0\] \('t'\).*not both nor neither"),
        ([{"name": "t"}], "either 'command'.*or 'url'"),
        ([{"name": "  ", "command": ["a"]}], "name: the name is empty"),
        ([{"name": "t", "command": []}], "the command is empty"),
        ([{"name": "t", "url": "ftp://h/mcp"}], "http:// or https://"),
        ([{"name": "t", "url": "http://h/mcp", "env": {"A": "b"}}], "'env' is for a 'command' server"),
        ([{"name": "t", "command": ["a"], "headers": {"A": "b"}}], "'headers' are for a 'url' server"),
        ([{"name": "t", "command": ["a"], "timeout_s": 0}], "timeout_s"),
        ([{"name": "t", "command": ["a"], "tools": "get_time"}], "tools"),
        ([{"name": "t", "command": ["a"], "comand": ["b"]}], "comand: Extra inputs are not permitted"),
        ([{"name": "Time", "command": ["a"]}, {"name": "time", "url": "http://h/mcp"}], "two servers are named 'time'"),
    ],
)
def test_bad_settings_say_which_entry_and_why(entries, message):
    with pytest.raises(ValueError, match=message):
        parse_mcp_servers(entries if isinstance(entries, str) else json.dumps(entries))


def test_a_bad_header_value_is_not_quoted():
    with pytest.raises(ValueError, match="headers") as raised:
        parse_mcp_servers([{"name": "h", "url": "http://h/mcp", "headers": {"Authorization": ["Bearer secret"]}}])
    assert "secret" not in str(raised.value)


# ---------------------------------------------------------------- what an untrusted server offers, and answers
def tool(name: str, schema: object = None, description: str = "") -> types.Tool:
    schema = {"type": "object", "properties": {}} if schema is None else schema
    return types.Tool.model_construct(name=name, input_schema=schema, description=description, title=None)


def connection(name: str, allowed: list[str] | None = None) -> _Connection:
    spec = McpServerSpec(name=name, command=("x",), tools=allowed)
    return _Connection(spec, retry_after_s=30, monotonic=time.monotonic)


def test_tools_unfit_to_offer_are_left_out_and_the_rest_stay(caplog):
    offered = [
        tool("fine", description="word " * 200),
        tool("dotted.name/v2"),
        tool("not_an_object", {"type": "string"}),
        tool("no_schema", {}),
        tool("huge", {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(1_000)}}),
        tool("remote_ref", {"type": "object", "properties": {"a": {"$ref": "http://example.com/a.json"}}}),
        tool("ünïcode"),
        tool("x" * 100),
    ]
    with caplog.at_level(logging.WARNING, logger="app.skills.mcp"):
        exposed = {t.name: t for t in exposed_tools([(connection("s"), offered)])}
    assert set(exposed) == {"fine", "dotted_name_v2", "_n_code", "x" * 64}
    assert len(exposed["fine"].description) <= MAX_DESCRIPTION_CHARS and exposed["fine"].description.endswith("…")
    for name in ("not_an_object", "no_schema", "huge", "remote_ref"):
        assert f"tool {name!r} left out" in caplog.text


def test_a_server_offers_at_most_its_share_of_tools(caplog):
    many = [tool(f"t{i}") for i in range(MAX_TOOLS_PER_SERVER + 10)]
    with caplog.at_level(logging.WARNING, logger="app.skills.mcp"):
        exposed = exposed_tools([(connection("s"), many), (connection("other"), [tool("t0"), tool("own")])])
    names = [t.name for t in exposed]
    assert len(names) == MAX_TOOLS_PER_SERVER + 2
    assert "s_t0" in names and "other_t0" in names and "own" in names and "t0" not in names
    assert "the first 64 are kept" in caplog.text


def test_results_are_text_for_the_llm_and_bounded():
    text = types.TextContent(type="text", text="line one")
    image = types.ImageContent(type="image", data="AAAA", mime_type="image/png")
    assert result_for_llm(types.CallToolResult(content=[text, text])) == "line one\nline one"
    assert result_for_llm(types.CallToolResult(content=[image])) == "[image: not shown]"
    structured = types.CallToolResult(content=[], structured_content={"temperature": 21})
    assert json.loads(result_for_llm(structured)) == {"temperature": 21}
    failed = types.CallToolResult(content=[types.TextContent(type="text", text="no such light")], is_error=True)
    assert result_for_llm(failed) == {"error": "no such light"}
    long = types.CallToolResult(content=[types.TextContent(type="text", text="word " * 5_000)])
    assert len(result_for_llm(long)) <= MAX_RESULT_CHARS


def test_a_home_assistant_intent_response_says_its_own_words():
    from app.skills.mcp import intent_speech

    done = {"speech": {"plain": {"speech": "Turned on the light", "extra_data": None}}, "response_type": "action_done"}
    assert intent_speech(json.dumps(done)) == "Turned on the light"
    error = {
        "speech": {"plain": {"speech": "Sorry, I am not aware of any device called garage"}},
        "response_type": "error",
    }
    assert intent_speech(json.dumps(error)).startswith("Sorry, I am not aware")
    for other in ("Turned on", '{"speech": "hi"}', '{"response_type": "action_done", "speech": {}}', "[1, 2]", ""):
        assert intent_speech(other) is None, other
