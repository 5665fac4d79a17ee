"""Test-session setup: the pure-Python core, and Hypothesis profiles.

The suite tests the pure-Python modules (the reference) even where ``twin compile`` has built
the compiled core: ``TWIN_PURE_PYTHON=1`` is set before ``twin`` is first imported, and rank
and agent processes inherit it. ``tests/test_compiled.py`` builds and checks its own copy.

``default``: no deadline (logical-time explorations vary in wall time). ``ci``: the same,
derandomized so a CI run is reproducible; loaded when the ``CI`` environment variable is set.
"""

from __future__ import annotations

import os
import types

os.environ["TWIN_PURE_PYTHON"] = "1"

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

settings.register_profile("default", deadline=None)
settings.register_profile("ci", derandomize=True, deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "default")


@pytest.fixture(scope="session")
def sglang_reference() -> types.SimpleNamespace:
    """SGLang 0.5.23's staging code from the wheel (``twin.reference.sglang_wheel.load``): a
    failure with the reason when the wheel cannot be had, a skip only with TWIN_OFFLINE=1."""
    from twin.reference.sglang_wheel import ReferenceUnavailable, load, offline

    try:
        return load()
    except ReferenceUnavailable as exc:
        problem = str(exc)
    if offline():
        pytest.skip(f"TWIN_OFFLINE=1: SGLang reference unavailable: {problem}")
    pytest.fail(problem, pytrace=False)
