"""How a voice reply is asked for, per model: what the model sees of the conversation, and how it decodes.

A 135M model is not a 7B one: fed the transcript of its own earlier answers, SmolLM2-135M copies
them and answers earlier questions, and greedy decoding loops (app/bench/results/conversation_policy.md).
So some settings (``app.config``) take their default from a row of ``POLICIES``, chosen by what the LLM is
(its architecture, size and chat template, read from its files: ``policy_for``); a setting the user gives wins
over the row. A row holds only what was measured
on its model (``parley bench quality``); the default row (no changes) is what every other model gets.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import date
from typing import Literal

from engine.model_traits import ModelTraits, served_traits, traits_of

HistoryReplies = Literal["all", "last", "none"]
FollowUps = Literal["as_said", "in_full", "in_full_alone"]


DATE_PLACEHOLDER = "{date}"  # a system prompt's place for today's date (``app.voice.reply_factory``)
# For a model that follows instructions (the default brain): its words are heard, not read, and it can act. Short
# sentences, nothing a voice cannot say, numbers as words, never an action it did not take. The date is in it; the
# time comes from the clock tool (in the prompt it would change the prompt's prefix-cached start every minute).
SPEECH_PROMPT = (
    "You are Parley, a voice assistant. Everything you write is spoken aloud: answer in one to three short "
    "sentences of plain speech, with no lists, markdown, code or emoji, and write numbers in words. "
    f"Today is {DATE_PLACEHOLDER}. When one of your tools does exactly what the user asks, call it. If none does, "
    "call no tool and say in one sentence that you cannot do that. Never say you did something you did not do."
)


def spoken_date(day: date) -> str:
    """``Sunday, 6 December 2026``: how the prompt says the date (the model reads it back to a listener)."""
    return f"{day:%A}, {day.day} {day:%B %Y}"


def dated(system_prompt: str, day: date) -> str:
    """``system_prompt`` with ``day`` where it says ``{date}`` (and as it is without the placeholder)."""
    return (
        system_prompt.replace(DATE_PLACEHOLDER, spoken_date(day))
        if DATE_PLACEHOLDER in system_prompt
        else system_prompt
    )


def instructed(system_prompt: str, instructions: str) -> str:
    """``system_prompt`` followed by what the server's skills add to it (an MCP server's prompt; "" for none)."""
    return f"{system_prompt}\n\n{instructions}" if instructions else system_prompt


# Each row names settings (``app.config.Settings``, by their own names) and the value the row gives them; a setting
# a row leaves out keeps its default there, and one the user sets wins over the row.
POLICIES: dict[str, dict[str, object]] = {
    "default": {},
    # its last reply only (what a follow-up needs; the earlier ones it copied), and DRY against copying and loops;
    # the conversation only for words it makes 0.9 nats a token likelier (the rest are asked alone: 25-28/40 facts in
    # conversation against 18-20 without, 24-26 alone), with 4 recalled statements (the user's facts asked back are then
    # asked alone: 3-4/8 recalled against 2/8). A spoken turn starts on one prompt where the words heard while the
    # user spoke choose it (``PrefixWarmup.heard_gain``), so the reply starts as soon as without it; 2 recalled: 4/8
    # user facts but 3/72 copied. An elliptical follow-up asked in full and alone: 5/8 right against 2/8 as said, and
    # none answering the question before it (in full with the conversation: 5/8, one answering it). The experiments
    # behind each value: app/bench/results/conversation_policy.md
    "smollm2-135m": {
        "history_replies": "last",
        "llm_dry_multiplier": 0.8,
        "recalled_user_statements": 4,
        "history_relevance_nats": 0.9,
        "follow_ups": "in_full_alone",
    },
    # the default brain: its prompt for speech; the rest as any model (measured: app/bench/results/default_brain.md)
    # One round of calls: given a result, the 0.5B called again, three times, instead of answering. The conversation
    # only with words it makes likelier (as SmolLM2's row): with every turn in the prompt, after one request acted
    # on it confirmed the next ones ("Your kitchen lights are turned on.") without calling a tool; asked alone, a
    # request is acted on. (app/bench/results/default_brain.md)
    "qwen2.5-0.5b": {"system_prompt": SPEECH_PROMPT, "tool_rounds": 1, "history_relevance_nats": 0.9},
}


@dataclass(frozen=True)
class PolicyRule:
    """A model the row ``row`` was measured on, recognised by its own metadata (``engine.model_traits``): a renamed
    file or an Ollama blob is the same model, and a model it was not measured on never gets it."""

    row: str
    matches: Callable[[ModelTraits], bool]
    describes: str


# the first rule that matches wins; a model none matches (or one not on this machine: a remote server's) gets "default"
MODEL_POLICIES: tuple[PolicyRule, ...] = (
    PolicyRule(
        "smollm2-135m",
        lambda t: t.architecture == "llama" and t.parameters < 200_000_000 and not t.tool_template,
        "a Llama-shaped model under 200M parameters with no tools in its template (SmolLM2-135M)",
    ),
    PolicyRule(
        "qwen2.5-0.5b",
        lambda t: t.architecture == "qwen2" and t.tool_template and t.parameters < 1_000_000_000,
        "a Qwen2 model under 1B parameters with tools in its template (Qwen2.5-Coder-0.5B-Instruct)",
    ),
)


def model_traits(llm_model: str, llm_backend: str) -> ModelTraits | None:
    """What the LLM is, read from its files; None for one not found, or a remote server's model left at ``auto``
    (the server may serve anything). A remote server's model named otherwise (``bundled``, the default brain's
    name, a folder: what `parley scale up` tells its voice servers) is read from this machine's copy: the
    conversation policy is then its row, as in process (it was ``default`` for every remote model: the default
    brain behind `parley scale up` had another system prompt and history than in process)."""
    return served_traits(llm_model) if llm_backend == "openai" else traits_of(llm_model)


def policy_for(name: str, llm_model: str, llm_backend: str) -> str:
    """The policy to use: ``name`` when it is not "auto", else the row of the first rule the model's traits match."""
    if name != "auto":
        if name not in POLICIES:
            raise ValueError(f"no conversation policy {name!r}; policies: auto, {', '.join(POLICIES)}")
        return name
    traits = model_traits(llm_model, llm_backend)
    if traits is None:
        return "default"
    return next((rule.row for rule in MODEL_POLICIES if rule.matches(traits)), "default")
