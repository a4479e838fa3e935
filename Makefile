# ema-ckpt developer commands. Everything runs in a local virtualenv ($(VENV)).
#   make test   install the package with its test dependencies, lint (ruff, mypy, import contracts) and run the whole suite
#   make check  lint and the fast tier: every module and boundary once, in a few minutes (the inner loop)
#   make demo   train a tiny transformer with FSDP2 on CPU, then EMA, post-hoc sweep, consolidate, reshard,
#               and compare held-out losses (table + demo/demo.png)
#   make bench  benchmark scripts (see docs/performance.md)
#   make fixtures  regenerate tests/fixtures/sequences (FSDP and DeepSpeed under torchrun) and
#               tests/fixtures/trainers with the trainers' own saving code (heavy installs, in their own
#               virtualenv $(FIXTURES_VENV)); the tests use the committed files
#   make docs-site  the documentation site, built strictly into site/

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch. On machines whose default index serves CUDA wheels, pass e.g.
#   make test TORCH_INDEX="--index-url https://download.pytorch.org/whl/cpu"
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
DEMO_DIR ?= demo
FIXTURES_VENV ?= .venv-fixtures
FIXTURES_PY := $(FIXTURES_VENV)/bin/python

.PHONY: install install-test test check lint demo bench docs docs-site clean fixtures

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# pip installs without compiling (it compiles file by file, on one core); the virtualenv's
# packages are then compiled once, on every core. Compiled ahead, since where PYTHONDONTWRITEBYTECODE
# is set every process would otherwise compile what it imports (torch: about 2 s) again. As under
# pip, a file that does not compile (torch ships one for Python 3.12) is left as it is.
PIP_INSTALL := $(PY) -m pip install -q --no-compile
COMPILE_PACKAGES = { $(PY) -m compileall -qq -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" || true; }

$(VENV)/.installed: $(VENV)/bin/python pyproject.toml
	$(PIP_INSTALL) $(TORCH_INDEX) "$(TORCH_SPEC)" -e .
	$(COMPILE_PACKAGES)
	touch $@

# DeepSpeed is a test-only producer and oracle; ema-ckpt never imports it. azurite (npm, node 18+)
# is the Azure Blob emulator of tests/object_store_scenarios.py. timm's load_checkpoint
# is an oracle too; timm without its dependencies: it asks for torchvision, which the tests never use.
# npm installs azurite beside pip (they share nothing); the recipe fails if either fails.
$(VENV)/.installed-test: $(VENV)/.installed pyproject.toml
	npm install --silent --no-audit --no-fund --prefix $(VENV)/node "azurite@3.35.0" & npm=$$!; \
	$(PIP_INSTALL) -e ".[test]" setuptools wheel \
	&& DS_BUILD_OPS=0 $(PIP_INSTALL) --no-build-isolation "deepspeed>=0.19,<0.20" \
	&& $(PIP_INSTALL) --no-deps "timm==1.0.31" \
	&& $(COMPILE_PACKAGES); pip=$$?; \
	wait $$npm && [ $$pip -eq 0 ]
	touch $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

# Test files are spread over $(TEST_WORKERS) processes (pytest-xdist; a file's tests stay together, so
# its fixtures are built once); TEST_WORKERS=0 runs everything in this process. Three on 2 cores:
# the tests often wait (for processes they start, emulators, retries), and a third process fills
# that time (a fresh clone's make test, one tree: 3 processes 713 s, 4 processes 791 s).
# mypy (one process, about 90 s without its cache, as in a fresh clone) checks the package beside the
# suite, at a lower priority than the tests; its output follows the tests', and its verdict counts too.
TEST_WORKERS ?= 3
test: $(VENV)/.installed-test
	$(PY) -m ruff check $(LINT_PATHS)
	$(VENV)/bin/lint-imports --no-logo
	@log=$$(mktemp); nice -n 10 $(PY) -m mypy > $$log 2>&1 & mypy=$$!; \
	echo "$(PY) -m mypy (beside the tests)"; \
	OMP_NUM_THREADS=1 $(PY) -m pytest -q --durations=25 $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile); \
	tests=$$?; wait $$mypy; typed=$$?; echo "mypy:"; cat $$log; rm -f $$log; [ $$tests -eq 0 ] && [ $$typed -eq 0 ]

check: $(VENV)/.installed-test lint
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m fast $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

# ruff over everything; mypy strict on the package; the import contracts (all three configured in
# pyproject.toml; the contracts are described in docs/development.md, "Layers")
LINT_PATHS := ema_ckpt tests benchmarks examples docs
lint: $(VENV)/.installed-test
	$(PY) -m ruff check $(LINT_PATHS)
	$(PY) -m mypy
	$(VENV)/bin/lint-imports --no-logo

$(VENV)/.installed-demo: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[demo]"
	touch $@

demo: $(VENV)/.installed-demo
	bash examples/demo.sh "$(PY)" "$(DEMO_DIR)"

bench: $(VENV)/.installed-test
	bash benchmarks/run_all.sh "$(PY)"

# DeepSpeed after the rest, without build isolation (as in install-test).
$(FIXTURES_VENV)/.installed: tests/producers/trainers/requirements.txt
	$(PYTHON) -m venv $(FIXTURES_VENV)
	$(FIXTURES_PY) -m pip install -q --upgrade pip
	$(FIXTURES_PY) -m pip install -q $(TORCH_INDEX) -r tests/producers/trainers/requirements.txt
	DS_BUILD_OPS=0 $(FIXTURES_PY) -m pip install -q --no-build-isolation "deepspeed==0.19.8"
	$(FIXTURES_PY) -m pip install -q --no-deps "timm==1.0.31"
	touch $@

# transformers 4 writes the pytorch_model.bin sets (transformers 5 writes safetensors only)
FIXTURES_TF4_VENV ?= .venv-fixtures-tf4
$(FIXTURES_TF4_VENV)/.installed: tests/producers/trainers/requirements-tf4.txt
	$(PYTHON) -m venv $(FIXTURES_TF4_VENV)
	$(FIXTURES_TF4_VENV)/bin/python -m pip install -q $(TORCH_INDEX) -r tests/producers/trainers/requirements-tf4.txt
	touch $@

# the trainers of step_records.py (litgpt, OLMo-core, mmengine, Composer) need a huggingface-hub
# transformers 5 refuses: their own virtualenv; Composer without its dependencies (it pins an old torch)
FIXTURES_STEPS_VENV ?= .venv-fixtures-steps
$(FIXTURES_STEPS_VENV)/.installed: tests/producers/trainers/requirements-steps.txt
	$(PYTHON) -m venv $(FIXTURES_STEPS_VENV)
	$(FIXTURES_STEPS_VENV)/bin/python -m pip install -q --upgrade pip
	$(FIXTURES_STEPS_VENV)/bin/python -m pip install -q $(TORCH_INDEX) -r tests/producers/trainers/requirements-steps.txt
	$(FIXTURES_STEPS_VENV)/bin/python -m pip install -q --no-deps "mosaicml==0.32.1"
	touch $@

fixtures: $(VENV)/.installed-test $(FIXTURES_VENV)/.installed $(FIXTURES_TF4_VENV)/.installed $(FIXTURES_STEPS_VENV)/.installed
	OMP_NUM_THREADS=1 $(PY) tests/producers/sequences.py --out tests/fixtures/sequences
	$(FIXTURES_PY) tests/producers/trainers/hf_accelerate.py --out tests/fixtures/trainers --set all
	$(FIXTURES_PY) tests/producers/trainers/lightning_titan_megatron.py --out tests/fixtures/trainers --set all
	$(FIXTURES_PY) tests/producers/trainers/single_files.py --out tests/fixtures/trainers --set all
	$(FIXTURES_PY) tests/producers/trainers/bin_folders.py --out tests/fixtures/trainers --set all \
		--tf4-python $(FIXTURES_TF4_VENV)/bin/python
	$(FIXTURES_PY) tests/producers/trainers/diffusers_accelerate.py --out tests/fixtures/trainers --set all
	$(FIXTURES_STEPS_VENV)/bin/python tests/producers/trainers/step_records.py --out tests/fixtures/trainers --set all
	EMA_CKPT=$(VENV)/bin/ema-ckpt $(FIXTURES_PY) tests/producers/trainers/moe_trainers.py --out tests/fixtures/trainers \
		--set all

clean:
	rm -rf $(VENV) $(FIXTURES_VENV) $(FIXTURES_TF4_VENV) $(FIXTURES_STEPS_VENV) $(DEMO_DIR) .pytest_cache .hypothesis

# The documentation site, into site/ (the test suite runs the same strict build).
docs-site: $(VENV)/.installed-test
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# The CLI reference, generated from the commands' own help (a test checks it is current).
docs: $(VENV)/.installed
	$(VENV)/bin/typer ema_ckpt.cli utils docs --name ema-ckpt --output docs/cli.md
