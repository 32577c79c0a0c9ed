"""The OpenAI Realtime API (GA) at ``/v1/realtime``: a second door to the same conversation as ``/ws``.

The official OpenAI SDKs (``client.realtime.connect()`` with ``base_url=http://HOST:PORT/v1``),
pipecat's ``OpenAIRealtimeLLMService(base_url="ws://HOST:PORT/v1/realtime")`` and LiveKit's
OpenAI realtime plugin talk to Parley here unchanged. One connection is one ``VoiceSession``,
admitted and limited exactly like ``/ws`` (``app.server.connection``: origin, API key, capacity,
send deadlines, idle timeout, audio rate); ``RealtimeAdapter`` translates between the two
vocabularies. Every client event is validated by the ``openai`` package's own models first
(``schema``); a field they refuse is an ``error`` naming its path.

  adapter.py    ``RealtimeAdapter``: one connection, composed of its state, inbound and outbound
  state.py      the connection's state (``RealtimeState``): configuration, items, open response,
                speech held back, input clock and manual buffer, event ids
  inbound.py    client events -> typed session calls, state changes, acknowledgements (``Inbound``):
                routing, session.update, response.create / cancel
  context.py    what the inbound handlers share: state, outbound, the session (``InboundContext``)
  input_audio.py  input_audio_buffer append / commit / clear, manual transcription (``InputAudioBuffer``)
  items.py      conversation.item create / truncate / delete / retrieve (``ConversationItems``)
  configure.py  what session.update and response.create ask for, checked (pure functions)
  outbound.py   the session's events and reply audio -> Realtime server events; the user's speech (``Outbound``)
  responses.py  a reply as a Realtime response: created, deltas, function calls, done (``ResponseEvents``)
  sender.py     all sending: event ids, the error shape (``EventSender``)
  schema.py     client events: parsed (``protocol.load_json``) and validated (``openai.types.realtime``)
  core.py       what all share: bounds, errors, ids, payload shapes

Client events -> the conversation
  session.update                 instructions -> system prompt; audio.output.voice -> voice (a Parley
                                 voice name, or an OpenAI voice name, which keeps the current voice);
                                 audio.input.transcription.language -> language; transcription null ->
                                 no transcription events (Parley still transcribes: it needs the words);
                                 turn_detection: server_vad/semantic_vad -> Parley's own VAD and endpoint
                                 (threshold -> VAD threshold, silence_duration_ms -> endpoint silence,
                                 semantic eagerness -> endpoint silences, interrupt_response -> barge-in:
                                 when false, speaking over a reply does not stop it, but a turn that
                                 commits still does, as Parley answers the latest turn),
                                 null -> manual turns (commit + response.create); output_modalities
                                 ["audio"] or ["text"]; include ["parley.turn_metrics", "parley.notice"]
                                 opts in to Parley's own extra events.
                                 Ignored (accepted, no effect): audio.input.noise_reduction,
                                 turn_detection.prefix_padding_ms (Parley keeps 300 ms of pre-roll),
                                 transcription.model/prompt/delay/keywords, max_output_tokens (the
                                 server's llm_max_tokens applies), tracing, truncation (Parley fits the
                                 history to the model's context itself), reasoning, model.
                                 tools (functions), tool_choice (auto, none, required, a named
                                 function), parallel_tool_calls -> the session's tools (see below).
                                 Refused with an error (the rest of the update still applies): MCP
                                 tools and tool_choice, prompt templates, audio formats other than
                                 24 kHz PCM, speed other than 1, create_response false,
                                 idle_timeout_ms, transcription sessions.
  input_audio_buffer.append      base64 PCM16 24 kHz mono -> 16 kHz -> VoiceSession.feed_audio (server
                                 VAD), or into the manual buffer (turn_detection null)
  input_audio_buffer.commit      manual turns: the buffer is transcribed (the shared ASR) and becomes a
                                 user item, answered on response.create
  input_audio_buffer.clear       drops the utterance in progress (or the manual buffer)
  conversation.item.create       user text -> held until response.create, then one typed turn;
                                 assistant text -> history; system text -> appended to the instructions;
                                 function_call_output -> a tool message for the history (its output cut
                                 to 4000 characters); function_call -> an earlier call, for the history
  response.create                answers the user items created since the last answer (a typed turn),
                                 or, with none, the function_call_output items (``VoiceSession.respond``);
                                 response.instructions, tools and tool_choice apply to it only
  response.cancel                Parley ``cancel``: the reply stops, the history keeps what was heard
  conversation.item.truncate     Parley ``playback`` (how much of the reply was played)
  conversation.item.retrieve     the item as the server last sent it
  conversation.item.delete       only items not yet answered

The conversation -> server events
  speech_started                 input_audio_buffer.speech_started (held back while a reply is
                                 audible, see below)
  speech_dropped                 input_audio_buffer.speech_stopped when the speech was announced, and
                                 no item (noise, a filler, a backchannel over the reply)
  transcript (partial)           conversation.item.input_audio_transcription.delta
  transcript (final, spoken)     input_audio_buffer.speech_stopped, .committed, conversation.item.added,
                                 ...input_audio_transcription.completed, conversation.item.done,
                                 response.created (Parley answers every spoken turn at once)
  assistant_text                 response.output_audio_transcript.delta (or output_text.delta)
  reply audio                    response.output_audio.delta (resampled to 24 kHz, streaming)
  interrupt                      the held-back speech_started; the response ends ``cancelled``
  tool_call (the client's)       a function_call output item after the message item: output_item.added,
                                 conversation.item.added, function_call_arguments.delta and .done,
                                 output_item.done, conversation.item.done (the response ends at its calls:
                                 the client adds each function_call_output, then response.create);
                                 calls of the server's own tools (its skills, tool_entry_point) stay in
                                 the reply; a skill's news (a timer rang) is a response of the server's
                                 own: response.created with no user item before it, then as any reply
  turn_done                      response.output_audio.done, ...transcript.done, content_part.done,
                                 output_item.done, conversation.item.done, [the function calls],
                                 response.done (+ parley.turn_metrics when included)
  error                          error {"error": {"type", "code", "message", "param", "event_id"}}

OpenAI clients stop their playback on ``input_audio_buffer.speech_started``. Parley decides
barge-in itself (speech longer than ``barge_in_ms``; a cough is not a turn), so while a reply
is audible that event is held back until Parley confirms the interruption (its ``interrupt``)
or the user's turn commits; a dropped utterance is never announced. Speculative replies are
held back by the session until their turn commits, so they are invisible here too.

No event type outside the GA server-event set is sent unless the client asks for it with
``include``: some clients (pipecat) stop on an event type they do not know.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import WebSocket
from starlette.datastructures import State

from app.config import Settings
from app.server.access import CLOSE_POLICY, KEY_SUBPROTOCOL_PREFIX
from app.server.connection import Connection
from app.server.realtime.adapter import RealtimeAdapter
from app.server.realtime.core import MAX_ID_CHARS, REALTIME_SAMPLE_RATE, RealtimeError, new_id

__all__ = ["REALTIME_SAMPLE_RATE", "RealtimeAdapter", "RealtimeError", "serve_realtime"]

REALTIME_SUBPROTOCOL = "realtime"
OPENAI_KEY_SUBPROTOCOL_PREFIX = "openai-insecure-api-key."  # what OpenAI's browser clients send the key as


# ---------------------------------------------------------------- the WebSocket
def _realtime_error_json(code: str, message: str, kind: str = "invalid_request_error") -> str:
    return json.dumps(
        {
            "type": "error",
            "event_id": new_id("event"),
            "error": {"type": kind, "code": code, "message": message, "param": None, "event_id": None},
        }
    )


async def serve_realtime(websocket: WebSocket, state: State, settings: Settings) -> None:
    """One Realtime API connection: admitted, limited and closed like ``/ws`` (``app.server.connection``)."""
    connection = Connection(websocket, state, settings, label="realtime session")
    keys = [
        KEY_SUBPROTOCOL_PREFIX + p[len(OPENAI_KEY_SUBPROTOCOL_PREFIX) :]
        for p in connection.offered
        if p.startswith(OPENAI_KEY_SUBPROTOCOL_PREFIX)
    ]
    if not await connection.accept(REALTIME_SUBPROTOCOL, keys):
        return
    if websocket.query_params.get("intent") == "transcription":
        unsupported = _realtime_error_json(
            "unsupported_intent", "transcription sessions are not supported by this server"
        )
        await connection.refuse(unsupported, CLOSE_POLICY)
        return
    if not await connection.admit(lambda refusal: _realtime_error_json(refusal.code, refusal.message, "server_error")):
        return

    async def send(event: dict[str, Any]) -> None:
        await connection.send(json.dumps(event, separators=(",", ":")))

    model = (websocket.query_params.get("model") or "parley")[:MAX_ID_CHARS]
    # per connection: session.update may change its turn-taking. A Realtime turn, once committed, is
    # an item of the conversation, so Parley's continued turns (``turn_continued``) stay off here.
    session_settings = settings.model_copy(update={"continuation_ms": 0})
    adapter = RealtimeAdapter(
        send,
        session_settings,
        state.models,
        model=model,
        on_rate_limited=state.metrics.rate_limited.inc,
        skills=state.skills,
    )
    session = adapter.open_session()

    async def on_binary(data: bytes) -> None:
        await adapter.handle_binary()

    await connection.serve(
        session,
        adapter.handle_client,
        on_binary,
        internal_error=_realtime_error_json("internal", "internal server error", "server_error"),
        started=adapter.start,
        closing=adapter.close,
    )
