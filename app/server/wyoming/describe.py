"""What the door offers, as Wyoming's ``info`` (the answer to ``describe``): asr, tts and handle programs."""

from __future__ import annotations

from pathlib import Path

from wyoming.info import (
    AsrModel,
    AsrProgram,
    Attribution,
    HandleModel,
    HandleProgram,
    Info,
    TtsProgram,
    TtsVoice,
)

from app.config import Settings
from app.stages.base import VoiceStages
from engine.weights import chosen_model

PROGRAM = "parley"
PARLEY = Attribution(name="Parley", url="")
WHISPER = Attribution(name="OpenAI Whisper (faster-whisper)", url="https://github.com/SYSTRAN/faster-whisper")
PIPER = Attribution(name="Piper", url="https://github.com/OHF-Voice/piper1-gpl")
VERSION = "1"


def model_name(setting: str, bundled: str) -> str:
    """A model setting as a user knows it: the bundled model's name, or a path's last part."""
    return bundled if setting.startswith("bundled") else Path(setting).name or setting


def describe(models: VoiceStages, settings: Settings) -> Info:
    asr_languages = [language for language in models.asr.languages if language] or ["en"]
    bundled_asr = "whisper-base" if settings.asr_model == "bundled-multilingual" else "whisper-tiny.en"
    asr = AsrProgram(
        name=PROGRAM,
        description="Parley: streaming Whisper transcription",
        attribution=PARLEY,
        installed=True,
        version=VERSION,
        models=[
            AsrModel(
                name=model_name(settings.asr_model, bundled_asr),
                description=f"Whisper ({settings.asr_compute_type})",
                attribution=WHISPER,
                installed=True,
                version=None,
                languages=asr_languages,
            )
        ],
        supports_transcript_streaming=True,
    )
    voices = [
        TtsVoice(
            name=voice,
            description=f"Piper voice {voice}",
            attribution=PIPER,
            installed=True,
            version=None,
            languages=[code for code in asr_languages if models.tts.voice_for(code) == voice]
            or ([asr_languages[0]] if index == 0 else []),
        )
        for index, voice in enumerate(models.tts.voices)
    ]
    tts = TtsProgram(
        name=PROGRAM,
        description="Parley: streaming Piper speech",
        attribution=PARLEY,
        installed=True,
        version=VERSION,
        voices=voices,
        supports_synthesize_streaming=True,
    )
    handle = HandleProgram(
        name=PROGRAM,
        description="Parley: the assistant's conversation (its LLM, memory, skills and tools)",
        attribution=PARLEY,
        installed=True,
        version=VERSION,
        models=[
            HandleModel(
                name=model_name(chosen_model(settings.llm_model), "SmolLM2-135M-Instruct"),
                description="the conversation's LLM",
                attribution=PARLEY,
                installed=True,
                version=None,
                languages=asr_languages,
            )
        ],
        supports_handled_streaming=True,
    )
    return Info(asr=[asr], tts=[tts], handle=[handle])
