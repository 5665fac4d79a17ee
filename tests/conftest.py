"""Test-session setup: Hypothesis profiles.

``default``: no deadline (logical-time explorations vary in wall time). ``ci``: the same,
derandomized so a CI run is reproducible; loaded when the ``CI`` environment variable is set.
"""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("default", deadline=None)
settings.register_profile("ci", derandomize=True, deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "default")
