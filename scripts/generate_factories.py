"""Regenerate ``twin/core/factories.py``, ``twin/trace/reducers.py``,
``twin/trace/emitters.py`` and ``twin/trace/packers.py`` from the event and frame dataclasses.

Run after changing a field of an event or frame (or ``twin.core.fastinit.FACTORY_CLASSES``):
``python scripts/generate_factories.py``. ``tests/core/test_fastinit.py``,
``tests/trace/test_rows.py``, ``tests/trace/test_emitters.py`` and
``tests/trace/test_packing.py`` fail until then.
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
from twin.trace.reducegen import REDUCERS_PATH, reducers_source  # noqa: E402

REDUCERS_PATH.write_text(reducers_source())
print(f"wrote {REDUCERS_PATH}")
from twin.trace.emitgen import EMITTERS_PATH, emitters_source  # noqa: E402

EMITTERS_PATH.write_text(emitters_source())
print(f"wrote {EMITTERS_PATH}")
from twin.trace.packgen import PACKERS_PATH, packers_source  # noqa: E402

PACKERS_PATH.write_text(packers_source())
print(f"wrote {PACKERS_PATH}")
from twin.trace.rowdecgen import ROWDECODERS_PATH, rowdecoders_source  # noqa: E402

ROWDECODERS_PATH.write_text(rowdecoders_source())
print(f"wrote {ROWDECODERS_PATH}")
