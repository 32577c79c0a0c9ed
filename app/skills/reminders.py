"""The ``reminders`` skill: ``set_reminder``, ``list_reminders``, ``cancel_reminder``, kept in SQLite so that a
restart loses none.

Where a due reminder is said: in the conversation that set it when that one is open, else in any open one (the
assistant is one user's: the conversation ids of before a restart never come back), else it waits, missed, and
is said when a conversation opens (``opened``). Each is said once: it is marked announced in the database by a
conditional update, so two passes (or two skill objects over one file) cannot both say it.

Which conversations are open is told by the session: ``opened(owner)`` when one starts and ``close(owner)``
when it ends. ``tools(owner)`` registers nothing: making a conversation's tools is not opening it.

Why one connection and a lock: sync tools run on worker threads and the due loop on the event loop; the store's
queries are small (at most ``MAX_REMINDERS`` rows waiting), so holding the lock for one is short.
"""

from __future__ import annotations

import difflib
import logging
import re
import sqlite3
import threading
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from app.skills.base import ServerTool, SkillOwner, WallClock
from app.skills.clock import DueLoop
from app.skills.spoken_time import (
    SpokenTimeError,
    as_digits,
    clock_as_said,
    describe_moment,
    parse_when,
    words_heard,
)

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
MAX_REMINDERS = 500  # waiting to be said, all conversations together
MAX_TEXT_CHARS = 200
MAX_AHEAD = timedelta(days=366)
LATE_AFTER = timedelta(minutes=2)  # said later than this after its time, a reminder says when it was due
KEEP_ANNOUNCED = timedelta(days=30)  # said reminders are kept this long (a record), then pruned on open
LISTED = 10  # list_reminders names at most this many (a small model reads the result)

_SCHEMA = """
CREATE TABLE reminders (
    id INTEGER PRIMARY KEY,
    text TEXT NOT NULL,
    due_at REAL NOT NULL,          -- POSIX seconds
    created_at REAL NOT NULL,
    conversation_id TEXT NOT NULL, -- the conversation that set it: it is said there when that one is open
    announced_at REAL              -- NULL until said
);
CREATE INDEX reminders_waiting ON reminders (announced_at, due_at);
"""


@dataclass(frozen=True)
class Reminder:
    id: int
    text: str
    due_at: datetime  # UTC
    conversation_id: str


class StoreFull(Exception):
    pass


class ReminderStore:
    """The reminders' SQLite file: created with its folder, its schema versioned by ``PRAGMA user_version``."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=5.0)
        with self._lock:
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                self._db.close()
                raise RuntimeError(f"{path}: reminders schema {version} is newer than this server's {SCHEMA_VERSION}")
            if version == 0:
                self._db.executescript(f"BEGIN; {_SCHEMA} PRAGMA user_version = {SCHEMA_VERSION}; COMMIT;")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def add(self, text: str, due_at: datetime, conversation_id: str, now: datetime, limit: int) -> int:
        """The new reminder's id; StoreFull when ``limit`` reminders already wait."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                waiting = self._db.execute("SELECT count(*) FROM reminders WHERE announced_at IS NULL").fetchone()[0]
                if waiting >= limit:
                    raise StoreFull
                cursor = self._db.execute(
                    "INSERT INTO reminders (text, due_at, created_at, conversation_id) VALUES (?, ?, ?, ?)",
                    (text, due_at.timestamp(), now.timestamp(), conversation_id),
                )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            return int(cursor.lastrowid or 0)

    def waiting(self, due_by: datetime | None = None) -> list[Reminder]:
        """The reminders not yet said, soonest first; only those due by ``due_by`` when given."""
        query = "SELECT id, text, due_at, conversation_id FROM reminders WHERE announced_at IS NULL"
        parameters: tuple[float, ...] = ()
        if due_by is not None:
            query, parameters = query + " AND due_at <= ?", (due_by.timestamp(),)
        with self._lock:
            rows = self._db.execute(query + " ORDER BY due_at, id", parameters).fetchall()
        return [Reminder(row[0], row[1], datetime.fromtimestamp(row[2], UTC), row[3]) for row in rows]

    def next_due_after(self, now: datetime) -> datetime | None:
        with self._lock:
            row = self._db.execute(
                "SELECT min(due_at) FROM reminders WHERE announced_at IS NULL AND due_at > ?", (now.timestamp(),)
            ).fetchone()
        return None if row[0] is None else datetime.fromtimestamp(row[0], UTC)

    def mark_announced(self, reminder_id: int, now: datetime) -> bool:
        """Whether this call marked it (False: it was said already, or cancelled)."""
        with self._lock:
            cursor = self._db.execute(
                "UPDATE reminders SET announced_at = ? WHERE id = ? AND announced_at IS NULL",
                (now.timestamp(), reminder_id),
            )
        return cursor.rowcount == 1

    def delete(self, reminder_id: int) -> bool:
        with self._lock:
            cursor = self._db.execute("DELETE FROM reminders WHERE id = ? AND announced_at IS NULL", (reminder_id,))
        return cursor.rowcount == 1

    def prune(self, before: datetime) -> None:
        """Forget reminders said before ``before``."""
        with self._lock:
            self._db.execute("DELETE FROM reminders WHERE announced_at < ?", (before.timestamp(),))


def _text(arguments: dict[str, Any]) -> str:
    text = arguments.get("text") or ""
    if not isinstance(text, str):
        raise SpokenTimeError("the reminder's text must be words")
    text = re.sub(r"^(?:remind me\s+)?(?:to\s+)?", "", " ".join(text.split()), flags=re.IGNORECASE).rstrip(" .")
    when = arguments.get("when")
    if isinstance(when, str):  # "call mom tomorrow at nine" with "tomorrow at nine": the time is said apart
        said_when = {*clock_as_said(as_digits(when)).split(), "at", "on", "in", "by"}
        words = text.split()
        while len(words) > 1 and clock_as_said(as_digits(words[-1]).strip(" .,")) in said_when:
            words.pop()
        text = " ".join(words)
    if text[:1].isupper() and text[1:2].islower() and not text.startswith("I "):
        text = text[0].lower() + text[1:]  # said after "remind you to"
    if len(text) > MAX_TEXT_CHARS:
        raise SpokenTimeError(f"the reminder's text is too long (at most {MAX_TEXT_CHARS} characters)")
    return text


class ReminderSkill:
    """Reminders in the SQLite file ``path`` over an injected wall clock. ``fire_due(now)`` says what is due
    (tests call it with a fake time); ``start()`` runs a ``DueLoop`` that calls it at each deadline; ``stop()``
    ends it and closes the file (the skill is done after it)."""

    name = "reminders"

    def __init__(self, clock: WallClock, path: Path, *, max_reminders: int = MAX_REMINDERS) -> None:
        self._clock, self._max_reminders = clock, max_reminders
        self._store = ReminderStore(path)
        self._store.prune(clock.now() - KEEP_ANNOUNCED)
        self._open: dict[str, SkillOwner] = {}  # in the order they opened
        self._open_lock = threading.Lock()
        self._loop = DueLoop(clock, self.next_due, self.fire_due)

    # ------------------------------------------------------------ the skill
    def tools(self, owner: SkillOwner) -> tuple[ServerTool, ...]:
        text = {"type": "string", "description": "What to remind the user of, in the user's words."}
        when = {"type": "string", "description": "When, in the user's words."}
        return (
            ServerTool(
                "set_reminder",
                lambda arguments: self.set_reminder(owner, arguments),
                "Remind the user of something at a time.",
                {"type": "object", "properties": {"text": text, "when": when}, "required": ["text", "when"]},
            ),
            ServerTool("list_reminders", lambda arguments: self.list_reminders(), "List the reminders."),
            ServerTool(
                "cancel_reminder",
                lambda arguments: self.cancel_reminder(arguments),
                "Cancel a reminder.",
                {"type": "object", "properties": {"text": text}, "required": ["text"]},
            ),
        )

    def opened(self, owner: SkillOwner) -> None:
        """A conversation started: due reminders may be said in it, and the missed ones are, now. On the loop."""
        with self._open_lock:
            self._open[owner.conversation_id] = owner
        self.fire_due(self._clock.now())

    def close(self, owner: SkillOwner) -> None:
        """The conversation ended: its reminders stay (they are said elsewhere, or later)."""
        with self._open_lock:
            self._open.pop(owner.conversation_id, None)

    async def start(self) -> None:
        await self._loop.start()

    async def stop(self) -> None:
        await self._loop.stop()
        self._store.close()

    # ------------------------------------------------------------ the tools
    def set_reminder(self, owner: SkillOwner, arguments: dict[str, Any]) -> dict[str, str]:
        now = self._clock.now()
        try:
            text = _text(arguments)
            if not text:
                return {"error": "what should I remind you of?"}
            due_at = parse_when(arguments.get("when", ""), now, max_ahead=MAX_AHEAD)
            heard = owner.heard()
            if heard and not (words_heard(text, heard, 0.5) and words_heard(arguments["when"], heard)):
                log.info("set_reminder refused: %r at %r is not in the words heard", text, arguments["when"])
                return {
                    "error": "not what the user said",
                    "say": "Sorry, I did not catch what to remind you of, or when.",
                }
            self._store.add(text, due_at, owner.conversation_id, now, self._max_reminders)
        except SpokenTimeError as error:
            return {"error": str(error)}
        except StoreFull:
            return {"error": f"there are already {self._max_reminders} reminders; cancel some first"}
        self._loop.wake()
        when = describe_moment(due_at, now)
        return {"set": "a reminder", "text": text, "when": when, "say": f"I will remind you to {text} {when}."}

    def list_reminders(self) -> dict[str, Any]:
        now = self._clock.now()
        waiting = self._store.waiting()
        if not waiting:
            return {"reminders": [], "say": "You have no reminders."}
        listed = [{"text": r.text, "when": describe_moment(r.due_at.astimezone(now.tzinfo), now)} for r in waiting]
        said = "; ".join(f"to {r['text']} {r['when']}" for r in listed[:LISTED])
        result: dict[str, Any] = {"reminders": listed[:LISTED], "say": f"You have reminders {said}."}
        if len(listed) > LISTED:
            result["more"] = len(listed) - LISTED
            result["say"] += f" And {len(listed) - LISTED} more."
        return result

    def cancel_reminder(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """The reminder whose text is closest to ``text``; with no text, the only one there is."""
        try:
            text = _text(arguments)
        except SpokenTimeError as error:
            return {"error": str(error)}
        waiting = self._store.waiting()
        if not waiting:
            return {"error": "there are no reminders"}
        chosen = _closest(text, waiting) if text else (waiting[0] if len(waiting) == 1 else None)
        if chosen is None:
            return {"error": f"no reminder matches '{text}'", "reminders": [r.text for r in waiting[:LISTED]]}
        if not self._store.delete(chosen.id):
            return {"error": f"the reminder '{chosen.text}' was already said"}
        self._loop.wake()
        now = self._clock.now()
        was_due = describe_moment(chosen.due_at.astimezone(now.tzinfo), now)
        return {"cancelled": chosen.text, "was_due": was_due, "say": f"I cancelled the reminder to {chosen.text}."}

    # ------------------------------------------------------------ saying them
    def next_due(self, now: datetime) -> datetime | None:
        """The next deadline to wake for: overdue ones wait for a conversation to open, not for the loop."""
        return self._store.next_due_after(now)

    def fire_due(self, now: datetime) -> int:
        """Say every reminder due by ``now`` where a conversation is open, each once; how many were said."""
        said = 0
        for reminder in self._store.waiting(due_by=now):
            with self._open_lock:
                owner = self._open.get(reminder.conversation_id) or next(reversed(self._open.values()), None)
            if owner is None:
                break  # missed: said when a conversation opens
            if not self._store.mark_announced(reminder.id, now):
                continue
            try:
                owner.announce("reminder", self._spoken(reminder, now))
                said += 1
            except Exception:  # one conversation's failure must not silence the other reminders
                log.exception("reminder %s: the announcement failed", reminder.id)
        return said

    @staticmethod
    def _spoken(reminder: Reminder, now: datetime) -> str:
        if now - reminder.due_at <= LATE_AFTER:
            return f"Reminder: {reminder.text}."
        return (
            f"You missed a reminder, {describe_moment(reminder.due_at.astimezone(now.tzinfo), now)}: {reminder.text}."
        )


_FILLER_WORDS = frozenset({"a", "an", "the", "my", "to", "of", "for", "me", "reminder", "remind", "about"})


def _words(text: str) -> set[str]:
    return set(re.findall(r"\w+", text)) - _FILLER_WORDS


def _closest(text: str, waiting: list[Reminder]) -> Reminder | None:
    """The reminder whose text is ``text``, contains it (or is in it), or is most like it: by the share of the
    words asked for that it has ("the milk" -> "buy milk"), or by its letters (a misheard word); the soonest
    among equals. None when none is much like it (a wrong reminder cancelled would be worse than asking)."""
    wanted = text.casefold()

    def likeness(reminder: Reminder) -> float:
        have = reminder.text.casefold()
        if have == wanted:
            return 3.0
        if wanted in have or have in wanted:
            return 2.0
        words = _words(wanted)
        shared = len(words & _words(have)) / len(words) if words else 0.0
        return max(shared, difflib.SequenceMatcher(None, wanted, have).ratio())

    best = max(waiting, key=likeness)  # max keeps the first (the soonest) of equals
    return best if likeness(best) >= 0.6 else None
