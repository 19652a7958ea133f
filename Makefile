# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
#
# Everything is installed into a project virtual environment, never into the system
# interpreter: `.venv` for the default torch release, `.venv-torchX.Y.Z` for any other
# (`make test TORCH=2.14.1`). Torch is pinned and installed first, so that the package's
# own `torch` requirement is already met and pip does not pick a release by itself.
# A stamp file in each environment records what was installed; it is redone only when
# pyproject.toml changes (`make clean` forgets the stamps, `make distclean` the venvs).

# The interpreter that creates the virtual environments (Python 3.10+).
PYTHON ?= python3

# The torch releases that CI tests; pyproject.toml's torch requirement spans them.
# TORCH_MAIN is the default (`.venv`). `make test` runs the whole suite on the oldest and
# the newest release and a shorter pass on the one between (see the README).
TORCH_OLDEST = 2.11.0
TORCH_MAIN = 2.13.0
TORCH_COMPAT = 2.14.1
# The GPU targets need a CUDA build of torch. On this project's machines pip finds the
# CPU wheel for 2.13.0 and a CUDA build (which also runs on CPU) for 2.14.1.
TORCH_GPU ?= $(TORCH_COMPAT)

# `make test` runs the tested matrix; `make test TORCH=X` the whole suite on torch X alone.
ifeq ($(origin TORCH),undefined)
TORCH := $(TORCH_MAIN)
MATRIX := 1
endif

venv_of = $(if $(filter $(TORCH_MAIN),$(1)),.venv,.venv-torch$(1))
VENV := $(call venv_of,$(TORCH))
PY := $(VENV)/bin/python
COMPAT_VENV := $(call venv_of,$(TORCH_COMPAT))
OLDEST_VENV := $(call venv_of,$(TORCH_OLDEST))
GPU_VENV := $(call venv_of,$(TORCH_GPU))
PIP_INSTALL = -m pip install --disable-pip-version-check -q
# Extra pip options for the torch install only, e.g. an --index-url of CPU-only wheels on a
# machine that lacks the local wheel (pip's default torch for Linux is a CUDA build, GBs).
TORCH_PIP_FLAGS ?=

# $(call venv_rules,VERSION): the virtual environment for torch VERSION and its stamps:
# `.stamp-demo` (the package and its examples extra: what `make demo` needs),
# `.stamp-test` (the test, examples and docs extras: tests/test_docs.py builds the site)
# and `.stamp-lint` (the lint extra: ruff and mypy, pinned).
# `torchVERSION.pin` holds the package installs to that torch (pip fails rather than swap it).
define venv_rules
$(call venv_of,$(1))/bin/python:
	$(PYTHON) -m venv $(call venv_of,$(1))

$(call venv_of,$(1))/torch$(1).pin: | $(call venv_of,$(1))/bin/python
	$(call venv_of,$(1))/bin/python $(PIP_INSTALL) $(TORCH_PIP_FLAGS) "torch==$(1)"
	echo "torch==$(1)" > $$@

$(call venv_of,$(1))/.stamp-demo: pyproject.toml | $(call venv_of,$(1))/torch$(1).pin
	$(call venv_of,$(1))/bin/python $(PIP_INSTALL) -c $(call venv_of,$(1))/torch$(1).pin -e ".[examples]"
	touch $$@

$(call venv_of,$(1))/.stamp-test: pyproject.toml | $(call venv_of,$(1))/torch$(1).pin
	$(call venv_of,$(1))/bin/python $(PIP_INSTALL) -c $(call venv_of,$(1))/torch$(1).pin -e ".[test,examples,docs]"
	touch $$@ $(call venv_of,$(1))/.stamp-demo

$(call venv_of,$(1))/.stamp-lint: pyproject.toml | $(call venv_of,$(1))/torch$(1).pin
	$(call venv_of,$(1))/bin/python $(PIP_INSTALL) -c $(call venv_of,$(1))/torch$(1).pin -e ".[lint]"
	touch $$@
endef
$(foreach v,$(sort $(TORCH) $(TORCH_MAIN) $(TORCH_OLDEST) $(TORCH_COMPAT) $(TORCH_GPU)),$(eval $(call venv_rules,$(v))))

# The linters run on TORCH_MAIN's environment whatever TORCH says: mypy reads torch's own
# annotations, which change between releases.
LINT_VENV := $(call venv_of,$(TORCH_MAIN))

# pytest's exit status 5 (no test collected) fails the recipe like any other failure.
PYTEST = -m pytest -q --durations=8
# $(call JIT_SWEEP,PYTHON,DEVICES): every JAX comparison again through pmap(jit=...) on
# DEVICES CPU devices, where a fallback to eager fails. TORCHPMAP_TEST_JIT_BACKEND picks the
# compiler: inductor (jit=True, on every device) or aot_eager (the default: Dynamo and
# AOTAutograd without generated code, on one device, where a backend compiles).
JIT_SWEEP = TORCHPMAP_NUM_CPU_DEVICES=$(2) TORCHPMAP_TEST_JIT=1 $(1) $(PYTEST) tests/test_jax_differential.py \
	-W error::torchpmap.JitFallbackWarning

.PHONY: setup demo lint test test-main test-oldest test-short test-compat test-quick test-jit-inductor bench bench-cluster \
	docs test-gpu bench-gpu require-cuda gpu-check clean distclean

setup: $(VENV)/.stamp-test

demo: $(VENV)/.stamp-demo
	$(PY) examples/train_digits.py

# ruff (pyproject.toml's [tool.ruff]) over torchpmap/, tests/ and examples/, then mypy
# ([tool.mypy]) over torchpmap/. The same checks run as pre-commit hooks
# (.pre-commit-config.yaml; `$(LINT_VENV)/bin/pre-commit install` once, after a `make lint`).
lint: $(LINT_VENV)/.stamp-lint
	$(LINT_VENV)/bin/ruff check
	$(LINT_VENV)/bin/python -m mypy

ifdef MATRIX
test: test-oldest test-short test-compat
else
test: test-main
endif

# $(call in_halves,COMMAND): a pytest COMMAND run as two processes at once, one a core:
# TORCHPMAP_TEST_SHARD=1/2 and 2/2 (tests/conftest.py deals whole files to the two, the same
# way every run, so each half's order never changes; a single file's tests are dealt out one
# by one). The second half's output follows the first's; either failing fails the recipe.
define in_halves
	@echo "(in two halves at once) $(1)"
	@second_log=$$(mktemp); \
	TORCHPMAP_TEST_SHARD=2/2 $(1) > $$second_log 2>&1 & second=$$!; \
	TORCHPMAP_TEST_SHARD=1/2 $(1); first_rc=$$?; \
	wait $$second; second_rc=$$?; \
	echo "-- the second half (TORCHPMAP_TEST_SHARD=2/2), exit status $$second_rc:"; cat $$second_log; rm -f $$second_log; \
	test $$first_rc -eq 0 && test $$second_rc -eq 0
endef

# $(call suite,PYTHON,TORCH VERSION): the whole suite on one device, then tests/ again on 4
# CPU devices, less what pins its own devices (tests/conftest.py) and less the slow tests
# but one (two processes of 4 devices each: the also_on_four_devices mark), then the
# inductor jit sweep (jit=True's own path, generated code) on one device.
define suite
	@echo "== $$(date +%T) torch $(2): tests and doctests, 1 device"
	$(call in_halves,TORCHPMAP_NUM_CPU_DEVICES=1 $(1) $(PYTEST))
	@echo "== $$(date +%T) torch $(2): tests/, 4 CPU devices"
	$(call in_halves,TORCHPMAP_NUM_CPU_DEVICES=4 $(1) $(PYTEST) -m "not slow or also_on_four_devices" tests)
	@echo "== $$(date +%T) torch $(2): jit sweep, inductor, 1 device"
	$(call in_halves,TORCHPMAP_TEST_JIT_BACKEND=inductor $(call JIT_SWEEP,$(1),1))
endef

# The inductor jit sweep on 4 CPU devices (compiled device slices, collectives between
# them): $(call devices_sweep,PYTHON,TORCH VERSION), in `make test-main` (not in CI: about 14
# minutes in two halves on the 2-core machine); tests/test_jit_multi_device.py runs on
# every release.
define devices_sweep
	@echo "== $$(date +%T) torch $(2): jit sweep, inductor, 4 CPU devices"
	$(call in_halves,TORCHPMAP_TEST_JIT_BACKEND=inductor $(call JIT_SWEEP,$(1),4))
endef

# The jit sweep through Dynamo and AOTAutograd (the aot_eager backend: the trace, without
# generated code), on one device: $(call aot_eager_sweep,PYTHON,TORCH VERSION).
define aot_eager_sweep
	@echo "== $$(date +%T) torch $(2): jit sweep, aot_eager, 1 device"
	$(call in_halves,$(call JIT_SWEEP,$(1),1))
endef

# The whole suite on $(TORCH) (TORCH_MAIN unless given), with every jit sweep.
test-main: $(VENV)/.stamp-test
	$(call suite,$(PY),$(TORCH))
	$(call devices_sweep,$(PY),$(TORCH))
	$(call aot_eager_sweep,$(PY),$(TORCH))

# The oldest release: the whole suite and the GPU check's short pass on CPU devices (the GPU
# machines run this release; the check must not rot between their sessions). The aot_eager
# jit sweep (the trace through Dynamo and AOTAutograd, without generated code) is left to
# `make test-main`: the inductor sweep traces the same programs the same way before it
# generates code, and CI's hour is short (its last run took 71 minutes). The inductor sweep
# on 4 CPU devices (`make test-jit-inductor`, `make test-main`) was on course for 14
# minutes in two halves here, too much for CI's 90; tests/test_jit_multi_device.py
# compiles on 4 devices in every release's pass.
test-oldest: $(OLDEST_VENV)/.stamp-test
	$(call suite,$(OLDEST_VENV)/bin/python,$(TORCH_OLDEST))
	@echo "== $$(date +%T) torch $(TORCH_OLDEST): gpu-check --quick (no CUDA: its CPU parts, two at once)"
	$(MAKE) --no-print-directory gpu-check PYTHON=$(OLDEST_VENV)/bin/python GPU_CHECK_FLAGS="--quick --jobs 2" \
		GPU_CHECK_OUT=build/gpu-check-quick

# The release between the oldest and the newest, which run everything: the private torch
# APIs' probes, then the doctests (they import every module), the public API's tests and
# the JAX comparisons, on one device. It shows that the package installs on this release
# and that its modules run; more here took CI past its 90 minutes (`make test-quick` runs
# everything but the slow tests on this release, the one the virtual environment `.venv`
# holds).
test-short: $(VENV)/.stamp-test
	@echo "== $$(date +%T) torch $(TORCH_MAIN): private torch API probes"
	$(PY) -c "from torchpmap._state import torch_private; torch_private.check()"
	@echo "== $$(date +%T) torch $(TORCH_MAIN): doctests, tests/test_api.py, JAX comparisons, 1 device"
	$(call in_halves,TORCHPMAP_NUM_CPU_DEVICES=1 $(PY) $(PYTEST) torchpmap tests/test_api.py tests/test_jax_differential.py)

# The newest release: the tests and doctests not marked slow on one device, and the inductor
# jit sweep on one device. The oldest runs the rest (the slow tests, the 4-device passes);
# more here took CI past its 90 minutes.
test-compat: $(COMPAT_VENV)/.stamp-test
	@echo "== $$(date +%T) torch $(TORCH_COMPAT): tests and doctests not marked slow, 1 device"
	$(call in_halves,TORCHPMAP_NUM_CPU_DEVICES=1 $(COMPAT_VENV)/bin/python $(PYTEST) -m "not slow")
	@echo "== $$(date +%T) torch $(TORCH_COMPAT): jit sweep, inductor, 1 device"
	$(call in_halves,TORCHPMAP_TEST_JIT_BACKEND=inductor $(call JIT_SWEEP,$(COMPAT_VENV)/bin/python,1))

# The jit sweeps through jit=True's own path (inductor, generated code, no Dynamo), alone,
# on one device and on 4 CPU devices (`make test` runs the one-device sweep; `make test-main`
# both).
test-jit-inductor: $(VENV)/.stamp-test
	TORCHPMAP_TEST_JIT_BACKEND=inductor $(call JIT_SWEEP,$(PY),1)
	TORCHPMAP_TEST_JIT_BACKEND=inductor $(call JIT_SWEEP,$(PY),4)

# The inner loop while working: everything but the tests marked slow (several processes,
# the examples, Hugging Face models, the longest sweeps), tests and doctests, on one
# device and torch $(TORCH) only (TORCH_MAIN unless given), in two halves at once; each
# half stops at its first failure. `make test` runs the slow tests too.
test-quick: $(VENV)/.stamp-test
	$(call in_halves,TORCHPMAP_NUM_CPU_DEVICES=1 $(PY) $(PYTEST) -x -m "not slow")

bench: $(VENV)/.stamp-test
	$(PY) -m torchpmap.bench

# The data-parallel step on 2 and 3 simulated hosts (network namespaces joined by a
# rate-limited link): DDP vs torchpmap eager and jit=True. Needs root; skips without it.
bench-cluster: $(VENV)/.stamp-test
	$(PY) -m torchpmap.bench.cluster --json bench-results/cluster.json

docs: $(VENV)/.stamp-test
	$(PY) -m mkdocs build --strict

# --- GPUs ---

# One prepared command for a machine with CUDA, that installs nothing: PYTHON names an
# interpreter that already has torch (and pytest); this checkout goes on PYTHONPATH. Every
# part is timed and reported, also when an earlier one failed, within a budget of 450 s
# (GPU_CHECK_FLAGS="--budget S"); the report goes to $(GPU_CHECK_OUT)/report.md and .json.
# Without CUDA it runs what it can on CPU devices and names what it skipped (CI: --quick).
GPU_CHECK_OUT ?= gpu-check-results
GPU_CHECK_FLAGS ?=
gpu-check:
	PYTHONPATH="$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}" GPU_CHECK_OUT="$(GPU_CHECK_OUT)" \
		$(PYTHON) -m torchpmap.bench.gpu_check $(GPU_CHECK_FLAGS)

# --- the older GPU targets: they install into a venv (see the README) ---
GPU_PY := $(GPU_VENV)/bin/python

# Refuses unless torch sees a CUDA device. Without a venv yet and without an NVIDIA device
# node, it refuses before installing a multi-GB torch for nothing.
require-cuda:
	@if [ ! -x $(GPU_PY) ] && ! ls /dev/nvidia[0-9]* >/dev/null 2>&1; then \
		echo "refusing: no NVIDIA device here (no /dev/nvidia0). The GPU targets need a CUDA machine; on CPU use make test." >&2; \
		exit 1; fi
	@$(MAKE) --no-print-directory $(GPU_VENV)/.stamp-test
	@$(GPU_PY) -c "import sys, torch; sys.exit(0) if torch.cuda.is_available() else sys.exit( \
		'refusing: torch.cuda.is_available() is False (torch ' + torch.__version__ + ', built for CUDA ' + \
		str(torch.version.cuda) + '). The GPU targets need a CUDA machine; on CPU use make test.')"
	@$(GPU_PY) -c "import torch; print('==', torch.cuda.device_count(), 'CUDA device(s):', \
		[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())], 'torch', torch.__version__)"

# Device equivalence and several devices in one process, the examples, then NCCL across
# 2 processes with torchrun. TORCHPMAP_NUM_CPU_DEVICES is unset: every CUDA device is one.
test-gpu: require-cuda
	env -u TORCHPMAP_NUM_CPU_DEVICES $(GPU_PY) $(PYTEST) $(wildcard tests/test_device_equivalence*.py) \
		tests/test_api.py tests/test_multi_device.py tests/test_examples.py
	env -u TORCHPMAP_NUM_CPU_DEVICES $(GPU_PY) examples/train_digits.py
	env -u TORCHPMAP_NUM_CPU_DEVICES $(GPU_PY) examples/train_digits.py --jit
	@$(GPU_PY) -c "import sys, torch; sys.exit(0) if torch.cuda.device_count() >= 2 else sys.exit( \
		'NCCL across processes needs 2 CUDA devices (one per process); this machine has 1')"
	env -u TORCHPMAP_NUM_CPU_DEVICES $(GPU_VENV)/bin/torchrun --nproc-per-node=2 examples/multiprocess_data_parallel.py
	env -u TORCHPMAP_NUM_CPU_DEVICES $(GPU_VENV)/bin/torchrun --nproc-per-node=2 examples/multiprocess_data_parallel.py --jit
	# every gradient all-reduced in small buckets during the backward (NCCL), eager and compiled
	env -u TORCHPMAP_NUM_CPU_DEVICES TORCHPMAP_ALL_REDUCE_BYTES=1 TORCHPMAP_BUCKET_BYTES=4096 \
		$(GPU_VENV)/bin/torchrun --nproc-per-node=2 examples/multiprocess_data_parallel.py
	env -u TORCHPMAP_NUM_CPU_DEVICES TORCHPMAP_ALL_REDUCE_BYTES=1 TORCHPMAP_BUCKET_BYTES=4096 \
		$(GPU_VENV)/bin/torchrun --nproc-per-node=2 examples/multiprocess_data_parallel.py --jit

# The benchmark on the first CUDA device; results beside the CPU ones, not over them.
bench-gpu: require-cuda
	env -u TORCHPMAP_NUM_CPU_DEVICES $(GPU_PY) -m torchpmap.bench \
		--json bench-results/bench-gpu.json --png bench-results/bench-gpu.png

clean:
	rm -rf .venv*/.stamp-* .venv*/torch*.pin .setup-done site build *.egg-info .mypy_cache .ruff_cache

distclean: clean
	rm -rf .venv .venv-torch*
