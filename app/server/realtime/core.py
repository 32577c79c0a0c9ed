"""What every part of the Realtime door shares: the API's bounds, its errors, ids and payload shapes."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import Any

REALTIME_SAMPLE_RATE = 24_000  # the only PCM rate of the Realtime API, both ways
PCM_FORMAT = {"type": "audio/pcm", "rate": REALTIME_SAMPLE_RATE}

# Bounds. Frames over 1 MiB are closed by uvicorn itself (``ws_max_size``, code 1009).
MAX_EVENT_CHARS = 1 << 20
MAX_APPEND_AUDIO_BYTES = REALTIME_SAMPLE_RATE * 2 * 10  # 10 s of audio in one append
MAX_APPEND_BASE64_CHARS = (MAX_APPEND_AUDIO_BYTES + 2) // 3 * 4
MIN_COMMIT_MS = 100  # what OpenAI requires of a manual commit
MAX_ID_CHARS = 64
MAX_CONTENT_PARTS = 16
MAX_PENDING_ITEMS = 64  # client items waiting for a response.create
ITEMS_KEPT = 128  # items remembered for truncate / retrieve / delete
MAX_METADATA_KEYS, MAX_METADATA_CHARS = 16, 512
TRANSCRIBE_TIMEOUT_S = 60.0


class RealtimeError(Exception):
    """A client event that cannot be served; becomes an ``error`` event and the session goes on."""

    def __init__(self, code: str, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.code, self.message, self.param, self.kind = code, message, param, kind


def unsupported(param: str, what: str) -> RealtimeError:
    return RealtimeError("unsupported_parameter", f"{what} is not supported by this server (Parley)", param)


# ---------------------------------------------------------------- payload shapes
# Parley does not meter tokens per turn; the figures are zeros in the shape clients read (pipecat reads them).
def zero_usage() -> dict[str, Any]:
    return {
        "total_tokens": 0,
        "input_tokens": 0,
        "output_tokens": 0,
        "input_token_details": {
            "text_tokens": 0,
            "audio_tokens": 0,
            "image_tokens": 0,
            "cached_tokens": 0,
            "cached_tokens_details": {"text_tokens": 0, "audio_tokens": 0, "image_tokens": 0},
        },
        "output_token_details": {"text_tokens": 0, "audio_tokens": 0},
    }


def message_item(item_id: str, role: str, content: list[dict], status: str = "completed") -> dict[str, Any]:
    return {
        "id": item_id,
        "object": "realtime.item",
        "type": "message",
        "status": status,
        "role": role,
        "content": content,
    }


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


SendEvent = Callable[[dict[str, Any]], Awaitable[None]]  # one server event to the client (JSON-able)
