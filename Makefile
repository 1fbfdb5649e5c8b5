# make run   - set up .venv if needed, then run the default job (tiny model, tool-use task)
# make test  - set up .venv if needed, then run the tests (what CI runs; the 20 slowest listed)
# make test-fast - the tests that start no engine, trainer or Ray (seconds; for the edit-test loop)
# make setup - install the CPU stack into .venv (idempotent)
.PHONY: setup run test test-fast lint

setup:
	@bash scripts/setup_cpu.sh

run: setup
	.venv/bin/instar rl

test: setup
	.venv/bin/ruff check instar tests benchmarks
	.venv/bin/python -m pytest -q --durations=20 tests

test-fast: setup
	.venv/bin/python -m pytest -q -m "not stack" tests

lint: setup
	.venv/bin/ruff check instar tests
