"""``parley bench kernels``: a small run reports every kernel call with this build's time; bad input is one line.

No timing assertions (a shared, drifting machine): the figures' presence, and this build equal to itself.
"""

from __future__ import annotations

import json

import pytest

from engine.benchmarks.kernels import main
from engine.fused import fused_kernels

fk = fused_kernels()
pytestmark = pytest.mark.skipif(
    fk is None or not fk.has_int8_linear(), reason="the fused kernels with int8_linear are not built here"
)


def test_a_small_run_reports_every_call(tmp_path, capsys):
    path = tmp_path / "kernels.json"
    args = ["--rows", "1,5", "--layers", "1", "--vocab", "256", "--context", "40", "--repeats", "2"]
    assert main([*args, "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    names = [row["case"] for row in result["cases"]]
    assert len(names) == 7 and any("5 row(s)" in name for name in names)  # silu, 2 attention, 2 x (linears, head)
    for row in result["cases"]:
        assert row["ms"]["this build"] > 0 and row["differs"] == {"this build": 0.0}
    assert "silu_mul 16 rows" in capsys.readouterr().out


def test_a_missing_source_to_compare_is_one_line(tmp_path, capsys):
    assert main(["--against", str(tmp_path / "old.cpp"), "--layers", "1", "--vocab", "64"]) == 2
    assert "no kernel source at" in capsys.readouterr().err
