"""Durations and moments as a user says them ("an hour and a half", "tomorrow at nine"), parsed on the server.

Why here and not in the model: a 0.5B model copies the user's words well and does arithmetic on time badly,
so the tools take the words and this module turns them into seconds or a datetime, or says it could not
(``SpokenTimeError``, whose message the LLM reads back), never guessing.

How: number words become digits (``text2num``), then
* a duration is a list of amount-unit pairs ("1 hour and 30 minutes", "90 seconds"), with the spoken fractions
  ("half an hour", "an hour and a half", "a quarter of an hour") rewritten first; anything left over fails;
* a moment is relative ("in two hours", "10 minutes from now": a duration after now), or a time of day
  ("at 5 pm", "9:30", "half past 9", "noon", "tonight") on a day ("tomorrow", "next Monday", "December 25",
  read by ``dateparser``; none: today).

The rules where speech is ambiguous (each said back to the user by the tool's result, so a wrong reading is
heard, not hidden):
* a bare hour ("at 9") with no day is the next one of 9:00 and 21:00; on a named day ("tomorrow at nine") 7..11
  are the morning, 12 is noon and 1..6 the afternoon; "morning", "afternoon", "evening", "tonight" decide it;
* a time already past today with no day named ("at 5 pm" at 18:00) rolls to tomorrow; with a day named
  ("today at 5 pm") it is an error, the moment is past;
* a day with no time ("tomorrow", "on Friday") is 09:00 that day ("today" alone asks for a time);
  "morning" 09:00, "afternoon" 15:00, "evening" 18:00, "tonight" 20:00.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta

import dateparser
from text_to_num import alpha2digit

MAX_TEXT_CHARS = 200
WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
MONTHS = (
    "January", "February", "March", "April", "May", "June",
    "July", "August", "September", "October", "November", "December",
)  # fmt: skip
_UNIT_SECONDS = {"second": 1, "minute": 60, "hour": 3600, "day": 86400, "week": 604800}
_UNIT_WORDS = {
    "second": ("s", "sec", "secs", "second", "seconds"),
    "minute": ("m", "min", "mins", "minute", "minutes"),
    "hour": ("h", "hr", "hrs", "hour", "hours"),
    "day": ("d", "day", "days"),
    "week": ("w", "wk", "wks", "week", "weeks"),
}
_UNIT_OF_WORD = {word: unit for unit, words in _UNIT_WORDS.items() for word in words}
_UNIT = "(?:" + "|".join(sorted(_UNIT_OF_WORD, key=len, reverse=True)) + ")"
_NUMBER = r"\d+(?:\.\d+)?"
_PERIOD_HOURS = {"morning": 9, "afternoon": 15, "evening": 18, "tonight": 20, "night": 20}
_DAY_WORDS = re.compile(
    r"\b(?:today|tomorrow|days?|weeks?|months?|years?|next|this|"
    + "|".join(w.lower() for w in (*WEEKDAYS, *MONTHS))
    + "|"
    + "|".join(w[:3].lower() for w in (*WEEKDAYS, *MONTHS))
    + r")\b|\d{1,4}[/-]\d{1,2}"
)


class SpokenTimeError(ValueError):
    """What could not be understood, in words the LLM can read back to the user."""


# ---------------------------------------------------------------- words to digits
def _digits(text: str) -> str:
    """Lower case, one space between words, number words as digits ("ten" -> "10").

    "second" is kept from text2num, which reads it as the ordinal "2nd"."""
    text = re.sub(r"(?<=[a-z])-(?=[a-z])", " ", " ".join(text.lower().split())).strip(" .,!?")
    text = re.sub(r"\bseconds\b", "secs", re.sub(r"\bsecond\b", "sec", text))
    return alpha2digit(text, "en", threshold=0) if text else text


def as_digits(text: str) -> str:
    """``text`` lower case, with its number words as digits ("Nine" -> "9")."""
    return _digits(text)


def _checked(text: object, what: str) -> str:
    if not isinstance(text, str) or not text.strip():
        raise SpokenTimeError(f"I need the {what} in words, like 'ten minutes'")
    if len(text) > MAX_TEXT_CHARS:
        raise SpokenTimeError(f"the {what} is too long")
    return text


# ---------------------------------------------------------------- durations
def _spoken_fractions(text: str) -> str:
    """ "half an hour" -> "0.5 hour", "1 hour and a half" -> "1.5 hour", "a minute" -> "1 minute"."""
    unit = rf"({_UNIT})"
    text = re.sub(r"\ba couple of\b", "2", text)
    text = re.sub(rf"\b(\d+) and a half {unit}\b", lambda m: f"{int(m[1]) + 0.5} {m[2]}", text)
    text = re.sub(rf"\b(?:an?|1) {unit} and a half\b", r"1.5 \1", text)
    text = re.sub(rf"\b(\d+) {unit} and a half\b", lambda m: f"{int(m[1]) + 0.5} {m[2]}", text)
    text = re.sub(rf"\b(?:an? |1 )?half (?:an? )?{unit}\b", r"0.5 \1", text)
    text = re.sub(r"\b(\d+) quarters? of an? hour\b", lambda m: f"{int(m[1]) * 0.25} hour", text)
    text = re.sub(r"\b(?:a |1 )?quarter (?:of )?(?:an? )?hour\b", "0.25 hour", text)
    return re.sub(rf"\b(?:an?|1) {unit}\b", r"1 \1", text)


def duration_seconds(text: str) -> float | None:
    """Seconds in ``text`` when it is a duration and nothing else ("10 minutes", "an hour and a half"), else None."""
    text = _spoken_fractions(_digits(text))
    text = re.sub(r"^(?:for|in|after) ", "", text)
    text = re.sub(r" (?:from now|later|long|timer)$", "", text)
    pair = re.compile(rf"(?:\s*(?:,|and))*\s*({_NUMBER})\s*({_UNIT})(?=[\d\s,]|$)")
    position, seconds, found = 0, 0.0, False
    while position < len(text):
        match = pair.match(text, position)
        if match is None:
            return None
        seconds += float(match[1]) * _UNIT_SECONDS[_UNIT_OF_WORD[match[2]]]
        position, found = match.end(), True
    return seconds if found else None


# Words an argument may add to what the user said without changing it ("at", "the"), and words a model copies in
# from a tool's description or its own habit that the user's sentence need not hold ("pm" for "in the evening").
_FREE_WORDS = frozenset("a an the at on in of for to my me by this that is am pm o'clock".split())


def words_heard(argument: str, heard: str, share: float = 1.0) -> bool:
    """Whether at least ``share`` of ``argument``'s words (numbers as digits, small words left out) are among the
    words of ``heard``, the user's sentence: an action's argument must come from what the user said (a small model
    filled a reminder with its description's example, "call mom", when asked to water the plants)."""
    said = set(clock_as_said(_digits(heard[: MAX_TEXT_CHARS * 4])).replace(",", " ").split())
    words = [w for w in clock_as_said(_digits(argument)).replace(",", " ").split() if w not in _FREE_WORDS]
    return not words or sum(w in said for w in words) >= share * len(words)


def clock_as_said(text: str) -> str:
    """A time on the hour as the hour alone, without a leading zero: "09:00" and "9:00" are the "9" the user said
    (the default brain wrote "tomorrow at 09:00" for "tomorrow at nine", and the reminder was refused)."""
    return re.sub(r"\b0?(\d{1,2}):00\b", r"\1", text)


def said_durations(words: str) -> set[float]:
    """The seconds of each duration said anywhere in ``words`` (a user's sentence), and of all of them together."""
    text = _spoken_fractions(_digits(words[: MAX_TEXT_CHARS * 4]))
    found = [float(m[1]) * _UNIT_SECONDS[_UNIT_OF_WORD[m[2]]] for m in re.finditer(rf"({_NUMBER})\s*({_UNIT})\b", text)]
    return {*found, sum(found)} if found else set()


def parse_duration(text: str, *, min_seconds: float = 1, max_seconds: float = 7 * 86400) -> float:
    """The seconds ``text`` says, within bounds; SpokenTimeError says why not."""
    text = _checked(text, "duration")
    seconds = duration_seconds(text)
    if seconds is None:
        raise SpokenTimeError(f"I could not understand the duration '{text}' (say it like 'ten minutes')")
    if not min_seconds <= seconds <= max_seconds:
        limits = f"{describe_duration(min_seconds)} and {describe_duration(max_seconds)}"
        raise SpokenTimeError(f"'{text}' is {describe_duration(seconds)}: it must be between {limits}")
    return seconds


def describe_duration(seconds: float) -> str:
    """ "1 hour 30 minutes", "45 seconds", "2 days": what a duration is, spoken, to the second."""
    seconds = round(seconds)
    parts = []
    for unit in ("day", "hour", "minute", "second"):
        amount, seconds = divmod(seconds, _UNIT_SECONDS[unit])
        if amount:
            parts.append(f"{amount} {unit}{'s' if amount != 1 else ''}")
    return " ".join(parts) or "0 seconds"


# ---------------------------------------------------------------- moments
@dataclass(frozen=True)
class _TimeOfDay:
    hour: int
    minute: int
    meridiem: str | None  # "am", "pm", or None: not said


def _clock_time(hour: str | int, minute: str | int = 0, meridiem: str | None = None) -> _TimeOfDay:
    hour, minute = int(hour), int(minute)
    if minute > 59 or hour > 23 or (meridiem and not 1 <= hour <= 12):
        raise SpokenTimeError(f"{hour}:{minute:02d}{' ' + meridiem if meridiem else ''} is not a time of day")
    return _TimeOfDay(hour, minute, meridiem)


def _relative_time(amount: str, relation: str, hour: str, meridiem: str | None) -> _TimeOfDay:
    """ "half past 9" -> 9:30, "quarter to 9" -> 8:45, "10 to 9" -> 8:50."""
    minutes = {"half": 30, "quarter": 15}.get(amount) or int(amount)
    if not 1 <= minutes <= 30 or (relation in ("to", "before") and amount == "half"):
        raise SpokenTimeError(f"I could not understand '{amount} {relation} {hour}'")
    if relation in ("past", "after"):
        return _clock_time(hour, minutes, meridiem)
    if int(hour) > 12 or (int(hour) == 0 and not meridiem):  # "quarter to 18:00" -> 17:45, "to 0" -> 23:45
        return _clock_time((int(hour) - 1) % 24, 60 - minutes)
    return _clock_time((int(hour) - 1) % 12 or 12, 60 - minutes, meridiem)


_TIME_PATTERNS: tuple[tuple[re.Pattern[str], Callable[[re.Match[str]], _TimeOfDay]], ...] = (
    (re.compile(r"\b(?:at )?(?:12 )?(noon|midday)\b"), lambda m: _TimeOfDay(12, 0, "pm")),
    (
        re.compile(r"\b(half|quarter|\d{1,2}) (past|after|to|before) (\d{1,2})\b\s*(am|pm)?"),
        lambda m: _relative_time(*m.groups()),
    ),
    (re.compile(r"\b(\d{1,2})[:.](\d{2})\s*(am|pm)?\b"), lambda m: _clock_time(*m.groups())),
    (re.compile(r"(?:\bat |^)(\d{1,2}) (\d{2})\b\s*(am|pm)?"), lambda m: _clock_time(*m.groups())),
    (re.compile(r"\b(\d{1,2}) (\d{2})\s*(am|pm)\b"), lambda m: _clock_time(*m.groups())),
    (re.compile(r"\b(\d{1,2})\s*(am|pm)\b"), lambda m: _clock_time(m[1], 0, m[2])),
    (re.compile(r"\bat (\d{1,2})\b(?![/-])"), lambda m: _clock_time(m[1])),
)


def _take_time(text: str) -> tuple[_TimeOfDay | None, str]:
    """The time of day said in ``text``, and the rest of it (the day)."""
    text = re.sub(r"(?<![a-z])([ap])\.?m\.?(?=\s|$)", r"\1m", text)
    text = re.sub(r"\b(?:at )?(\d{1,2}) ?o ?'? ?clock\b", r"at \1", text)
    for pattern, make in _TIME_PATTERNS:
        match = pattern.search(text)
        if match:
            return make(match), (text[: match.start()] + " " + text[match.end() :]).strip()
    return None, text


def _take_period(text: str) -> tuple[str | None, str]:
    """ "tomorrow morning" -> ("morning", "tomorrow"); "tonight" -> ("tonight", "today")."""
    match = re.search(r"\b(?:in the |this |at )?(morning|afternoon|evening|tonight|night)\b", text)
    if not match:
        return None, text
    rest = (text[: match.start()] + " " + text[match.end() :]).strip()
    if match[1] == "tonight" or match[0].startswith("this "):
        rest = (rest + " today").strip()
    return match[1], rest


def _day(text: str, now: datetime) -> date | None:
    """The day ``text`` names (None: none named); SpokenTimeError when it names none that we can read."""
    text = re.sub(r"^(?:on|at|,)\s+|\s+(?:at|on|,)$", "", text.strip(" ,")).strip()
    if text in ("", "at", "on"):
        return None
    if text == "today":
        return now.date()
    ordinal = re.fullmatch(r"(?:the )?(\d{1,2})(?:st|nd|rd|th)", text)
    if ordinal:  # "the 3rd": this month's, else next month's (dateparser reads a bare "3rd" as March)
        return _next_day_of_month(int(ordinal[1]), now.date())
    parsed = None
    if _DAY_WORDS.search(text) and not _bare_number(text):
        settings = {"RELATIVE_BASE": now.replace(tzinfo=None), "PREFER_DATES_FROM": "future"}
        parsed = dateparser.parse(text, languages=["en"], settings=settings)
    if parsed is None:
        raise SpokenTimeError(f"I could not understand the day '{text}'")
    return parsed.date()


def _bare_number(text: str) -> bool:
    """Whether ``text`` has a number that is no day of a month, date or count of days ("tomorrow 9"): dateparser
    would drop it or read it as a month, so the day is not understood rather than guessed."""
    undated = _without_dated(text)
    return (
        re.search(r"(?<![\d/-])\d{1,2}(?![\d/-]|st|nd|rd|th| (?:days?|weeks?|months?|years?)\b)", undated) is not None
    )


def _without_dated(text: str) -> str:
    """``text`` without the day numbers that a month name dates ("december 25", "25 december 2027")."""
    months = "|".join(m.lower()[:3] + r"[a-z]*" for m in MONTHS)
    return re.sub(rf"\b(?:\d{{1,2}} (?:{months})|(?:{months}) \d{{1,2}})\b( \d{{4}})?", " ", text)


def _next_day_of_month(day: int, today: date) -> date:
    year, month = today.year, today.month
    for _ in range(13):
        try:
            candidate = date(year, month, day)
        except ValueError:
            candidate = None
        if candidate and candidate >= today:
            return candidate
        year, month = (year + 1, 1) if month == 12 else (year, month + 1)
    raise SpokenTimeError(f"there is no day {day} in a month")


def _hour_on_named_day(said: _TimeOfDay, period: str | None) -> int:
    if said.meridiem == "am" or period == "morning":
        return said.hour % 12
    if said.meridiem == "pm" or period in ("afternoon", "evening", "tonight", "night"):
        return said.hour % 12 + 12
    if said.hour == 0 or said.hour > 12:
        return said.hour
    return said.hour if 7 <= said.hour <= 12 else said.hour + 12


def parse_when(text: str, now: datetime, *, max_ahead: timedelta = timedelta(days=366)) -> datetime:
    """The moment ``text`` says, after ``now`` and at most ``max_ahead`` later, in ``now``'s timezone.

    See the module's doc for the rules where speech is ambiguous; SpokenTimeError says what was not understood.
    """
    text = _checked(text, "time")
    normal = _digits(text)
    relative = re.fullmatch(r"(?:in|after) (.+)|(.+) (?:from now|later)", normal)
    seconds = duration_seconds(relative[1] or relative[2]) if relative else duration_seconds(normal)
    if seconds is not None:  # real time: across a daylight-saving change "in 2 hours" is two hours, not on the dial
        moment = (now.astimezone(UTC) + timedelta(seconds=seconds)).astimezone(now.tzinfo)
    else:
        moment = _moment(text, normal, now)
    if moment <= now:
        raise SpokenTimeError(f"'{text}' is already past (it is {now:%H:%M} now)")
    if moment - now > max_ahead:
        raise SpokenTimeError(f"'{text}' is too far ahead (at most {max_ahead.days} days)")
    return moment


def _moment(text: str, normal: str, now: datetime) -> datetime:
    said, rest = _take_time(normal)
    midnight = re.search(r"\bmidnight\b", rest)
    if midnight:
        said, rest = _TimeOfDay(0, 0, None), (rest[: midnight.start()] + rest[midnight.end() :]).strip()
    period, rest = _take_period(rest)
    try:
        day = _day(rest, now)
    except SpokenTimeError:
        raise SpokenTimeError(f"I could not understand the time '{text}' (say it like 'tomorrow at 9 am')") from None
    if said is None and period:
        said = _TimeOfDay(_PERIOD_HOURS[period], 0, None)
    if said is None:
        if day is None or day == now.date():
            raise SpokenTimeError(f"I could not understand the time '{text}' (say it like 'tomorrow at 9 am')")
        said = _TimeOfDay(9, 0, "am")
    if midnight and said.hour == 0:  # "midnight" ends the day it is on: tonight's midnight is tomorrow 00:00
        return datetime.combine((day or now.date()) + timedelta(days=1), time(0, 0), now.tzinfo)
    if day is not None:
        return datetime.combine(day, time(_hour_on_named_day(said, period), said.minute), now.tzinfo)
    return _next_of(said, period, now)


def _next_of(said: _TimeOfDay, period: str | None, now: datetime) -> datetime:
    """The next moment at ``said`` when no day is named: today's if still ahead, else tomorrow's."""
    if said.meridiem or period or said.hour == 0 or said.hour > 12:
        hours = [_hour_on_named_day(said, period)]
    else:  # "at 9": 9:00 or 21:00, whichever comes first
        hours = [said.hour % 12, said.hour % 12 + 12]
    for day in (now.date(), now.date() + timedelta(days=1)):
        for hour in hours:
            candidate = datetime.combine(day, time(hour, said.minute), now.tzinfo)
            if candidate > now:
                return candidate
    raise AssertionError("a time of day comes again within a day")


def describe_moment(moment: datetime, now: datetime) -> str:
    """ "today at 14:32", "tomorrow at 09:00", "Friday at 15:00", "Friday 25 December at 08:00": when, spoken
    (a past one too: "yesterday at 09:00", a missed reminder's)."""
    days = (moment.date() - now.date()).days
    at = f"at {moment:%H:%M}"
    if days == 0:
        return f"today {at}"
    if days == 1:
        return f"tomorrow {at}"
    if days == -1:
        return f"yesterday {at}"
    weekday = WEEKDAYS[moment.weekday()]
    if 1 < days < 7:
        return f"{weekday} {at}"
    year = f" {moment.year}" if moment.year != now.year else ""
    return f"{weekday} {moment.day} {MONTHS[moment.month - 1]}{year} {at}"
