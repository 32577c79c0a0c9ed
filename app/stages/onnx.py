"""ONNX Runtime sessions as the stages run them: on a CPU they share with each other."""

from __future__ import annotations

from pathlib import Path


def cpu_session(model: str | Path | bytes, threads: int, *, log_severity: int = 2):
    """An ONNX Runtime session (of a model file, or a serialized model) on ``threads`` intra-op threads (0: ONNX
    Runtime's default, one per physical core) whose idle threads sleep.

    By default ORT's pool threads spin after each run, waiting for the next: after a Piper piece on
    2 threads that burnt ~50 ms of a core while the LLM wrote the next piece beside it. Without it the
    synthesis itself was no slower (4 words: 89-102 ms against 100-104, 30 runs each).
    """
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = log_severity
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return onnxruntime.InferenceSession(
        model if isinstance(model, bytes) else str(model), sess_options=options, providers=["CPUExecutionProvider"]
    )
