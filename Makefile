# make lint: ruff check + ruff format --check + make typecheck (make format rewrites); make typecheck: mypy on core/, parallel/, measure/
# make test-unit: the quick tier to run while editing: tests marked `unit` (in-process; tests/conftest.py fails one that starts a process)
# make test: exactly what CI runs (the README's test command).
# make setup: install the requirements into the active virtual environment (none active: into .venv, made here
#   first), then run the main job (README "Set up").
.PHONY: setup lint format typecheck test test-unit
lint:
	ruff check .
	ruff format --check .
	$(MAKE) --no-print-directory typecheck
typecheck:
	mypy
format:
	ruff format .
	ruff check --fix .
test-unit:
	python -m pytest -q -p no:cacheprovider -m "unit and not slow"
test:
	python -m pytest -q -m "not slow"
VENV ?= .venv
# exit 0 in a virtual environment (venv or conda), 1 outside one
IN_VENV = python3 -c 'import os, sys; sys.exit(sys.prefix == sys.base_prefix and not os.environ.get("CONDA_PREFIX"))'
setup:
	@if ! $(IN_VENV); then \
		[ -x $(VENV)/bin/python ] || python3 -m venv $(VENV) || exit 1; \
		echo "make setup: no virtual environment is active: installing into $(VENV) (activate it in each new shell: . $(VENV)/bin/activate)"; \
		. $(VENV)/bin/activate; \
	fi; \
	pip install -r requirements.txt && python train.py parallel=jit_sharding precision=bf16
