"""Room lifecycles on each side, as data: states, triggers and the one table of transitions.

Everything that moves a room from one state to another lives here (the way h11 keeps its
connection states in one file). ``PrefillRank`` and ``DecodeRank`` change a room's state only
through ``prefill_next`` / ``decode_next``, which raise ``ProtocolError`` for a pair the table
does not hold, so a property test that drives the ranks in any order also checks the table.
"""

from __future__ import annotations

from enum import Enum

from twin.core.errors import ProtocolError as ProtocolError  # raised here; imported from here


class _Member(Enum):
    """An enum hashed by identity (its members are singletons and compare by identity):
    ``Enum.__hash__`` is a Python function, called twice per transition-table lookup."""

    __hash__ = object.__hash__


class PrefillRoomState(_Member):
    """A prefill room (SGLang's ``KVPoll`` on the sender)."""

    BOOTSTRAPPING = "Bootstrapping"  # metadata known, no chunk dequeued yet
    TRANSFERRING = "Transferring"    # a transfer worker took one of its chunks
    SUCCESS = "Success"              # the last chunk was written and announced
    FAILED = "Failed"                # failed or aborted; absorbing


class PrefillTrigger(_Member):
    DEQUEUE = "a worker dequeued one of the room's chunks"
    LAST_CHUNK_DONE = "the last chunk finished on every target"
    FAIL = "a chunk failed, a send failed or the room was aborted"


class DecodeRoomState(_Member):
    """A decode room (``DecodeStagingHandler``'s view of one request).

    Whether the room is registered is kept beside the state: registration is its own step only
    with the ``late-decode-registration`` defect, and a room can progress before it.
    """

    WAITING = "Waiting"            # KV arriving, not every prefill rank succeeded yet
    ALL_SUCCESS = "AllSuccess"     # every prefill rank reported Success; scatters may be pending
    DONE = "Done"                  # every byte landed here; the group's other ranks not yet
    SUCCESS = "Success"            # concluded: every rank of the group is done
    FAILED = "Failed"              # concluded as failed here or on a rank of the group; with
    #                                deferred release the room (and its staging) is held until
    #                                every prefill rank acknowledged the abort, or the deadline


class DecodeTrigger(_Member):
    ALL_RANKS_SUCCESS = "the last prefill rank reported Success"
    COMPLETE = "every allocation was scattered and every scatter finished"
    GROUP_SUCCESS = "every rank of the group is done (the MIN of the group's polls is Success)"
    FAIL = "aborted, a prefill rank failed, a timeout fired, or a rank of the group failed"


P, PT = PrefillRoomState, PrefillTrigger
PREFILL_TRANSITIONS: dict[tuple[PrefillRoomState, PrefillTrigger], PrefillRoomState] = {
    (P.BOOTSTRAPPING, PT.DEQUEUE): P.TRANSFERRING,
    (P.TRANSFERRING, PT.DEQUEUE): P.TRANSFERRING,
    (P.SUCCESS, PT.DEQUEUE): P.SUCCESS,  # update_status takes the max: never demote Success
    (P.BOOTSTRAPPING, PT.LAST_CHUNK_DONE): P.SUCCESS,
    (P.TRANSFERRING, PT.LAST_CHUNK_DONE): P.SUCCESS,
    (P.BOOTSTRAPPING, PT.FAIL): P.FAILED,
    (P.TRANSFERRING, PT.FAIL): P.FAILED,
    (P.SUCCESS, PT.FAIL): P.FAILED,
    (P.FAILED, PT.FAIL): P.FAILED,
}

D, DT = DecodeRoomState, DecodeTrigger
DECODE_TRANSITIONS: dict[tuple[DecodeRoomState, DecodeTrigger], DecodeRoomState] = {
    (D.WAITING, DT.ALL_RANKS_SUCCESS): D.ALL_SUCCESS,
    (D.ALL_SUCCESS, DT.COMPLETE): D.DONE,
    (D.DONE, DT.GROUP_SUCCESS): D.SUCCESS,
    (D.WAITING, DT.FAIL): D.FAILED,
    (D.ALL_SUCCESS, DT.FAIL): D.FAILED,
    (D.DONE, DT.FAIL): D.FAILED,
    (D.FAILED, DT.FAIL): D.FAILED,
}

PREFILL_CONCLUDED = frozenset({P.SUCCESS, P.FAILED})
DECODE_CONCLUDED = frozenset({D.SUCCESS, D.FAILED})


_observed: set[tuple[object, object]] | None = None
"""Where ``observe`` collects the (state, trigger) pairs taken; None when nobody watches."""


def observe(pairs: set[tuple[object, object]] | None) -> set[tuple[object, object]] | None:
    """Collect every (state, trigger) pair that ``prefill_next`` / ``decode_next`` take into
    ``pairs`` from now on (None stops); returns the set collected into before. A module
    variable, not a wrapper, so compiled callers report too (``twin explore``'s coverage)."""
    global _observed
    before = _observed
    _observed = pairs
    return before


def observing() -> bool:
    """Whether ``observe`` collects pairs now: a caller that skips a transition that leaves
    the state as it is (a hot loop's fast path) must still take it while somebody watches."""
    return _observed is not None


def prefill_next(state: PrefillRoomState, trigger: PrefillTrigger) -> PrefillRoomState:
    """The state after ``trigger``; ``ProtocolError`` names both when the pair is not allowed."""
    key = (state, trigger)
    seen = _observed
    if seen is not None:
        seen.add(key)
    nxt = PREFILL_TRANSITIONS.get(key)
    if nxt is None:
        raise ProtocolError(f"prefill room in state {state.value}: {trigger.value} is not allowed")
    return nxt


def decode_next(state: DecodeRoomState, trigger: DecodeTrigger) -> DecodeRoomState:
    """The state after ``trigger``; ``ProtocolError`` names both when the pair is not allowed."""
    key = (state, trigger)
    seen = _observed
    if seen is not None:
        seen.add(key)
    nxt = DECODE_TRANSITIONS.get(key)
    if nxt is None:
        raise ProtocolError(f"decode room in state {state.value}: {trigger.value} is not allowed")
    return nxt
