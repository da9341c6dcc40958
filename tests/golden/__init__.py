"""Golden-run regression tests: see :mod:`tests.golden.runs`."""
