"""Test-session setup: the pure-Python core, and Hypothesis profiles.

The suite tests the pure-Python modules (the reference) even where ``twin compile`` has built
the compiled core: ``TWIN_PURE_PYTHON=1`` is set before ``twin`` is first imported, and rank
and agent processes inherit it. ``tests/test_compiled.py`` builds and checks its own copy.

``default``: no deadline (logical-time explorations vary in wall time). ``ci``: the same,
derandomized so a CI run is reproducible; loaded when the ``CI`` environment variable is set.
"""

from __future__ import annotations

import os

os.environ["TWIN_PURE_PYTHON"] = "1"

from hypothesis import settings  # noqa: E402

settings.register_profile("default", deadline=None)
settings.register_profile("ci", derandomize=True, deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "default")
