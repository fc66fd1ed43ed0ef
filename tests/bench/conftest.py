"""Keep `pytest tests` from collecting anything here: these are benchmarks, not tests."""

collect_ignore_glob = ["*"]
