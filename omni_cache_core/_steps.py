"""Steps: the saved steps not yet ended, their ids and their consumes (STEP, D5, DLV-5).

A step is saved by `SaveCommit`, which issues its id (STEP-1), and consumed once by id: a
discard ends it at once; a materialize hands out its plan and ends at `ConsumeEnd` (D5):

==========  =====================  ==========
state       input                  next state
==========  =====================  ==========
OPEN        ConsumeBegin, discard  ended
OPEN        ConsumeBegin, waits    OPEN (a consume deadline is set on the first wait)
OPEN        ConsumeBegin, plan     CONSUMING
CONSUMING   ConsumeEnd             ended
==========  =====================  ==========

This unit decides which steps exist, in id order, what each captured at save (its layout, its
keys, the positions it carries per admission: DLV-1) and whether a consume may move a request's
cursor past rows an earlier step still owes (DLV-5). It does not hand out positions (the request
lifecycle does), plan reads, or hold pages: it names the page it was saved on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import numpy.typing as npt

from omni_cache_core._contract import ReqId, StepId, TensorName, Tid
from omni_cache_core._counters import CoreCounters
from omni_cache_core._errors import (
    BadInputError,
    DeliveryOrderError,
    InvariantError,
    StepAlreadyConsumedError,
    UnknownStepError,
    WaitTimeoutError,
)
from omni_cache_core._occupancy import any_true
from omni_cache_core._values import AwaitTasks, SlotArray, TaskState

__all__ = ["Step", "Steps"]

Int64Array = npt.NDArray[np.int64]


class Step:
    """One saved step, as its save captured it (STEP-3), and its consume's progress."""

    __slots__ = (
        "_req_set",
        "consume_deadline_ns",
        "consuming",
        "entries",
        "handed",
        "hi",
        "keys",
        "lo",
        "page",
        "req_ids",
        "row_bounds",
        "step_id",
        "tid",
        "valid",
    )

    def __init__(
        self,
        step_id: StepId,
        page: int,
        req_ids: tuple[ReqId, ...],
        row_bounds: SlotArray,
        keys: tuple[TensorName, ...],
        tid: Tid | None,
        entries: Int64Array,
        lo: Int64Array,
        hi: Int64Array,
        valid: Int64Array | None = None,
    ) -> None:
        self.step_id = step_id
        self.page = page
        self.req_ids = req_ids
        # Built on first use: only a materialize of a subset of the layout asks (STEP-4).
        self._req_set: frozenset[ReqId] | None = None
        self.row_bounds = row_bounds
        self.keys = keys
        self.tid = tid
        #: Per request in layout order: its admission entry and the positions ``[lo, hi)``
        #: the step carries for it (its hit rows, when it registered a hit here, then its own
        #: rows: DLV-1).
        self.entries = entries
        self.lo = lo
        self.hi = hi
        #: Per request, one past the last position that may be handed out: `hi`, except that
        #: draft rows count only once confirmed (SPEC-1, SPEC-2). Its own array when the step
        #: has drafts (a confirmation raises it in place), else `hi` itself.
        self.valid = hi if valid is None else valid
        self.consuming = False
        self.consume_deadline_ns: int | None = None
        #: While a materialize consumes it: the entries it delivered to, their cursors before
        #: and after (a failed build puts them back: D19).
        self.handed: tuple[Int64Array, ...] | None = None

    @property
    def req_set(self) -> frozenset[ReqId]:
        """The layout's requests as a set."""
        req_set = self._req_set
        if req_set is None:
            req_set = self._req_set = frozenset(self.req_ids)
        return req_set

    def select(
        self, requested: tuple[ReqId, ...]
    ) -> tuple[Int64Array, Int64Array, Int64Array, Int64Array]:
        """The entries, positions ``[lo, hi)`` and confirmed ends of `requested`, a subset of
        the layout."""
        if requested == self.req_ids:
            return self.entries, self.lo, self.hi, self.valid
        at = self.rows_of(requested)
        return self.entries[at], self.lo[at], self.hi[at], self.valid[at]

    def rows_of(self, req_ids: Iterable[ReqId]) -> Int64Array:
        """Each request's index in the layout, -1 for one the step does not carry."""
        index = {r: i for i, r in enumerate(self.req_ids)}
        return np.fromiter((index.get(r, -1) for r in req_ids), dtype=np.int64)


class Steps:
    """The unended steps by id (in id order) and the next step id."""

    __slots__ = ("_next_step_id", "_steps", "_timeout_ns", "_timeout_s")

    def __init__(self, timeout_ns: int, timeout_s: float) -> None:
        self._timeout_ns = timeout_ns
        self._timeout_s = timeout_s
        self._next_step_id = 1
        self._steps: dict[StepId, Step] = {}

    def __len__(self) -> int:
        return len(self._steps)

    def __iter__(self) -> Iterator[Step]:
        return iter(self._steps.values())

    @property
    def by_id(self) -> dict[StepId, Step]:
        """The unended steps by id, in id order (callers only read it)."""
        return self._steps

    def get(self, step_id: StepId) -> Step | None:
        """An unended step, or None."""
        return self._steps.get(step_id)

    def open_ids(self) -> tuple[StepId, ...]:
        """Saved steps not yet consumed, by id."""
        return tuple(sorted(s for s, step in self._steps.items() if not step.consuming))

    def entry_arrays(self) -> list[Int64Array]:
        """The admission entries of every unended step, in id order."""
        return [s.entries for s in self._steps.values()]

    def deadlines(self) -> list[int]:
        """The consume deadlines set, in step order."""
        return [d for s in self._steps.values() if (d := s.consume_deadline_ns) is not None]

    def is_oldest(self, step: Step) -> bool:
        """Whether `step` is the oldest unended step."""
        return next(iter(self._steps)) == step.step_id

    def issue_id(self) -> StepId:
        """STEP-1: a fresh, increasing step id."""
        step_id = StepId(self._next_step_id)
        self._next_step_id += 1
        return step_id

    def add(self, step: Step) -> None:
        """Keep a committed step."""
        self._steps[step.step_id] = step

    def remove(self, step: Step) -> None:
        """The step ended (discarded, consumed, or refused: STEP-4)."""
        del self._steps[step.step_id]

    def open_step(self, step_id: StepId) -> Step:
        """The step a `ConsumeBegin` names (STEP-1, STEP-2).

        Raises:
            StepAlreadyConsumedError: The id was consumed, or its consume is in progress.
            UnknownStepError: The id was never issued. In both cases nothing changes.
        """
        step = self._steps.get(step_id)
        if step is not None and not step.consuming:
            return step
        open_ids = self.open_ids()
        if 0 < step_id < self._next_step_id:
            raise StepAlreadyConsumedError(step_id=step_id, open_step_ids=open_ids)
        raise UnknownStepError(step_id=step_id, open_step_ids=open_ids)

    def consuming_step(self, step_id: StepId) -> Step:
        """The step a `ConsumeEnd` names.

        Raises:
            BadInputError: Its consume did not begin; nothing changes.
        """
        step = self._steps.get(step_id)
        if step is None or not step.consuming:
            raise BadInputError(
                what=f"consume end of step {step_id}",
                expected="a step whose consume began",
                got="no such consume",
            )
        return step

    def await_writes(
        self,
        step: Step,
        now_ns: int,
        waits: list[tuple[Tid, TaskState]],
        state_of: Callable[[Tid], TaskState | None],
        counters: CoreCounters,
    ) -> AwaitTasks:
        """HIT-3: a consume waits for the immediate writes its hits read, up to its deadline.

        Raises:
            WaitTimeoutError: The deadline passed (FAIL-3); the caller ends the step.
        """
        if step.consume_deadline_ns is None:
            step.consume_deadline_ns = now_ns + self._timeout_ns
        if now_ns >= step.consume_deadline_ns:
            counters.wait_timeouts += 1
            tid = waits[0][0]
            state = state_of(tid)
            raise WaitTimeoutError(
                what="hit join",
                tid=tid,
                state=state.name if state is not None else "RETIRED",
                timeout_s=self._timeout_s,
            )
        return AwaitTasks(
            waits=tuple(sorted(set(waits))), deadline_ns=step.consume_deadline_ns, what="hit join"
        )

    def check_delivery_order(
        self,
        step: Step,
        requested: tuple[ReqId, ...],
        entries: Int64Array,
        cursor: Int64Array,
        hi: Int64Array,
        cursors: Int64Array,
    ) -> None:
        """DLV-5: refuse to move a request's cursor while an earlier step still owes it rows.

        `cursor`: the requests' cursors; `cursors`: every admission's (indexed by entry).

        An earlier unconsumed step that carries positions at or above a request's cursor would
        hand them out after this step's, out of position order, or find them passed over: this
        step would move the cursor past them (handing out rows, or passing over positions as
        DLV-4 does, even from a step with no rows of the request). So this step waits for it. A
        step whose positions for a request all lie below its cursor is never refused for it, and
        a discard is never refused at all (it moves no cursor).

        Raises:
            DeliveryOrderError: An earlier step owes rows; nothing changes.
        """
        gives = hi > cursor  # the cursor would move to hi (the step's confirmed ends)
        if not any_true(gives):
            return
        for other in self._steps.values():  # in step id order
            if other.step_id == step.step_id:
                return
            if other.consuming:
                continue  # its rows are handed out already
            owes = other.valid > np.maximum(other.lo, cursors[other.entries])
            if not any_true(owes):
                continue
            blocked = gives & np.isin(entries, other.entries[owes])
            if any_true(blocked):
                i = int(np.flatnonzero(blocked)[0])
                j = int(np.flatnonzero(other.entries == entries[i])[0])
                raise DeliveryOrderError(
                    req_id=requested[i],
                    step_id=step.step_id,
                    earlier_step_id=other.step_id,
                    gap=(max(int(other.lo[j]), int(cursor[i])), int(other.valid[j])),
                )

    def snapshot(self, reads: Callable[[StepId], Any]) -> tuple[Any, ...]:
        """A canonical, hashable value of the steps; `reads(step_id)` names each one's reads."""
        return (
            self._next_step_id,
            tuple(
                (
                    s.step_id,
                    s.page,
                    s.req_ids,
                    tuple(s.row_bounds.tolist()),
                    s.keys,
                    s.tid,
                    s.consuming,
                    None if s.handed is None else tuple(tuple(a.tolist()) for a in s.handed[1:]),
                    s.consume_deadline_ns,
                    reads(s.step_id),
                    tuple(s.lo.tolist()),
                    tuple(s.hi.tolist()),
                    tuple(s.valid.tolist()),
                )
                for s in self._steps.values()
            ),
        )

    def check_invariants(self, depth: int) -> None:
        """Check each step's layout and consume record; at most `depth` steps (PAGE-2).

        Raises:
            InvariantError: One does not hold (a bug in this library).
        """
        if len(self._steps) > depth:
            raise InvariantError("more unended steps than pages")
        if list(self._steps) != sorted(self._steps):
            raise InvariantError("steps out of id order")
        for step in self._steps.values():
            if step.handed is not None and not step.consuming:
                raise InvariantError(f"step {step.step_id}: handed, not consumed")
            if not (
                len(step.entries) == len(step.req_ids) == len(step.lo) == len(step.hi)
                and bool((step.lo <= step.hi).all())
                and bool((step.lo <= step.valid).all() and (step.valid <= step.hi).all())
            ):
                raise InvariantError(f"step {step.step_id}: positions do not match its layout")
