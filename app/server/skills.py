"""The server's skills, made from the settings and run for as long as the server: the built-in ones (their due
loops) and the MCP servers' tools (their connections), one ``SkillSet`` every session uses."""

from __future__ import annotations

import datetime
import logging
from pathlib import Path

from app.config import Settings
from app.policy import dated, instructed
from app.skills.base import SkillOwner, SystemWallClock
from app.skills.builtin import SkillSet, builtin_skills
from app.skills.mcp import McpHub, parse_mcp_servers
from app.stages.base import ChatLLM, scheduling_of
from app.voice.tools import SessionTools, load_server_tools

log = logging.getLogger(__name__)


def data_dir(settings: Settings) -> Path:
    """Where what must survive a restart is kept (``data_dir``, else ``~/.local/share/parley``)."""
    return Path(settings.data_dir).expanduser() if settings.data_dir else Path.home() / ".local" / "share" / "parley"


class ServerSkills:
    """``start`` (the MCP servers connected, the due loops running), ``skills`` for the sessions, ``stop``.

    Made at once (a bad ``skills`` or ``mcp_servers`` setting fails the start with what is wrong); an MCP server
    that does not answer is left out with a line saying why, and the server starts anyway."""

    def __init__(self, settings: Settings) -> None:
        self._hub = McpHub(parse_mcp_servers(settings.mcp_servers))
        builtin = builtin_skills(settings.skills, clock=SystemWallClock(), data_dir=data_dir(settings))
        self.skills = SkillSet([*builtin, self._hub.skill])

    async def start(self) -> list[str]:
        """Start everything; one line per skill and MCP server, for the start-up log."""
        await self._hub.start()
        await self.skills.start()
        lines = [f"skills: {', '.join(s.name for s in self.skills.skills if s.name != 'mcp') or 'none'}"]
        if self._hub.tools or self._hub.failures:
            lines.append(f"MCP tools: {', '.join(t.name for t in self._hub.tools) or 'none'}")
        lines += [f"WARNING: MCP server {name} left out: {why}" for name, why in self._hub.failures.items()]
        return lines

    async def warm_first_prompt(self, llm: ChatLLM, settings: Settings) -> None:
        """Prefill the prompt every conversation starts with (the system prompt and the tools: ~900 tokens for the
        default brain, 6 s of a first turn when cold; with four users starting at once, 8 s) into the LLM's prefix
        cache, once, so no first turn waits for it. A remote server (``OpenAIChatLLM``) is asked for one token after
        that prompt: its prefix cache then holds it, and its own first-call costs are paid here (a cold
        ``parley engine serve`` took over ``llm_wait_s`` on the default brain's first turn, which failed)."""
        from app.stages.llm import OpenAIChatLLM

        scheduling = scheduling_of(llm)
        if scheduling is not None:
            warm = scheduling.warm
        elif isinstance(llm, OpenAIChatLLM):
            warm = llm.warm_prefix
        else:
            return
        owner = SkillOwner("warm-up", lambda kind, text: None)
        tools = SessionTools((), load_server_tools(settings.tool_entry_point) + self.skills.tools(owner))
        prompt = instructed(dated(settings.system_prompt, datetime.date.today()), self.skills.instructions())
        system = {"role": "system", "content": prompt}
        try:
            await warm([system], tools=tools.spec([]))
        except Exception:  # a warm-up that fails costs only its own time
            log.exception("the first prompt was not prefilled")

    async def stop(self) -> None:
        await self.skills.stop()
        await self._hub.close()
