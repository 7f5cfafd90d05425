# Two entry points do all set-up on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0

.PHONY: demo test install clean bench

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# torch first, pinned: on a CPU machine this resolves to the local CPU wheel, and the
# package's own `torch>=2.4` range is then already satisfied (no CUDA stack is pulled).
# llama-cpp-python (the llamacpp extra, in dev) compiles llama.cpp here: several minutes on 2
# cores the first time, then pip's wheel cache has it. Its multimodal library is not needed.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q "torch==$(TORCH_VERSION)"
	CMAKE_ARGS="$${CMAKE_ARGS:--DLLAVA_BUILD=OFF}" $(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/verispec generate "def fibonacci(n):" --max-new-tokens 64 --temperature 0 --compare

test: $(STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(BIN)/python -m pytest -q

bench: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/run_bench.py --ks 1 2 3 4 5 6 8

clean:
	rm -rf $(VENV) build dist src/*.egg-info
