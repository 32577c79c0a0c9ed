"""A reply's text split into content and tool calls, fed as it streams or whole.

Why one incremental parser for both: a streamed reply and the same reply returned at once must
say the same thing, so the non-streamed answer is the streamed deltas put together
(``parse_reply``). Text outside a format's call markers is content (a marker split over two
deltas is held back until it is clear); inside, each JSON object is scanned as it grows: its
call is announced once its ``"name"`` string is complete (index, id, name), then the raw text
of its ``"arguments"`` (or Llama's ``"parameters"``) value follows in fragments, so the
fragments joined are exactly what the model wrote. Whitespace after a call is content only
when more content follows.

Malformed output: an object without a string ``"name"`` is content. A finished call whose
arguments are not JSON makes the whole non-streamed reply content, as vLLM does (a stream has
sent its fragments already). A call cut short by ``max_tokens`` keeps its partial arguments
(the finish reason says ``length``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from engine.structured_output.formats import ToolFormat

_ARGUMENT_KEYS = ("arguments", "parameters")
_CALL_FIRST_KEYS = ('"name"', '"type"')  # Llama 3.2 sometimes opens a call with "type": "function"


@dataclass
class CallDelta:
    """A piece of call ``index``: its first carries ``id`` and ``name``, the rest argument text."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass
class ParsedDelta:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI's ``function.arguments``

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedReply:
    content: str | None
    calls: list[ToolCall]


class _ObjectScan:
    """One JSON object scanned as it grows: where it ends, and where each top-level value lies."""

    def __init__(self) -> None:
        self.text = ""
        self.depth = 0
        self.in_str = False
        self.esc = False
        self.str_start = 0
        self.expect = "object"  # object, key, colon, value, string, scalar, container, comma
        self.key: str | None = None
        self.spans: dict[str, list[int | None]] = {}  # top-level key -> [start, end or None]
        self.end: int | None = None  # just after the closing brace

    def feed(self, chunk: str) -> int:
        """Scan ``chunk``; returns how many of its characters belong to the object."""
        start = len(self.text)
        self.text += chunk
        for i in range(start, len(self.text)):
            self._char(self.text[i], i)
            if self.end is not None:
                self.text = self.text[: self.end]
                return self.end - start
        return len(chunk)

    def _open(self, i: int, kind: str) -> None:
        if self.key is not None:
            self.spans[self.key] = [i, None]
        self.expect = kind

    def _close(self, j: int) -> None:
        if self.key is not None and self.key in self.spans:
            self.spans[self.key][1] = j
        self.expect = "comma"

    def _char(self, c: str, i: int) -> None:
        if self.in_str:
            if self.esc:
                self.esc = False
            elif c == "\\":
                self.esc = True
            elif c == '"':
                self.in_str = False
                if self.depth == 1 and self.expect == "key":
                    try:
                        key = json.loads(self.text[self.str_start : i + 1])
                    except json.JSONDecodeError:
                        key = None
                    self.key = key if isinstance(key, str) else None
                    self.expect = "colon"
                elif self.depth == 1 and self.expect == "string":
                    self._close(i + 1)
            return
        if self.depth == 1 and self.expect == "scalar" and (c.isspace() or c in ",}"):
            self._close(i)
        if c.isspace():
            return
        if self.depth == 0:
            if c == "{":
                self.depth, self.expect = 1, "key"
            return
        if c == '"':
            self.in_str, self.str_start = True, i
            if self.depth == 1 and self.expect == "value":
                self._open(i, "string")
        elif c in "{[":
            if self.depth == 1 and self.expect == "value":
                self._open(i, "container")
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            if self.depth == 1 and self.expect == "container":
                self._close(i + 1)
            elif self.depth == 0:
                self.end = i + 1
        elif self.depth == 1:
            if c == ":" and self.expect == "colon":
                self.expect = "value"
            elif c == ",":
                self.expect, self.key = "key", None
            elif self.expect == "value":
                self._open(i, "scalar")

    def value(self, key: str) -> str | None:
        span = self.spans.get(key)
        return None if span is None or span[1] is None else self.text[span[0] : span[1]]

    def name(self) -> str | None:
        raw = self.value("name")
        try:
            name = json.loads(raw) if raw is not None else None
        except json.JSONDecodeError:
            return None
        return name if isinstance(name, str) and name else None

    def arguments_so_far(self) -> str | None:
        """The arguments' text written so far (None: no arguments key yet)."""
        for key in _ARGUMENT_KEYS:
            span = self.spans.get(key)
            if span is not None:
                return self.text[span[0] : len(self.text) if span[1] is None else span[1]]
        return None


@dataclass
class _Call:
    index: int
    scan: _ObjectScan
    announced: bool = False
    sent: str = ""  # argument text sent so far


class ToolCallParser:
    """Feed a reply's text deltas (``feed``), then ``finish``; each returns what is new."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self.buf = ""  # text not consumed yet
        self.mode = "text"  # text, block (between calls), object
        self.started = False  # past the reply's leading whitespace (a JSON call may only open it)
        self.held_ws = ""  # whitespace after a call: content only if content follows
        self.num_calls = 0
        self.call: _Call | None = None
        self.malformed = False
        self.bare = False  # the calls opened the reply as bare JSON (no marker): "," may join them

    # --- public ---------------------------------------------------------------------------
    def feed(self, text: str) -> ParsedDelta:
        self.buf += text
        out = ParsedDelta()
        while self._step(out):
            pass
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self.mode == "text":
            self._content(out, self.buf)
        elif self.mode == "object" and self.call is not None and not self.call.announced:
            self._content(out, self.call.scan.text)  # cut short before its name: what it was is unknown
        self.buf = ""
        return out

    # --- steps ------------------------------------------------------------------------------
    def _step(self, out: ParsedDelta) -> bool:
        """One move on ``self.buf``; False when it needs more text."""
        if self.mode == "text":
            return self._text(out)
        if self.mode == "block":
            return self._block(out)
        return self._object(out)

    def _text(self, out: ParsedDelta) -> bool:
        fmt = self.fmt
        if fmt.json_at_start and not self.started:
            stripped = self.buf.lstrip()
            opens = _opens_call(stripped)
            if opens is None:
                return False
            self.started = True
            if opens:
                self.buf = stripped
                self.bare = True
                self._begin_object()
                return True
        at = self.buf.find(fmt.open) if fmt.open else -1
        if at >= 0:
            self._content(out, self.buf[:at])
            self.buf = self.buf[at + len(fmt.open) :]
            self.mode = "block"
            return True
        keep = _partial_suffix(self.buf, fmt.open) if fmt.open else 0
        self._content(out, self.buf[: len(self.buf) - keep])
        self.buf = self.buf[len(self.buf) - keep :]
        return False

    def _block(self, out: ParsedDelta) -> bool:
        fmt = self.fmt
        while self.buf:
            c = self.buf[0]
            # bare calls joined by "," as a JSON list's items are: the default brain wrote `{call}, {the next
            # tool's schema}` through vLLM, and the rest after the first call was spoken as content
            if c.isspace() or c in fmt.separator or (fmt.array and c == "[") or (self.bare and c == ","):
                self.buf = self.buf[1:]
            elif fmt.array and c == "]":
                self.buf, self.mode = self.buf[1:], "text"
                return True
            elif c == "{":
                self._begin_object()
                return True
            elif fmt.close and self.buf.startswith(fmt.close):
                self.buf, self.mode = self.buf[len(fmt.close) :], "text"
                return True
            elif fmt.close and fmt.close.startswith(self.buf):
                return False  # a closing marker on its way
            else:
                self.mode = "text"  # not a call: the rest is content
                return True
        return False

    def _begin_object(self) -> None:
        self.mode = "object"
        self.call = _Call(self.num_calls, _ObjectScan())

    def _object(self, out: ParsedDelta) -> bool:
        call = self.call
        assert call is not None
        used = call.scan.feed(self.buf)
        self.buf = self.buf[used:]
        self._announce(out, call)
        if call.scan.end is None:
            return False
        self._end_call(out, call)
        self.call, self.mode = None, "block"
        return True

    def _announce(self, out: ParsedDelta, call: _Call) -> None:
        """Send the call's name once known, then whatever its arguments gained."""
        if not call.announced:
            name = call.scan.name()
            if name is None:
                return
            call.announced = True
            self.num_calls += 1
            out.calls.append(CallDelta(call.index, "", self.fmt.call_id(), name))
        args = call.scan.arguments_so_far()
        if args is not None and len(args) > len(call.sent):
            piece, call.sent = args[len(call.sent) :], args
            if out.calls and out.calls[-1].index == call.index:
                out.calls[-1].arguments += piece
            else:
                out.calls.append(CallDelta(call.index, piece))

    def _end_call(self, out: ParsedDelta, call: _Call) -> None:
        if not call.announced:  # no name: not a call
            self._content(out, call.scan.text)
            return
        if call.scan.arguments_so_far() is None:
            call.sent = "{}"
            out.calls.append(CallDelta(call.index, "{}"))
        try:
            json.loads(call.sent)
        except json.JSONDecodeError:
            self.malformed = True

    def _content(self, out: ParsedDelta, text: str) -> None:
        if not text:
            return
        if self.num_calls:  # after a call, trailing whitespace waits for content after it
            text = self.held_ws + text
            body = text.rstrip()
            self.held_ws = text[len(body) :]
            text = body
        if text.strip():
            self.started = True
        out.content += text


def _opens_call(text: str) -> bool | None:
    """Whether a reply starting with ``text`` (leading whitespace stripped) opens a JSON call; None: too soon to say."""
    if not text:
        return None
    if text[0] != "{":
        return False
    rest = text[1:].lstrip()
    if not rest:
        return None
    for key in _CALL_FIRST_KEYS:
        if rest.startswith(key):
            return True
    return None if any(key.startswith(rest) for key in _CALL_FIRST_KEYS) else False


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that starts ``marker`` (a marker split across deltas)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReplyAssembler:
    """Parsed deltas put together: the content, and each call's id, name and arguments."""

    def __init__(self) -> None:
        self.content = ""
        self.calls: dict[int, ToolCall] = {}

    def add(self, delta: ParsedDelta) -> None:
        self.content += delta.content
        for d in delta.calls:
            if d.index not in self.calls:
                self.calls[d.index] = ToolCall(d.id or "", d.name or "", "")
            self.calls[d.index].arguments += d.arguments

    def reply(self) -> ParsedReply:
        """Content is None when the reply is calls and nothing else (as OpenAI's ``message.content``)."""
        calls = [self.calls[i] for i in sorted(self.calls)]
        return ParsedReply(None if calls and not self.content.strip() else self.content, calls)


def parse_reply(fmt: ToolFormat, text: str) -> ParsedReply:
    """A whole reply: the streamed deltas put together, or all of it as content when a call's JSON is malformed."""
    parser = ToolCallParser(fmt)
    assembled = ReplyAssembler()
    assembled.add(parser.feed(text))
    assembled.add(parser.finish())
    if parser.malformed:
        return ParsedReply(text, [])
    return assembled.reply()
