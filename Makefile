# The two commands at the top of the README. Each creates or reuses .venv.
.PHONY: demo test lint format venv bench

venv:
	@bash scripts/setup_env.sh

demo: venv
	.venv/bin/aiayn demo $(ARGS)

test: venv
	.venv/bin/python -m pytest -q
	.venv/bin/ruff check src tests benchmarks
	.venv/bin/ruff format --check src tests benchmarks

lint: venv
	.venv/bin/ruff check src tests benchmarks

format: venv
	.venv/bin/ruff format src tests benchmarks
	.venv/bin/ruff check --fix src tests benchmarks

bench: venv
	.venv/bin/python benchmarks/run_all.py
