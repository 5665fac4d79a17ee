"""Driver records (``dir: "sys"``) checked natively: compiled with the core by ``twin compile``.

``sys_type`` says whether a record is a valid driver record, by the rules of
``twin.trace.format.SYS_TYPES`` (passed in, with the outcome statuses and the trace's nodes),
without naming what is wrong: where it returns None, ``format._check_sys`` (which applies the
same rules) raises the error that names the field. The trace writer checks every record it
writes with it, and the readers every record they read.
"""

from __future__ import annotations

import math
from collections.abc import Container
from typing import Any, Final

__all__ = ["sys_type"]

_MISSING: Final = object()


def sys_type(record: Any, types: dict[str, dict[str, str]], statuses: tuple[str, ...],
             nodes: Container[str]) -> str | None:
    """``record``'s type when it is a valid driver record (``types``: type -> required field
    -> ``"int"``, ``"str"``, ``"number"`` or ``"list[str]"``; an ``Outcome``'s ``status`` one
    of ``statuses``; a ``RequestArrived``'s nodes in ``nodes``), else None."""
    if type(record) is not dict:
        return None
    d: dict[str, Any] = record
    rtype = d.get("type")
    if type(rtype) is not str:
        return None
    fields = types.get(rtype)
    if fields is None:
        return None
    for name, kind in fields.items():
        v = d.get(name, _MISSING)
        if kind == "int":
            if type(v) is not int:
                return None
        elif kind == "str":
            if type(v) is not str:
                return None
        elif kind == "number":
            if type(v) is float:
                if not math.isfinite(v):
                    return None
            elif type(v) is not int:
                return None
        elif kind == "list[str]":
            if type(v) is not list:
                return None
            for x in v:
                if type(x) is not str:
                    return None
        else:
            return None
    if rtype == "Outcome" and d["status"] not in statuses:
        return None
    if rtype == "RequestArrived":
        for key in ("prefill_node", "decode_node"):
            for nid in d[key]:
                if nid not in nodes:
                    return None
    return rtype
