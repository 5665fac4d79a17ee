"""Regenerate ``twin/core/factories.py`` from the event and frame dataclasses.

Run after changing a field of a class in ``twin.core.fastinit.FACTORY_CLASSES`` (or the list):
``python scripts/generate_factories.py``. ``tests/core/test_fastinit.py`` fails until then.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ["TWIN_PURE_PYTHON"] = "1"  # read the classes from their sources

from twin.core import events, wire  # noqa: E402
from twin.core.fastinit import FACTORIES_PATH, factories_source  # noqa: E402

FACTORIES_PATH.write_text(factories_source([wire, events]))
print(f"wrote {FACTORIES_PATH}")
