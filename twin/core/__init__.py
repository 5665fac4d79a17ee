"""The sans-I/O protocol core: pure, deterministic state machines of the staging protocol.

Nothing here reads a clock, opens a socket, starts a thread or imports SimPy, torch or NIXL.
Drivers (``twin.sim``, ``twin.hw``) feed inputs to ``DecodeRank.handle`` and
``PrefillRank.handle`` and carry out the effects they return.
"""

from twin.core.allocator import ALLOC_OVERSIZED, StagingAllocator, is_watermark_ready
from twin.core.config import ConfigError, ModelShape, ServerSide, TwinConfig
from twin.core.decode import DecodeRank
from twin.core.defects import ALL_DEFECTS, CATALOG, Defects
from twin.core.fixes import ALL_FIXES, Fixes
from twin.core.grid import compute_grid_segments, staging_grid_tokens
from twin.core.layout import compute_head_slice_params, compute_staging_layout
from twin.core.prefill import PrefillRank

__all__ = [
    "ALLOC_OVERSIZED",
    "ALL_DEFECTS",
    "ALL_FIXES",
    "CATALOG",
    "ConfigError",
    "DecodeRank",
    "Defects",
    "Fixes",
    "ModelShape",
    "PrefillRank",
    "ServerSide",
    "StagingAllocator",
    "TwinConfig",
    "compute_grid_segments",
    "compute_head_slice_params",
    "compute_staging_layout",
    "is_watermark_ready",
    "staging_grid_tokens",
]
