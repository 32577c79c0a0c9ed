"""Speaking the user's language: names for prompts, and which voice answers."""

from __future__ import annotations

NAMES = {
    "en": "English", "de": "German", "es": "Spanish", "fr": "French", "it": "Italian", "pt": "Portuguese",
    "nl": "Dutch", "pl": "Polish", "ru": "Russian", "uk": "Ukrainian", "cs": "Czech", "sv": "Swedish",
    "da": "Danish", "no": "Norwegian", "fi": "Finnish", "tr": "Turkish", "ar": "Arabic", "he": "Hebrew",
    "hi": "Hindi", "zh": "Chinese", "ja": "Japanese", "ko": "Korean", "vi": "Vietnamese", "id": "Indonesian",
}  # fmt: skip


def name(code: str) -> str:
    return NAMES.get(code, code)


def reply_in(system_prompt: str, language: str | None) -> str:
    """The system prompt, asking for the reply in the user's language when it is not English.

    A small model may still answer in English; a larger one (a setting) follows this.
    """
    if not language or language == "en":
        return system_prompt
    return f"{system_prompt} The user speaks {name(language)}: answer in {name(language)}."
