"""Tool calling and structured output for the OpenAI-compatible API.

``formats``: how a model family writes its calls (Hermes/Qwen ``<tool_call>``, Llama 3 JSON,
Mistral ``[TOOL_CALLS]``, or plain JSON for a template without tools), chosen from its chat
template. ``parser``: a reply's text, whole or streamed, split into content and calls.
``grammar``: JSON schemas (a ``response_format``, or the tools wrapped in the model's call
format) turned into llguidance grammars, and the per-request token masks the sampler applies.
``plan``: what one chat request needs of them (the conversation and tools for the template,
whether to parse calls, which grammar).
"""
