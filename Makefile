# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
PIP = $(PYTHON) -m pip install --disable-pip-version-check -q
# The pinned CPU wheel first: an unpinned torch would pull several GB of CUDA packages.
TORCH_PIN ?= torch==2.13.0
STAMP = .setup-done

.PHONY: setup demo test test-quick bench docs clean

$(STAMP): pyproject.toml
	$(PIP) "$(TORCH_PIN)"
	$(PIP) -e ".[test,examples,docs]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PYTHON) examples/train_digits.py

# The whole suite on one device, then the device-spanning parts again on 4 CPU devices,
# then every JAX comparison again through pmap(jit=True), where a fallback to eager fails.
test: $(STAMP)
	TORCHPMAP_NUM_CPU_DEVICES=1 $(PYTHON) -m pytest -q
	TORCHPMAP_NUM_CPU_DEVICES=4 $(PYTHON) -m pytest -q tests
	TORCHPMAP_NUM_CPU_DEVICES=1 TORCHPMAP_TEST_JIT=1 $(PYTHON) -m pytest -q tests/test_jax_differential.py \
		-W error::torchpmap.JitFallbackWarning

test-quick: $(STAMP)
	$(PYTHON) -m pytest -q -x -m "not slow"

bench: $(STAMP)
	$(PYTHON) -m torchpmap.bench

docs: $(STAMP)
	$(PYTHON) -m mkdocs build --strict

clean:
	rm -rf $(STAMP) site build *.egg-info
