"""The collector's pace during a run: raised for the run, restored after, cycles still freed."""

from __future__ import annotations

import gc
import weakref

from twin.runtime.collector import RUN_THRESHOLDS, paced_collector


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def test_thresholds_raised_inside_and_restored_after() -> None:
    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        with paced_collector():
            assert gc.get_threshold() == RUN_THRESHOLDS
        assert gc.get_threshold() == (700, 10, 10)
        gc.set_threshold(10**6, 10, 10)  # a caller's slower pace is kept
        with paced_collector():
            assert gc.get_threshold()[0] == 10**6
        gc.set_threshold(0)  # switched off stays off
        with paced_collector():
            assert gc.get_threshold()[0] == 0
    finally:
        gc.set_threshold(*before)


def test_restored_when_the_body_raises() -> None:
    before = gc.get_threshold()
    try:
        with paced_collector():
            raise KeyError("x")
    except KeyError:
        pass
    assert gc.get_threshold() == before


def test_cycles_are_still_collected_inside() -> None:
    with paced_collector():
        a, b = _Node(), _Node()
        a.other, b.other = b, a
        ref = weakref.ref(a)
        del a, b
        assert ref() is not None
        # net container allocations past the young threshold start a pass on their own
        keep = [[] for _ in range(RUN_THRESHOLDS[0] + 1000)]
        assert ref() is None
        del keep
