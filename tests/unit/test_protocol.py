import json

import pytest

from app import protocol
from app.protocol import ProtocolError, check_audio_frame, parse_client_text


def error_code(call) -> str:
    with pytest.raises(ProtocolError) as info:
        call()
    assert info.value.event.message  # every error says what was wrong
    return info.value.event.code


def test_valid_messages_parse_to_typed_objects():
    assert parse_client_text('{"type": "start", "sample_rate": 48000}') == protocol.Start(sample_rate=48000)
    assert parse_client_text('{"type": "start"}').sample_rate == 16000
    assert parse_client_text('{"type": "text", "text": "hi"}') == protocol.UserText(text="hi")
    assert isinstance(parse_client_text('{"type": "reset"}'), protocol.Reset)


def test_malformed_json():
    assert error_code(lambda: parse_client_text("{not json")) == "bad_json"


def test_json_that_is_not_an_object():
    assert error_code(lambda: parse_client_text("[1, 2]")) == "bad_message"


def test_unknown_message_type():
    assert error_code(lambda: parse_client_text('{"type": "dance"}')) == "unknown_type"
    assert error_code(lambda: parse_client_text('{"text": "no type"}')) == "unknown_type"


@pytest.mark.parametrize(
    "message",
    [
        {"type": "start", "sample_rate": 100},
        {"type": "start", "sample_rate": "fast"},
        {"type": "start", "sample_rate": 16000, "extra": 1},
        {"type": "text", "text": ""},
        {"type": "text", "text": "x" * (protocol.MAX_USER_TEXT_CHARS + 1)},
    ],
)
def test_invalid_fields(message):
    assert error_code(lambda: parse_client_text(json.dumps(message))) == "bad_message"


def test_oversized_text_frame():
    big = json.dumps({"type": "text", "text": "a" * protocol.MAX_TEXT_FRAME_BYTES})
    assert error_code(lambda: parse_client_text(big)) == "frame_too_large"


def test_audio_frame_must_hold_whole_samples():
    check_audio_frame(b"\x00\x01" * 320)
    assert error_code(lambda: check_audio_frame(b"\x00" * 641)) == "bad_audio"


def test_oversized_audio_frame():
    assert error_code(lambda: check_audio_frame(b"\x00" * (protocol.MAX_AUDIO_FRAME_BYTES + 2))) == "frame_too_large"


def test_server_messages_serialize_with_their_type():
    event = json.loads(protocol.encode(protocol.Transcript(turn_id=3, text="hello", final=True)))
    assert event == {"type": "transcript", "turn_id": 3, "text": "hello", "final": True}


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        ('{"type": ["text"]}', "unknown_type"),
        ('{"type": {"a": 1}}', "unknown_type"),
        ('{"type": 5}', "unknown_type"),
        ('{"type": null}', "unknown_type"),
        ("[" * 1000 + "]" * 1000, "bad_json"),
        ('{"type": "start", "x": ' + "[" * 500 + "]" * 500 + "}", "bad_json"),
        ('{"type": "start", "sample_rate": ' + "9" * 5000 + "}", "bad_json"),
        ('{"type": "playback", "turn_id": 1, "played_ms": 1e999}', "bad_json"),
        ('{"type": "playback", "turn_id": 1, "played_ms": NaN}', "bad_json"),
        ('{"type": "playback", "turn_id": 1, "played_ms": Infinity}', "bad_json"),
        ('"just a string"', "bad_message"),
        ("", "bad_json"),
    ],
)
def test_hostile_json_is_an_error_not_a_crash(raw, code):
    assert error_code(lambda: parse_client_text(raw)) == code


def test_brackets_inside_strings_do_not_count_as_nesting():
    message = parse_client_text(json.dumps({"type": "text", "text": '[[[[[[[[[[{{{{{{{{{{ \\" ]]'}))
    assert message.text.startswith("[[[[")


def test_every_server_event_round_trips_through_the_client_parser():
    events = [
        protocol.Ready(input_sample_rate=16000, output_sample_rate=22050),
        protocol.Transcript(turn_id=1, text="hi", final=False),
        protocol.TurnDone(turn_id=2, text="ok", metrics=protocol.TurnMetrics(voice_to_voice_ms=512.5, rtf=3.0)),
        protocol.Error(code="bad_json", message="nope"),
    ]
    for event in events:
        assert protocol.parse_server_message(protocol.encode(event)) == event
    with pytest.raises(ValueError):
        protocol.parse_server_message('{"type": "no_such_event"}')


def test_tools_are_declared_in_config_and_answered_with_tool_result():
    schema = {
        "type": "object",
        "properties": {
            "when": {"type": "object", "properties": {"days": {"type": "array", "items": {"enum": ["mon"]}}}}
        },
    }
    config = parse_client_text(
        json.dumps(
            {
                "type": "config",
                "tools": [{"type": "function", "name": "set_alarm", "description": "Wake me", "parameters": schema}],
                "tool_choice": {"type": "function", "name": "set_alarm"},
                "parallel_tool_calls": False,
            }
        )
    )
    assert config.tools[0].parameters == schema and config.tool_choice == protocol.NamedFunction(name="set_alarm")
    assert parse_client_text('{"type": "config", "tool_choice": "required"}').tool_choice == "required"
    result = parse_client_text('{"type": "tool_result", "call_id": "call_1", "output": "{\\"ok\\": true}"}')
    assert result == protocol.ToolResult(call_id="call_1", output='{"ok": true}')


@pytest.mark.parametrize(
    "message",
    [
        {"type": "config", "tools": [{"name": "no spaces allowed"}]},
        {"type": "config", "tools": [{"name": "x" * 65}]},
        {"type": "config", "tools": [{"name": f"t{i}"} for i in range(protocol.MAX_TOOLS + 1)]},
        {"type": "config", "tool_choice": "sometimes"},
        {"type": "tool_result", "call_id": "", "output": "x"},
        {"type": "tool_result", "call_id": "call_1"},
    ],
)
def test_bad_tool_messages_are_refused(message):
    assert error_code(lambda: parse_client_text(json.dumps(message))) == "bad_message"


def test_tool_events_round_trip_through_the_client_parser():
    events = [
        protocol.CallTool(turn_id=1, call_id="call_1", name="get_weather", arguments='{"city": "Paris"}'),
        protocol.ToolDone(turn_id=1, call_id="call_1", name="get_weather", status="timeout", output="{}"),
        protocol.TurnDone(
            turn_id=1, text="", metrics=protocol.TurnMetrics(tool_calls=1, tool_ms=12.0, answer_ms=900.0)
        ),
    ]
    for event in events:
        assert protocol.parse_server_message(protocol.encode(event)) == event
    assert {"tool_ms", "answer_ms"} <= set(protocol.LATENCY_FIELDS)
