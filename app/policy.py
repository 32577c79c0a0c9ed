"""How a voice reply is asked for, per model: what the model sees of the conversation, and how it decodes.

A 135M model is not a 7B one: fed the transcript of its own earlier answers, SmolLM2-135M copies
them and answers earlier questions, and greedy decoding loops (app/bench/results/conversation_policy.md).
So some settings (``app.config``) take their default from a row of ``POLICIES``, chosen by the LLM's
name (``policy_for``); a setting the user gives wins over the row. A row holds only what was measured
on its model (``parley bench quality``); the default row (no changes) is what every other model gets.
"""

from __future__ import annotations

from pathlib import PurePath
from typing import Literal

HistoryReplies = Literal["all", "last", "none"]
FollowUps = Literal["as_said", "in_full", "in_full_alone"]
BUNDLED_LLM = "SmolLM2-135M-Instruct"  # what llm_model "bundled" is (``engine.weights.resolve_model``)


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
