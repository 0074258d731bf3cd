# The two commands of the README: `make demo` (main job) and `make test` (the whole suite).
# Both create .venv first when needed (scripts/setup.sh).
.PHONY: setup demo test

setup:
	@bash scripts/setup.sh

demo: setup
	.venv/bin/agentwin demo

test: setup
	.venv/bin/python -m pytest -q --durations=15
