"""A Piper voice's model cut in two, so that a piece's first words are heard before the rest is synthesized.

A Piper (VITS) model turns phonemes into a latent: a frame of 192 values per ~12 ms of audio (the text
encoder, the duration predictor and the flow: about a third of the time), and the decoder (HiFi-GAN) turns
the frames into audio (the rest, in proportion to the audio's length). The decoder is convolutional, so
frames decoded with ``CONTEXT_FRAMES`` of their neighbours on each side give the very samples the whole
decode gives. A piece a listener waits on is then decoded head first (``chunk_ends``): its first
``HEAD_FRAMES`` go out while the rest is decoded (figures: app/bench/results/turn_flow.md).

The cut needs the exported graph's names (``/dec/...``, as piper-train's exports since 2023 have them); a
voice without them runs whole (``split_piper`` returns None).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from pathlib import Path

import numpy as np

from app.stages.onnx import cpu_session

DECODER_SCOPE = "/dec/"
# Frames decoded beside a chunk on each side and dropped: the bundled voice's decoder sees ~12 frames each way
# (12: the whole decode's samples exactly; 8: within 1e-3; 4: clicks at the seams, 0.05).
CONTEXT_FRAMES = 12
# A piece decoded head first: its first HEAD_FRAMES (~280 ms of audio, the voice's ~50 ms lead-in among them),
# then chunks of up to twice the frames before them (at least MIN_CHUNK_FRAMES), each decoded while the audio
# before it plays. With four users on 2 cores a head of 16 frames then the rest in one run left 5 gaps of 15-95 ms
# in 96 replies: the rest waited for the lane, beside three other conversations' work.
HEAD_FRAMES = 24
MIN_CHUNK_FRAMES = 64


def chunk_ends(frames: int) -> list[int]:
    """Where a piece of ``frames`` decoded head first is cut: the end of each chunk, the last one ``frames``."""
    if frames <= HEAD_FRAMES + CONTEXT_FRAMES:
        return [frames]  # (too short to gain from a head)
    ends = [HEAD_FRAMES]
    while ends[-1] < frames:
        ends.append(min(frames, ends[-1] + max(2 * ends[-1], MIN_CHUNK_FRAMES)))
    return ends


@dataclasses.dataclass
class PiperHalves:
    """The two sessions of one voice's model and the tensors between them."""

    front: object  # onnxruntime.InferenceSession: phonemes -> the latent (and any speaker conditioning)
    decoder: object  # onnxruntime.InferenceSession: the latent -> audio
    latent: str  # the decoder input with one frame per hop of audio, on its last axis
    conditioning: list[str]  # other decoder inputs (a multi-speaker voice's speaker embedding), passed whole
    hop: int  # audio samples per latent frame

    def latents(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run the front half: the model's own inputs (``input``, ``input_lengths``, ``scales``, ``sid``)."""
        names = [self.latent, *self.conditioning]
        return dict(zip(names, self.front.run(names, inputs), strict=True))

    def frames(self, latents: dict[str, np.ndarray]) -> int:
        return int(latents[self.latent].shape[-1])

    def decode(self, latents: dict[str, np.ndarray], start: int = 0, end: int | None = None) -> np.ndarray:
        """Audio of frames ``start`` to ``end`` (None: the last), decoded with their context and cut to them."""
        frames = self.frames(latents)
        end = frames if end is None else min(end, frames)
        low, high = max(0, start - CONTEXT_FRAMES), min(frames, end + CONTEXT_FRAMES)
        feeds = dict(latents)
        feeds[self.latent] = latents[self.latent][..., low:high]
        audio = self.decoder.run(None, feeds)[0].reshape(-1)
        offset = (start - low) * self.hop
        return audio[offset : offset + (end - start) * self.hop]


# Bump when the cut's output changes: every cached cut is then made again.
CUT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class _Cut:
    """A voice's graph cut before its decoder: the two halves (serialized, or their cached files) and the
    tensors that cross the cut."""

    front: bytes | Path
    decoder: bytes | Path
    latent: str
    conditioning: list[str]


def split_piper(
    model: str | Path, threads: int | list[int], hop: int = 256, *, cache: Path | None = None
) -> list[PiperHalves] | None:
    """``model`` cut before its decoder, as sessions on each of ``threads`` (one pair per count); ``hop``: its
    audio samples per latent frame (the voice config's ``hop_length``). None when the graph has no decoder scope
    to cut at.

    The cut is kept in ``cache`` (``PARLEY_CACHE_DIR`` or ``~/.cache/parley``, under ``piper-halves``): making it
    loads the ``onnx`` package and walks the graph, ~3.5 s of a server's start on 2 cores; reading it back, the
    two halves' files, is what the sessions load anyway.
    """
    cut = _cached_cut(Path(model), cache)
    if cut is None:
        return None
    counts = [threads] if isinstance(threads, int) else threads
    return [
        PiperHalves(cpu_session(cut.front, count), cpu_session(cut.decoder, count), cut.latent, cut.conditioning, hop)
        for count in counts
    ]


def _cached_cut(model: Path, cache: Path | None) -> _Cut | None:
    """The cut from the cache when an earlier start made it for this very file (path, size, mtime), else made now
    and written there (each half under a temporary name and renamed, the description last: a crash or a start
    beside this one never leaves a half-written cut that reads as whole). A cache that cannot be written is only
    a slower next start."""
    if cache is None:
        from engine.weights import cache_dir

        cache = cache_dir()
    resolved = model.resolve()
    stat = resolved.stat()
    key = hashlib.sha256(f"{CUT_VERSION}|{resolved}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()
    folder = cache / "piper-halves" / f"{model.stem}-{key[:16]}"
    described = folder / "cut.json"
    if described.is_file():
        found = json.loads(described.read_text(encoding="utf-8"))
        if not found["cut"]:
            return None
        return _Cut(folder / "front.onnx", folder / "decoder.onnx", found["latent"], found["conditioning"])
    cut = _cut(model)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if cut is not None:
            _write_atomically(folder / "front.onnx", cut.front)
            _write_atomically(folder / "decoder.onnx", cut.decoder)
        description = (
            {"cut": False} if cut is None else {"cut": True, "latent": cut.latent, "conditioning": cut.conditioning}
        )
        _write_atomically(described, json.dumps(description).encode())
    except OSError:
        pass
    return cut


def _write_atomically(target: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _cut(model: Path) -> _Cut | None:
    """Cut the graph: the front half runs the model's own inputs to every tensor the decoder reads."""
    import onnx
    from onnx.utils import Extractor

    graph_model = onnx.load(str(model))
    graph = graph_model.graph
    made_by = {output: index for index, node in enumerate(graph.node) for output in node.output}
    # the decoder and what reads its output (a reshape), in the graph's topological order
    after: set[int] = set()
    for index, node in enumerate(graph.node):
        if node.name.startswith(DECODER_SCOPE) or any(made_by.get(name) in after for name in node.input):
            after.add(index)
    if not after:
        return None
    cut: list[str] = []  # tensors made before the decoder and read after it, in the order first read
    for index in sorted(after):
        for name in graph.node[index].input:
            if name in made_by and made_by[name] not in after and name not in cut:
                cut.append(name)
    latent = next(node for node in graph.node if node.name.startswith(DECODER_SCOPE)).input[0]
    audio = graph.output[0].name
    model_inputs = [value.name for value in graph.input]
    reads_inputs = any(name in model_inputs for index in after for name in graph.node[index].input)
    if latent not in cut or made_by.get(audio) not in after or reads_inputs:
        return None  # not the graph this cut is for
    extractor = Extractor(graph_model)
    return _Cut(
        extractor.extract_model(model_inputs, cut).SerializeToString(),
        extractor.extract_model(cut, [audio]).SerializeToString(),
        latent,
        [name for name in cut if name != latent],
    )
