"""Load every model once at start-up and share it across sessions."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from app.config import Settings
from app.policy import model_traits
from app.stages.asr import Transcriber
from app.stages.base import (
    ChatLLM,
    GenerationSettings,
    ReplyRequest,
    Synthesizer,
    TurnDetector,
    VadConfig,
    VoiceStages,
    open_reply,
    scheduling_of,
)
from app.stages.tts import PiperSynthesizer
from app.stages.vad import SileroVad, VadStream
from engine.config import EngineConfig, resolve_dtype, resolve_quantization


@dataclass
class Models:
    """Every model, loaded once and shared by all sessions (a ``base.VoiceStages``)."""

    vad: SileroVad
    asr: Transcriber
    llm: ChatLLM
    tts: Synthesizer
    turn: TurnDetector | None = None
    # One session is open (set by the server): the speed-ups that slow several sessions apply
    # (``Settings.solo_speedups``).
    solo: bool = False

    def vad_stream(self, config: VadConfig) -> VadStream:
        return VadStream(self.vad, config)

    def close(self) -> None:
        self.llm.close()


SOLO_FIRST_TOKENS = 12  # about a reply's first spoken piece


def set_open_sessions(models: VoiceStages, settings: Settings, count: int) -> None:
    """The server opened or closed a session: the solo speed-ups apply while exactly one is open.

    They give one user's first piece every core, which makes several users slower (their extra
    threads compete with the other sessions' work), so they stop when a second session opens
    (figures: app/bench/results/turn_flow.md).
    """
    solo = settings.solo_speedups and count == 1
    models.solo = solo
    base = settings.llm_prefill_threads_first_tokens
    if (scheduling := scheduling_of(models.llm)) is not None:
        scheduling.set_urgent_first_tokens(max(base, SOLO_FIRST_TOKENS) if solo else base)


def llm_engine_config(settings: Settings) -> EngineConfig:
    """The in-process engine's settings, from the app's."""
    return EngineConfig(
        model=settings.llm_model,
        dtype=resolve_dtype(settings.llm_dtype, settings.llm_device),
        quantization=resolve_quantization(settings.llm_quantization, settings.llm_device),
        int8_method=settings.llm_int8_method,
        device=settings.llm_device,
        num_threads=settings.llm_threads,
        prefill_threads=settings.llm_prefill_threads or os.cpu_count(),
        prefill_threads_first_tokens=settings.llm_prefill_threads_first_tokens,
        gpu_memory_fraction=settings.llm_gpu_memory_fraction,
        cuda_graphs=settings.llm_cuda_graphs,
    )


def make_llm(settings: Settings) -> ChatLLM:
    """The LLM backend; how each reply decodes is the reply's own (``ReplyRequest.sampling``), from the settings."""
    if settings.llm_backend == "engine":
        from app.stages.llm_engine import EngineChatLLM

        return EngineChatLLM(llm_engine_config(settings))
    if settings.llm_backend == "transformers":
        from app.stages.llm import TransformersChatLLM

        return TransformersChatLLM(settings.llm_model, dtype=resolve_dtype(settings.llm_dtype, settings.llm_device))
    if not settings.llm_url:
        raise ValueError("llm_backend 'openai' needs llm_url (e.g. --llm-url http://127.0.0.1:8001/v1)")
    from app.stages.llm import OpenAIChatLLM

    return OpenAIChatLLM(settings.llm_url, settings.llm_model)


def make_tts(settings: Settings) -> Synthesizer:
    if settings.tts_backend == "coqui":
        from app.stages.tts_coqui import CoquiSynthesizer

        return CoquiSynthesizer.from_settings(settings)
    return PiperSynthesizer(
        settings.tts_voice,
        threads=settings.tts_threads,
        voices_by_language=settings.tts_voices,
        # a second Piper session only where first pieces are synthesized apart
        urgent_threads=(
            settings.tts_first_piece_threads
            if settings.first_piece_priority or settings.solo_speedups
            else settings.tts_threads
        ),
    )


def make_turn_detector(settings: Settings, progress: Callable[[str], None] = print) -> TurnDetector | None:
    """Smart Turn v3, or None (the words alone decide) when it is off or not installed."""
    if settings.turn_model == "none":
        return None
    from app.stages.end_of_turn import SmartTurn

    try:
        return SmartTurn(threads=1)
    except FileNotFoundError as missing:
        progress(f"WARNING: {missing}; ending turns by the words alone")
        return None


def one_blas_thread() -> None:
    """Run numpy's matrix products (OpenBLAS) on one thread in this process.

    After each call OpenBLAS keeps its worker threads spinning for a while, and the only BLAS
    calls in the voice loop are tiny: the mel filter bank of Whisper's and Smart Turn's features
    (80x201 times a few hundred frames). On 2 cores the spinning worker took a core from
    CTranslate2 right after the features were made, slowing the transcription (figures:
    app/bench/results/engine_cpu.md). Only OpenBLAS is limited: the LLM's torch threads and the ONNX and CTranslate2
    pools are set per model.
    """
    from threadpoolctl import threadpool_limits

    threadpool_limits(1, user_api="blas")


def policy_line(settings: Settings) -> str:
    """What the LLM is and the conversation policy that follows from it (said at start-up and by ``parley config``)."""
    traits = model_traits(settings.llm_model, settings.llm_backend)
    what = traits.describe() if traits is not None else "a model not known here (its files are not on this machine)"
    return f"LLM {settings.llm_model!r} is {what}: conversation policy {settings.llm_policy!r}"


def load_models(settings: Settings, progress: Callable[[str], None] = print) -> Models:
    """Load VAD, ASR, LLM and TTS, printing one line per model with its load time."""
    one_blas_thread()

    def timed(label: str, load: Callable[[], object]):
        progress(f"loading {label} ...")
        started = time.perf_counter()
        model = load()
        detail = getattr(model, "description", None)  # e.g. the LLM engine's kernels and KV pool
        progress(f"loaded {label} in {time.perf_counter() - started:.1f} s" + (f": {detail}" if detail else ""))
        return model

    vad = timed("VAD (Silero v6 ONNX)", SileroVad)
    asr = timed(
        f"ASR (faster-whisper {settings.asr_model}, {settings.asr_compute_type}, language {settings.asr_language or 'detect'})",
        lambda: Transcriber(
            settings.asr_model,
            device=settings.asr_device,
            compute_type=settings.asr_compute_type,
            cpu_threads=settings.asr_threads,
            language=settings.asr_language,
            beam_size=settings.asr_beam_size,
            window_s=settings.asr_window_s,
        ),
    )
    progress(policy_line(settings))
    if (
        settings.llm_backend == "engine"
        and settings.llm_device.startswith("cuda")
        and settings.llm_quantization == "auto"
    ):
        from engine.int8_choice import cuda_choice

        progress(f"llm_quantization auto on CUDA: {cuda_choice().why}")
    llm = timed(f"LLM ({settings.llm_backend}: {settings.llm_url or settings.llm_model})", lambda: make_llm(settings))
    tts = timed(f"TTS ({settings.tts_backend} {settings.tts_voice})", lambda: make_tts(settings))
    turn = timed(f"end of turn ({settings.turn_model})", lambda: make_turn_detector(settings, progress))
    models = Models(vad=vad, asr=asr, llm=llm, tts=tts, turn=turn)
    timed("warm-up (one pass through ASR, LLM and TTS)", lambda: warm_up(models))
    return models


def warm_up(models: Models) -> None:
    """Run each model once so the first user does not pay for lazy initialisation."""
    import asyncio

    import numpy as np

    models.asr.transcribe(np.zeros(16_000, dtype=np.float32))
    list(models.tts.synthesize("Hello."))

    async def first_tokens() -> None:
        request = ReplyRequest([{"role": "user", "content": "Hi"}], "warm-up", GenerationSettings(max_tokens=2))
        stream = open_reply(models.llm, request)
        try:
            async for _ in stream:
                break
        finally:
            await stream.aclose()

    asyncio.run(first_tokens())
    prepare_tools = getattr(models.llm, "prepare_tools", None)
    if prepare_tools is not None:  # the grammar library's view of the vocabulary: ~1.5 s for Qwen's 152k tokens
        prepare_tools()
