"""Skills: what the assistant can do, not only say. Each skill is a small module that gives a conversation its
tools (``app.voice.tools.ServerTool``); the LLM calls them like any other tool (``app.voice.tools.ToolRunner``).

* ``base``: what a skill is (``Skill``) and what it acts for (``SkillOwner``).
* built in, on by default, each one an operator can turn off (``Settings.skills``): ``clock`` (the local date
  and time), ``timers``, ``reminders`` (kept on disk), ``calculator`` (arithmetic and unit conversion);
* ``mcp``: the tools of Model Context Protocol servers named in the settings.
"""
