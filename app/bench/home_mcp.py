"""A stand-in for Home Assistant's MCP server, over stdio, for ``parley bench quality --home``.

Home Assistant's *Model Context Protocol Server* integration (``/api/mcp``) offers its intents as tools;
``HassTurnOn`` and ``HassTurnOff`` take the device by ``name`` and/or ``area`` (and ``floor``, ``domain``,
``device_class``), which is what "turn on the kitchen lights" must reach. This server offers those two tools with
those parameters on a few made-up lights, matches them as loosely as Home Assistant does (a name or an area,
any case, "lights" for "light"), answers as Home Assistant does (an intent response whose ``speech`` Parley says),
fails a request that matches nothing, and writes every light's state to ``--state`` after each call, so the
benchmark reads what really happened, not what the reply says.

Like Home Assistant's, it offers a prompt named ``Assist`` (for ``McpServerSpec.prompt``): how to pass a device to
the tools, and the home's devices with their domain and area, as Home Assistant lists its exposed entities (a YAML
list of names, domain, areas). Without it the default brain guessed arguments that matched nothing
(``domain=['kitchen']``).

Not Home Assistant: no live home was at hand; its tools' names and parameters are copied, its matching is not.
Like Home Assistant (whose intent slots pass through ``cv.ensure_list``), ``domain`` and ``device_class`` take a
list or one string: the default brain writes ``"domain": "light"``, which a stricter stand-in refused.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Annotated

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import BeforeValidator

# a list of strings, as advertised; one string is taken as a list of it (Home Assistant's ``cv.ensure_list``)
Names = Annotated[list[str] | None, BeforeValidator(lambda value: [value] if isinstance(value, str) else value)]

LIGHTS = {
    "light.kitchen": {"name": "Kitchen light", "area": "kitchen"},
    "light.bedroom_lamp": {"name": "Bedroom lamp", "area": "bedroom"},
    "light.living_room": {"name": "Living room lights", "area": "living room"},
    "light.porch": {"name": "Porch light", "area": "porch"},
}


def _words(text: str | None) -> str:
    return " ".join((text or "").lower().replace("_", " ").replace("lights", "light").split())


def matching(name: str | None, area: str | None, domain: list[str] | None) -> list[str]:
    """The lights a request names: by area, by name, or by both; a domain other than light matches none."""
    if domain and "light" not in [_words(d) for d in domain]:
        return []
    wanted_name, wanted_area = _words(name), _words(area)
    found = []
    for entity, light in LIGHTS.items():
        light_name, light_area = _words(light["name"]), _words(light["area"])
        by_area = not wanted_area or wanted_area in light_area or light_area in wanted_area
        by_name = not wanted_name or wanted_name in light_name or light_name in wanted_name or wanted_name == "light"
        by_name = by_name or (wanted_name and light_area in wanted_name)  # "kitchen light" said as the name
        if (wanted_area or wanted_name) and by_area and by_name:
            found.append(entity)
    return found


def make_server(state_path: Path) -> MCPServer:
    state = dict.fromkeys(LIGHTS, "off")
    server = MCPServer("home-stand-in")

    def switch(to: str, name: str | None, area: str | None, domain: list[str] | None) -> str:
        found = matching(name, area, domain)
        if not found:
            raise ToolError(f"no device or entity matched name={name!r} area={area!r} domain={domain!r}")
        for entity in found:
            state[entity] = to
        tmp = state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, state_path)
        return json.dumps(intent_response(to, found))

    @server.tool(name="HassTurnOn", description="Turns on/opens/presses a device or entity")
    def turn_on(
        name: str | None = None,
        area: str | None = None,
        floor: str | None = None,
        domain: Names = None,
        device_class: Names = None,
    ) -> str:
        return switch("on", name, area, domain)

    @server.tool(name="HassTurnOff", description="Turns off/closes a device or entity")
    def turn_off(
        name: str | None = None,
        area: str | None = None,
        floor: str | None = None,
        domain: Names = None,
        device_class: Names = None,
    ) -> str:
        return switch("off", name, area, domain)

    @server.prompt(name="Assist", description="How to control this home, and its devices")
    def assist() -> str:
        return home_prompt()

    state_path.write_text(json.dumps(state))
    return server


def intent_response(to: str, entities: list[str]) -> dict:
    """What Home Assistant's MCP server returns for a switch: its intent response (``speech``, ``response_type``,
    ``data``), its words as Home Assistant writes them for lights."""
    lights = "light" if len(entities) == 1 else "lights"
    return {
        "speech": {"plain": {"speech": f"Turned {to} the {lights}", "extra_data": None}},
        "response_type": "action_done",
        "data": {
            "targets": [],
            "success": [{"name": LIGHTS[e]["name"], "type": "entity", "id": e} for e in entities],
            "failed": [],
        },
    }


def home_prompt() -> str:
    """What the ``Assist`` prompt says: the tools' use, then each light as Home Assistant lists an exposed entity."""
    devices = "\n".join(
        f"- names: {light['name']}\n  domain: light\n  areas: {light['area'].title()}" for light in LIGHTS.values()
    )
    return (
        "To control the home, call its tools. For a device, pass its name and its domain; for a whole area, pass "
        f"the area's name and the domain.\nThe devices of this home and their areas:\n{devices}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state", required=True, help="where every light's state is written")
    make_server(Path(parser.parse_args().state)).run("stdio")


if __name__ == "__main__":
    main()
