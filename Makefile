# Entry points for a fresh machine: `make demo`, `make test` (ruff, then pytest) and `make lint`. Each first builds
# .venv (once per change of pyproject.toml) with jinsum installed in editable mode and its nn and test extras.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint venv clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[nn,test]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/gcn/main.py --dataset cora

lint: $(STAMP)
	$(BIN)/ruff check .

test: lint
	$(BIN)/python -m pytest -n 2 --dist worksteal

clean:
	rm -rf $(VENV) build *.egg-info
