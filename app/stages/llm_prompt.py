"""A conversation as the in-process engine takes it: rendered as the engine's OpenAI API renders it (with ``tools``:
the template's tools or a system note, earlier calls in the model's format, a forced call's grammar, the lazy
grammar of a bare call), and how the reply is then decoded and read (``Rendered``)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from app.stages.base import Message, ToolSpec


@dataclass(frozen=True)
class Rendered:
    """A prompt as the engine takes it, and how its reply is decoded and read (``EngineChatLLM.render``)."""

    ids: list[int]
    grammar: str | None = None  # a forced call's grammar
    tool_format: object | None = None  # the reply is parsed for calls in this format (None: text only)
    skip_special_tokens: bool = True
    lazy_grammar: object | None = None  # tool_choice "auto": free text, or a well-formed call once one opens
    banned: tuple[int, ...] = ()  # tokens the reply may not write (an answer-only round's JSON openers)


class PromptRenderer:
    """Renders prompts for one engine (``AsyncLLMEngine``): its tokenizer, chat template and tool format."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def render(
        self, messages: list[Message], tools: ToolSpec | None, *, add_generation_prompt: bool = True
    ) -> Rendered:
        """``messages`` as the engine's API renders them with ``tools`` (the template's tools or a system note,
        earlier calls in the model's format); ValueError for a conversation or tools the API would refuse."""
        if tools is None:
            return Rendered(self.engine.apply_chat_template(messages, add_generation_prompt=add_generation_prompt))
        plan = self.tool_plan(messages, tools)
        ids = self.engine.apply_chat_template(
            plan.messages, add_generation_prompt=add_generation_prompt, tools=plan.tools
        )
        tool_format, banned = plan.tool_format, ()
        if tool_format is None and tools.choice == "none" and self._tool_format.json_at_start:
            # an answer-only round after calls: the 0.5B wrote its answer as JSON ({"response": "I cannot do that"}),
            # which a voice would read out; no spoken answer opens with "{", and a call written anyway is read
            from engine.structured_output.grammar import opener_ids

            tool_format, banned = self._tool_format, opener_ids(self.engine.tokenizer)
        return Rendered(ids, plan.grammar, tool_format, plan.skip_special_tokens, plan.lazy_grammar, banned)

    def prepare_tools(self) -> None:
        """Build what the first reply with tools would otherwise wait for: the grammar library's view of the
        vocabulary and the tokens that open a bare call (a second or two for a 152k-token vocabulary)."""
        from engine.structured_output.grammar import opener_ids

        core = self.engine.engine
        core.grammars.tokenizer()
        opener_ids(core.tokenizer)

    def tool_plan(self, messages: list[Message], tools: ToolSpec):
        """What a request with ``tools`` needs (``engine.openai_api.tool_plan.ChatPlan``)."""
        from pydantic import ValidationError

        from engine.openai_api.protocol import ChatCompletionRequest, validation_error
        from engine.openai_api.tool_plan import plan_chat

        body = {"messages": messages, "tools": list(tools.tools) or None, "parallel_tool_calls": tools.parallel}
        if tools.tools:
            body["tool_choice"] = tools.choice
        try:
            request = ChatCompletionRequest.model_validate(body, context={"vocab_size": len(self.engine.tokenizer)})
        except ValidationError as e:
            raise ValueError(validation_error(e)[0]) from None
        return plan_chat(request, self._tool_format, self.engine.tokenizer)

    @functools.cached_property
    def _tool_format(self):
        from engine.structured_output.formats import detect_format

        return detect_format(self.engine.tokenizer)
