"""One voice conversation: client messages in, server events and reply audio out.

The session is transport-agnostic: a server hands it frames and gives it two async
callbacks to send events and audio. It is thin on purpose; the work is in two units:

* ``UtteranceTracker`` (``app.voice.utterance``): audio -> VAD -> partial and tail ASR ->
  speech started / paused / resumed / committed / dropped;
* ``Reply`` (``app.voice.reply``): messages -> LLM -> clauses -> TTS -> audio, held back
  while speculative, cancellable.

What stays here is what ties them together: the speculative reply and its swap into the
real one at the endpoint, barge-in, continued turns (the user going on right after a commit),
and warming the LLM's prefix cache for the next turn,
with the history (``app.voice.history``) and the client's preferences (``app.voice.prefs``). Models come in through ``app.stages.base.VoiceStages``; time through an
injected ``Clock``, and blocking model calls through an injected runner, so that the
whole conversation runs in tests with scripted stand-ins and a manual clock.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from app import protocol
from app.audio import ASR_SAMPLE_RATE, StreamResampler, pcm16_to_float
from app.config import Settings
from app.stages.base import ChatLLM, Message, TurnDetector, VadConfig, VoiceStages, scheduling_of
from app.voice import utterance as heard
from app.voice.clock import Clock, MonotonicClock, RunBlocking, run_in_thread
from app.voice.context import Fitted
from app.voice.continuation import Continuation, ContinuationRule
from app.voice.history import History
from app.voice.language import reply_in
from app.voice.prefs import Preferences, SessionPrefs
from app.voice.reply import Reply, SendBytes, SendJson, cancel_task
from app.voice.turns import Endpointer, is_backchannel, is_filler, looks_unfinished

log = logging.getLogger(__name__)


BARGE_IN_RECHECK_MS = 300  # after a backchannel verdict, listen this much more speech before judging again


@dataclass(frozen=True)
class BesideTheLLM:
    """The end-of-turn model, run with one core lent to it by the LLM (``LocalScheduling.core_lent``).

    It runs at each pause, just as a speculative reply's first tokens are written on every core;
    a step split over the core it takes waits for its slowest thread. On the 2-core Xeon, six
    first tokens took 72 ms alone, 115 beside a Smart Turn call, and 93 stepping on the other
    core only while the call ran.
    """

    detector: TurnDetector
    llm: ChatLLM

    def complete_probability(self, audio: np.ndarray) -> float:
        if (scheduling := scheduling_of(self.llm)) is None:
            return self.detector.complete_probability(audio)
        with scheduling.core_lent():
            return self.detector.complete_probability(audio)


class VoiceSession:
    def __init__(
        self,
        models: VoiceStages,
        settings: Settings,
        send_json: SendJson,
        send_bytes: SendBytes,
        *,
        clock: Clock | None = None,
        run_blocking: RunBlocking | None = None,
    ) -> None:
        self.models = models
        self.settings = settings
        self._send_json = send_json
        self._send_bytes = send_bytes
        self._clock = clock or MonotonicClock()
        self._run = run_blocking or run_in_thread
        self.session_id = uuid.uuid4().hex[:12]
        self._history = History(settings.max_history_messages)
        self._turn_ids = itertools.count(1)
        self._request_ids = itertools.count(1)  # unique per LLM request, even for a re-speculation
        self._reply: Reply | None = None  # the released reply (producing or playing)
        self._speculation: Reply | None = None  # a reply to the utterance in progress, held back
        self._continuation: Continuation | None = None  # the last turn, which the user may be going on with
        self._spoken_turn: int | None = None  # the last turn committed from speech (only those continue)
        self._continuation_rule = ContinuationRule(settings.continuation_ms, settings.continuation_heard_ms)
        self._warm_task: asyncio.Task | None = None
        self._barge_in_check: asyncio.Task | None = None
        self._barge_in_checked_ms = 0.0  # speech length at the last barge-in check of this utterance
        self._reply_playing_at_speech_start = False
        self._turn_language: str | None = None  # the language of the turn being answered, when known
        self._closed = False
        self.on_turn_metrics: Callable[[protocol.TurnMetrics], None] | None = None
        self._prefs = Preferences(settings.system_prompt, models.asr, models.tts)
        self._configure_input(protocol.INPUT_SAMPLE_RATE)

    # ------------------------------------------------------------------ input
    def _configure_input(self, sample_rate: int) -> None:
        settings = self.settings
        self.input_sample_rate = sample_rate
        self._resampler = StreamResampler(sample_rate, ASR_SAMPLE_RATE)
        vad = self.models.vad_stream(
            VadConfig(
                threshold=settings.vad_threshold,
                neg_threshold=max(0.05, settings.vad_threshold - 0.15),
                min_speech_ms=settings.min_speech_ms,
                min_silence_ms=settings.pause_ms,
            )
        )
        self._tracker = heard.UtteranceTracker(
            vad,
            self.models.asr,
            self._on_utterance_event,
            next_turn_id=lambda: next(self._turn_ids),
            clock=self._clock,
            run_blocking=self._run,
            turn_detector=None if self.models.turn is None else BesideTheLLM(self.models.turn, self.models.llm),
            language=lambda: self.prefs.language,
            early_tail=lambda: self.models.solo,  # several sessions share Whisper: no transcriptions wasted on gaps
            options=heard.TrackerOptions(
                endpointer=Endpointer(
                    settings.endpoint_silence_ms,
                    settings.endpoint_unfinished_silence_ms,
                    settings.endpoint_complete_silence_ms,
                    settings.turn_complete_threshold,
                    settings.turn_incomplete_threshold,
                ),
                partial_interval_ms=settings.partial_interval_ms,
                max_utterance_s=settings.max_utterance_s,
                tail_start_ms=settings.tail_start_ms,
            ),
        )

    async def start(self) -> None:
        await self._ready()

    async def _ready(self) -> None:
        await self._send_json(
            protocol.Ready(
                input_sample_rate=self.input_sample_rate,
                output_sample_rate=self.models.tts.sample_rate,
                voices=list(self.models.tts.voices),
                languages=list(self.models.asr.languages),
            )
        )

    @property
    def history(self) -> list[Message]:
        return self._history.messages

    @property
    def prefs(self) -> SessionPrefs:
        return self._prefs.current

    @property
    def busy(self) -> bool:
        """A reply is being produced or played: the user is listening, not idle."""
        return self._reply is not None and self._reply.active()

    async def report(self, message: protocol.ServerMessage) -> None:
        """Send an event that does not come from the conversation itself (a transport limit, say)."""
        await self._send_json(message)

    async def handle(self, message: protocol.ClientMessageType) -> None:
        """One client message, already parsed and validated by the door it came through (``/ws`` or Realtime)."""
        if isinstance(message, protocol.Start):
            await self._drop_utterance()
            self._configure_input(message.sample_rate)
            await self._ready()
        elif isinstance(message, protocol.UserText):
            self._turn_language = self._prefs.fixed_language
            self._abandon_continuation()
            await self._interrupt_reply()
            now = self._clock.now()
            await self._start_turn(next(self._turn_ids), message.text, speech_end=now, commit=now)
        elif isinstance(message, protocol.Reset):
            self._abandon_continuation()
            await self._interrupt_reply()
            await self._drop_utterance()
            self._history.clear()
        elif isinstance(message, protocol.Playback):
            reply = self._reply
            if reply is not None and reply.turn_id == message.turn_id:
                reply.playback.report(message.played_ms / 1000, self._clock.now())
        elif isinstance(message, protocol.Cancel):
            self._abandon_continuation()
            await self._cancel_speculation()
            await self._interrupt_reply(barge_in=False)
        elif isinstance(message, protocol.SessionConfig):
            await self._configure(message)

    async def _configure(self, message: protocol.SessionConfig) -> None:
        old_prompt = self.prefs.system_prompt
        answer = self._prefs.apply(message)
        await self._send_json(answer)
        if isinstance(answer, protocol.ConfigApplied) and answer.system_prompt != old_prompt and self.history:
            self._warm_next_prompt()  # the prompt's start changed: prefill it while the user is silent

    async def handle_audio(self, data: bytes) -> None:
        """One PCM16 frame at ``input_sample_rate``, already checked by the server (``protocol.check_audio_frame``)."""
        await self.feed_audio(self._resampler(pcm16_to_float(data)))

    async def tune(self, **changes: float) -> None:
        """Change this conversation's turn-taking settings live (the Realtime door's ``turn_detection``).

        Only fields of ``Settings`` may change; the utterance in progress is dropped and the VAD rebuilt
        with the new values (a ``start`` at the current input rate).
        """
        unknown = [name for name in changes if name not in Settings.model_fields]
        if unknown:
            raise ValueError(f"not a setting: {', '.join(unknown)}")
        self.settings = self.settings.model_copy(update=changes)
        await self.handle(protocol.Start(sample_rate=self.input_sample_rate))

    async def feed_audio(self, samples: np.ndarray) -> None:
        """16 kHz float32 input, already decoded (``handle_audio`` decodes and resamples the wire format)."""
        if self.prefs.half_duplex and self.busy:
            samples = np.zeros_like(samples)  # the speaker's own reply must not be heard as the user
        await self._tracker.feed(samples)

    # ------------------------------------------------------------------ the user's side
    async def _on_utterance_event(self, event: heard.UtteranceEvent) -> None:
        match event:
            case heard.SpeechStarted(onset=onset):
                self._barge_in_checked_ms = 0.0
                self._reply_playing_at_speech_start = self.busy
                await self._send_json(protocol.SpeechStarted())
                await self._maybe_continue_turn(onset)
            case heard.Resumed():
                await self._cancel_speculation()
                await self._send_json(protocol.SpeechStarted())
            case heard.Paused():
                await self._send_json(protocol.SpeechStopped())
            case heard.Partial(turn_id=turn_id, text=text):
                await self._send_json(protocol.Transcript(turn_id=turn_id, text=text, final=False))
                self._warm_words_so_far(text)
            case heard.Speaking(speech_ms=speech_ms):
                if self.prefs.barge_in and speech_ms >= self.settings.barge_in_ms:
                    await self._consider_barge_in(speech_ms)
            case heard.TailText():
                self._turn_language = event.language or self._turn_language
                said = self._new_words(event.text)
                said_over_reply = self._reply_playing_at_speech_start and is_backchannel(said)
                if self.settings.speculative_reply and not said_over_reply:
                    if not is_filler(said) and not looks_unfinished(event.text):
                        await self._speculate(event)
            case heard.Dropped():
                await self._cancel_speculation()  # a cough or "mm": not a turn, and the reply goes on
                await self._end_continuation()
            case heard.Committed():
                said = self._new_words(event.text)
                reply_goes_on = self.busy or self._continuation is not None
                if self._reply_playing_at_speech_start and reply_goes_on and is_backchannel(said):
                    await self._cancel_speculation()  # "mm-hmm" said over the reply: it goes on
                    await self._end_continuation()
                    return
                await self._on_committed(event)

    async def _consider_barge_in(self, speech_ms: float) -> None:
        """Sustained speech over a reply: stop it, unless the words so far are only a backchannel.

        Hearing the words costs one short transcription (~0.1 s) before the reply stops; it is what
        keeps "mm-hmm" or "yeah, right" from cutting the assistant off. The check is repeated as the
        speech goes on, so "yeah, but wait" still interrupts.
        """
        reply = self._reply
        if reply is None or not reply.active():
            return
        if not self.settings.barge_in_confirm:
            await self._stop_reply_for_speech()
            return
        checking = self._barge_in_check is not None and not self._barge_in_check.done()
        if checking or speech_ms < self._barge_in_checked_ms + BARGE_IN_RECHECK_MS:
            return
        self._barge_in_checked_ms = speech_ms
        self._barge_in_check = asyncio.create_task(self._confirm_barge_in(reply), name="barge-in-check")

    async def _confirm_barge_in(self, reply: Reply) -> None:
        text = await self._tracker.transcribe_speech_so_far()
        if reply is not self._reply or is_backchannel(text):
            return
        await self._stop_reply_for_speech()

    async def _stop_reply_for_speech(self) -> None:
        """The user is saying more than a backchannel: a continued turn's reply is withdrawn, any other interrupted."""
        continuation = self._continuation
        if continuation is not None and continuation.reply is self._reply:
            await self._withdraw(continuation)
        else:
            await self._interrupt_reply()

    # ------------------------------------------------------------------ continued turns
    def _new_words(self, text: str) -> str:
        """What the utterance adds to the turn it continues (all of ``text`` when it continues none)."""
        return self._continuation.new_words(text) if self._continuation is not None else text

    async def _maybe_continue_turn(self, onset: float) -> None:
        """Speech right after a spoken turn was committed, before its reply was heard, goes on with that turn.

        People pause mid-sentence ("I want to visit Paris ... and London"); a short endpoint
        commits at the pause. Rather than answer half a question (or make the endpoint slow for
        everyone), the reply is held and, if words follow, withdrawn and the whole answered.
        """
        await self._end_continuation()  # one left by an utterance that ended without a verdict
        reply = self._reply
        if reply is None or not self._continuation_rule.applies(reply, self._spoken_turn, onset):
            return
        now = self._clock.now()
        log.info(
            "turn %s continued: speech began %.0f ms after the commit, with %.0f ms of the reply heard (%.0f by now)",
            reply.turn_id,
            (onset - reply.commit) * 1000,
            reply.playback.played_s(onset) * 1000,
            reply.playback.played_s(now) * 1000,
        )
        reply.hold()
        self._history.withdraw(reply.user_text)
        self._tracker.continue_turn(reply.turn_id, reply.user_text)
        self._continuation = Continuation(reply)

    async def _withdraw(self, continuation: Continuation) -> None:
        """Cancel the continued turn's reply and tell the client to drop it; the whole turn is answered next."""
        if continuation.withdrawn:
            return
        continuation.withdrawn = True
        if self._reply is continuation.reply:
            self._reply = None
        await continuation.reply.cancel()
        await self._send_json(protocol.TurnContinued(turn_id=continuation.reply.turn_id))

    async def _end_continuation(self) -> None:
        """Nothing was added after all (a cough, "mm-hmm"): the turn stands and its reply goes on."""
        continuation, self._continuation = self._continuation, None
        if continuation is None:
            return
        reply = continuation.reply
        if continuation.withdrawn:  # already stopped at the client: answer the turn again
            now = self._clock.now()
            await self._start_turn(reply.turn_id, reply.user_text, speech_end=now, commit=now)
            return
        self._history.remember({"role": "user", "content": reply.user_text})
        await reply.release()  # (records the reply if it was complete)

    def _abandon_continuation(self) -> None:
        """Typed input, cancel or reset: the held turn is an ordinary turn again (its reply is stopped next)."""
        continuation, self._continuation = self._continuation, None
        if continuation is not None and not continuation.withdrawn:
            self._history.remember({"role": "user", "content": continuation.reply.user_text})

    async def _on_committed(self, turn: heard.Committed) -> None:
        self._turn_language = turn.language or self._prefs.fixed_language
        self._spoken_turn = turn.turn_id
        continuation, self._continuation = self._continuation, None
        if continuation is not None:
            await self._withdraw(continuation)
        await self._interrupt_reply()
        figures = {
            "endpoint_ms": turn.endpoint_ms,
            "asr_final_ms": turn.asr_final_ms,
            "asr_compute_ms": turn.asr_compute_ms,
            "turn_detect_ms": turn.turn_detect_ms,
            "turn_probability": turn.turn_probability,
        }
        speculation = self._speculation
        if speculation is not None and speculation.user_text == turn.text:
            self._speculation = None
            await self._send_json(
                protocol.Transcript(turn_id=speculation.turn_id, text=turn.text, final=True, language=turn.language)
            )
            await self._tell_if_voiceless(turn.turn_id)
            self._history.remember({"role": "user", "content": turn.text})
            speculation.commit, speculation.speech_end = turn.commit, turn.speech_end
            speculation.metrics = speculation.metrics.model_copy(update={**figures, "speculative": True})
            self._reply = speculation
            await speculation.release()
            return
        await self._cancel_speculation()
        await self._start_turn(
            turn.turn_id, turn.text, speech_end=turn.speech_end, commit=turn.commit, language=turn.language, **figures
        )

    async def _drop_utterance(self) -> None:
        await self._tracker.drop()
        await self._cancel_speculation()

    # ------------------------------------------------------------------ replies
    def _new_reply(self, turn_id: int, user_text: str) -> Reply:
        return Reply(
            turn_id,
            user_text,
            llm=self.models.llm,
            tts=self.models.tts,
            send_json=self._send_json,
            send_bytes=self._send_bytes,
            clock=self._clock,
            run_blocking=self._run,
            request_id=f"{self.session_id}-{turn_id}-{next(self._request_ids)}",
            first_clause_chars=self.settings.first_clause_chars,
            first_piece_words=self.settings.first_piece_words,
            yield_ahead_s=self.settings.llm_yield_ahead_s,
            # the server's solo mode (``registry.set_open_sessions``) turns it on while one session is open
            first_piece_priority=self.settings.first_piece_priority or self.models.solo,
            voice=self._prefs.voice_for(self._turn_language),
            on_complete=self._record_reply,
            on_failed=self._forget_failed_turn,
            on_metrics=self.on_turn_metrics,
        )

    async def _start_turn(
        self, turn_id: int, text: str, *, speech_end: float, commit: float, language: str | None = None, **figures
    ) -> None:
        await self._send_json(protocol.Transcript(turn_id=turn_id, text=text, final=True, language=language))
        fitted = self._prompt(text)
        if fitted.truncated_chars:
            text = fitted.messages[-1]["content"]
            await self._send_json(
                protocol.Notice(
                    turn_id=turn_id,
                    code="truncated",
                    message=f"That was too long for the model: {fitted.truncated_chars} characters at the end were left out.",
                )
            )
        await self._tell_if_voiceless(turn_id)
        reply = self._new_reply(turn_id, text)
        reply.speech_end, reply.commit = speech_end, commit
        reply.metrics = reply.metrics.model_copy(update=figures)
        self._history.remember({"role": "user", "content": text})
        self._reply = reply
        reply.start(fitted.messages, released=True)

    async def _speculate(self, tail: heard.TailText) -> None:
        """Start answering before the endpoint; nothing is sent unless the turn commits with this text."""
        if self._speculation is not None and self._speculation.user_text == tail.text:
            return
        await self._cancel_speculation()
        fitted = self._prompt(tail.text)
        if fitted.truncated_chars:
            return  # an over-long turn is answered (with a notice) once committed
        reply = self._new_reply(tail.turn_id, tail.text)
        reply.speech_end = tail.speech_end
        self._speculation = reply
        reply.start(fitted.messages, released=False)

    async def _tell_if_voiceless(self, turn_id: int) -> None:
        notice = self._prefs.voiceless_notice(self._turn_language, turn_id)
        if notice is not None:
            await self._send_json(notice)

    def _prompt(self, user_text: str) -> Fitted:
        system_prompt = reply_in(self.prefs.system_prompt, self._turn_language)
        return self._history.prompt(
            system_prompt,
            user_text,
            self.models.llm,
            context_tokens=self.settings.llm_context_tokens,
            reply_tokens=self.settings.llm_max_tokens,
        )

    async def _cancel_speculation(self) -> None:
        reply, self._speculation = self._speculation, None
        if reply is not None:
            await reply.cancel()

    def _record_reply(self, reply: Reply) -> None:
        if reply.text:
            self._history.remember({"role": "assistant", "content": reply.text})
            self._warm_next_prompt()

    def _forget_failed_turn(self, reply: Reply) -> None:
        self._history.forget_failed(reply.user_text)

    def _warm_next_prompt(self) -> None:
        """Prefill what the next turn's prompt will start with, while the user listens.

        The history just changed (a reply, or what of it was heard); computing its KV now,
        in the gap between turns, takes it off the next turn's critical path. Cheap when
        the prefix cache already holds most of it.
        """
        if self._closed or self.settings.max_history_messages <= 0:
            return
        upcoming = self._history.upcoming_prefix(self.prefs.system_prompt)
        if self._warm_task is not None:
            self._warm_task.cancel()
        self._warm_task = asyncio.create_task(self._warm(upcoming), name="llm-warm")

    def _warm_words_so_far(self, text: str) -> None:
        """Prefill the prompt with the words heard so far, while the user is still speaking.

        The reply's prompt then adds only the last words and the template's few tokens: the
        engine keeps a freed request's partial last block, and the reply's request takes it
        over (prefill costs ~4 ms a token on 2 CPU cores, and a question is 10-20 tokens).
        Skipped in the hangover and at a pause, where the tail transcription is the critical
        path; while an earlier warm-up or a speculation still runs; and while a reply is being
        written (its decode steps would wait for the prefill: the listener could hear a gap).
        """
        if self._closed or not self.settings.llm_warm_while_speaking or self._tracker.speech_may_be_ending:
            return
        if self._speculation is not None or (self._reply is not None and self._reply.producing):
            return
        if self._warm_task is not None and not self._warm_task.done():
            return
        fitted = self._prompt(text)
        if fitted.truncated_chars:
            return
        self._warm_task = asyncio.create_task(self._warm(fitted.messages), name="llm-warm-words")

    async def _warm(self, messages: list[Message]) -> None:
        try:
            if (scheduling := scheduling_of(self.models.llm)) is not None:
                await scheduling.warm(messages)
        except asyncio.CancelledError:
            raise
        except Exception:  # only an optimisation: the next turn computes it anyway
            log.debug("prefix warm-up failed", exc_info=True)

    async def _interrupt_reply(self, barge_in: bool = True) -> None:
        """Barge-in (or ``cancel``): stop the reply, tell the client to stop playing, keep only what was heard."""
        reply, self._reply = self._reply, None
        if reply is None or not reply.active():
            return
        producing = reply.producing
        await reply.cancel()
        heard_text = reply.playback.heard_text(self._clock.now())
        self._history.keep_only_heard(heard_text, reply_was_recorded=not producing)
        self._warm_next_prompt()
        if self._closed:
            return
        await self._send_json(protocol.Interrupt(turn_id=reply.turn_id))
        reply.metrics.barge_in = barge_in
        await self._send_json(
            protocol.TurnDone(turn_id=reply.turn_id, text=heard_text, interrupted=True, metrics=reply.final_metrics())
        )

    async def close(self) -> None:
        """The client is gone: stop the reply and free its LLM request and TTS work."""
        self._closed = True
        await self._drop_utterance()
        reply, self._reply = self._reply, None
        if reply is not None:
            await reply.cancel()
        for task in (self._warm_task, self._barge_in_check):
            if task is not None:
                await cancel_task(task)
