"""Benchmarks: run by hand (`python -m tests.bench.<module>`), never collected by `pytest tests`."""
