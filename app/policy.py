"""How a voice reply is asked for, per model: what the model sees of the conversation, and how it decodes.

A 135M model is not a 7B one: fed the transcript of its own earlier answers, SmolLM2-135M copies
them and answers earlier questions, and greedy decoding loops (README, "Conversation policy").
So the conversation's defaults are a row of ``POLICIES``, chosen by the LLM's name
(``policy_for``), and each of them is also a setting of its own (``app.config``), which wins
over the row. A row holds only what was measured on its model (``parley bench quality``); the
default row, today's behaviour, is what every other model gets.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import PurePath
from typing import Literal

HistoryReplies = Literal["all", "last", "none"]
FollowUps = Literal["as_said", "in_full", "in_full_alone"]
BUNDLED_LLM = "SmolLM2-135M-Instruct"  # what llm_model "bundled" is (``engine.weights.resolve_model``)


@dataclass(frozen=True)
class ConversationPolicy:
    """One model's defaults for a voice reply (each field is the setting of the same name, see ``SETTINGS``)."""

    # short and near SmolLM2's training prompt: longer "voice style" instructions made it answer in broken French
    system_prompt: str = "You are a helpful AI assistant named Parley. Keep your answers short."
    history_messages: int = 16  # messages of the conversation sent back each turn
    # of the model's own earlier replies in them: all, only the last one (follow-ups read it), or none
    history_replies: HistoryReplies = "all"
    # the user's own earlier statements (not questions) recalled in the system prompt, newest first; 0: none
    recalled_statements: int = 0
    # an English elliptical follow-up ("And Spain?"): asked as said, or as the question it stands for
    # (app/voice/follow_up.py) with the conversation or without it
    follow_ups: FollowUps = "as_said"
    # the history only for words it makes this much likelier (mean nats a token, by the LLM itself); 0: always
    relevance_nats: float = 0.0
    max_tokens: int = 120
    temperature: float = 0.0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # prompt and reply tokens
    presence_penalty: float = 0.0  # reply tokens
    frequency_penalty: float = 0.0  # reply tokens
    dry_multiplier: float = 0.0  # DRY (llama.cpp's "don't repeat yourself"); 0: off

    def settings(self) -> dict[str, object]:
        """The policy as ``Settings`` field values."""
        return {SETTINGS[name]: value for name, value in asdict(self).items()}


# the setting each policy field is the default of
SETTINGS = {
    "system_prompt": "system_prompt",
    "history_messages": "max_history_messages",
    "history_replies": "history_replies",
    "recalled_statements": "recalled_user_statements",
    "follow_ups": "follow_ups",
    "relevance_nats": "history_relevance_nats",
    "max_tokens": "llm_max_tokens",
    "temperature": "llm_temperature",
    "top_p": "llm_top_p",
    "min_p": "llm_min_p",
    "repetition_penalty": "llm_repetition_penalty",
    "presence_penalty": "llm_presence_penalty",
    "frequency_penalty": "llm_frequency_penalty",
    "dry_multiplier": "llm_dry_multiplier",
}

POLICIES: dict[str, ConversationPolicy] = {
    "default": ConversationPolicy(),
    # its last reply only (what a follow-up needs; the earlier ones it copied), and DRY against copying and loops;
    # the conversation only for words it makes 0.9 nats a token likelier (the rest are asked alone: 25-28/40 facts in
    # conversation against 18-20 without, 24-26 alone), with 4 recalled statements (the user's facts asked back are then
    # asked alone: 3-4/8 recalled against 2/8). A spoken turn starts on one prompt where the words heard while the
    # user spoke choose it (``PrefixWarmup.heard_gain``), so the reply starts as soon as without it (README,
    # "Conversation policy"); 2 recalled: 4/8 user facts but 3/72 copied. An elliptical follow-up asked in full and
    # alone: 5/8 right against 2/8 as said, and none answering the question before it (in full with the
    # conversation: 5/8, one answering it)
    "smollm2-135m": ConversationPolicy(
        history_replies="last",
        dry_multiplier=0.8,
        recalled_statements=4,
        relevance_nats=0.9,
        follow_ups="in_full_alone",
    ),
}

# a model whose name (lower case) contains the key gets that policy; the first match wins
MODEL_POLICIES: tuple[tuple[str, str], ...] = (("smollm2-135m", "smollm2-135m"),)


def model_name(llm_model: str, llm_backend: str) -> str:
    """The LLM's name as the policy table reads it: the bundled model's, or a folder's or file's last part."""
    if llm_model == "bundled":
        return "" if llm_backend == "openai" else BUNDLED_LLM  # a remote server's own model is unknown here
    return PurePath(llm_model.rstrip("/\\")).name


def policy_for(name: str, llm_model: str, llm_backend: str) -> str:
    """The policy to use: ``name`` when it is not "auto", else the row whose key the model's name contains."""
    if name != "auto":
        if name not in POLICIES:
            raise ValueError(f"no conversation policy {name!r}; policies: auto, {', '.join(POLICIES)}")
        return name
    found = model_name(llm_model, llm_backend).lower()
    return next((policy for key, policy in MODEL_POLICIES if key in found), "default")
