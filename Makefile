# make lint: ruff check + ruff format --check + make typecheck (make format rewrites); make typecheck: mypy on core/, parallel/, measure/
# make test-unit: the quick tier to run while editing: tests marked `unit` (in-process; tests/conftest.py fails one that starts a process)
# make test: exactly what CI runs (the README's test command).
# make setup: install the requirements, then the main job (README "Set up").
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
setup:
	pip install -r requirements.txt
	if [ -z "$$TFDS_DATA_DIR" ] && [ -d ../shared/tensorflow_datasets ]; then \
		export TFDS_DATA_DIR=../shared/tensorflow_datasets; fi; \
	python train.py parallel=jit_sharding precision=bf16
