PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: run test lint bench bundle clean

# The venv is (re)built when missing or when pyproject.toml changed.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/mlx-desk $(ARGS)

test: $(STAMP)
	QT_QPA_PLATFORM=offscreen $(PY) -m pytest $(PYTEST_ARGS)

# The house rules a machine can check: ruff (lint + format), the import-linter contracts
# in .importlinter (layers, walls, no cycles), and types at the thread wall.
lint: $(STAMP)
	$(VENV)/bin/ruff check engine app tests packaging
	$(VENV)/bin/ruff format --check engine app tests packaging
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy engine/api.py engine/errors.py app/bridge.py

bench: $(STAMP)
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) -m engine bench --shape qwen3-4b --bits 4 -p 512 -g 128 --vs mlx-lm

bundle: $(STAMP)
	$(PY) -m pip install -q -e '.[bundle]'
	$(PY) packaging/build.py

clean:
	rm -rf $(VENV) build dist .pytest_cache
