# Two commands: `make lab` opens the course, `make test` runs every test.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: lab test unit notebooks figures venv clean

venv: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

lab: $(STAMP)
	$(VENV)/bin/jupyter lab notebooks/00_hardware_hierarchy.ipynb

test: $(STAMP)
	$(PY) -m pytest tests -q
	$(PY) -m pytest --nbval-lax --sanitize-with tests/sanitize.cfg notebooks -q
	$(VENV)/bin/torchrun --nproc-per-node=2 --master-addr=127.0.0.1 --master-port=0 -m helpers.run allreduce

unit: $(STAMP)
	$(PY) -m pytest tests -q

figures: $(STAMP)
	$(PY) -m figures.make_figures

clean:
	rm -rf $(VENV)
