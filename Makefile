# Entry points for a fresh machine: `make demo`, `make test` (ruff, then pytest), `make lint` and `make docs`. Each
# first builds .venv (once per change of pyproject.toml) with jinsum installed in editable mode and its nn, test and
# docs extras.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint docs venv clean

# pip compiles the installed packages' bytecode on one core (about half its time here); compileall uses every core
# instead. Like pip, it passes over the few files that are not Python 3.11 (some of torch's tests): hence `|| true`.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --no-compile -e '.[nn,test,docs]'
	$(BIN)/python -m compileall -qq -j 0 $(VENV)/lib || true
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/gcn/main.py --dataset cora

lint: $(STAMP)
	$(BIN)/ruff check .

docs: $(STAMP)
	$(BIN)/python -m sphinx -W --keep-going -q -b html docs docs/_build/html
	@echo "docs/_build/html/index.html"

test: lint
	$(BIN)/python -m pytest -n 2 --dist worksteal

clean:
	rm -rf $(VENV) build *.egg-info docs/_build
