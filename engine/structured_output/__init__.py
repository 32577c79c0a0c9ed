"""Structured output: the grammars a reply is decoded under, beside the sampler that applies them.

``formats``: how a model family writes its tool calls (Hermes/Qwen ``<tool_call>``, Llama 3 JSON,
Mistral ``[TOOL_CALLS]``, or plain JSON for a template without tools), chosen from its chat
template. ``grammar``: JSON schemas (a ``response_format``, or the tools wrapped in the model's
call format) turned into llguidance grammars, and the per-request token masks the sampler applies.

The low floor, as vLLM keeps ``structured_output`` beside its sampler: ``engine.sampling`` and
``engine.llm_engine`` use it, and it imports nothing from the API above it (``engine.openai_api``:
the request schema, the tool-call parser, the chat plan), which ``tests/unit/test_import_rules.py`` checks.
"""
