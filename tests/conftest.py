"""Hypothesis profiles: CI (`CI` set, as `.ci/run` does) draws the same examples on every run, so a
landing never depends on a lucky draw; local runs explore new random examples each time (a failure
prints the example to pin with `@example`)."""

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "explore")
