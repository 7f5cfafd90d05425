# Two entry points do all set-up on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0

.PHONY: demo test lint install clean bench bench-llama

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

DEMO_GGUF := build/demo-gguf

# the demo pair as GGUF files, for the llama.cpp backend (verispec export-gguf, F32: exact)
$(DEMO_GGUF)/target.gguf: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/verispec export-gguf $@
$(DEMO_GGUF)/draft.gguf: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/verispec export-gguf --demo-draft $@

# the demo pair on PyTorch, then the same pair on llama.cpp's forward
demo: $(STAMP) $(DEMO_GGUF)/target.gguf $(DEMO_GGUF)/draft.gguf
	HF_HUB_OFFLINE=1 $(BIN)/verispec generate "def fibonacci(n):" --max-new-tokens 64 --temperature 0 --compare
	HF_HUB_OFFLINE=1 $(BIN)/verispec generate "def fibonacci(n):" --max-new-tokens 64 --temperature 0 --compare \
		--target $(DEMO_GGUF)/target.gguf --draft $(DEMO_GGUF)/draft.gguf --backend llama.cpp

# two pytest workers (pytest-xdist), each test on one torch thread (tests/conftest.py): on the
# 2-core machines CI runs on, 11.5 instead of 17.5 minutes on a Zen 3 EPYC. A test file stays
# on one worker (--dist loadfile), so its module fixtures load once. TEST_WORKERS=0: one process
TEST_WORKERS ?= 2

# ruff (pinned in the dev extra, configured in pyproject.toml) runs first: a finding fails the
# target before the suite starts
LINTED := src tests benchmarks scripts examples

lint: $(STAMP)
	$(BIN)/ruff check $(LINTED)

test: $(STAMP) lint
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

bench: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/run_bench.py --ks 1 2 3 4 5 6 8

# verispec on llama.cpp against llama.cpp's own server on the demo pair's GGUF files. The
# llama-server comparison needs a binary built from llama.cpp's source: make bench-llama
# LLAMA_SERVER=/path/to/llama-server (without it, verispec's rows alone).
LLAMA_SERVER ?=
bench-llama: $(STAMP) $(DEMO_GGUF)/target.gguf $(DEMO_GGUF)/draft.gguf
	HF_HUB_OFFLINE=1 $(BIN)/verispec bench --target $(DEMO_GGUF)/target.gguf \
		--draft $(DEMO_GGUF)/draft.gguf --backend llama.cpp --ks 1 2 3 4 5 6 8 \
		--max-new-tokens 96 --ngram-ks --hybrid-ks 3 \
		$(if $(LLAMA_SERVER),--llama-server $(LLAMA_SERVER) --llama-server-ks 3 5 8) \
		--json benchmarks/results/bench_llama_cpp.json \
		--markdown benchmarks/results/bench_llama_cpp.md

clean:
	rm -rf $(VENV) build dist src/*.egg-info
