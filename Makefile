# The two commands of the quick start. Each sets up what it needs (idempotently) first.
VENV ?= .venv

.PHONY: setup run test

setup:
	bash scripts/setup.sh

run: setup
	$(VENV)/bin/agentrl train

test: setup
	bash scripts/test.sh
