# make run   - set up .venv if needed, then run the default job (tiny model, reverse task)
# make test  - set up .venv if needed, then run the tests
# make setup - install the CPU stack into .venv (idempotent)
.PHONY: setup run test lint

setup:
	@bash scripts/setup_cpu.sh

run: setup
	.venv/bin/instar rl

test: setup
	.venv/bin/ruff check instar tests
	.venv/bin/python -m pytest -q tests

lint: setup
	.venv/bin/ruff check instar tests
