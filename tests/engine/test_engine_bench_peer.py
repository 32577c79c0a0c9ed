"""engine/benchmarks/peer.py plumbing with fake sides (no llama.cpp needed): keys, ratios, report, errors."""

from __future__ import annotations

import json

import pytest

from engine.benchmarks import peer as bench_peer


class FakePeer:
    mode_concurrent = "fake, one after another"
    name = "fake llama.cpp"

    def __init__(self, *a) -> None:
        self.closed = False

    def decode_bs1(self, prompt, n):
        return 100.0

    def concurrent(self, reqs):
        assert len(reqs) == 8
        return 60.0, 6.0

    def prefill_ms(self, prompt):
        assert len(prompt) == bench_peer.PREFILL_TOKENS
        return 600.0

    def close(self):
        self.closed = True


class FakeOurs:
    def __init__(self, model, threads) -> None:
        pass

    def engine(self, precision):
        return None

    def decode_bs1(self, precision, prompt, n):
        return {"fp32": 50.0, "bf16": 80.0, "int8": 120.0}[precision]

    def concurrent(self, precision, reqs):
        return 150.0, 1.2

    def prefill_ms(self, precision, prompt):
        return 150.0


@pytest.mark.models  # the workload is tokenized with the bundled model's tokenizer
def test_peer_bench_ratios_and_json(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(bench_peer, "LlamaCppPeer", FakePeer)
    monkeypatch.setattr(bench_peer, "Ours", FakeOurs)
    out = tmp_path / "peer.json"
    assert bench_peer.main(["--quick", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["peer_decode_bs1_ratio"] == 1.2 and r["ours_decode_bs1_best_precision"] == "int8"
    assert r["peer_decode_bs1_ratio_fp32"] == 0.5
    assert r["peer_concurrent8_throughput_ratio"] == 2.5
    assert abs(r["peer_concurrent8_ttft_ratio"] - 0.2) < 1e-9
    assert r["peer_prefill_ratio"] == 0.25
    assert r["reps"] == 3 and len(r["peer_decode_bs1_tok_s"]["values"]) == 3
    text = capsys.readouterr().out
    assert "MISSED" not in text and "one after another" in text


def test_peer_bench_unreachable_url_is_a_clean_error(capsys):
    assert bench_peer.main(["--quick", "--peer-url", "http://127.0.0.1:9", "--precisions", "bf16"]) == 2
    assert "bench engine --peer" in capsys.readouterr().err


def _dies_on_its_first_token(conn, gguf, threads):
    """A worker that dies as a llama.cpp built for another CPU does: SIGILL on its first token (the warm-up, while
    the parent still waits for it to be ready)."""
    import os
    import signal

    os.kill(os.getpid(), signal.SIGILL)


def test_a_peer_that_dies_stops_the_run_with_its_cause(tmp_path):
    """`--peer llama-cpp` on a CPU its build does not fit: the worker's death is an error naming SIGILL, not a wait."""
    import time

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="signal 4 .*illegal instruction.*make bench-deps"):
        bench_peer.LlamaCppPeer(tmp_path / "model.gguf", 1, worker=_dies_on_its_first_token)
    assert time.monotonic() - t0 < 30


def _ready_built_for_avx2(conn, gguf, threads):
    """A worker that is ready and says what its llama.cpp was built for, then ends when asked to."""
    conn.send(("ok", "AVX AVX2 FMA"))
    conn.recv()


def test_the_report_names_what_the_peer_was_built_for(tmp_path):
    """A build for AVX2 alone on an AVX-512 CPU is llama.cpp below its best: the peer's name says which sets it uses."""
    peer = bench_peer.LlamaCppPeer(tmp_path / "model.gguf", 1, worker=_ready_built_for_avx2)
    try:
        assert peer.name.endswith("(built for AVX AVX2 FMA)")
    finally:
        peer.close()
