"""An elliptical follow-up ("And Spain?", "What about a duck?") made a question of its own, from the question before it.

Why: SmolLM2-135M reads "And what about Spain?" after "What is the capital of Italy?" as a question about Italy's
answer ("The capital of Spain is Spain."), and "And snow?" after the sky's colour answers with the sky; asked in
full, it answers most such questions right (``parley bench quality``: follow-ups 2/8 in conversation, 6/8 asked in
full). Rewriting the follow-up into the question it stands for is what conversational search calls query rewriting;
a small model cannot be asked to do it, so this is a rule over English word forms, conservative by design: the
follow-up's phrase takes the place of the phrase of the same kind in the question before it, and where the words
are not such a follow-up, or no such place is found, there is no rewrite (None) and the words are sent as said.

The places, tried in order (``_place``):

* a phrase that opens with a preposition ("in French") replaces the question's phrase with the same preposition
  ("How do you say hello in Spanish?");
* a number or a time ("two loaves", "Friday") replaces the question's of the same kind ("one loaf", "tomorrow");
* a name ("Spain", "New York") replaces the question's name, a run of capitalised words not at its start (where
  it has one only: "Who wrote Pride and Prejudice?" has two);
* a phrase that opens with one of the question's words ("rugby league") replaces as many words from there;
* a possessive ("the Nile's") replaces the question's possessive ("the Amazon's");
* a phrase with a determiner ("a duck", "the moon") replaces the question's noun phrase that shares most words with
  it ("a baby dog" for "a baby cat"), a name's for a name ("the Andes" for "the Alps"), else its first one;
* a bare word or phrase ("snow", "happy") replaces what ends the question after "of" ("the opposite of big"),
  what "how many" counts, the subject between a wh-question's auxiliary and its verb ("What do pandas eat?"), or
  the noun phrase a wh-question asks about with "is" ("What colour is the sky on a clear day?"); in a yes/no
  question nothing ("Is the soup gluten-free?": the soup, or gluten-free?).

A noun phrase is a determiner and the words after it up to a function word or the question's end (across "of":
"a group of lions"; not past a participle: "the Louvre | closed on Tuesdays"), less a last word that is the
question's verb: after "does"/"can"/... ("How many legs does a spider have?") or a participle ("What is a baby cat
called?").
"""

from __future__ import annotations

import re

MAX_PHRASE_WORDS = 4  # a follow-up's phrase longer than this is a question of its own
MAX_CHARS = 200  # words longer than this are not read (a follow-up is short; the patterns stay cheap)
MAX_CHAIN = 3  # follow-ups of follow-ups resolved back this far ("And Spain?" "And Germany?")

# "and what about X", "what about X", "how about X", "and X"; the bare "and X" only with a question mark
_ABOUT = re.compile(r"^(?:(?:and|but|so|ok(?:ay)?|then)[,\s]+)?(?:what|how)\s+about\s+(?P<phrase>.+?)\s*[?.!]*$", re.I)
_AND = re.compile(r"^(?:and|but)[,\s]+(?P<phrase>.+?)\s*\?+$", re.I)
_WORD = re.compile(r"^[^\W_][\w'’-]*$")

DETERMINERS = frozenset("a an the this that these those my your his her its our their some any every each".split())
PREPOSITIONS = frozenset(
    "of in on at for with to from by about into onto like than under over after before during without until since "
    "between near across through around inside outside behind within towards toward per against among".split()
)
# words that end a noun phrase, and that a follow-up's phrase is not (besides determiners and prepositions)
_AUXILIARIES = frozenset(
    "is are was were be been being do does did have has had can could will would shall should may might must".split()
)
_DO_OR_MODAL = frozenset("do does did can could will would shall should may might must".split())
_FUNCTION = frozenset(
    "and or but not if so then when where what which who whom whose why how there here very too also".split()
)
_PRONOUNS = frozenset(
    "i me my mine you your yours he him his she her hers it its we us our they them their this that these those "
    "one ones something anything nothing everything someone anyone".split()
)
# what a follow-up's phrase is never: words that ask or react, not a thing to ask the same about
_NOT_A_THING = (
    _AUXILIARIES
    | _FUNCTION
    | _PRONOUNS
    | frozenset("yes no ok okay thanks thank please sorry again more else why really well now later".split())
)
_PARTICIPLES = frozenset(
    "called named known made said done seen found born given taken written spoken used eaten grown worn "
    "built sung kept held meant".split()
)
_WH = frozenset("what which who where when why how".split())
_BE = frozenset("is are was were".split())
_PARTICLES = frozenset("out up down off away back".split())  # "come out", "give up": after a verb
_NUMBER = re.compile(r"^\d+(?:[.,]\d+)?(?:st|nd|rd|th)?$")
_NUMBER_WORDS = frozenset(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen twenty thirty forty fifty sixty seventy eighty ninety hundred thousand million".split()
)
_TIME_WORDS = frozenset(
    "today tomorrow tonight yesterday weekend monday tuesday wednesday thursday friday saturday sunday january "
    "february march april may june july august september october november december spring summer autumn fall "
    "winter".split()
)
_STOPS = DETERMINERS | PREPOSITIONS | _AUXILIARIES | _FUNCTION | _PARTICLES


def follow_up_phrase(text: str) -> str | None:
    """The phrase an elliptical follow-up asks about ("Spain" of "And what about Spain?"); None when ``text`` is
    not one: too long, or its phrase is a pronoun, a question word, a verb or a reaction ("What about you?",
    "And then?", "And is it far?")."""
    text = " ".join(text.split())
    if len(text) > MAX_CHARS:
        return None
    match = _ABOUT.match(text) or _AND.match(text)
    if match is None:
        return None
    words = match["phrase"].rstrip(",;:").split()
    if not 1 <= len(words) <= MAX_PHRASE_WORDS or not all(_WORD.match(word) for word in words):
        return None
    lower = [word.lower() for word in words]
    opens_a_noun_phrase = lower[0] in DETERMINERS and len(words) > 1  # "my hamster", not "that"
    stem = re.split(r"['’]", lower[0])[0]  # "what's", "it's": what they contract
    if (stem in _NOT_A_THING and not opens_a_noun_phrase) or lower[-1] in _STOPS or lower[-1] in _NOT_A_THING:
        return None
    if lower[0] in PREPOSITIONS and len(words) < 2:
        return None
    return " ".join(words)


def resolve(previous_question: str, follow_up: str) -> str | None:
    """``follow_up`` as the question ``previous_question`` asks, with its phrase in place; None when it is not an
    elliptical follow-up, ``previous_question`` not a question, or no place for the phrase is found."""
    phrase = follow_up_phrase(follow_up)
    question = " ".join(previous_question.split())
    if phrase is None or not question.endswith("?") or len(question) > MAX_CHARS:
        return None
    words = question.rstrip("?").rstrip().split()
    if len(words) < 3 or not all(_WORD.match(word) for word in words):
        return None  # commas, quotes and the like: not a question this rule reads safely
    span = _place(words, phrase.split())
    if span is None:
        return None
    start, end = span
    said = phrase.split()
    if start > 0 and said[0][0].isupper() and said[0].lower() in DETERMINERS | PREPOSITIONS:
        said[0] = said[0].lower()  # "What about The moon" mid-question
    return " ".join([*words[:start], *said, *words[end:]]) + "?"


def _place(words: list[str], phrase: list[str]) -> tuple[int, int] | None:
    """Where in the question's ``words`` the follow-up's ``phrase`` goes: (start, end) of what it replaces."""
    lower = [word.lower() for word in words]
    first = phrase[0].lower()
    if first in PREPOSITIONS:
        for start in range(len(words) - 1, 0, -1):
            if lower[start] == first:
                object_end = _phrase_end(words, start + 1)
                return (start, object_end) if object_end > start + 1 else None
        return None
    if (kind := _kind(first)) is not None:
        same = [index for index in range(1, len(lower)) if _kind(lower[index]) == kind]
        if same:  # "Friday" for "tomorrow"; "two loaves" for "one loaf", "6 feet 2" for "5 feet 10 inches"
            return (same[-1], same[-1] + 1) if len(phrase) == 1 else (same[0], _phrase_end(words, same[0]))
        if len(phrase) > 1:
            return None
    if phrase[0][0].isupper() and first not in DETERMINERS:
        names = _names(words)
        if len(names) == 1:
            return names[0]
        if names:
            return None  # which of two names ("Pride and Prejudice")? None rather than a guess
    if len(phrase) > 1 and first not in _STOPS and first in lower[1:]:  # "rugby league" for "rugby union"
        start = lower.index(first, 1)
        end = start + len(phrase)
        return (start, end) if end <= len(words) and not any(w in _STOPS for w in lower[start:end]) else None
    noun_phrases = _noun_phrases(words)
    if _possessive(phrase[-1]):  # "the Nile's" for "the Amazon's": the phrase that ends the same way
        ends = [(s, e) for s, e in noun_phrases if any(_possessive(w) for w in words[s:e])]
        owner = [(s, next(i for i in range(s, e) if _possessive(words[i])) + 1) for s, e in ends]
        return owner[0] if len(owner) == 1 else None
    if first in DETERMINERS:
        if not noun_phrases:
            return None
        if phrase[-1][0].isupper():  # "the Andes" for "the Alps", not for "the highest peak"
            noun_phrases = [(s, e) for s, e in noun_phrases if words[e - 1][0].isupper()] or noun_phrases
        shared = [len({w.lower() for w in phrase[1:]} & set(lower[s + 1 : e])) for s, e in noun_phrases]
        return noun_phrases[shared.index(max(shared))]
    return _after_last_of(words) or _counted(lower) or _bare_subject(lower) or _asked_about(lower, noun_phrases)


def _possessive(word: str) -> bool:
    return word.lower().endswith(("'s", "’s", "s'", "s’"))


def _asked_about(lower: list[str], noun_phrases: list[tuple[int, int]]) -> tuple[int, int] | None:
    """The noun phrase a wh-question asks about with "is"/"are" ("What colour is the sky on a clear day?"), for a
    bare phrase ("snow"); none in a yes/no question ("Is the cake gluten-free?": the cake, or gluten-free?)."""
    if not noun_phrases or lower[0].split("'")[0] not in _WH:
        return None
    start, end = noun_phrases[0]
    before = lower[start - 1]
    if before not in _BE and not lower[0].endswith("'s"):
        return None
    return (start, end) if end == len(lower) or lower[end] in PREPOSITIONS else None


def _kind(word: str) -> str | None:
    """A word's closed class (a number, a time), where the follow-up's word replaces the question's of its class."""
    if _NUMBER.match(word) or word in _NUMBER_WORDS:
        return "number"
    return "time" if word in _TIME_WORDS else None


def _phrase_end(words: list[str], start: int) -> int:
    """The end of the phrase that starts at ``start`` (a preposition's object): a determiner's noun phrase, else
    the words up to a function word, a time, or where a name starts or ends ("8 am", "table salt", "March 3rd",
    "Manchester | tomorrow")."""
    if start >= len(words):
        return start
    if words[start].lower() in DETERMINERS:
        return _noun_phrase_end(words, start)
    end, name = start, words[start][0].isupper()
    while end < len(words) and words[end].lower() not in _STOPS and end - start < MAX_PHRASE_WORDS:
        changes_case = words[end][0].isalpha() and words[end][0].isupper() != name  # (a number has no case)
        if end > start and (changes_case or _kind(words[end].lower()) == "time"):
            break  # "in Manchester | tomorrow"
        end += 1
    return end


def _noun_phrase_end(words: list[str], start: int) -> int:
    """The end of the noun phrase a determiner at ``start`` opens (``start`` + 1 when it has no words), less its
    last word where that is the question's verb: after "does"/"can"/... ("How many legs does a spider have?",
    "How long should a puppy sleep each night?"), or a participle ending the question ("What is a baby cat
    called?")."""
    lower = [word.lower() for word in words]
    end = start + 1
    while end < len(words) and end - start <= MAX_PHRASE_WORDS:
        if lower[end] == "of" and end > start + 1 and end + 1 < len(words):
            end += 2 if lower[end + 1] in DETERMINERS else 1  # "a group of (the) lions": one phrase
        elif lower[end] in _STOPS or (end > start + 1 and _is_participle(lower[end]) and end + 1 < len(words)):
            break  # "the Louvre | closed on Tuesdays"
        else:
            end += 1
    if end - start > 2 and (lower[start - 1] in _DO_OR_MODAL or (end == len(words) and _is_participle(lower[-1]))):
        end -= 1
    return end


def _is_participle(word: str) -> bool:
    return word in _PARTICIPLES or word.endswith("ed")


def _noun_phrases(words: list[str]) -> list[tuple[int, int]]:
    """The question's noun phrases that open with a determiner (never its first word), each (start, end)."""
    found = []
    for start in range(1, len(words)):
        if words[start].lower() in DETERMINERS:
            end = _noun_phrase_end(words, start)
            if end > start + 1:
                found.append((start, end))
    return found


def _names(words: list[str]) -> list[tuple[int, int]]:
    """Runs of capitalised words after the question's first word (not "I")."""
    runs, start = [], None
    for index in range(1, len(words) + 1):
        capital = index < len(words) and words[index][0].isupper() and words[index] != "I"
        if capital and start is None:
            start = index
        elif not capital and start is not None:
            runs.append((start, index))
            start = None
    return runs


def _after_last_of(words: list[str]) -> tuple[int, int] | None:
    """The phrase after the question's last "of", where it ends the question but for a participle ("the opposite
    of big", "a group of crows called")."""
    lower = [word.lower() for word in words]
    if "of" not in lower[1:]:
        return None
    start = len(lower) - lower[::-1].index("of")
    end = len(lower) - 1 if _is_participle(lower[-1]) else len(lower)
    if start >= end:
        return None
    if lower[start] in DETERMINERS or words[start][0].isupper():
        return (start, end) if _phrase_end(words, start) == end else None
    bare = lower[start:end]
    ok = len(bare) <= MAX_PHRASE_WORDS and not any(w in _STOPS or w in _PRONOUNS for w in bare)
    return (start, end) if ok else None


def _counted(lower: list[str]) -> tuple[int, int] | None:
    """What "how many"/"how much" counts, without a determiner ("How many tablespoons are in a cup?")."""
    if lower[:2] not in (["how", "many"], ["how", "much"]):
        return None
    end = 2
    while end < len(lower) and lower[end] not in _STOPS and lower[end] not in _PRONOUNS and end - 2 < MAX_PHRASE_WORDS:
        end += 1
    return (2, end) if end > 2 and end < len(lower) else None


def _bare_subject(lower: list[str]) -> tuple[int, int] | None:
    """A noun phrase without a determiner between the question's auxiliary and its verb at the end: "What do
    pandas eat?", "What are baby kangaroos called?" (a wh-question only: "Can dogs eat grapes?" could be either)."""
    if lower[0] not in _WH:
        return None
    aux = next((i for i in range(1, min(3, len(lower))) if lower[i] in _AUXILIARIES), None)
    if aux is None:
        return None
    start, end = aux + 1, len(lower) - 1
    if lower[aux] not in _DO_OR_MODAL and not _is_participle(lower[-1]):
        return None
    bare = lower[start:end]
    if not 1 <= len(bare) <= MAX_PHRASE_WORDS or any(w in _STOPS or w in _PRONOUNS for w in bare):
        return None
    return start, end


def resolve_in(user_messages: list[str], follow_up: str) -> str | None:
    """``follow_up`` resolved against the user's messages before it (oldest first): the last one, itself resolved
    first where it was a follow-up too (up to ``MAX_CHAIN`` back; no earlier message is read)."""
    chain: list[str] = []
    for earlier in reversed(user_messages):
        chain.insert(0, earlier)
        if follow_up_phrase(earlier) is None or len(chain) > MAX_CHAIN:
            break
    if not chain:
        return None
    question: str | None = chain[0]
    for later in chain[1:]:
        question = resolve(question, later) if question is not None else None
    return resolve(question, follow_up) if question is not None else None
