"""Request workloads both modes run: trace readers, seeded generators, spec strings, a prefix cache.

A :class:`Workload` is an immutable, arrival-ordered tuple of :class:`Request` objects plus a
``digest`` (sha256 of a canonical serialisation) that identifies it across runs and machines.
Workloads come from public production traces (:func:`load_trace`: Mooncake JSON Lines, Azure
CSV), seeded generators (:func:`poisson`, :func:`bursty`, :func:`shared_prefix`, :func:`fixed`)
or CLI strings (:func:`parse_workload_spec`). :class:`PrefixCache` models SGLang's radix cache.
Everything here is pure Python plus numpy and deterministic.
"""

from twin.workloads.generators import bursty, fixed, poisson, shared_prefix
from twin.workloads.model import (
    MOONCAKE_BLOCK_TOKENS,
    LengthSpec,
    Request,
    Workload,
    WorkloadError,
)
from twin.workloads.prefix_cache import PrefixCache
from twin.workloads.readers import load_trace
from twin.workloads.spec import parse_workload_spec

__all__ = [
    "MOONCAKE_BLOCK_TOKENS",
    "LengthSpec",
    "PrefixCache",
    "Request",
    "Workload",
    "WorkloadError",
    "bursty",
    "fixed",
    "load_trace",
    "parse_workload_spec",
    "poisson",
    "shared_prefix",
]
