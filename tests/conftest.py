"""Checks every test in tests/ gets: no process it started outlives it (tests/support/leaks.py)."""

from tests.support.leaks import pytest_fixture_setup, pytest_runtest_setup, pytest_runtest_teardown

__all__ = ["pytest_fixture_setup", "pytest_runtest_setup", "pytest_runtest_teardown"]
