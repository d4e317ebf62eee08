# Two commands do everything on a fresh machine:
#   make demo   set up .venv (Python 3.12, megatron-core 0.19.x, transformers 5.12.1: Megatron-Bridge 0.6.2's) and run the main job
#   make test   set up .venv and run the test suite
# The support-floor leg (Python 3.11, megatron-core 0.16.1, torch 2.13 CPU, the newest transformers) runs with
# `make test-floor`.
PYTEST_ARGS ?=

.PHONY: setup setup-floor demo test test-floor

setup:
	bash scripts/setup.sh

setup-floor:
	PY=3.11 VENV=.venv311 bash scripts/setup.sh

demo: setup
	.venv/bin/megatron-vlm-packing demo

test: setup
	.venv/bin/python -m pytest $(PYTEST_ARGS)

test-floor: setup-floor
	.venv311/bin/python -m pytest $(PYTEST_ARGS)
