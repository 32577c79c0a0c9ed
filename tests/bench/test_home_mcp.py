"""``app.bench.home_mcp``, the stand-in home for ``bench quality --home``: its tools reach Parley's MCP client over
stdio with Home Assistant's names and parameters, switch the lights a request names, write what happened, and fail
a request that names nothing in the home."""

from __future__ import annotations

import json
import sys

from app.bench.home_mcp import home_prompt, matching
from app.bench.quality_actions import ACTIONS, HOME_ACTIONS, with_home
from app.skills.mcp import McpHub, parse_mcp_servers


def test_a_request_matches_lights_by_area_or_name_as_said():
    assert matching(None, "kitchen", ["light"]) == ["light.kitchen"]
    assert matching("kitchen lights", None, None) == ["light.kitchen"]
    assert matching("Bedroom lamp", None, None) == ["light.bedroom_lamp"]
    assert matching("light", "Living Room", None) == ["light.living_room"]
    assert matching(None, "garage", None) == [] and matching(None, "kitchen", ["fan"]) == []
    assert matching(None, None, None) == []


async def test_the_home_server_switches_lights_through_the_mcp_client(tmp_path):
    state = tmp_path / "home.json"
    command = [sys.executable, "-m", "app.bench.home_mcp", "--state", str(state)]
    hub = McpHub(parse_mcp_servers([{"name": "home", "command": command}]))
    await hub.start()
    try:
        tools = {tool.name: tool for tool in hub.tools}
        assert set(tools) == {"HassTurnOn", "HassTurnOff"}
        assert {"name", "area", "domain"} <= set(tools["HassTurnOn"].parameters["properties"])
        assert tools["HassTurnOn"].parameters["properties"]["domain"]["anyOf"][0]["type"] == "array"
        switched = await tools["HassTurnOn"].run({"area": "kitchen", "domain": "light"})
        assert switched["say"] == "Turned on the light" and "Kitchen light" in switched["result"]
        assert json.loads(state.read_text())["light.kitchen"] == "on"
        failed = await tools["HassTurnOff"].run({"name": "garage door"})
        assert "no device" in failed["error"] and json.loads(state.read_text())["light.kitchen"] == "on"
    finally:
        await hub.close()


def test_with_a_home_the_lights_request_is_to_be_acted_on():
    asked = with_home(ACTIONS)
    lights = next(a for a in asked if a.text == "Turn on the kitchen lights.")
    assert lights.tool == "HassTurnOn" and len(asked) == len(ACTIONS) + len(HOME_ACTIONS) - 1
    assert [a.text for a in asked][: len(ACTIONS)] == [a.text for a in ACTIONS]


async def test_the_home_s_prompt_is_read_for_the_system_prompt_and_a_missing_one_is_only_logged(tmp_path, caplog):
    command = [sys.executable, "-m", "app.bench.home_mcp", "--state", str(tmp_path / "home.json")]
    specs = [{"name": "home", "command": command, "prompt": "Assist"}]
    async with McpHub(parse_mcp_servers(specs)) as hub:
        assert hub.instructions == home_prompt()
        assert "- names: Kitchen light\n  domain: light\n  areas: Kitchen" in hub.instructions
    specs = [{"name": "home", "command": command, "prompt": "Nothing"}]
    async with McpHub(parse_mcp_servers(specs)) as hub:
        assert hub.instructions == "" and {tool.name for tool in hub.tools} == {"HassTurnOn", "HassTurnOff"}
    assert "its prompt 'Nothing' was not read" in caplog.text
