# The two commands of the README: `make serve` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.specserve-installed
PYTEST_ARGS ?=

.PHONY: install test serve bench-engine bench-spec bench-methods bench-trees bench-predicted \
	bench-eagle bench-traffic bench-trees-eagle bench-medusa bench-variants bench-lookahead bench-server bench-tp bench-llamacpp wheelhouse gpu-check image-check clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# the CPU build from this machine's disk; a bare `torch` would pull a multi-GB CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $(STAMP)

install: $(STAMP)

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

# `HOST=0.0.0.0 PORT=9000 make serve` (or make serve HOST=... PORT=...) overrides the config's
HOST ?=
PORT ?=
serve: install
	$(VENV)/bin/specserve serve --config configs/default.yaml --fetch-missing \
		$(if $(HOST),--host $(HOST)) $(if $(PORT),--port $(PORT))

bench-engine: install
	$(VENV)/bin/specserve models fetch smollm2-135m-instruct qwen2.5-coder-0.5b-instruct
	$(PY) bench/engine_vs_hf.py

bench-spec: install
	$(VENV)/bin/specserve models fetch qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct
	$(PY) bench/spec_decode.py

bench-methods: install
	$(VENV)/bin/specserve models fetch qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct
	$(PY) bench/spec_methods.py

# Token trees against chains: plain, suffix, the draft model and hybrid, chains only and trees.
bench-trees: install
	$(VENV)/bin/specserve models fetch qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct
	$(PY) bench/spec_methods.py --trees

# lookahead decoding (no draft): its n-gram pool, its window guarded and unguarded, in hybrid
bench-lookahead: install
	$(VENV)/bin/specserve models fetch qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct
	$(PY) bench/spec_methods.py --lookahead

# OpenAI's Predicted Outputs on whole-file code edits: plain, hybrid, hybrid + prediction
# (bench/prompts/predicted_outputs/; about 25-30 minutes on 2 cores).
bench-predicted: install
	$(VENV)/bin/specserve models fetch qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct
	$(PY) bench/predicted_outputs.py

# The packaged pair with the target split over 1 and 2 ranks (processes), the cores shared out.
bench-tp: install
	$(VENV)/bin/specserve models fetch qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct
	$(PY) bench/tensor_parallel.py

# A draft head for the served target (int4 on the CPU), trained once within 60 minutes and
# cached (its curve: bench/results/eagle_training_<intel|amd>.md), then plain / draft model / eagle /
# hybrid with the head side by side.
SPECULATOR ?= $(HOME)/.cache/specserve/speculators/qwen2.5-coder-1.5b-instruct-auto
bench-eagle: install
	$(VENV)/bin/specserve models fetch qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct
	$(PY) bench/eagle_training.py --head $(SPECULATOR) --minutes 60 --concurrency 32
	$(PY) bench/spec_methods.py --speculator $(SPECULATOR)

# Learning from served traffic: serve with `speculative.record` on, send 200 chat requests,
# fine-tune bench-eagle's head on them for 10 minutes, held-out acceptance before and after.
bench-traffic: install
	$(VENV)/bin/specserve models fetch qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct
	test -f $(SPECULATOR)/config.json || $(PY) bench/eagle_training.py --head $(SPECULATOR) \
		--minutes 60 --concurrency 32
	$(PY) bench/traffic_finetune.py --head $(SPECULATOR)

# A head's EAGLE-2 dynamic token trees against its chains (the head from bench-eagle's cache,
# trained first where it is missing).
bench-trees-eagle: install
	$(VENV)/bin/specserve models fetch qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct
	test -f $(SPECULATOR)/config.json || $(VENV)/bin/specserve speculator train \
		--target qwen2.5-coder-1.5b-instruct --out $(SPECULATOR) --minutes 60 --concurrency 32
	$(PY) bench/spec_methods.py --trees --speculator $(SPECULATOR)

# Medusa heads against the EAGLE head, both trained once within 60 minutes on the same pipeline
# (the same prompts, answers and budget as bench-eagle's head) and cached: plain, eagle, medusa
# chains and trees, hybrid with the heads.
MEDUSA ?= $(HOME)/.cache/specserve/speculators/qwen2.5-coder-1.5b-instruct-medusa
bench-medusa: install
	$(VENV)/bin/specserve models fetch qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct
	test -f $(SPECULATOR)/config.json || $(PY) bench/eagle_training.py --head $(SPECULATOR) \
		--minutes 60 --concurrency 32
	test -f $(MEDUSA)/config.json || $(VENV)/bin/specserve speculator train --kind medusa \
		--target qwen2.5-coder-1.5b-instruct --out $(MEDUSA) --minutes 60 --concurrency 32
	$(PY) bench/spec_methods.py --speculator $(SPECULATOR) --medusa $(MEDUSA)

# Both variants (Medusa with the heads above, Lookahead) in one run beside plain and the EAGLE
# head; QUANT=none runs the bf16 target (default: int4, as make serve).
QUANT ?= auto
bench-variants: install
	$(VENV)/bin/specserve models fetch qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct
	test -f $(SPECULATOR)/config.json || $(PY) bench/eagle_training.py --head $(SPECULATOR) \
		--minutes 60 --concurrency 32
	test -f $(MEDUSA)/config.json || $(VENV)/bin/specserve speculator train --kind medusa \
		--target qwen2.5-coder-1.5b-instruct --out $(MEDUSA) --minutes 60 --concurrency 32
	$(PY) bench/spec_methods.py --speculator $(SPECULATOR) --medusa $(MEDUSA) --lookahead \
		--quantization $(QUANT) $(if $(filter none,$(QUANT)),--repeats 1 \
		--out bench/results/spec_methods_medusa_lookahead_bf16.md)

# specserve (bf16, int4, int4 + speculation) against llama.cpp's server on the same GGUF files;
# builds llama-server once from the llama-cpp-python source package, native to this CPU
# (about 8 minutes; checked by serving a completion, rebuilt with AMX off where AMX crashes).
bench-llamacpp: install
	$(VENV)/bin/specserve models fetch qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct \
		--keep-downloads
	PYTHON=$(PY) scripts/build_llamacpp.sh "$$($(PY) -c 'from engine.models import recipes; \
		print(recipes.source_gguf("qwen2.5-coder-1.5b-instruct"))' 2> /dev/null | tail -1)"
	$(PY) bench/cpu_vs_llamacpp.py

# The server's packages as CPython 3.12 manylinux wheels, for `make gpu-check` on a machine
# without network (torch, transformers and triton are expected there already).
wheelhouse: install
	$(PY) scripts/wheelhouse.py --out .wheelhouse

# On a machine with an NVIDIA GPU: CUDA tests, bench/gpu_bench.py, one HTTP request on cuda.
# Uses that machine's python3 (torch + CUDA, transformers, triton), never this venv.
gpu-check:
	scripts/gpu_check.sh

# Builds the image and runs docker-compose.yml (two replicas, nginx, Prometheus): requests, a
# drained stop and a kill -9 under load (scripts/image_check.sh; ~20 min; not part of `make test`)
image-check:
	scripts/image_check.sh

bench-server: install
	$(VENV)/bin/specserve models fetch smollm2-135m-instruct
	$(PY) bench/server_overhead.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
