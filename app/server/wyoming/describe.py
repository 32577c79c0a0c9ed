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


def program(description: str) -> dict:
    """What each of Parley's three programs says of itself."""
    return {"name": PROGRAM, "description": description, "attribution": PARLEY, "installed": True, "version": VERSION}


def artifact(name: str, description: str, attribution: Attribution = PARLEY) -> dict:
    """A model or a voice a program has (installed: nothing is downloaded)."""
    return {"name": name, "description": description, "attribution": attribution, "installed": True, "version": None}


def describe(models: VoiceStages, settings: Settings) -> Info:
    asr_languages = [language for language in models.asr.languages if language] or ["en"]
    bundled_asr = "whisper-base" if settings.asr_model == "bundled-multilingual" else "whisper-tiny.en"
    asr = AsrProgram(
        **program("Parley: streaming Whisper transcription"),
        models=[
            AsrModel(
                **artifact(
                    model_name(settings.asr_model, bundled_asr), f"Whisper ({settings.asr_compute_type})", WHISPER
                ),
                languages=asr_languages,
            )
        ],
        supports_transcript_streaming=True,
    )
    voices = [
        TtsVoice(
            **artifact(voice, f"Piper voice {voice}", PIPER),
            languages=[code for code in asr_languages if models.tts.voice_for(code) == voice]
            or ([asr_languages[0]] if index == 0 else []),
        )
        for index, voice in enumerate(models.tts.voices)
    ]
    tts = TtsProgram(
        **program("Parley: streaming Piper speech"),
        voices=voices,
        supports_synthesize_streaming=True,
    )
    handle = HandleProgram(
        **program("Parley: the assistant's conversation (its LLM, memory, skills and tools)"),
        models=[
            HandleModel(
                **artifact(
                    model_name(chosen_model(settings.llm_model), "SmolLM2-135M-Instruct"), "the conversation's LLM"
                ),
                languages=asr_languages,
            )
        ],
        supports_handled_streaming=True,
    )
    return Info(asr=[asr], tts=[tts], handle=[handle])
