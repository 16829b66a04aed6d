# make test-unit: the quick tests (no train.py subprocesses); make test: exactly what CI runs (README).
.PHONY: lint test test-unit
lint:
	ruff check .
	ruff format --check .
test-unit:
	python -m pytest -q tests/test_config.py
test:
	python -m pytest -q -m "not slow"
