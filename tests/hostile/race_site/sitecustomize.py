"""Loaded at interpreter start-up only by tests that put this folder on PYTHONPATH (tests/hostile/racing.py)."""

import os

if os.environ.get("KVTOOL_TEST_RACE"):
    from tests.hostile.racing import install

    install()
