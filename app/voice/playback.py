"""Where the client's playback of a reply stands, as the server can reconstruct it.

Barge-in cuts the history to what was heard, and the RTF figures count underruns (the
stream running dry), so both need this model of the client's speaker.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from app.protocol import TurnMetrics


@dataclass
class ReplyPlayback:
    """The client's playback of one reply, as the server can reconstruct it.

    The client plays chunks back to back from the first one it gets; a chunk sent after the
    audio before it would have finished is an underrun. The client may report ``played_ms``;
    otherwise we assume it plays as audio arrives.
    """

    sample_rate: int
    started_at: float | None = None  # wall time the first chunk was sent
    sent_s: float = 0.0
    underruns: int = 0
    underrun_s: float = 0.0  # silence mid-reply while the next chunk was late, all underruns together
    reported_played_s: float | None = None
    pieces: list[tuple[str, float]] = field(default_factory=list)  # (text, audio end in s)
    _clock_origin: float = 0.0  # started_at, shifted by each underrun's stall
    _reported_at: float | None = None  # when reported_played_s came

    def on_send(self, samples: int, now: float) -> None:
        if self.started_at is None:
            self.started_at = self._clock_origin = now
        elif now > self._clock_origin + self.sent_s + 0.02:
            self.underruns += 1
            self.underrun_s += now - (self._clock_origin + self.sent_s)
            self._clock_origin = now - self.sent_s  # the client restarts playback when data arrives
        self.sent_s += samples / self.sample_rate

    def add_piece(self, text: str) -> None:
        """Text whose audio ends at the current ``sent_s`` (call after sending it); "" for audio that says no text."""
        self.pieces.append((text, self.sent_s))

    def report(self, played_s: float, now: float) -> None:
        """The client says it has played ``played_s`` of the reply (its ``playback`` message)."""
        self.reported_played_s, self._reported_at = played_s, now

    def played_s(self, now: float) -> float:
        """How much had played at ``now`` (which may be a moment ago: when the user began to speak).

        A client's report wins over the estimate (it may skip playback, or play late); asked about
        a moment before the report, it is wound back by the time between (playback is real time).
        """
        if self.reported_played_s is not None:
            before_report = max(0.0, self._reported_at - now) if self._reported_at is not None else 0.0
            return max(0.0, min(self.reported_played_s, self.sent_s) - before_report)
        if self.started_at is None:
            return 0.0
        return max(0.0, min(self.sent_s, now - self._clock_origin))

    def figures(self, metrics: TurnMetrics, spent_s: float) -> TurnMetrics:
        """``metrics`` with the playback's figures: audio sent, RTF over ``spent_s`` (the reply's production time),
        underruns."""
        update: dict = {"underruns": self.underruns, "underrun_s": self.underrun_s if self.sent_s else None}
        if self.sent_s:
            update.update(reply_audio_s=self.sent_s, rtf=self.sent_s / max(1e-6, spent_s))
        return metrics.model_copy(update=update)

    def runs_dry_at(self, now: float) -> float:
        """When the client has played everything sent so far (``now`` before anything was sent)."""
        return now if self.started_at is None else self._clock_origin + self.sent_s

    def playing(self, now: float) -> bool:
        return self.started_at is not None and self.played_s(now) < self.sent_s - 0.05

    def heard_text(self, now: float) -> str:
        """The reply cut to what was played: whole pieces, then the played share of the current one."""
        played = self.played_s(now)
        heard: list[str] = []
        start = 0.0
        for text, end in self.pieces:
            if end <= played + 1e-6:
                heard.append(text)  # (a filler phrase is a piece with no text: heard, never written)
            else:
                share = (played - start) / max(1e-6, end - start)
                spoken = text.split()
                cut = int(len(spoken) * max(0.0, share))
                if cut:
                    heard.append(" ".join(spoken[:cut]))
                break
            start = end
        return " ".join(text for text in heard if text)
