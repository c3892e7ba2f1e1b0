"""Inputs the core accepts, effects it asks for, and the enums both use.

Inputs are what the adapter feeds in (engine calls and committer reports); effects are what the
core asks the adapter to do. Both are plain frozen values that carry ids and slot arrays, never
tensors. Each effect's docstring ends with the inputs the adapter reports when it is done.

Slot arrays are numpy ``int64`` vectors; they are compared by identity, so values holding them
use ``eq=False`` (the canonical, comparable state is `CacheCore.snapshot()`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Final, TypeAlias

import attrs
import numpy as np
import numpy.typing as npt

from omni_cache_core._contract import PrefixCacheStep, ReqId, StepId, TensorName, Tid, _CodeRepr

__all__ = [
    "AwaitPage",
    "AwaitTasks",
    "CommitEffect",
    "ConsumeBegin",
    "ConsumeEffect",
    "ConsumeEnd",
    "ConsumePlan",
    "CopyLanded",
    "CopyStarted",
    "DeferredChunk",
    "Effect",
    "EscalateTasks",
    "PageClaimed",
    "PrefetchRead",
    "Presence",
    "Preserve",
    "ReadPlan",
    "SaveAbort",
    "SaveBegin",
    "SaveCommit",
    "SaveProceed",
    "SaveProceedEffect",
    "SavePublished",
    "ShutDown",
    "SlotArray",
    "SlotSource",
    "StartEffect",
    "StartStep",
    "StepWrite",
    "TaskState",
    "Tombstone",
    "WriteFailed",
    "WriteLanded",
]

SlotArray: TypeAlias = npt.NDArray[np.int64]


class TaskState(_CodeRepr):
    """Where a write task is in its pipeline (TASK-2)."""

    #: Registered, not queued: an open deferred write that may still take chunks.
    PENDING = 0
    #: Queued for the committer (or for an inline run); takes no more chunks.
    QUEUED = 1
    #: The copy stage runs (one thread only).
    COPYING = 2
    #: Host rows are complete; the device clones are no longer needed.
    HOST_READY = 3
    #: The rows are in the pool (except tombstoned slots). Terminal.
    WRITTEN = 4
    #: The copy or the pool write failed. Terminal; the cache is poisoned (FAIL-1).
    FAILED = 5


class Presence(_CodeRepr):
    """State of one (slot, key) as SLOT-1 names it; derived from the owner table."""

    #: Never observed for the slot's current tenant.
    UNKNOWN = -2
    #: The current tenant wrote no value for this key (SLOT-4).
    ABSENT = -1
    #: The pool holds the rows of the last completed write.
    COMMITTED = 0
    #: A registered write owns the slot (owner > 0).
    IN_TRANSIT = 1


class SlotSource(_CodeRepr):
    """Where one planned hit row is read from (HIT-3, HIT-5)."""

    #: The pool row (committed), or its preserved copy if a newer write claimed the slot.
    POOL = 0
    #: The pool row once the owning immediate write is WRITTEN (never a staging view).
    AFTER_WRITE = 1
    #: The owning deferred write's own rows (host rows, or its device clone).
    TASK = 2
    #: Zeros: an mm key unknown or absent at this slot.
    ZEROS = 3
    #: A row of the consuming step itself: a producer of the same step wins (HIT-5).
    THIS_STEP = 4


# ---------------------------------------------------------------------------------------------
# Inputs: engine calls.


@attrs.frozen(kw_only=True)
class StartStep:
    """The engine starts a step: lifecycle records and scheduled counts (`new_step_starts`).

    Attributes:
        step: The step's records and counts.
        now_ns: The clock when the step started.
        prefetch: Whether the adapter prefetches hits (HIT-7): without, the start asks for no
            `PrefetchRead` (a CPU manager's default), and plans the same reads.
    """

    step: PrefixCacheStep
    now_ns: int
    prefetch: bool = True


@attrs.frozen(kw_only=True, eq=False)
class SaveBegin:
    """The engine saves a step: the layout and what the adapter classified (`save_outputs`).

    Attributes:
        now_ns: The clock when the save began.
        req_ids: Requests of the layout in batch order.
        row_bounds: ``len(req_ids) + 1`` row boundaries: request ``i`` owns rows
            ``[row_bounds[i], row_bounds[i + 1])``; the last bound is ``num_tokens``.
        slots: One KV slot per row (``num_tokens`` entries).
        num_tokens: The step's unpadded token count ``n``.
        immediate_keys: Cached keys copied at save (hidden first when the policy caches it).
        deferred_keys: Deferred keys this step emitted as step-token tensors.
        immediate_bytes: Bytes of the immediate device clones (BUDGET-1).
        deferred_bytes: Bytes of the deferred device clones (BUDGET-1).
        drafts: Per request, how many of its rows, at the end of its range, are draft tokens
            whose acceptance is not known yet (SPEC-1); None when the step has none.
    """

    now_ns: int
    req_ids: tuple[ReqId, ...]
    row_bounds: SlotArray
    slots: SlotArray
    num_tokens: int
    immediate_keys: tuple[TensorName, ...] = ()
    deferred_keys: tuple[TensorName, ...] = ()
    immediate_bytes: int = 0
    deferred_bytes: int = 0
    drafts: SlotArray | None = None


@attrs.frozen(kw_only=True)
class SaveProceed:
    """Advance the pending save: barrier, budget, page (re-asked after every wait)."""

    now_ns: int


@attrs.frozen(kw_only=True)
class SaveCommit:
    """Publish the pending save once its page is claimed and filled."""

    now_ns: int


@attrs.frozen(kw_only=True)
class SaveAbort:
    """Forget the pending save and give back its page and budget (STEP-5)."""


@attrs.frozen(kw_only=True)
class ConsumeBegin:
    """Consume a step: `materialize` (``req_ids`` given) or `discard_step` (``None``).

    ``computed``: per request, its computed-token count as the engine knows it after this
    step's sampler, when the consumer reports it: it confirms the step's draft rows below it
    (SPEC-2). Requests without drafts in the step are not checked.
    """

    step_id: StepId
    req_ids: tuple[ReqId, ...] | None
    now_ns: int
    computed: Mapping[ReqId, int] | None = None


@attrs.frozen(kw_only=True)
class ConsumeEnd:
    """The reads of a consumed step are done: release its page and drop its reads.

    ``delivered=False``: the adapter could not build the outputs (a gather failed), so nothing
    reached the caller and the delivery cursors the consume moved go back (D19).
    """

    step_id: StepId
    delivered: bool = True


@attrs.frozen(kw_only=True)
class ShutDown:
    """The cache closes; every later engine input raises `ShutDownError`."""


# ---------------------------------------------------------------------------------------------
# Inputs: committer reports (drained under the state lock, in the order they happened).


@attrs.frozen(kw_only=True)
class CopyStarted:
    """A task's copy stage started (QUEUED -> COPYING)."""

    tid: Tid


@attrs.frozen(kw_only=True)
class CopyLanded:
    """A task's host rows are complete (COPYING -> HOST_READY)."""

    tid: Tid


@attrs.frozen(kw_only=True)
class WriteLanded:
    """A task's rows are in the pool (HOST_READY -> WRITTEN)."""

    tid: Tid


@attrs.frozen(kw_only=True)
class WriteFailed:
    """A task's copy or pool write failed (-> FAILED); the cache is poisoned (FAIL-1)."""

    tid: Tid
    reason: str


Report: TypeAlias = CopyStarted | CopyLanded | WriteLanded | WriteFailed


# ---------------------------------------------------------------------------------------------
# Effects.


@attrs.frozen(kw_only=True)
class AwaitTasks:
    """Wait until each task reaches its state, or the deadline.

    Attributes:
        waits: ``(tid, state)`` pairs: WRITTEN or HOST_READY; FAILED also ends a wait.
        deadline_ns: When the core will raise the timeout error for this wait.
        what: Which wait this is ("save barrier", "budget flush", "hit join").

    Report with: the drained committer reports, then the same input again with a fresh now_ns.
    """

    waits: tuple[tuple[Tid, TaskState], ...]
    deadline_ns: int
    what: str


@attrs.frozen(kw_only=True)
class EscalateTasks:
    """Move these tasks to the front of the high-priority queue, last one first (TASK-4).

    A task already copying is left alone (TASK-2). Inline mode runs them at once, outside the
    state lock (CONC-1).

    Report with: CopyStarted, CopyLanded, WriteLanded or WriteFailed per task, as they happen.
    """

    tids: tuple[Tid, ...]


@attrs.frozen(kw_only=True)
class AwaitPage:
    """No page is free: wait for a consume to end or a write to land, or the deadline.

    Report with: SaveProceed again with a fresh now_ns.
    """

    deadline_ns: int


@attrs.frozen(kw_only=True)
class PageClaimed:
    """The pending save holds this page: copy the step's immediate rows into it.

    Report with: SaveCommit once the copy is launched (or done, on CPU), else SaveAbort.
    """

    page: int


@attrs.frozen(kw_only=True)
class StepWrite:
    """Write the step's page rows of these keys into the pool (one write per step, D1).

    Attributes:
        tid: The write task.
        step_id: The step whose page and slots it uses.
        page: The page holding the rows.
        keys: Immediate keys to write.

    Report with: CopyStarted, CopyLanded, WriteLanded, or WriteFailed.
    """

    tid: Tid
    step_id: StepId
    page: int
    keys: tuple[TensorName, ...]


@attrs.frozen(kw_only=True)
class DeferredChunk:
    """Append rows ``[row_start, row_end)`` of this step's deferred clones to a deferred task.

    Attributes:
        tid: The deferred task (JOIN_ON_FINISH) of ``req_id``.
        req_id: The request.
        new_task: True when this chunk opens the task (D2, SLOT-5).
        row_start: First row in the step.
        row_end: One past the last row.

    Report with: nothing until the task is escalated.
    """

    tid: Tid
    req_id: ReqId
    new_task: bool
    row_start: int
    row_end: int


@attrs.frozen(kw_only=True, eq=False)
class Tombstone:
    """A newer write took these slots: this task must never write them to the pool (SLOT-2).

    Report with: nothing.
    """

    tid: Tid
    key: TensorName
    slots: SlotArray


@attrs.frozen(kw_only=True, eq=False)
class Preserve:
    """Copy the pool rows of these read positions into the read, before any new write lands.

    Copy-on-write for a delayed read (HIT-6). Must be done before the effects that follow it
    (the new write) are dispatched.

    Report with: nothing.
    """

    read_id: int
    key: TensorName
    positions: SlotArray
    slots: SlotArray


@attrs.frozen(kw_only=True, eq=False)
class PrefetchRead:
    """Optionally start gathering these committed pool rows of a planned read (HIT-7).

    Report with: nothing; the gather's result is used at consume, after the preserved overlay.
    """

    read_id: int
    req_id: ReqId
    key: TensorName
    positions: SlotArray
    slots: SlotArray

    @classmethod
    def _of_registered(
        cls,
        read_id: int,
        req_id: ReqId,
        key: TensorName,
        positions: SlotArray,
        slots: SlotArray,
    ) -> PrefetchRead:
        """A prefetch the core's hit registration built, its fields given in order.

        The caller guarantees each field has its declared type (no attrs validator checks one
        either). A start with many hits builds one per hit and key; skipping the keyword call
        and the frozen class's attribute guard halves that. The value equals the constructor's.
        """
        read = object.__new__(cls)
        set_read_id, set_req_id, set_key, set_positions, set_slots = _PREFETCH_READ_SETTERS
        set_read_id(read, read_id)
        set_req_id(read, req_id)
        set_key(read, key)
        set_positions(read, positions)
        set_slots(read, slots)
        return read


@attrs.frozen(kw_only=True, eq=False)
class ReadPlan:
    """Final per-row sources of one hit read, handed out at consume.

    Attributes:
        read_id: The read.
        req_id: The request.
        key: The cached key.
        slots: The hit slots, in prefix order.
        source: `SlotSource` values per position (int8).
        writer: The owning task per position for AFTER_WRITE and TASK, else 0.
        chunk_limit: For TASK sources, ``(tid, chunks)``: read that task's first ``chunks``
            chunks only (rows appended after planning belong to a newer tenant).
        step_row: The consuming step's row per position for THIS_STEP, else -1.
        preserved: Positions whose pool row was preserved by a Preserve effect.
    """

    read_id: int
    req_id: ReqId
    key: TensorName
    slots: SlotArray
    source: npt.NDArray[np.int8]
    writer: npt.NDArray[np.int32]
    chunk_limit: tuple[tuple[Tid, int], ...]
    step_row: npt.NDArray[np.int32]
    preserved: npt.NDArray[np.bool_]

    @classmethod
    def _of_planned(
        cls,
        read_id: int,
        req_id: ReqId,
        key: TensorName,
        slots: SlotArray,
        source: npt.NDArray[np.int8],
        writer: npt.NDArray[np.int32],
        chunk_limit: tuple[tuple[Tid, int], ...],
        step_row: npt.NDArray[np.int32],
        preserved: npt.NDArray[np.bool_],
    ) -> ReadPlan:
        """A plan the core's read planning built, its fields given in order.

        The caller guarantees each field has its declared type (no attrs validator checks one
        either). A prefill save plans one read per hit and key; skipping the keyword call and
        the frozen class's attribute guard halves each plan's cost. The value equals the
        constructor's.
        """
        plan = object.__new__(cls)
        (
            set_read_id,
            set_req_id,
            set_key,
            set_slots,
            set_source,
            set_writer,
            set_chunk_limit,
            set_step_row,
            set_preserved,
        ) = _READ_PLAN_SETTERS
        set_read_id(plan, read_id)
        set_req_id(plan, req_id)
        set_key(plan, key)
        set_slots(plan, slots)
        set_source(plan, source)
        set_writer(plan, writer)
        set_chunk_limit(plan, chunk_limit)
        set_step_row(plan, step_row)
        set_preserved(plan, preserved)
        return plan


def _slot_setters(cls: type) -> tuple[Callable[[object, object], None], ...]:
    """The setters of a slotted attrs class's fields, in field order (for fast constructors)."""
    return tuple(cls.__dict__[field.name].__set__ for field in attrs.fields(cls))


_PREFETCH_READ_SETTERS: Final = _slot_setters(PrefetchRead)
_READ_PLAN_SETTERS: Final = _slot_setters(ReadPlan)


@attrs.frozen(kw_only=True, eq=False)
class ConsumePlan:
    """What the consume of a step reads.

    Attributes:
        step_id: The step.
        page: Its page (still held until ConsumeEnd, D5).
        keys: Cached keys returned (hidden first when cached; OUT-6).
        reads: Hit reads of the requested requests.
        discard: True for `discard_step`: nothing to read, page already released.
        starts: Per requested request, in the order asked, the first position it is handed
            (DLV-2, DLV-7).
        ends: Likewise, one past the last; ``start == end`` when nothing is new.
        skip: Per requested request, how many of the rows the step carries for it (hit rows,
            then its own rows) come before its start and are not handed out again (DLV-2);
            None when that is 0 for every request, as it is without preemption.
        cut_tail: Whether some request is handed fewer rows than it carries after `skip`:
            draft rows not confirmed, or rejected (SPEC-1). Each request then gets exactly
            ``ends - starts`` rows.

    Report with: ConsumeEnd (not for a discard).
    """

    step_id: StepId
    page: int
    keys: tuple[TensorName, ...]
    reads: tuple[ReadPlan, ...]
    discard: bool
    starts: npt.NDArray[np.int64] = attrs.field(factory=lambda: np.zeros(0, np.int64))
    ends: npt.NDArray[np.int64] = attrs.field(factory=lambda: np.zeros(0, np.int64))
    skip: npt.NDArray[np.int64] | None = None
    cut_tail: bool = False

    @property
    def positions(self) -> npt.NDArray[np.int64]:
        """``(start, end)`` per requested request, as rows of a ``(k, 2)`` array."""
        return np.stack((self.starts, self.ends), axis=1)


@attrs.frozen(kw_only=True)
class SavePublished:
    """The save is published under ``step_id``; run ``effects`` in order.

    ``reads`` are the step's planned hit reads (D4), each its read id and the write tasks whose
    own rows it reads (`SlotSource.TASK`): what the adapter keeps for the step's consume, so it
    never asks the core back.

    Report with: per effect, as each says.
    """

    step_id: StepId
    effects: tuple[CommitEffect, ...]
    reads: tuple[tuple[int, frozenset[Tid]], ...]


Effect: TypeAlias = (
    AwaitTasks
    | EscalateTasks
    | AwaitPage
    | PageClaimed
    | StepWrite
    | DeferredChunk
    | Tombstone
    | Preserve
    | PrefetchRead
    | ConsumePlan
    | SavePublished
)


# ---------------------------------------------------------------------------------------------
# Effects by the input that returns them. Each adapter dispatch matches one of these unions
# exhaustively, so an effect that an input starts returning without a handler fails the type
# check instead of reaching the adapter's `assert_never`.

StartEffect: TypeAlias = EscalateTasks | PrefetchRead | Tombstone
"""What `CacheCore.start_step` returns: escalations of ended requests' writes, tombstones of
rejected draft rows (SPEC-3), hit prefetches."""

SaveProceedEffect: TypeAlias = AwaitTasks | EscalateTasks | AwaitPage | PageClaimed
"""What `CacheCore.save_proceed` returns: a wait, a budget flush to run first, or the page."""

CommitEffect: TypeAlias = StepWrite | DeferredChunk | Tombstone | Preserve
"""What `SavePublished.effects` of `CacheCore.save_commit` holds, in the order to run them."""

ConsumeEffect: TypeAlias = ConsumePlan | AwaitTasks
"""What `CacheCore.consume_begin` returns: the consume's plan, or the hit join to wait for."""
