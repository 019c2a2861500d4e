# The two commands of the README. Both do all set-up on a fresh machine first (scripts/setup.sh).
VENV ?= .venv
PORT ?= 8000
SERVE_ARGS ?=
PYTEST_ARGS ?=

.PHONY: setup serve test test-unit bench

setup:
	bash scripts/setup.sh

serve: setup
	$(VENV)/bin/foresight serve --port $(PORT) $(SERVE_ARGS)

test: setup
	$(VENV)/bin/python -m pytest -q $(PYTEST_ARGS)

test-unit: setup
	$(VENV)/bin/python -m pytest -q tests/unit

bench: setup
	$(VENV)/bin/foresight bench --prompts humaneval --modes ar,sync --temperature 0 --max-tokens 128 --limit 20 --out bench-out/humaneval.json
