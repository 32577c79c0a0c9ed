"""The OpenAI-compatible API over the engine, as vLLM keeps ``entrypoints/openai``.

``api_server``: the HTTP app of ``parley engine serve`` (chat completions, completions, models,
metrics). ``protocol``: the request schema (pydantic) and how a request becomes sampling params.
``tool_plan``: what one chat request needs of the tools machinery (the conversation and tools
for the template, whether to parse calls, which grammar). ``tool_parser``: a reply's text, whole
or streamed, split into content and tool calls.

The top floor: it uses the engine core and ``engine.structured_output`` (formats, grammars), and
nothing in the core imports it (``tests/unit/test_import_rules.py``); only ``engine.cli`` and the
app's LLM stage reach it.
"""
