"""Piper's model in two halves (``app.stages.piper_halves``): a piece decoded head first is the same audio."""

from __future__ import annotations

import itertools
import os
import threading
import time

import numpy as np
import pytest

from app.stages.piper_halves import CONTEXT_FRAMES, HEAD_FRAMES, MIN_CHUNK_FRAMES, chunk_ends, split_piper


@pytest.fixture(scope="module")
def tts():
    from app.stages.tts import PiperSynthesizer

    synthesizer = PiperSynthesizer(threads=1, urgent_threads=2)
    synthesizer._config.noise_scale = synthesizer._config.noise_w_scale = 0.0  # the same audio on every run
    return synthesizer


@pytest.mark.models
def test_frames_decoded_in_chunks_with_their_context_are_the_whole_decode(tts):
    model = tts._voices["joe"]
    halves = model.halves
    assert halves is not None and halves.hop == 256
    latents = halves.latents(tts._inputs(model, tts._sentences(model, "Paris is a big city on the Seine.")[0]))
    frames = halves.frames(latents)
    whole = halves.decode(latents)
    assert len(whole) == frames * halves.hop
    cuts = [0, 16, 21, frames // 2, frames]
    chunks = np.concatenate([halves.decode(latents, start, end) for start, end in itertools.pairwise(cuts)])
    assert np.abs(chunks - whole).max() < 1e-4


def test_a_head_then_chunks_of_up_to_twice_the_audio_before_them():
    assert chunk_ends(HEAD_FRAMES + CONTEXT_FRAMES) == [HEAD_FRAMES + CONTEXT_FRAMES]  # too short: whole
    assert chunk_ends(80) == [HEAD_FRAMES, 80]
    assert chunk_ends(245) == [HEAD_FRAMES, HEAD_FRAMES + MIN_CHUNK_FRAMES, 245]
    ends = chunk_ends(5000)
    assert ends[0] == HEAD_FRAMES and ends[-1] == 5000
    for before, end in itertools.pairwise(ends):
        assert end - before <= max(2 * before, MIN_CHUNK_FRAMES)


@pytest.mark.models
def test_a_piece_needed_now_comes_head_first_and_one_with_time_ahead_whole(tts):
    text = "The weather is sunny today, and tomorrow it will rain."
    now = list(tts.synthesize(text, deadline=None))
    ahead = list(tts.synthesize(text, deadline=time.monotonic() + 10))
    assert len(ahead) == 1
    frames = len(ahead[0]) // 256
    assert [len(chunk) // 256 for chunk in now] == np.diff([0, *chunk_ends(frames)]).tolist()
    assert len(now) >= 3
    assert np.abs(np.concatenate(now) - ahead[0]).max() < 1e-4
    # one gain for every piece (not Piper's peak of 1.0 per sentence), nothing past full scale
    peak = float(np.abs(ahead[0]).max())
    assert 0.4 < peak <= 1.0


@pytest.mark.models
def test_a_piece_whose_listener_runs_dry_while_it_waits_for_the_lane_comes_head_first(tts):
    holding, release = threading.Event(), threading.Event()

    def long_piece() -> None:  # another conversation's piece, with a minute of its audio ahead, holds the lane
        with tts._lock.hold(time.monotonic() + 60):
            holding.set()
            release.wait(10)

    holder = threading.Thread(target=long_piece)
    holder.start()
    assert holding.wait(5)
    try:  # its listener has 0.3 s of audio left: by the time that has played it is needed now, and head first
        chunks = list(
            tts.synthesize("The weather is sunny today, and tomorrow it will rain.", deadline=time.monotonic() + 0.3)
        )
    finally:
        release.set()
        holder.join(5)
    assert len(chunks) == len(chunk_ends(sum(len(chunk) for chunk in chunks) // 256)) > 1


@pytest.mark.models
def test_only_the_first_sentence_comes_head_first(tts):
    text = "It is sunny today. Tomorrow it will rain in the north."
    now = list(tts.synthesize(text, deadline=None))
    ahead = list(tts.synthesize(text, deadline=time.monotonic() + 10))
    assert len(ahead) == 2  # a sentence each
    assert len(now) == len(chunk_ends(len(ahead[0]) // 256)) + 1  # the first in chunks, the second whole
    assert np.abs(np.concatenate(now) - np.concatenate(ahead)).max() < 1e-4


def test_a_graph_without_a_decoder_scope_is_not_cut(tmp_path):
    """Voices exported without the module names run whole (``PiperSynthesizer`` keeps their one session)."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["input"], ["output"], name="Identity_0")],
        "plain",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, 4])],
    )
    path = tmp_path / "plain.onnx"
    onnx.save(helper.make_model(graph), str(path))
    assert split_piper(path, 1, cache=tmp_path / "cache") is None
    assert split_piper(path, 1, cache=tmp_path / "cache") is None  # (read back from the cache)


def tiny_voice(path, decoder_op: str) -> None:
    """A graph shaped as Piper's exports are: a front (``/enc/``) to a latent, and a decoder scope (``/dec/``)."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [
            helper.make_node("Relu", ["input"], ["latent"], name="/enc/Relu"),
            helper.make_node(decoder_op, ["latent"], ["output"], name=f"/dec/{decoder_op}"),
        ],
        "voice",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, 4])],
        value_info=[helper.make_tensor_value_info("latent", TensorProto.FLOAT, [1, 4])],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def test_the_cut_is_kept_and_read_back_only_for_the_same_file(tmp_path, monkeypatch):
    """A start after the first reads the two halves from the cache (the cut loads ``onnx`` and walks the graph);
    a voice file replaced at the same path is cut again. (Sessions on the halves: the model tests above.)"""
    from app.stages import piper_halves

    voice, cache = tmp_path / "voice.onnx", tmp_path / "cache"
    tiny_voice(voice, "Neg")
    first = piper_halves._cached_cut(voice, cache)
    assert isinstance(first.front, bytes) and (first.latent, first.conditioning) == ("latent", [])
    with monkeypatch.context() as patch:
        patch.setattr(piper_halves, "_cut", lambda model: pytest.fail("cut again although cached"))
        again = piper_halves._cached_cut(voice, cache)
    assert (again.front.read_bytes(), again.decoder.read_bytes()) == (first.front, first.decoder)
    assert (again.latent, again.conditioning) == (first.latent, first.conditioning)
    tiny_voice(voice, "Exp")  # another voice at the same path
    os.utime(voice, ns=(voice.stat().st_mtime_ns + 10**9,) * 2)
    replaced = piper_halves._cached_cut(voice, cache)
    assert isinstance(replaced.decoder, bytes) and replaced.decoder != first.decoder
    assert b"Exp" in replaced.decoder and b"Neg" in first.decoder
    assert not [path.name for path in cache.rglob("*") if path.name.startswith(("front.onnx.", "decoder.onnx."))]
