"""Driver records checked natively (``twin.trace.sysrec.sys_type``) accept exactly what the
checking path (``format._check_sys``) accepts. Run against the compiled build too
(``tests/test_compiled.py``)."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from twin.trace.codec import TraceError
from twin.trace.format import OUTCOME_STATUSES, SYS_TYPES, _check_sys
from twin.trace.sysrec import sys_type

NODES = {"p0g0r0": {}, "d0g0r0": {}}
VALID: dict[str, dict[str, Any]] = {
    "RequestArrived": {"type": "RequestArrived", "room": 3, "rid": "r3", "input_len": 100,
                       "output_len": 8, "decode_prefix_len": 0, "prefill_prefix_len": 0,
                       "prefill_node": ["p0g0r0"], "decode_node": ["d0g0r0"]},
    "ForwardStart": {"type": "ForwardStart", "room": 3, "tokens": 64},
    "ForwardEnd": {"type": "ForwardEnd", "room": 3, "tokens": 64, "extra": [1]},
    "FaultInjected": {"type": "FaultInjected", "fault": "crash:p0g0r0:at=1", "detail": "x"},
    "Note": {"type": "Note", "text": "hello"},
    "Metric": {"type": "Metric", "name": "ttft", "value": 0.25},
    "Outcome": {"type": "Outcome", "status": "completed", "completed": 1, "failed": 0,
                "requests": 1, "diagnosis": [], "corruption": ["x"]},
}


def checked(record: Any) -> str | None:
    try:
        return _check_sys(record, "t", NODES)
    except TraceError:
        return None


def test_every_type_has_a_valid_sample() -> None:
    assert set(VALID) == set(SYS_TYPES)
    for rtype, record in VALID.items():
        assert sys_type(record, SYS_TYPES, OUTCOME_STATUSES, NODES) == rtype == checked(record)


ODD = [None, True, 1, -5, 2**70, 1.5, math.inf, math.nan, "", "d0g0r0", "nobody", [], ["x"],
       ["d0g0r0", 3], [1], {}, {"a": 1}]


@pytest.mark.parametrize("rtype", sorted(VALID))
def test_a_field_of_any_value_is_judged_alike(rtype: str) -> None:
    for name in [*SYS_TYPES[rtype], "type"]:
        for value in ODD:
            record = copy.deepcopy(VALID[rtype])
            record[name] = value
            assert sys_type(record, SYS_TYPES, OUTCOME_STATUSES, NODES) == checked(record), (
                name, value)
        record = copy.deepcopy(VALID[rtype])
        del record[name]
        assert sys_type(record, SYS_TYPES, OUTCOME_STATUSES, NODES) is None
        assert checked(record) is None


JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=3), max_leaves=8)


@settings(max_examples=500, deadline=None)
@given(st.sampled_from(sorted(VALID)), st.dictionaries(
    st.sampled_from(["room", "tokens", "value", "status", "decode_node", "rid", "type"]),
    JSONISH, max_size=3))
def test_any_edit_of_a_record_is_judged_alike(rtype: str, edit: dict[str, Any]) -> None:
    record = {**copy.deepcopy(VALID[rtype]), **edit}
    assert sys_type(record, SYS_TYPES, OUTCOME_STATUSES, NODES) == checked(record)


def test_a_huge_integer_is_a_number() -> None:
    record = {**VALID["Metric"], "value": 10**400}
    assert sys_type(record, SYS_TYPES, OUTCOME_STATUSES, NODES) == "Metric" == checked(record)
