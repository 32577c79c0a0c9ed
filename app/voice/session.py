"""One voice conversation: client messages in, server events and reply audio out.

Transport-agnostic (a server hands it frames and callbacks to send events and audio), it tells the
story of a turn: heard, perhaps answered ahead, answered, perhaps interrupted (the history keeps only
what was heard), with the client's preferences. Each part is a unit of ``app.voice``:

* ``listening``: audio -> VAD -> ASR -> speech started / paused / resumed / committed / dropped;
* ``reply_factory``: the prompt and the ``Reply`` (LLM -> clauses -> TTS -> audio, cancellable);
* ``answering``: a committed turn answered (the reply started, or the held speculation released);
* ``speculation``: a reply started at a pause, held back, used if the turn commits with that text;
* ``barge_in``: speech over a reply stops it, unless a backchannel;
* ``continuation``: the user going on right after a commit;
* ``warmup``: the LLM's prefix cache filled for the next turn;
* ``tools``: the functions a reply may call, and their results (the client's ``tool_result``).

Models come in through ``VoiceStages``, time through a ``Clock`` and blocking calls through a runner,
all injected: whole conversations run in tests with scripted stand-ins and a manual clock.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

import numpy as np

from app import protocol
from app.audio import ASR_SAMPLE_RATE, StreamResampler, pcm16_to_float
from app.config import Settings
from app.skills.base import SessionSkills
from app.stages.base import Message, VoiceStages
from app.voice import utterance as heard
from app.voice.announcements import ConversationSkills
from app.voice.answering import Answering
from app.voice.barge_in import BargeIn
from app.voice.clock import Clock, MonotonicClock, RunBlocking, run_in_thread
from app.voice.continuation import ContinuationRule, ContinuedTurns
from app.voice.history import History
from app.voice.listening import listen
from app.voice.prefs import Preferences, SessionPrefs
from app.voice.reply import Reply, ReplyWiring, SendBytes, SendJson
from app.voice.reply_factory import ReplyFactory, ToolSetup
from app.voice.speculation import Speculation
from app.voice.tools import ClientResults, PendingCalls, load_server_tools
from app.voice.turn_state import TurnState
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
        skills: SessionSkills | None = None,
    ) -> None:
        """``client_tool_results``: a reply that calls the client's tools waits for their ``tool_result`` ("wait"), or
        ends at its calls, whose results the client adds to the history before asking for the answer (``respond``:
        the Realtime API's way, "next_response"). ``withdraw_unheard``: a ``cancel`` before any of the reply was
        heard takes the turn back (left in, the next reply answered it); not for the Realtime door, whose
        conversation items are the client's. ``skills``: the server's (their tools, and their news said here)."""
        self.models, self._send_json = models, send_json
        self._clock, self._run = clock or MonotonicClock(), run_blocking or run_in_thread
        self.session_id = uuid.uuid4().hex[:12]
        self._state = TurnState(settings)  # what the parts below read at each use
        self._history = History(
            settings.max_history_messages,
            settings.history_replies,
            settings.recalled_user_statements,
            follow_ups=settings.follow_ups,
        )
        self.on_turn_metrics: Callable[[protocol.TurnMetrics], None] | None = None
        busy = lambda: self.busy or self._tracker.in_utterance  # noqa: E731
        heard = self._history.last_user_words
        language = lambda: self._state.language  # noqa: E731
        self._skills = ConversationSkills(
            skills, self.session_id, send_json, say=self._say, busy=busy, heard=heard, language=language
        )
        server_tools = load_server_tools(settings.tool_entry_point) + self._skills.tools()
        names = tuple(tool.name for tool in server_tools)
        self._prefs = Preferences(
            settings.system_prompt, models.asr, models.tts, tool_choice=settings.tool_choice, server_tools=names
        )
        self._pending_calls = PendingCalls()
        wiring = ReplyWiring(models, send_json, send_bytes, self._clock, self._run, listener=self)
        tools = ToolSetup(server_tools, self._pending_calls, client_tool_results, self._skills.instructions())
        self._replies = ReplyFactory(
            models, self._state, self._history, self._prefs, wiring, session_id=self.session_id, tools=tools
        )
        self._configure_input(protocol.INPUT_SAMPLE_RATE)
        self._warmup = PrefixWarmup(self._replies, self._llm_needed)
        self._speculation = Speculation(self._replies, self._warmup)
        parts = (self._replies, self._state, self._history, self._prefs, self._warmup)
        self._answering = Answering(*parts, send_json=send_json, clock=self._clock, withdraw_unheard=withdraw_unheard)
        self._barge_in = BargeIn(self._state, self._stop_reply_for_speech)
        rule = ContinuationRule(settings.continuation_ms, settings.continuation_heard_ms)
        answer = self._answering.start_turn
        self._continued = ContinuedTurns(
            rule, self._state, history=self._history, clock=self._clock, send_json=send_json, start_turn=answer
        )

    @property
    def settings(self) -> Settings:
        return self._state.settings

    # ------------------------------------------------------------------ input
    def _configure_input(self, sample_rate: int) -> None:
        self.input_sample_rate = sample_rate
        self._resampler = StreamResampler(sample_rate, ASR_SAMPLE_RATE)
        self._tracker = self._state.tracker = listen(
            self.models,
            self.settings,
            self._on_utterance_event,
            next_turn_id=self._state.next_turn_id,
            clock=self._clock,
            run_blocking=self._run,
            language=self._prefs.language,
            prompt=self._replies.messages_for,
        )

    async def start(self) -> None:
        """Tell the client the conversation is ready, and what it takes and gives (sent again at each ``start``); the
        skills may speak here from now on; the first prompt (the system prompt and the tools, ~900 tokens for the
        default brain: 6 s of the first turn when cold) is prefilled while the user has not spoken yet."""
        self._skills.opened()
        if not self.history:
            self._warmup.next_prompt()
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
        return self._state.reply is not None and self._state.reply.active()

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
            self._state.language = self._prefs.fixed_language
            self._continued.abandon()
            await self._answering.interrupt()
            now = self._clock.now()
            turn_id = self._state.next_turn_id()
            await self._answering.start_turn(turn_id, message.text, speech_end=now, commit=now, spoken=False)
        elif isinstance(message, protocol.Reset):
            self._continued.abandon()
            await self._answering.interrupt()
            await self._drop_utterance()
            self._history.clear()
        elif isinstance(message, protocol.Playback):
            reply = self._state.reply
            if reply is not None and reply.turn_id == message.turn_id:
                reply.playback.report(message.played_ms / 1000, self._clock.now())
        elif isinstance(message, protocol.Cancel):
            self._continued.abandon()
            await self._speculation.cancel()
            await self._answering.interrupt(barge_in=False)
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
        await self._answering.interrupt()
        turn_id, now = self._state.next_turn_id(), self._clock.now()
        self._answering.answer(turn_id, "", self._replies.prompt(None).messages, speech_end=now, commit=now)
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
        self._state.settings = self.settings.model_copy(update=changes)
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
                self._state.language = event.language or self._state.language
                said = self._continued.new_words(event.text)
                if self.settings.speculative_reply and not self._barge_in.only_backchannel(said):
                    if not is_filler(said) and not looks_unfinished(event.text):
                        self._warmup.give_way()
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
            await self._answering.interrupt()

    async def _on_committed(self, turn: heard.Committed) -> None:
        self._state.language = turn.language or self._prefs.fixed_language
        await self._continued.committed(turn.turn_id)
        await self._answering.interrupt()
        figures = turn.figures()
        timing = {"speech_end": turn.speech_end, "commit": turn.commit, **figures}
        speculation = await self._speculation.take(turn.text)
        if speculation is not None:
            await self._answering.release(speculation, turn.text, language=turn.language, **timing)
        else:
            await self._answering.start_turn(turn.turn_id, turn.text, language=turn.language, **timing)

    async def _drop_utterance(self) -> None:
        await self._tracker.drop()
        await self._speculation.cancel()

    # ------------------------------------------------------------------ how replies end (``ReplyListener``)
    def reply_complete(self, reply: Reply) -> None:
        self._answering.record(reply)

    def reply_failed(self, reply: Reply) -> None:
        self._history.forget_failed(reply.user_text)

    def turn_metrics(self, metrics: protocol.TurnMetrics) -> None:
        if self.on_turn_metrics is not None:
            self.on_turn_metrics(metrics)

    def _llm_needed(self) -> bool:
        """The tail transcription is about to run, a speculation runs or a reply is written: no prefill now."""
        if self._tracker.speech_may_be_ending or self._speculation.running:
            return True
        return self._state.reply is not None and self._state.reply.producing

    async def _say(self, words: str) -> None:
        """An announcement's words, spoken as a turn of the assistant's own."""
        self._answering.say(self._state.next_turn_id(), words)

    async def close(self) -> None:
        """The client is gone: stop the reply and free its LLM request and TTS work."""
        await self._skills.close()
        await self._warmup.close()
        await self._drop_utterance()
        await self._answering.close()
        await self._barge_in.close()
