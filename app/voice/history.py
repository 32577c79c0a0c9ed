"""The conversation's memory, and the prompt built from it each turn.

Bounded twice: what is *sent* is a window of ``max_messages`` whose start moves in jumps
(``history_window``: the prompt's prefix, cached by the LLM, stays the same for several
turns), fitted to the model's context by tokens (``context.fit_to_context``); what is *kept*
is at most about twice that, cut in whole window steps so the window does not move.
"""

from __future__ import annotations

import re
import unicodedata

from app.policy import FollowUps, HistoryReplies
from app.stages.base import ChatLLM, Message
from app.voice.context import Fitted, cut_at_word, estimate_tokens, fit_to_context
from app.voice.follow_up import resolve_in

KEPT_MIN = 32  # messages kept in memory at least (only a window of them is sent each turn)
STATEMENT_CHARS = 160  # a recalled statement is cut to this
# a question, by its mark in the scripts that have one: ? (Latin, Cyrillic, ...), the full-width one (Chinese,
# Japanese), Arabic's, Spanish's opening one. A text without any counts as a statement; a question with no mark
# (Greek's is ";", or an ASR that wrote none) is recalled too, which costs a line of the prompt, no more
QUESTION_MARKS = ("?", "\uff1f", "\u061f", "\u00bf")
# what could pass for a chat template's markup in a recalled statement (it goes into the system prompt)
_MARKUP = re.compile(r"<\|[^|>]*\|>|</?s>|\[/?INST\]|<<SYS>>|<</SYS>>|<start_of_turn>|<end_of_turn>", re.IGNORECASE)


def history_window(history: list[dict], limit: int) -> list[dict]:
    """The last ``limit`` messages at most, with a window start that moves in jumps.

    Why jumps: a window sliding by one message changes the prompt's first tokens every turn, so
    the LLM's prefix cache misses and the whole history is prefilled again (app/bench/results/conversation_policy.md).
    Moving the start by half the limit at a time keeps the prefix, and its cached KV, for
    several turns. The window starts at a user message.
    """
    if limit <= 0:
        return []
    if len(history) <= limit:
        return history
    step = max(2, limit // 2)
    start = -(-(len(history) - limit) // step) * step
    while start < len(history) and history[start].get("role") != "user":
        start += 1
    return history[start:]


def shown_replies(messages: list[Message], replies: HistoryReplies) -> list[Message]:
    """``messages`` with the model's own replies among them that the policy shows: "all", the "last" one, or "none".

    Why: a tiny model (SmolLM2-135M) fed its earlier answers copies them and answers earlier questions
    (``app.policy``); what the user said (their name, the question a follow-up refers to) stays. A reply
    left out leaves the rest of the prompt as it was, so the prefix before it stays in the LLM's cache.
    """
    if replies == "all":
        return messages
    # an assistant message that calls tools stays (its results follow it, and a template needs both)
    said = [index for index, message in enumerate(messages) if _is_reply(message)]
    kept = set(said[-1:]) if replies == "last" else set()
    return [message for index, message in enumerate(messages) if not _is_reply(message) or index in kept]


def user_statements(messages: list[Message], limit: int) -> list[str]:
    """The user's own statements among ``messages`` (their messages that are not questions), newest first, without
    repeats, at most ``limit``, each made safe to put in the system prompt (``sanitize_statement``).

    Language-agnostic on purpose: a question is told by its question mark (``QUESTION_MARKS``), no word list.
    """
    found: list[str] = []
    seen: set[str] = set()
    for message in reversed(messages):
        if len(found) >= limit:
            break
        content = message.get("content")
        if message.get("role") != "user" or not isinstance(content, str) or any(q in content for q in QUESTION_MARKS):
            continue
        statement = sanitize_statement(content)
        key = statement.casefold()
        if statement and key not in seen:
            seen.add(key)
            found.append(statement)
    return found


def sanitize_statement(text: str) -> str:
    """``text`` as a part of one line of the system prompt: it is the user's, so untrusted. No control characters
    or line breaks (a fake new section), no chat template markup, no double quotes (``recall_statements``), at
    most ``STATEMENT_CHARS``."""
    text = _MARKUP.sub(" ", text)
    text = "".join(" " if unicodedata.category(ch)[0] in "CZ" else ch for ch in text)  # controls, separators
    text = " ".join(text.replace('"', "'").replace("\u201c", "'").replace("\u201d", "'").split())
    if len(text) > STATEMENT_CHARS:
        text = cut_at_word(text, STATEMENT_CHARS) + " ..."
    return text


def recall_statements(system_prompt: str, statements: list[str]) -> str:
    """The system prompt with the user's earlier ``statements`` recalled after it."""
    if not statements:
        return system_prompt
    # unquoted: quoted, they set SmolLM2-135M writing quotes ('A: "A: "') in a conversation where it had begun to
    # (bench quality: copied replies 1 -> 7 of 72); a statement without an end mark gets a full stop
    said = " ".join(s if unicodedata.category(s[-1]).startswith("P") else s + "." for s in statements)
    return f"{system_prompt} The user told you earlier: {said}"


def _is_reply(message: Message) -> bool:
    return message["role"] == "assistant" and not message.get("tool_calls")


class History:
    def __init__(
        self,
        max_messages: int,
        replies: HistoryReplies = "all",
        statements: int = 0,
        *,
        follow_ups: FollowUps = "as_said",
    ) -> None:
        """``statements``: how many of the user's earlier statements the system prompt recalls (0: none);
        ``follow_ups``: an English elliptical follow-up is asked "as_said", or as the question it stands for
        (``asked``), with the conversation ("in_full") or without it ("in_full_alone")."""
        self.max_messages = max_messages
        self.replies = replies
        self.statements = statements
        self.follow_ups = follow_ups
        self.messages: list[Message] = []

    def asked(self, user_text: str, language: str | None) -> str:
        """What the LLM is asked for ``user_text``: the words, or with ``follow_ups`` on, an English elliptical
        follow-up as the question it stands for ("And Spain?" after "What is the capital of Italy?": "What is the
        capital of Spain?", ``app.voice.follow_up``). The history keeps the words as said."""
        if self.follow_ups == "as_said" or (language is not None and language != "en"):
            return user_text
        messages = self.messages
        if messages and messages[-1] == {"role": "user", "content": user_text}:
            messages = messages[:-1]  # remembered already (a typed turn, before its reply is made): not its own
        said = [m["content"] for m in messages if m.get("role") == "user" and isinstance(m.get("content"), str)]
        return resolve_in(said, user_text) or user_text

    def earlier_replies(self) -> tuple[str, ...]:
        """The model's replies kept in memory, oldest first, shown in the window or not: what the LLM's DRY reads as
        said before (``ChatLLM.stream``'s ``earlier_replies``), so a reply left out of the prompt is not said again."""
        return tuple(m["content"] for m in self.messages if _is_reply(m) and isinstance(m.get("content"), str))

    def window(self, system_prompt: str, messages: list[Message] | None = None) -> list[Message]:
        """The system prompt and the window of ``messages`` (default: the history) to send, with the replies the
        policy shows, and the system prompt recalling the user's statements kept in memory (``user_statements``).

        Why recall them: SmolLM2-135M, with "My name is Maya." in its window, answers "What is my name?" with
        "What's your name?"; said again in the system prompt, it is read more often
        (app/bench/results/conversation_policy.md: measured, and off by default, it cost other answers). They come
        from the history kept, never from
        the turn being answered, so the prompt prefilled while the user listens (``upcoming_prefix``) is the next
        turn's; but a turn that tells something new changes the system prompt, and so the whole prompt's prefix.
        """
        window = history_window(self.messages if messages is None else messages, self.max_messages)
        if self.statements > 0:
            system_prompt = recall_statements(system_prompt, user_statements(self.messages, self.statements))
        return [{"role": "system", "content": system_prompt}, *shown_replies(window, self.replies)]

    def prompt(
        self,
        system_prompt: str,
        user_text: str | None,
        llm: ChatLLM,
        *,
        context_tokens: int | None,
        reply_tokens: int,
        related: bool = True,
        language: str | None = None,
    ) -> Fitted:
        """The next turn's messages, fitted by tokens into what the LLM can take with its reply (``user_text`` None:
        the history alone, which ends with what the reply answers: the results of the assistant's calls).

        ``related`` False: the words stand alone (``app.voice.reply_factory``), so the conversation is left out
        but for what the system prompt recalls of it; so too for a follow-up asked in full with ``follow_ups``
        "in_full_alone". ``language``: the turn's, where known (``asked``)."""
        asked = None if user_text is None else self.asked(user_text, language)
        if asked != user_text and self.follow_ups == "in_full_alone":
            related = False  # the question in full carries what it took from the conversation
        said = [] if asked is None else [{"role": "user", "content": asked}]
        if related or user_text is None:
            messages = self.window(system_prompt, [*self.messages, *said])
        else:
            messages = [*self.window(system_prompt, []), *said]
        limits = [n for n in (llm.context_tokens, context_tokens) if n]
        if not limits:
            return Fitted(messages)  # a remote server of unknown size: it will say if it is too long

        def count(candidate: list[Message]) -> int:
            return llm.count_tokens(candidate) or estimate_tokens(candidate)

        return fit_to_context(messages, count, max(64, min(limits) - reply_tokens))

    def last_user_words(self) -> str:
        """What the user said last ("" before they said anything)."""
        said = next((m.get("content") for m in reversed(self.messages) if m.get("role") == "user"), "")
        return said if isinstance(said, str) else ""

    def upcoming_prefix(self, system_prompt: str) -> list[Message]:
        """What the next turn's prompt will start with (to prefill while the user listens)."""
        return self.window(system_prompt, [*self.messages, {"role": "user", "content": ""}])[:-1]

    def remember(self, message: Message) -> None:
        """Append, dropping the oldest messages in whole window steps once over the bound.

        A multiple of the window's step keeps ``history_window``'s start where it was, so the
        prompt's prefix (cached by the LLM) does not change when the history is cut.
        """
        self.messages.append(message)
        step = max(2, self.max_messages // 2)
        keep = max(KEPT_MIN, 2 * self.max_messages)
        if len(self.messages) > keep + step:
            del self.messages[: (len(self.messages) - keep) // step * step]

    def forget_failed(self, user_text: str) -> None:
        """A turn that failed leaves no trace, so it cannot fail the next one too."""
        if self.messages and self.messages[-1] == {"role": "user", "content": user_text}:
            self.messages.pop()

    def withdraw(self, user_text: str) -> None:
        """Take the last turn back (its user message, and its reply if recorded): the user went on with it."""
        said = {"role": "user", "content": user_text}
        if len(self.messages) >= 2 and self.messages[-1]["role"] == "assistant" and self.messages[-2] == said:
            self.messages.pop()
        if self.messages and self.messages[-1] == said:
            self.messages.pop()

    def keep_only_heard(self, heard: str, reply_was_recorded: bool, *, withdrawn_if_unheard: bool = False) -> None:
        """An interrupted reply: the history keeps what the user heard of it, not what was written.

        ``withdrawn_if_unheard``: the user stopped it (``cancel``) before hearing any of it, so the turn is taken
        back whole; left in, the request with no answer was answered with the next question (a cancelled story
        went on into the reply to "What planet do we live on?").
        """
        if reply_was_recorded and self.messages and self.messages[-1]["role"] == "assistant":
            self.messages.pop()
        if heard:
            self.messages.append({"role": "assistant", "content": heard})
        elif withdrawn_if_unheard and self.messages and self.messages[-1]["role"] == "user":
            self.messages.pop()

    def clear(self) -> None:
        self.messages.clear()
