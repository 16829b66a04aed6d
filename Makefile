# make lint: ruff; make test-unit: a quick tier to run while editing (config, throughput, report, projection, comm,
# layers, loop)
# make test: exactly what CI runs (the README's test command).
.PHONY: lint test test-unit
lint:
	ruff check .
test-unit:
	python -m pytest -q -p no:cacheprovider tests/test_config.py tests/test_throughput.py tests/test_report.py tests/test_project.py tests/test_comm.py \
		tests/test_layers.py tests/test_loop.py
test:
	python -m pytest -q -m "not slow"
