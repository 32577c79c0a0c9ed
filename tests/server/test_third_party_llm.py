"""The voice server on a third-party OpenAI-compatible server: Hugging Face's `transformers serve`.

`parley engine serve` is ours, so agreeing with it proves little about the `openai` backend
(`llm_url`). `transformers serve` is another team's reading of the same API (its own streaming
chunks, its own end of stream), and it ships with transformers, which Parley depends on: no build
(llama-cpp-python's server would add a ~5-minute source build to every CI run).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
from harness import NO_BREAKER, TEST_MAX_SESSIONS

from app import protocol
from app.bench.launcher import ServerProcess
from app.clients.core import open_connection
from app.voice.text import words

pytestmark = pytest.mark.models


@pytest.fixture(scope="module")
def third_party_and_voice(output_dir):
    from engine.weights import resolve_model

    cli = Path(sys.executable).with_name("transformers")
    if not cli.exists() and shutil.which("transformers") is None:
        pytest.fail("the transformers CLI is missing: `pip install -e .` installs it")
    model = str(resolve_model(float32_weights=True))  # the bundled GGUF as a Hugging Face folder with weights
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing from the hub: the folder is local
    server = ServerProcess(
        [model, "--dtype", "float32", "--log-level", "info"],
        output_dir / "transformers-serve.log",
        ready_path="/v1/models",
        program=[str(cli if cli.exists() else shutil.which("transformers")), "serve"],
    )
    llm_url = server.base_url + "/v1"
    try:
        voice = ServerProcess(
            [
                "serve",
                "--llm-backend",
                "openai",
                "--llm-url",
                llm_url,
                "--llm-model",
                model,
                "--llm-max-tokens",
                "12",
                *NO_BREAKER,
                *TEST_MAX_SESSIONS,
            ],
            output_dir / "third-party-voice.log",
        )
    except Exception:
        server.stop()
        raise
    yield voice.base_url.replace("http://", "ws://") + "/ws"
    voice.stop()
    server.stop()


async def test_a_typed_question_is_answered_aloud_through_transformers_serve(third_party_and_voice):
    connection = await open_connection(third_party_and_voice)
    try:
        await connection.send_text("What is the capital of France?")
        written, audio_bytes, done = [], 0, None
        while done is None:
            item = await connection.recv(120)
            if isinstance(item, bytes):
                audio_bytes += len(item)
            elif isinstance(item, protocol.AssistantText):
                written.append(item.delta)
            elif isinstance(item, protocol.TurnDone):
                done = item
            elif isinstance(item, protocol.Error):
                pytest.fail(f"the server answered with an error: {item.message}")
    finally:
        await connection.close()
    assert words(done.text) and "".join(written).strip() == done.text.strip()
    assert "paris" in words(done.text), done.text  # the bundled model knows this one, greedy
    assert audio_bytes > 0
