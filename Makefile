# posterior-bench: `make benchmark` runs the default experiment end to end, `make test` the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
EXPERIMENT ?= digits_optunet
STAMP := $(VENV)/.installed

.PHONY: install benchmark test bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

benchmark: $(STAMP)
	$(PY) -m benchmark experiment=$(EXPERIMENT) stage=all

test: $(STAMP)
	$(PY) -m pytest -q tests

bench: $(STAMP)
	@for f in bench/bench_*.py; do echo "== $$f"; $(PY) $$f || exit 1; done

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
