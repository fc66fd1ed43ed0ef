"""What several test suites share: real processes on free ports, plain HTTP, object builders."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
