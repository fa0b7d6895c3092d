# Two commands: `make lab` opens the course, `make test` runs every test.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: lab test unit browser notebooks figures bench venv clean

venv: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

# JupyterLab listens on 127.0.0.1 only. As root (containers), Jupyter needs --allow-root.
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)
lab: $(STAMP)
	$(VENV)/bin/jupyter lab --ServerApp.ip=127.0.0.1 --ServerApp.root_dir=. $(ROOT_FLAG) notebooks/00_hardware_hierarchy.ipynb

# Every test, three suites side by side (each spends much of its time waiting on ranks, kernels or
# the browser): the unit tests (tests/test_torchrun.py runs a demo under torchrun with 2 CPU ranks),
# every notebook top to bottom under nbval (comparing the cells marked NBVAL_CHECK_OUTPUT), and the
# widgets in a real browser (JupyterLab + Debian's headless Chromium; skipped, saying so, where
# /usr/bin/chromium is missing: `apt-get install chromium`). The unit tests print as they go; the
# other two reports follow from test-logs/. The unit tests are the longest and the other two wait
# most of the time, so those two run at a lower priority (nice 5): they fill the unit tests' gaps.
# Their kernels start in sessions of their own, which nice alone does not reach where Linux
# schedules by session: JUPYTER_PATH gives them tests/jupyter's kernel, which lowers its session
# (by PLAB_SESSION_NICE; the browser harness lowers JupyterLab's and Chromium's the same way).
test: $(STAMP)
	@mkdir -p test-logs; \
	PLAB_SESSION_NICE=2 JUPYTER_PATH=$(CURDIR)/tests/jupyter nice -n 5 $(PY) -u -m pytest tests/browser -q -rs -p no:cacheprovider > test-logs/browser.txt 2>&1 & br=$$!; \
	PLAB_SESSION_NICE=2 JUPYTER_PATH=$(CURDIR)/tests/jupyter nice -n 5 $(PY) -u -m pytest --nbval-lax --nbval-sanitize-with tests/sanitize.cfg notebooks -q -p no:cacheprovider > test-logs/notebooks.txt 2>&1 & nb=$$!; \
	$(PY) -m pytest tests -q --ignore=tests/browser; unit=$$?; \
	wait $$nb; notebooks=$$?; wait $$br; browser=$$?; \
	echo "== notebooks under nbval (test-logs/notebooks.txt)"; cat test-logs/notebooks.txt; \
	echo "== widgets in the browser (test-logs/browser.txt)"; cat test-logs/browser.txt; \
	echo "== make test: unit tests rc=$$unit, notebooks rc=$$notebooks, browser rc=$$browser"; \
	test $$unit -eq 0 && test $$notebooks -eq 0 && test $$browser -eq 0

# The widgets in a real browser alone (screenshots in browser-shots/; -rs: a skip says why).
browser: $(STAMP)
	$(PY) -m pytest tests/browser -q -rs -p no:cacheprovider

unit: $(STAMP)
	$(PY) -m pytest tests -q --ignore=tests/browser

# Re-execute every notebook in place and strip it for committing.
notebooks: $(STAMP)
	cd notebooks && for nb in *.ipynb; do ../$(VENV)/bin/jupyter nbconvert --to notebook --execute --inplace --ExecutePreprocessor.timeout=300 $$nb || exit 1; done
	$(PY) scripts/strip_notebooks.py notebooks/*.ipynb

# Every speed figure the issues ask for; each prints one JSON object as its last line.
bench: $(STAMP)
	for b in interactivity collectives ddp tp pipeline parallel3d cluster memory experts_context exercises simulator planner browser; do $(PY) -m benchmarks.$$b || exit 1; done

figures: $(STAMP)
	$(PY) -m figures.make_figures

clean:
	rm -rf $(VENV)
