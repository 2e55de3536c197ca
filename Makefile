# Two entry points for a fresh machine: `make demo` and `make test`. Both first build .venv (once per
# change of pyproject.toml) with jinsum installed in editable mode and its nn and test extras.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test venv clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[nn,test]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/gcn/main.py --dataset cora

test: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist worksteal

clean:
	rm -rf $(VENV) build *.egg-info
