"""Imported by Python at start-up when this folder is on PYTHONPATH (tests/conftest.py puts it
there for the processes the tests start): see fast_interpreter.py."""

import fast_interpreter  # noqa: F401
