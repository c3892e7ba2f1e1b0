"""Requests and delivery: who is admitted, at which position, and what was handed out (LIFE, DLV).

This unit is the one home of a request's state. One *admission* is a request id from its
STARTED to its FINISHED or ABORTED; an id started again after it ended is a new admission
(LIFE-1). A live request (running or preempted) maps to its admission's entry in a few dense
arrays, so a save or a consume of hundreds of requests costs a handful of numpy calls, not a
Python loop:

- `computed`: the next position the request's rows will be (DLV-1): ``hit_end`` at STARTED or
  RESUMED, advanced by the request's rows at every save.
- `cursor`: the delivery cursor ``d`` (DLV-2): every position below it was handed out, or passed
  over after a discard (DLV-4). It never moves back.
- `state`: an `AdmissionState` code per entry.

An entry outlives its admission's end while an unended step carries it, since a late builder may
still materialize that step; it is freed when the last such step ends. Ended entries are few, so
the save and consume of a decode step pay nothing for this.

A request id moves by `_LIFECYCLE` (LIFE-2), as (state, record kind) -> next state:

===========  ===================  ===========
state        record               next state
===========  ===================  ===========
NOT_LIVE     STARTED              RUNNING
RUNNING      STARTED              RUNNING (a continuation: no new admission, HIT-1)
RUNNING      PREEMPTED            PREEMPTED
PREEMPTED    RESUMED              RUNNING
any          FINISHED, ABORTED    NOT_LIVE (the end of an unknown request is ignored)
===========  ===================  ===========

This unit decides nothing about steps, pages, slots or writes; `CacheCore` composes it, tells
it which admissions the unended steps carry, and asks it for positions at save and for the
delivered range at consume.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection, Iterable, Sequence
from operator import itemgetter
from typing import Any, Final, NoReturn, cast

import numpy as np
import numpy.typing as npt

from omni_cache_core._contract import (
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
    ReqId,
    _CodeRepr,
)
from omni_cache_core._errors import BadInputError, InvariantError, LifecycleError
from omni_cache_core._occupancy import any_true

__all__ = ["AdmissionState", "Admissions", "RequestState", "carried_among"]

Int64Array = npt.NDArray[np.int64]
#: An end or preemption record: (request, kind).
_Ending = tuple[ReqId, PrefixCacheEventKind]
#: A start or resume record: (request, kind, hit_end, block ids).
_Starting = tuple[ReqId, PrefixCacheEventKind, int, tuple[int, ...]]


class AdmissionState(enum.IntEnum):
    """The code of one admission entry in `Admissions.state`."""

    #: Not in use.
    FREE = 0
    #: The request runs: its steps are saved (LIFE-1).
    RUNNING = 1
    #: The engine took the request's blocks back; its steps can still be consumed (LIFE-3).
    PREEMPTED = 2
    #: The admission ended while an unended step still carries it.
    ENDED = 3

    def __repr__(self) -> str:
        return f"AdmissionState.{self.name}"


class RequestState(_CodeRepr):
    """A request id's state, as a lifecycle record finds it (its value is the error's wording)."""

    #: Never started, or ended.
    NOT_LIVE = "not live"
    #: Started or resumed, not ended.
    RUNNING = "running"
    #: Preempted, not resumed or ended.
    PREEMPTED = "preempted"


_K = PrefixCacheEventKind
_STARTS: Final = (_K.STARTED, _K.RESUMED)
_NOT_LIVE, _RUNNING, _PREEMPTED = (
    RequestState.NOT_LIVE,
    RequestState.RUNNING,
    RequestState.PREEMPTED,
)

# LIFE-2: the legal records per request state; anything else raises `LifecycleError`.
_LIFECYCLE: Final[dict[tuple[RequestState, PrefixCacheEventKind], RequestState]] = {
    (_NOT_LIVE, _K.STARTED): _RUNNING,
    (_RUNNING, _K.STARTED): _RUNNING,
    (_RUNNING, _K.PREEMPTED): _PREEMPTED,
    (_PREEMPTED, _K.RESUMED): _RUNNING,
    **{(state, end): _NOT_LIVE for state in RequestState for end in (_K.FINISHED, _K.ABORTED)},
}

_FREE: Final = AdmissionState.FREE.value
_RUNNING_CODE: Final = AdmissionState.RUNNING.value
_PREEMPTED_CODE: Final = AdmissionState.PREEMPTED.value
_ENDED_CODE: Final = AdmissionState.ENDED.value

_INITIAL_ENTRIES: Final = 64


class Admissions:
    """Live requests, their admissions' positions and delivery state (LIFE-1..4, DLV-1, DLV-2)."""

    __slots__ = (
        "_entry_of",
        "_free",
        "_known_layout",
        "_num_preempted",
        "_stamp",
        "computed",
        "cursor",
        "ended",
        "state",
    )

    def __init__(self) -> None:
        self.computed: Int64Array = np.zeros(_INITIAL_ENTRIES, dtype=np.int64)
        self.cursor: Int64Array = np.zeros(_INITIAL_ENTRIES, dtype=np.int64)
        #: One `AdmissionState` code per entry.
        self.state = np.zeros(_INITIAL_ENTRIES, dtype=np.int8)
        #: Entries whose admission ended while unended steps still carry them.
        self.ended: set[int] = set()
        # Lowest entries first, so a run reuses a small prefix of the arrays.
        self._free: list[int] = list(range(_INITIAL_ENTRIES - 1, -1, -1))
        #: Live requests (running or preempted) and their admission's entry (LIFE-1).
        self._entry_of: dict[ReqId, int] = {}
        #: How many live requests are preempted (their state is in `state`).
        self._num_preempted = 0
        #: The last layout found distinct and running, with its entries, kept until a request
        #: ends or is preempted (a cache only: not part of the state).
        self._known_layout: tuple[tuple[ReqId, ...], Int64Array] | None = None
        #: Scratch for `_repeats`, one per entry; its values mean nothing between calls.
        self._stamp: Int64Array = np.zeros(_INITIAL_ENTRIES, dtype=np.int64)

    # ---------------------------------------------------------------------------------------
    # Queries.

    def state_of(self, req_id: ReqId) -> RequestState:
        """The request id's lifecycle state."""
        entry = self._entry_of.get(req_id)
        if entry is None:
            return RequestState.NOT_LIVE
        if self.state[entry] == _PREEMPTED_CODE:
            return RequestState.PREEMPTED
        return RequestState.RUNNING

    def is_live(self, req_id: ReqId) -> bool:
        """Whether the request is running or preempted."""
        return req_id in self._entry_of

    def live(self) -> dict[ReqId, RequestState]:
        """Every live request's state, by id in sorted order."""
        return {r: self.state_of(r) for r in sorted(self._entry_of)}

    @property
    def any_preempted(self) -> bool:
        """Whether some live request is preempted."""
        return self._num_preempted > 0

    @property
    def entries_by_request(self) -> dict[ReqId, int]:
        """Live requests and their admission entries (callers only read it)."""
        return self._entry_of

    def entry_of(self, req_id: ReqId) -> int:
        """The live request's admission entry."""
        return self._entry_of[req_id]

    # ---------------------------------------------------------------------------------------
    # Lifecycle (LIFE-1..4).

    def split_records(
        self,
        events: Iterable[PrefixCacheRequestEvent],
        check_hit: Callable[[ReqId, int, tuple[int, ...]], None],
    ) -> tuple[list[_Ending], list[_Starting]]:
        """Split a step's records into ends (and preemptions) and starts, checking each (LIFE-2).

        `check_hit` checks a start's hit (HIT-1) as its record is read.

        Raises:
            BadInputError: A request started twice in the step, or a bad hit (HIT-1, FAIL-5).
            LifecycleError: A record is illegal in its request's state (LIFE-2).
            In both cases nothing changes.
        """
        # The ids are request ids: cast once for the lists, not once per record.
        ending: list[tuple[str, PrefixCacheEventKind]] = []
        starting: list[tuple[str, PrefixCacheEventKind, int, tuple[int, ...]]] = []
        seen: set[str] = set()
        # Ends are legal in every state, and a start in every state but preempted: only a
        # preemption, a resume or a request already preempted needs the states checked.
        check = self._num_preempted > 0
        for event in events:
            req_id = event.req_id
            kind = event.kind
            if kind in _STARTS:
                if req_id in seen:
                    raise BadInputError(
                        what=f"request {req_id!r}",
                        expected="at most one STARTED or RESUMED record per step",
                        got="two",
                    )
                seen.add(req_id)
                if event.hit_end:
                    check_hit(cast(ReqId, req_id), event.hit_end, event.block_ids)
                starting.append((req_id, kind, event.hit_end, event.block_ids))
                check = check or kind is _K.RESUMED
            else:
                ending.append((req_id, kind))
                check = check or kind is _K.PREEMPTED
        ends, starts = cast(list[_Ending], ending), cast(list[_Starting], starting)
        if check:
            self.check_records(ends, starts)
        return ends, starts

    def check_records(self, ending: list[_Ending], starting: list[_Starting]) -> None:
        """LIFE-2: check a step's records against each request's state, changing nothing.

        Ends and preemptions are applied first, in order, then starts and resumes (HIT-2).

        Raises:
            LifecycleError: A record is illegal in its request's state; nothing changes.
        """
        after: dict[ReqId, RequestState] = {}  # the state each request reaches within this step
        for req_id, kind in ending:
            if kind is _K.FINISHED or kind is _K.ABORTED:
                after[req_id] = _NOT_LIVE  # legal in every state: no state to look up
                continue
            now = after.get(req_id) or self.state_of(req_id)
            nxt = _LIFECYCLE.get((now, kind))
            if nxt is None:
                raise LifecycleError(req_id=req_id, event=kind.value, state=now.value)
            after[req_id] = nxt
        # With no request preempted, a STARTED record is legal unless this step preempted it.
        no_preempted = not self._num_preempted
        for req_id, kind, _, _ in starting:
            step_state = after.get(req_id)
            if step_state is None and no_preempted and kind is _K.STARTED:
                continue
            now = step_state or self.state_of(req_id)
            if (now, kind) not in _LIFECYCLE:
                raise LifecycleError(req_id=req_id, event=kind.value, state=now.value)

    def admit(self, req_id: ReqId, hit_end: int) -> None:
        """Open an admission whose positions start at `hit_end`."""
        if not self._free:
            self._grow()
        entry = self._free.pop()
        self.state[entry] = _RUNNING_CODE
        self.computed[entry] = hit_end
        self.cursor[entry] = 0
        self._entry_of[req_id] = entry

    def preempt(self, req_id: ReqId) -> None:
        """LIFE-3: the admission keeps its cursor; its positions restart at the resume."""
        self.state[self._entry_of[req_id]] = _PREEMPTED_CODE
        self._num_preempted += 1
        self._known_layout = None

    def resume(self, req_id: ReqId, hit_end: int) -> int:
        """LIFE-4: positions restart at `hit_end`. Returns the delivery cursor (DLV-3)."""
        entry = self._entry_of[req_id]
        self.state[entry] = _RUNNING_CODE
        self._num_preempted -= 1
        self.computed[entry] = hit_end
        return int(self.cursor[entry])

    def end(self, req_id: ReqId, carried: bool) -> None:
        """The admission ended; its entry is freed now, or once no unended step carries it.

        `carried`: whether an unended step carries its entry (`carried_among`).
        """
        entry = self._entry_of.pop(req_id)
        # Only a preempted count above 0 leaves an entry preempted to look for.
        if self._num_preempted and self.state[entry] == _PREEMPTED_CODE:
            self._num_preempted -= 1
        self._known_layout = None
        if carried:
            self.state[entry] = _ENDED_CODE
            self.ended.add(entry)
        else:
            self._release_entry(entry)

    def check_layout(self, req_ids: tuple[ReqId, ...]) -> Int64Array:
        """Check a save's requests are distinct and running (D9, LIFE-3); return their entries.

        Raises:
            BadInputError: A repeat, a request not live or a preempted one; nothing changes.
        """
        known = self._known_layout
        if known is not None and req_ids == known[0]:
            return known[1]  # decode steps repeat the layout: checked already
        live = self._entry_of
        n = len(req_ids)
        try:
            # One pass over the ids: a request not live fails the lookup, and the distinct check
            # runs on the int entries (two live requests never share one), not on the strings.
            found: tuple[int, ...] | None = (
                itemgetter(*req_ids)(live) if n > 1 else tuple(map(live.__getitem__, req_ids))
            )
        except KeyError:
            found = None  # raised below, outside the handler: the error has no KeyError context
        if found is None:
            self._refuse_layout(req_ids)
        entries = np.fromiter(found, np.int64, n)
        if self._repeats(entries):
            self._refuse_layout(req_ids)
        if self._num_preempted and any_true(self.state[entries] == _PREEMPTED_CODE):
            preempted = sorted(
                r for r in frozenset(req_ids) if self.state[live[r]] == _PREEMPTED_CODE
            )[:4]
            raise BadInputError(
                what="write layout requests",
                expected="running requests: a preempted request has no blocks (LIFE-3, D9)",
                got=f"preempted requests {preempted}",
            )
        self._known_layout = (req_ids, entries)
        return entries

    def _repeats(self, entries: Int64Array) -> bool:
        """Whether an entry appears twice: each row stamps its entry with its index, and a
        repeated entry keeps only one of its rows' stamps."""
        n = len(entries)
        if n < 2:
            return False
        rows = np.arange(n, dtype=np.int64)
        stamp = self._stamp
        stamp[entries] = rows
        same = stamp[entries] == rows
        return not same[same.argmin()]

    def _refuse_layout(self, req_ids: tuple[ReqId, ...]) -> NoReturn:
        """Raise the error of a layout with a repeat or a request not live, a repeat first.

        Raises:
            BadInputError: Always.
        """
        unique = frozenset(req_ids)
        if len(unique) != len(req_ids):
            raise BadInputError(
                what="write layout requests", expected="distinct request ids", got="a repeat"
            )
        missing = sorted(unique - self._entry_of.keys())[:4]
        raise BadInputError(
            what="write layout requests",
            expected="requests STARTED and not finished (D9)",
            got=f"unknown requests {missing}",
        )

    # ---------------------------------------------------------------------------------------
    # Steps.

    def on_save(self, entries: Int64Array, rows: Int64Array) -> tuple[Int64Array, Int64Array]:
        """A step carries `rows` rows of each admission: return their positions (DLV-1).

        Returns each admission's first and one-past-last position. `entries` are distinct (a
        layout names a request once).
        """
        first = self.computed[entries]
        end = first + rows
        self.computed[entries] = end
        return first, end

    def on_step_end(self, carried: list[Int64Array]) -> None:
        """A step ended: free the ended entries that no unended step (`carried`) holds now."""
        held = carried_among(self.ended, carried)
        freed = [entry for entry in self.ended if entry not in held]
        if freed:
            self.ended.difference_update(freed)
            self._release_entries(freed)

    def deliver(
        self, entries: Int64Array, cursor: Int64Array, lo: Int64Array, hi: Int64Array
    ) -> tuple[Int64Array, Int64Array, Int64Array | None]:
        """Hand out positions ``[max(lo, d), hi)`` and move each cursor to ``hi`` (DLV-2, DLV-4).

        `cursor` is ``self.cursor[entries]``, as the caller read it for its DLV-5 check. Returns
        the delivered start and end per entry (``start == end`` when nothing is new) and how many
        of the rows the step carries come before the start, or None when none do.
        """
        if not any_true(cursor > lo):
            # The usual step: nothing at or above its first row was delivered yet.
            self.cursor[entries] = hi
            return lo, hi, None
        start = np.maximum(lo, cursor)
        end = np.maximum(hi, start)
        self.cursor[entries] = end
        return start, end, np.minimum(start, hi) - lo

    def undeliver(self, entries: Int64Array, before: Int64Array, after: Int64Array) -> None:
        """A delivery never reached the caller: put back each cursor `deliver` moved from
        `before` to `after`, unless another consume moved it on since (D19)."""
        back = self.cursor[entries] == after
        self.cursor[entries[back]] = before[back]

    # ---------------------------------------------------------------------------------------
    # State.

    def snapshot(self, steps: list[Int64Array]) -> tuple[Any, ...]:
        """A value of this state independent of how entries happen to be numbered.

        `steps`: the entries of every unended step, in step order. Entries are renamed in
        order of first appearance: live requests sorted by id, then the steps' entries.
        """
        live = self._entry_of
        names: dict[int, int] = {}
        for entry in [*(live[r] for r in sorted(live)), *(e for s in steps for e in s.tolist())]:
            names.setdefault(int(entry), len(names))
        return (
            tuple((r, names[live[r]]) for r in sorted(live)),
            tuple(tuple(names[int(e)] for e in s.tolist()) for s in steps),
            tuple(
                (
                    name,
                    int(self.state[entry]),
                    int(self.computed[entry]),
                    int(self.cursor[entry]),
                )
                for entry, name in names.items()
            ),
        )

    def check_invariants(self, steps: list[Int64Array]) -> None:
        """Check this unit's invariants against the entries of the unended steps.

        Raises:
            InvariantError: One does not hold (a bug in this library).
        """
        carried: set[int] = set()
        for entries in steps:
            if len(np.unique(entries)) != len(entries):
                raise InvariantError("a step carries one admission twice")
            carried.update(entries.tolist())
        used = set(np.flatnonzero(self.state != _FREE).tolist())
        if used & set(self._free) or len(used) + len(self._free) != len(self.state):
            raise InvariantError("the free list and the entry states disagree")
        if not carried <= used:
            raise InvariantError("a step carries a freed admission entry")
        live_entries = set(self._entry_of.values())
        if len(live_entries) != len(self._entry_of):
            raise InvariantError("two live requests share an admission entry")
        preempted = 0
        for req_id, entry in self._entry_of.items():
            code = AdmissionState(int(self.state[entry]))
            if code not in (AdmissionState.RUNNING, AdmissionState.PREEMPTED):
                raise InvariantError(f"request {req_id!r}: entry {entry} is {code.name}")
            preempted += code is AdmissionState.PREEMPTED
        if preempted != self._num_preempted:
            raise InvariantError("the preempted count does not match the entry states")
        if used - live_entries != self.ended:
            raise InvariantError("ended entries do not match those of no live request")
        if not self.ended <= carried:
            raise InvariantError("an ended entry outlived the steps that carry it")
        if (self.cursor < 0).any() or (self.computed < 0).any():
            raise InvariantError("a negative position or cursor")

    # ---------------------------------------------------------------------------------------
    # Internals.

    def _release_entry(self, entry: int) -> None:
        self.state[entry] = _FREE
        self._free.append(entry)

    def _release_entries(self, entries: list[int]) -> None:
        """`_release_entry` of each of `entries`, in order, with one array assignment."""
        self.state[entries] = _FREE
        self._free.extend(entries)

    def _grow(self) -> None:
        size = len(self.state)
        self.computed = np.concatenate([self.computed, np.zeros(size, dtype=np.int64)])
        self.cursor = np.concatenate([self.cursor, np.zeros(size, dtype=np.int64)])
        self.state = np.concatenate([self.state, np.zeros(size, dtype=np.int8)])
        self._stamp = np.zeros(2 * size, dtype=np.int64)
        self._free.extend(range(2 * size - 1, size - 1, -1))


#: Up to this many admissions, `carried_among` looks each up in every step's entries; more (the
#: end of a prefill's hundreds of requests while their step is unconsumed) take one membership
#: test of them all.
_FEW_ENTRIES: Final = 8


def carried_among(entries: Collection[int], step_entries: Sequence[Int64Array]) -> set[int]:
    """Those of admission `entries` that an unended step, given by its entry array, carries."""
    if not entries or not step_entries:
        return set()
    if len(entries) <= _FEW_ENTRIES:
        return {e for e in entries if any(any_true(held == e) for held in step_entries)}
    wanted = np.fromiter(entries, dtype=np.int64, count=len(entries))
    found = np.isin(wanted, np.concatenate(step_entries))
    return set(wanted[found].tolist())
