"""Benchmarks: run from the repository root as ``python -m bench.NAME`` (they import the test harness)."""
