# The two commands at the top of the README. Each creates or reuses .venv.
.PHONY: demo test lint format venv bench

venv:
	@bash scripts/setup_env.sh

demo: venv
	.venv/bin/aiayn demo $(ARGS)

test: venv
	.venv/bin/python -m pytest -q
	.venv/bin/ruff check src tests benchmarks scripts
	.venv/bin/ruff format --check src tests benchmarks scripts
	.venv/bin/mypy

lint: venv
	.venv/bin/ruff check src tests benchmarks scripts
	.venv/bin/mypy

format: venv
	.venv/bin/ruff format src tests benchmarks scripts
	.venv/bin/ruff check --fix src tests benchmarks scripts

bench: venv
	.venv/bin/python benchmarks/run_all.py
