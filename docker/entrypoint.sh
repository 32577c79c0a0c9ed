#!/bin/sh
# Container entrypoint: check the data volume, fetch hub-named models into it (first start only,
# with progress), then run the command (default: parley serve --host 0.0.0.0).
set -eu

say() { echo "[parley-entrypoint] $*" >&2; }

data=${PARLEY_DATA_DIR:-/data}
say "data volume $data: converted weights in ${PARLEY_CACHE_DIR:-$data/cache}, downloads in ${HF_HOME:-$data/hf}"
if ! mkdir -p "${PARLEY_CACHE_DIR:-$data/cache}" "${HF_HOME:-$data/hf}" 2>/dev/null; then
    say "cannot write to $data as uid $(id -u): mount a volume there that this user can write (-v parley-data:$data)"
    exit 1
fi
say "ASR ${PARLEY_ASR_MODEL:-bundled} on ${PARLEY_ASR_DEVICE:-cpu} (${PARLEY_ASR_COMPUTE_TYPE:-int8});" \
    "LLM ${PARLEY_LLM_BACKEND:-engine} ${PARLEY_LLM_URL:-${PARLEY_LLM_MODEL:-bundled}} on ${PARLEY_LLM_DEVICE:-cpu};" \
    "TTS ${PARLEY_TTS_BACKEND:-piper} ${PARLEY_TTS_VOICE:-bundled}"
if command -v nvidia-smi >/dev/null 2>&1; then
    say "GPU: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -n 1)"
else
    say "no nvidia-smi: was the container started with --gpus all?"
fi
[ "$#" -gt 0 ] || set -- parley serve --host 0.0.0.0
exec python "$(dirname "$0")/fetch_models.py" "$@"
