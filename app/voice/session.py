"""One voice conversation: client messages in, server events and reply audio out.

Transport-agnostic (a server hands it frames and callbacks to send events and audio), it tells the
story of a turn: heard, perhaps answered ahead, answered, perhaps interrupted (the history keeps only
what was heard), with the client's preferences. Each part is a unit of ``app.voice``:

* ``listening``: audio -> VAD -> ASR -> speech started / paused / resumed / committed / dropped;
* ``reply_factory``: the prompt and the ``Reply`` (LLM -> clauses -> TTS -> audio, cancellable);
* ``speculation``: a reply started at a pause, held back, used if the turn commits with that text;
* ``barge_in``: speech over a reply stops it, unless a backchannel;
* ``continuation``: the user going on right after a commit;
* ``warmup``: the LLM's prefix cache filled for the next turn;
* ``tools``: the functions a reply may call, and their results (the client's ``tool_result``).

Models come in through ``VoiceStages``, time through a ``Clock`` and blocking calls through a runner,
all injected: whole conversations run in tests with scripted stand-ins and a manual clock.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable

import numpy as np

from app import protocol
from app.audio import ASR_SAMPLE_RATE, StreamResampler, pcm16_to_float
from app.config import Settings
from app.stages.base import Message, VoiceStages
from app.voice import utterance as heard
from app.voice.barge_in import BargeIn
from app.voice.clock import Clock, MonotonicClock, RunBlocking, run_in_thread
from app.voice.continuation import ContinuationRule, ContinuedTurns
from app.voice.history import History
from app.voice.listening import listen
from app.voice.prefs import Preferences, SessionPrefs
from app.voice.reply import Reply, SendBytes, SendJson
from app.voice.reply_factory import ReplyFactory
from app.voice.speculation import Speculation
from app.voice.tools import ClientResults, PendingCalls, load_server_tools
from app.voice.turns import is_filler, looks_unfinished
from app.voice.warmup import PrefixWarmup


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
        client_tool_results: ClientResults = "wait",
        withdraw_unheard: bool = True,
    ) -> None:
        """``client_tool_results``: a reply that calls the client's tools waits for their ``tool_result`` ("wait"), or
        ends at its calls, whose results the client adds to the history before asking for the answer (``respond``:
        the Realtime API's way, "next_response"). ``withdraw_unheard``: a ``cancel`` before any of the reply was
        heard takes the turn back (left in, the next reply answered it); not for the Realtime door, whose
        conversation items are the client's."""
        self.models, self.settings, self._send_json = models, settings, send_json
        self._clock, self._run = clock or MonotonicClock(), run_blocking or run_in_thread
        self.session_id = uuid.uuid4().hex[:12]
        self._history = History(
            settings.max_history_messages,
            settings.history_replies,
            settings.recalled_user_statements,
            follow_ups=settings.follow_ups,
        )
        self._turn_ids = itertools.count(1)
        self._reply: Reply | None = None  # the released reply (producing or playing)
        self._turn_language: str | None = None  # the language of the turn being answered, when known
        self._closed = False
        self._withdraw_unheard = withdraw_unheard
        self.on_turn_metrics: Callable[[protocol.TurnMetrics], None] | None = None
        server_tools = tuple(tool.name for tool in load_server_tools(settings.tool_entry_point))
        self._prefs = Preferences(
            settings.system_prompt, models.asr, models.tts, tool_choice=settings.tool_choice, server_tools=server_tools
        )
        self._pending_calls = PendingCalls()
        self._configure_input(protocol.INPUT_SAMPLE_RATE)
        self._replies = ReplyFactory(
            models,
            lambda: self.settings,
            self._history,
            self._prefs,
            send_json=send_json,
            send_bytes=send_bytes,
            clock=self._clock,
            run_blocking=self._run,
            session_id=self.session_id,
            on_complete=self._record_reply,
            on_failed=lambda reply: self._history.forget_failed(reply.user_text),
            on_metrics=lambda: self.on_turn_metrics,
            pending_calls=self._pending_calls,
            client_results=client_tool_results,
        )
        self._speculation = Speculation(
            self._replies,
            language=lambda: self._turn_language,
            heard_gain=lambda text, related: self._warmup.heard_gain(text, related),
        )
        self._barge_in = BargeIn(
            reply=lambda: self._reply,
            hear=lambda: self._tracker.transcribe_speech_so_far(),
            stop=self._stop_reply_for_speech,
        )
        self._continued = ContinuedTurns(
            ContinuationRule(settings.continuation_ms, settings.continuation_heard_ms),
            history=self._history,
            clock=self._clock,
            send_json=send_json,
            reply=lambda: self._reply,
            let_go=self._let_go,
            continue_turn=lambda turn_id, text: self._tracker.continue_turn(turn_id, text),
            start_turn=self._start_turn,
        )
        self._warmup = PrefixWarmup(
            self._replies.warm_prefix,
            settings=lambda: self.settings,
            upcoming_prefix=lambda: self._history.upcoming_prefix(self.prefs.system_prompt),
            prompt=lambda text: self._replies.prompt(text, self._turn_language),
            llm_needed=self._llm_needed,
            alone_prompt=lambda text, related: self._replies.alone_prompt(text, self._turn_language, related),
        )

    # ------------------------------------------------------------------ input
    def _configure_input(self, sample_rate: int) -> None:
        self.input_sample_rate = sample_rate
        self._resampler = StreamResampler(sample_rate, ASR_SAMPLE_RATE)
        self._tracker = listen(
            self.models,
            self.settings,
            self._on_utterance_event,
            next_turn_id=lambda: next(self._turn_ids),
            clock=self._clock,
            run_blocking=self._run,
            language=lambda: self.prefs.language,
            prompt=lambda text: self._replies.prompt(text, self._turn_language).messages,
        )

    async def start(self) -> None:
        """Tell the client the conversation is ready, and what it takes and gives (sent again at each ``start``)."""
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
            await self.start()
        elif isinstance(message, protocol.UserText):
            self._turn_language = self._prefs.fixed_language
            self._continued.abandon()
            await self._interrupt_reply()
            now = self._clock.now()
            await self._start_turn(next(self._turn_ids), message.text, speech_end=now, commit=now, spoken=False)
        elif isinstance(message, protocol.Reset):
            self._continued.abandon()
            await self._interrupt_reply()
            await self._drop_utterance()
            self._history.clear()
        elif isinstance(message, protocol.Playback):
            reply = self._reply
            if reply is not None and reply.turn_id == message.turn_id:
                reply.playback.report(message.played_ms / 1000, self._clock.now())
        elif isinstance(message, protocol.Cancel):
            self._continued.abandon()
            await self._speculation.cancel()
            await self._interrupt_reply(barge_in=False)
        elif isinstance(message, protocol.SessionConfig):
            await self._configure(message)
        elif isinstance(message, protocol.ToolResult):
            if not self._pending_calls.resolve(message.call_id, message.output):
                why = f"no call {message.call_id!r} is waiting for a result (unknown, timed out or cancelled)"
                await self._send_json(protocol.Error(code="unknown_tool_call", message=why))

    async def respond(self) -> int:
        """Answer from the history as it stands (it ends with the results of the assistant's calls, added by the
        client); returns the reply's turn id. The Realtime door's ``response.create`` after ``function_call_output``."""
        self._continued.abandon()
        await self._interrupt_reply()
        turn_id, now = next(self._turn_ids), self._clock.now()
        self._answer(turn_id, "", self._replies.prompt(None, self._turn_language).messages, speech_end=now, commit=now)
        return turn_id

    async def _configure(self, message: protocol.SessionConfig) -> None:
        old_prompt = self.prefs.system_prompt
        answer = self._prefs.apply(message)
        await self._send_json(answer)
        if isinstance(answer, protocol.ConfigApplied) and answer.system_prompt != old_prompt and self.history:
            self._warmup.next_prompt()  # the prompt's start changed: prefill it while the user is silent

    async def handle_audio(self, data: bytes) -> None:
        """One PCM16 frame at ``input_sample_rate``, already checked by the server (``protocol.check_audio_frame``)."""
        await self.feed_audio(self._resampler(pcm16_to_float(data)))

    async def tune(self, **changes: float) -> None:
        """Change this conversation's turn-taking settings live (the Realtime door's ``turn_detection``).

        Only fields of ``Settings``; the utterance in progress is dropped and the VAD rebuilt (a ``start``).
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
                self._barge_in.speech_started(reply_playing=self.busy)
                await self._send_json(protocol.SpeechStarted())
                await self._continued.speech_started(onset)
            case heard.Resumed():
                await self._speculation.cancel()
                await self._send_json(protocol.SpeechStarted())
            case heard.Paused():
                await self._send_json(protocol.SpeechStopped())
            case heard.Partial(turn_id=turn_id, text=text, heard=hypothesis):
                if text:
                    await self._send_json(protocol.Transcript(turn_id=turn_id, text=text, final=False))
                if hypothesis:
                    self._warmup.words_so_far(hypothesis)
            case heard.Speaking(speech_ms=speech_ms):
                if self.prefs.barge_in and speech_ms >= self.settings.barge_in_ms:
                    await self._barge_in.speaking(speech_ms, confirm=self.settings.barge_in_confirm)
            case heard.TailText():
                self._turn_language = event.language or self._turn_language
                said = self._continued.new_words(event.text)
                if self.settings.speculative_reply and not self._barge_in.only_backchannel(said):
                    if not is_filler(said) and not looks_unfinished(event.text):
                        await self._speculation.start(event)
            case heard.Dropped(turn_id=turn_id, text=text):
                await self._speculation.cancel()  # a cough or "mm": not a turn, and the reply goes on
                said = self._continued.new_words(text)
                await self._speech_dropped(turn_id, "filler" if said.strip() else "no_words", said)
            case heard.Committed():
                said = self._continued.new_words(event.text)
                reply_goes_on = self.busy or self._continued.holding
                if reply_goes_on and self._barge_in.only_backchannel(said):
                    await self._speculation.cancel()  # "mm-hmm" said over the reply: it goes on
                    await self._speech_dropped(event.turn_id, "backchannel", said)
                    return
                await self._on_committed(event)

    async def _speech_dropped(self, turn_id: int, reason: str, heard_words: str) -> None:
        """Tell the client the speech is not a turn; a turn it went on with stands (``ContinuedTurns.end``)."""
        await self._send_json(protocol.SpeechDropped(turn_id=turn_id, reason=reason, heard=heard_words.strip()))
        await self._continued.end()

    async def _stop_reply_for_speech(self) -> None:
        """The user is saying more than a backchannel: a continued turn's reply is withdrawn, any other interrupted."""
        if not await self._continued.withdraw_if_held():
            await self._interrupt_reply()

    async def _on_committed(self, turn: heard.Committed) -> None:
        self._turn_language = turn.language or self._prefs.fixed_language
        await self._continued.committed(turn.turn_id)
        await self._interrupt_reply()
        figures = turn.figures()
        speculation = await self._speculation.take(turn.text)
        if speculation is not None:
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
        await self._start_turn(
            turn.turn_id, turn.text, speech_end=turn.speech_end, commit=turn.commit, language=turn.language, **figures
        )

    async def _drop_utterance(self) -> None:
        await self._tracker.drop()
        await self._speculation.cancel()

    # ------------------------------------------------------------------ replies
    async def _start_turn(
        self,
        turn_id: int,
        text: str,
        *,
        speech_end: float,
        commit: float,
        language: str | None = None,
        spoken: bool = True,
        **figures,
    ) -> None:
        await self._send_json(protocol.Transcript(turn_id=turn_id, text=text, final=True, language=language))
        fitted = self._replies.prompt(text, self._turn_language)
        # before the words are in the history
        alone = self._replies.alone_prompt(text, self._turn_language, fitted.messages)
        if fitted.truncated_chars:
            text = fitted.messages[-1]["content"]
            left_out = f"That was too long for the model: {fitted.truncated_chars} characters at the end were left out."
            await self._send_json(protocol.Notice(turn_id=turn_id, code="truncated", message=left_out))
        await self._tell_if_voiceless(turn_id)
        self._history.remember({"role": "user", "content": text})
        heard_gain = self._warmup.heard_gain(text, fitted.messages) if spoken else None
        weighing = self._replies.weigh(fitted.messages, alone, heard_gain, spoken=spoken)
        self._answer(
            turn_id,
            text,
            weighing.messages,
            speech_end=speech_end,
            commit=commit,
            alone=weighing.alone,
            weighed=weighing.gain,
            **figures,
        )

    def _answer(
        self,
        turn_id: int,
        text: str,
        messages: list[Message],
        *,
        speech_end: float,
        commit: float,
        alone: list[Message] | None = None,
        weighed: float | None = None,
        **figures,
    ) -> None:
        """Start the reply the user hears (``text``: what it answers, "" for the history's last results; ``alone``
        and ``weighed``: how the reply weighs the conversation, ``ReplyFactory.weigh``)."""
        reply = self._replies.new(turn_id, text, self._turn_language)
        reply.speech_end, reply.commit = speech_end, commit
        reply.metrics = reply.metrics.model_copy(update=figures)
        self._reply = reply
        reply.start(messages, released=True, alone=alone, weighed=weighed)

    async def _tell_if_voiceless(self, turn_id: int) -> None:
        notice = self._prefs.voiceless_notice(self._turn_language, turn_id)
        if notice is not None:
            await self._send_json(notice)

    def _record_reply(self, reply: Reply) -> None:
        for message in reply.tool_messages:
            self._history.remember(message)
        if reply.answer_text:
            self._history.remember({"role": "assistant", "content": reply.answer_text})
        if reply.text or reply.tool_messages:
            self._warmup.next_prompt()

    def _llm_needed(self) -> bool:
        """The tail transcription is about to run, a speculation runs or a reply is written: no prefill now."""
        if self._tracker.speech_may_be_ending or self._speculation.running:
            return True
        return self._reply is not None and self._reply.producing

    def _let_go(self, reply: Reply) -> None:
        """A continued turn's reply is withdrawn: it is no longer the one the user hears."""
        if self._reply is reply:
            self._reply = None

    async def _interrupt_reply(self, barge_in: bool = True) -> None:
        """Barge-in (or ``cancel``): stop the reply, tell the client to stop playing, keep only what was heard."""
        reply, self._reply = self._reply, None
        if reply is None or not reply.active():
            return
        recorded = reply.finished and reply.released  # (``_record_reply`` ran)
        await reply.cancel()  # (the calls it waits for are cancelled: the client is told)
        heard_text = reply.heard_text(self._clock.now())
        if not recorded:
            for message in reply.tool_messages:  # calls made and answered stay made
                self._history.remember(message)
        self._history.keep_only_heard(
            reply.heard_answer(heard_text),
            reply_was_recorded=recorded and bool(reply.answer_text),
            withdrawn_if_unheard=self._withdraw_unheard and not barge_in,
        )
        self._warmup.next_prompt()
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
        await self._warmup.close()
        await self._drop_utterance()
        reply, self._reply = self._reply, None
        if reply is not None:
            await reply.cancel()
        await self._barge_in.close()
