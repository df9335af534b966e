# The two commands at the top of the README. Each creates or reuses .venv.
.PHONY: demo demo-lm demo-classify test test-all lint format venv bench bench-paired bench-levers

venv:
	@bash scripts/setup_env.sh

demo: venv
	.venv/bin/aiayn demo $(ARGS)

# The other two families on the embedded corpus (docs/families.md): about 12 and 25 minutes.
demo-lm: venv
	.venv/bin/aiayn prepare --corpus bible --task lm --lang en --out data/bible-lm-en
	.venv/bin/aiayn train --config configs/bible_lm.toml --data data/bible-lm-en --out runs/bible-lm
	.venv/bin/aiayn generate runs/bible-lm "In the beginning" --top-p 0.9 --seed 1

demo-classify: venv
	.venv/bin/aiayn prepare --corpus bible --task classify --lang en --out data/bible-genre
	.venv/bin/aiayn train --config configs/bible_mlm.toml --data data/bible-genre --out runs/bible-mlm
	.venv/bin/aiayn train --config configs/bible_classify.toml --data data/bible-genre \
		--out runs/bible-genre
	.venv/bin/aiayn classify runs/bible-genre --data data/bible-genre --split test \
		--confusion runs/bible-genre/confusion.png

# What CI runs: every test but those marked slow (pyproject's addopts), then the linters;
# --durations lists the slowest tests. make test-all runs the slow ones too. The tests run on
# one thread each (tests/conftest.py), one pytest-xdist worker per core, a file per worker.
test: venv
	.venv/bin/python -m pytest -q -n auto --dist loadfile --durations=15
	.venv/bin/ruff check src tests benchmarks scripts experiments
	.venv/bin/ruff format --check src tests benchmarks scripts experiments
	.venv/bin/mypy

test-all: venv
	.venv/bin/python -m pytest -q -n auto --dist loadfile --durations=15 -m "slow or not slow"
	.venv/bin/ruff check src tests benchmarks scripts experiments
	.venv/bin/ruff format --check src tests benchmarks scripts experiments
	.venv/bin/mypy

lint: venv
	.venv/bin/ruff check src tests benchmarks scripts experiments
	.venv/bin/mypy

format: venv
	.venv/bin/ruff format src tests benchmarks scripts experiments
	.venv/bin/ruff check --fix src tests benchmarks scripts experiments

# Every system on the fixed workloads: benchmarks/results/bench-<host>.md (benchmarks/README.md).
bench: venv
	.venv/bin/python benchmarks/run_all.py

# aiayn and CTranslate2 taking turns batch by batch: benchmarks/results/paired-<host>.md,
# about 8 minutes.
bench-paired: venv
	.venv/bin/python benchmarks/paired_decode.py --write

# Each lever of aiayn.accel on and off on the headline figures, SMALL and BASE, 3 rounds
# (benchmarks/results/levers-<host>.md, shown by docs/performance.md): about 35 minutes on 2
# cores with a bf16 CPU. `.venv/bin/python -m benchmarks.lever_table --quick` takes a few.
bench-levers: venv
	.venv/bin/python -m benchmarks.lever_table
