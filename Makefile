PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# MLX's backend on Linux: CUDA where an NVIDIA GPU answers, else the CPU build
# (make run MLX_BACKEND=cpu|cuda|cuda12 to choose). macOS always uses Metal.
MLX_BACKEND ?= $(shell if [ "$$(uname)" = Linux ]; then \
	if nvidia-smi -L >/dev/null 2>&1; then echo cuda; else echo cpu; fi; fi)
comma  := ,
EXTRAS := dev$(if $(MLX_BACKEND),$(comma)$(MLX_BACKEND))
STAMP  := $(VENV)/.installed-$(or $(MLX_BACKEND),metal)
ENTRY  := $(VENV)/bin/mlx-desk

.PHONY: run test test-long lint bench bundle clean

# The venv is (re)built when missing, when pyproject.toml changed, or for another backend.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(if $(MLX_BACKEND),$(PY) -m pip uninstall -q -y mlx-cpu mlx-cuda-12 mlx-cuda-13 >/dev/null 2>&1 || true)
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	rm -f $(VENV)/.installed*
	touch $(STAMP)

# The project itself (editable) can go while the stamp stays: `pip uninstall mlx-desk`, or an
# install of the wheel elsewhere that pip took for an upgrade. Put it back without the deps.
$(ENTRY): $(STAMP)
	test -x $@ || $(PY) -m pip install -q --no-deps -e .
	touch $@

run: $(ENTRY)
	$(ENTRY) $(ARGS)

# The suite in two parts, so that the everyday one stays under a quarter of an hour: the
# long tests (soaks, the bundle build, sampling-distribution checks; marked `long`) run apart.
# The everyday part runs in two processes (pytest-xdist), each taking whole files so that a
# module's fixtures, servers and ranks live in one process: a test's wall time is one core's
# work, so two workers halve the suite on a two-core machine (999 s -> 613 s measured).
# TEST_WORKERS=0 runs it in this process. The long tests stay in one: the soaks time stalls.
TEST_WORKERS ?= 2
test: $(ENTRY)
	QT_QPA_PLATFORM=offscreen $(PY) -m pytest -m "not long" -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

test-long: $(ENTRY)
	QT_QPA_PLATFORM=offscreen $(PY) -m pytest -m long $(PYTEST_ARGS)

# The house rules a machine can check: ruff (lint + format), the import-linter contracts
# in .importlinter (layers, walls, no cycles), and types (mypy --strict, set in pyproject.toml)
# at the thread wall and over the app's controllers and background work.
lint: $(ENTRY)
	$(VENV)/bin/ruff check engine app tests packaging
	$(VENV)/bin/ruff format --check engine app tests packaging
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy engine/api engine/errors.py app/bridge.py app/ops.py app/controllers

bench: $(STAMP)
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) -m engine bench --shape qwen3-4b --bits 4 -p 512 -g 128 --vs mlx-lm

bundle: $(STAMP)
	$(PY) -m pip install -q -e '.[bundle]'
	$(PY) packaging/build.py

clean:
	rm -rf $(VENV) build dist .pytest_cache
