"""Write tasks: the registry, their moves, the GPU-byte budget and the save barrier (TASK, BUDGET).

A write task carries rows of cached keys to the pool: one step write per step (D1, its rows on
the step's staging page) and one open deferred write per request (D2, its rows from device
clones, joined when the request finishes). It moves only by `_TASK_MOVES`:

==============  ==============  ==============
state           move            next state
==============  ==============  ==============
PENDING         QUEUE           QUEUED
QUEUED          COPY_STARTED    COPYING
COPYING         COPY_LANDED     HOST_READY
HOST_READY      WRITE_LANDED    WRITTEN
any but last 2  FAIL            FAILED
==============  ==============  ==============

A task retires (leaves the registry) at WRITTEN or FAILED, in the same input (TASK-6).

This unit decides:

- which tasks exist, their states, the slots each claimed and lost (its tombstones: SLOT-2) and
  the chunks a deferred write took (SLOT-5);
- each request's open deferred write and its unfinished ones (D2, TASK-4): a fact about writes,
  so it lives here, not with the request's lifecycle;
- the budget (BUDGET-1): a *ticket* per clone allocation, viewed by the tasks that read it and
  uncharged when the last viewer no longer needs it; plus the bytes the save in progress
  reserved before its commit turns them into tickets;
- what the next save's barrier waits for (TASK-3) and which write a budget flush takes (BUDGET-2).

It does not decide which slots a claim takes (the occupancy tables do), which page a step write
uses (the pages and the save do), nor when a request ends (the request lifecycle does).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any, Final, NamedTuple

import numpy as np
import numpy.typing as npt

from omni_cache_core._contract import ReqId, StepId, TensorName, Tid, WriteSchedule
from omni_cache_core._errors import IllegalTransitionError, InvariantError
from omni_cache_core._occupancy import concat
from omni_cache_core._values import CommitEffect, DeferredChunk, SaveBegin, SlotArray, TaskState

__all__ = ["MAX_TID", "Task", "TaskClaims", "TaskMove", "WriteTasks", "task_ids_needed"]

MAX_TID: Final = 2**31 - 1  # owner table is int32 (D3)


class TaskMove(enum.StrEnum):
    """What moves a write task: a committer report, or the core's own escalation."""

    #: Escalation queues a PENDING write (TASK-4, BUDGET-2).
    QUEUE = "queue"
    #: `CopyStarted`.
    COPY_STARTED = "copy_started"
    #: `CopyLanded`.
    COPY_LANDED = "copy_landed"
    #: `WriteLanded`.
    WRITE_LANDED = "write_landed"
    #: `WriteFailed`.
    FAIL = "fail"

    def __repr__(self) -> str:
        return f"TaskMove.{self.name}"


# TASK-2: the only legal moves, as (state, move) -> next state. Anything else raises.
_TASK_MOVES: Final[dict[tuple[TaskState, TaskMove], TaskState]] = {
    (TaskState.PENDING, TaskMove.QUEUE): TaskState.QUEUED,
    (TaskState.QUEUED, TaskMove.COPY_STARTED): TaskState.COPYING,
    (TaskState.COPYING, TaskMove.COPY_LANDED): TaskState.HOST_READY,
    (TaskState.HOST_READY, TaskMove.WRITE_LANDED): TaskState.WRITTEN,
    (TaskState.PENDING, TaskMove.FAIL): TaskState.FAILED,
    (TaskState.QUEUED, TaskMove.FAIL): TaskState.FAILED,
    (TaskState.COPYING, TaskMove.FAIL): TaskState.FAILED,
    (TaskState.HOST_READY, TaskMove.FAIL): TaskState.FAILED,
}


def task_ids_needed(inp: SaveBegin) -> int:
    """D3: the task ids a save may take: its step write, one deferred write per request with rows.

    Owners are int32, so task ids stop at 2**31 - 1; the save is refused at its begin if they
    would run out.
    """
    n = inp.num_tokens
    needed = 1 if n and inp.immediate_keys else 0
    if n and inp.deferred_keys:
        needed += int((inp.row_bounds[1:] > inp.row_bounds[:-1]).sum())
    return needed


class Task:
    """One write task: its schedule, state, claimed slots per key and tombstones."""

    __slots__ = (
        "chunks",
        "escalated",
        "page",
        "req_id",
        "schedule",
        "slots",
        "state",
        "step_id",
        "tickets",
        "tid",
        "tombstones",
    )

    def __init__(
        self,
        tid: Tid,
        schedule: WriteSchedule,
        state: TaskState,
        *,
        req_id: ReqId | None = None,
        page: int | None = None,
        step_id: StepId | None = None,
    ) -> None:
        self.tid = tid
        self.schedule = schedule
        self.state = state
        self.req_id = req_id
        self.page = page
        self.step_id = step_id
        self.slots: dict[TensorName, list[SlotArray]] = {}
        self.tombstones: dict[TensorName, list[SlotArray]] = {}
        self.tickets: set[int] = set()
        self.chunks = 0
        self.escalated = False

    def lost_any(self, keys: Iterable[TensorName], slots: SlotArray) -> bool:
        """Tell whether this task lost any of `slots` for any of `keys` (SLOT-5)."""
        for key in keys:
            lost = self.tombstones.get(key)
            if lost and np.isin(slots, np.concatenate(lost)).any():
                return True
        return False


class TaskClaims(NamedTuple):
    """What a registered write claimed, as read-only copies (for tests and diagnostics)."""

    #: How many chunks the write took (SLOT-5).
    chunks: int
    #: Its slot chunks per key, in append order.
    slots: dict[TensorName, tuple[SlotArray, ...]]
    #: The slots it lost per key, one array per claim or absence that took them (SLOT-2).
    tombstones: dict[TensorName, tuple[SlotArray, ...]]


def _frozen_copies(
    chunks: dict[TensorName, list[SlotArray]],
) -> dict[TensorName, tuple[SlotArray, ...]]:
    copies: dict[TensorName, tuple[SlotArray, ...]] = {}
    for key, arrays in chunks.items():
        frozen = []
        for array in arrays:
            copy = array.copy()
            copy.setflags(write=False)
            frozen.append(copy)
        copies[key] = tuple(frozen)
    return copies


class _Ticket:
    __slots__ = ("nbytes", "viewers")

    def __init__(self, nbytes: int, viewers: set[Tid]) -> None:
        self.nbytes = nbytes
        self.viewers = viewers


class _RequestWrites:
    """A request's deferred writes: the open one (D2) and the unfinished ones, oldest first."""

    __slots__ = ("open_tid", "tids")

    def __init__(self) -> None:
        self.open_tid: Tid | None = None
        self.tids: list[Tid] = []


class WriteTasks:
    """The registered write tasks, the budget's tickets and the save barrier's waits.

    Args:
        budget_bytes: The GPU-byte budget for device clones (`gpu_staging_bytes`).
    """

    __slots__ = (
        "_budget_bytes",
        "_budget_used",
        "_escalated",
        "_next_ticket",
        "_next_tid",
        "_requests",
        "_reserved",
        "_tasks",
        "_tickets",
        "_unwritten_step_writes",
        "_writers",
    )

    def __init__(self, budget_bytes: int) -> None:
        self._budget_bytes = budget_bytes
        self._next_tid = 1
        # Kept in tid (insertion) order: terminal tasks retire at once, so the first one is
        # the oldest unfinished write (BUDGET-2).
        self._tasks: dict[Tid, Task] = {}
        #: Per key, how many registered writes hold slots of it (with none, no slot of that
        #: key can be in flight, and a claim skips looking).
        self._writers: dict[TensorName, int] = {}
        self._tickets: dict[int, _Ticket] = {}
        self._next_ticket = 1
        #: Bytes charged: the live tickets plus `_reserved`.
        self._budget_used = 0
        #: Bytes the save in progress was admitted with and has not turned into tickets yet.
        self._reserved = 0
        self._requests: dict[ReqId, _RequestWrites] = {}
        self._unwritten_step_writes: set[Tid] = set()  # TASK-3: next save waits WRITTEN
        self._escalated: set[Tid] = set()  # TASK-3: next save waits HOST_READY

    # -----------------------------------------------------------------------------------------
    # Queries.

    @property
    def tasks(self) -> Mapping[Tid, Task]:
        """The registered tasks by tid, oldest first (a read-only view)."""
        return MappingProxyType(self._tasks)

    def get(self, tid: Tid) -> Task | None:
        """A registered task, or None."""
        return self._tasks.get(tid)

    def is_registered(self, tid: Tid) -> bool:
        """Whether the task is registered (not retired)."""
        return tid in self._tasks

    def state_of(self, tid: Tid) -> TaskState | None:
        """A registered task's state, or None once it retired."""
        task = self._tasks.get(tid)
        return task.state if task is not None else None

    def chunks_of(self, tid: Tid) -> int | None:
        """How many chunks a registered task took, or None once it retired."""
        task = self._tasks.get(tid)
        return task.chunks if task is not None else None

    def claims_of(self, tid: Tid) -> TaskClaims | None:
        """A registered task's chunks, slots and tombstones as copies, or None once it retired."""
        task = self._tasks.get(tid)
        if task is None:
            return None
        return TaskClaims(task.chunks, _frozen_copies(task.slots), _frozen_copies(task.tombstones))

    @property
    def budget_used(self) -> int:
        """Device clone bytes charged (BUDGET-1)."""
        return self._budget_used

    @property
    def reserved(self) -> int:
        """Bytes the save in progress reserved."""
        return self._reserved

    def busy_keys(self) -> set[TensorName]:
        """Keys some registered write holds slots of (SLOT-1: only those can be in flight)."""
        return {key for key, count in self._writers.items() if count}

    def open_write(self, req_id: ReqId) -> Tid | None:
        """The request's open deferred write (D2), or None."""
        writes = self._requests.get(req_id)
        return writes.open_tid if writes is not None else None

    @property
    def any_request_writes(self) -> bool:
        """Whether this unit tracks some request's deferred writes (else `end_request` has none)."""
        return bool(self._requests)

    def requests_with_writes(self) -> set[ReqId]:
        """Requests this unit tracks deferred writes of."""
        return set(self._requests)

    def with_pages(self) -> list[tuple[Tid, str]]:
        """Each write that holds a page, with its state's name (for `PageTimeoutError`)."""
        return [(t.tid, t.state.name) for t in self._tasks.values() if t.page is not None]

    def barrier_waits(self) -> tuple[tuple[Tid, TaskState], ...]:
        """TASK-3: what the next save waits for; empty when nothing."""
        if not self._unwritten_step_writes and not self._escalated:
            return ()
        waits = [(tid, TaskState.WRITTEN) for tid in sorted(self._unwritten_step_writes)]
        waits += [(tid, TaskState.HOST_READY) for tid in sorted(self._escalated)]
        return tuple(waits)

    def flush_victim(self) -> Task | None:
        """The oldest unfinished write (BUDGET-2), or None.

        SPEC has the flush force that write to "copy and write", so a write that has copied
        (HOST_READY, its charge already gone) is still the victim and is awaited until WRITTEN;
        the loop then moves to the next oldest, until the save fits or nothing is left.
        """
        return next(iter(self._tasks.values()), None)

    # -----------------------------------------------------------------------------------------
    # Registration.

    def check_tid_room(self, inp: SaveBegin) -> None:
        """D3, STEP-5: refuse a save that may need more task ids than int32 owners allow.

        Raises:
            InvariantError: The ids would run out; nothing changes.
        """
        # A save takes at most one id per request plus its step write's: count them exactly
        # only when that bound does not fit.
        if self._next_tid + len(inp.req_ids) <= MAX_TID:
            return
        needed = task_ids_needed(inp)
        if self._next_tid - 1 + needed > MAX_TID:
            raise InvariantError(
                f"write task ids exhausted (2**31 - 1): a save needing {needed} more cannot start"
            )

    def _new_tid(self) -> Tid:
        if self._next_tid > MAX_TID:
            raise InvariantError("write task ids exhausted (2**31 - 1)")
        tid = Tid(self._next_tid)
        self._next_tid += 1
        return tid

    def register_step_write(
        self,
        step_id: StepId,
        page: int,
        keys: tuple[TensorName, ...],
        slots: SlotArray,
        nbytes: int,
    ) -> Task:
        """Register a step's write of `slots` for every immediate key (D1).

        It is queued at once (it is dispatched with the commit) and, with `nbytes`, views a
        ticket of that many reserved bytes (BUDGET-1).
        """
        task = Task(
            self._new_tid(),
            WriteSchedule.JOIN_NEXT_STEP,
            TaskState.QUEUED,
            page=page,
            step_id=step_id,
        )
        task.chunks = 1
        self._tasks[task.tid] = task
        self._unwritten_step_writes.add(task.tid)
        for key in keys:
            self.hold(task, key, slots)
        if nbytes:
            self.add_ticket(nbytes, {task.tid})
        return task

    def hold(self, task: Task, key: TensorName, slots: SlotArray) -> None:
        """Add a chunk of `key` slots to `task`'s write."""
        chunks = task.slots.get(key)
        if chunks is None:
            task.slots[key] = [slots]
            self._writers[key] = self._writers.get(key, 0) + 1
        else:
            chunks.append(slots)

    def tombstone(self, tid: Tid, key: TensorName, lost: SlotArray) -> None:
        """SLOT-2: `tid` lost `lost` slots of `key` to a newer claim or an absence."""
        self._tasks[tid].tombstones.setdefault(key, []).append(lost)

    def stage_deferred(
        self, sv: SaveBegin, effects: list[CommitEffect]
    ) -> tuple[npt.NDArray[np.int32], set[Tid]]:
        """Append each request's rows to its open deferred write, or open one (D2, SLOT-5)."""
        bounds = sv.row_bounds.tolist()
        owners = np.zeros(sv.num_tokens, dtype=np.int32)
        used: set[Tid] = set()
        for i, req_id in enumerate(sv.req_ids):
            start, end = bounds[i], bounds[i + 1]
            if start == end:
                continue
            writes = self._requests.get(req_id)
            if writes is None:
                writes = self._requests[req_id] = _RequestWrites()
            chunk = sv.slots[start:end]
            task = self._tasks.get(writes.open_tid) if writes.open_tid is not None else None
            new_task = task is None or task.lost_any(sv.deferred_keys, chunk)
            if new_task:
                task = Task(
                    self._new_tid(), WriteSchedule.JOIN_ON_FINISH, TaskState.PENDING, req_id=req_id
                )
                self._tasks[task.tid] = task
                writes.open_tid = task.tid
                writes.tids.append(task.tid)
            assert task is not None
            task.chunks += 1
            for key in sv.deferred_keys:
                self.hold(task, key, chunk)
            owners[start:end] = task.tid
            used.add(task.tid)
            effects.append(
                DeferredChunk(
                    tid=task.tid, req_id=req_id, new_task=new_task, row_start=start, row_end=end
                )
            )
        return owners, used

    # -----------------------------------------------------------------------------------------
    # Budget (BUDGET-1).

    def admit(self, nbytes: int) -> Task | None:
        """BUDGET-2: reserve a save's `nbytes` if they fit, or if nothing is left to flush.

        Returns None once reserved (before the save's clones exist); otherwise the write to
        flush first (`flush_victim`), with nothing reserved. An oversized save is admitted once
        every write has gone, so it never hangs.
        """
        if self._budget_used + nbytes > self._budget_bytes:
            victim = self.flush_victim()
            if victim is not None:
                return victim
        self._reserved += nbytes
        self._budget_used += nbytes
        return None

    def unreserve(self, nbytes: int) -> None:
        """Give back reserved bytes: an aborted save, or a charge nothing was cloned for."""
        self._reserved -= nbytes
        self._budget_used -= nbytes

    def add_ticket(self, nbytes: int, viewers: set[Tid]) -> None:
        """Turn `nbytes` of the reservation into a ticket the `viewers` read."""
        ident = self._next_ticket
        self._next_ticket += 1
        self._tickets[ident] = _Ticket(nbytes, set(viewers))
        self._reserved -= nbytes
        for tid in viewers:
            self._tasks[tid].tickets.add(ident)

    def _release_tickets(self, task: Task) -> None:
        """BUDGET-1: a task no longer needs its clones; the last viewer uncharges them."""
        for ident in task.tickets:
            ticket = self._tickets[ident]
            ticket.viewers.discard(task.tid)
            if not ticket.viewers:
                self._budget_used -= ticket.nbytes
                del self._tickets[ident]
        task.tickets = set()

    # -----------------------------------------------------------------------------------------
    # Moves.

    def move(self, tid: Tid, how: TaskMove) -> Task:
        """Apply one move of the TASK-2 table.

        Raises:
            IllegalTransitionError: The move is not in the table; nothing changes.
        """
        task = self._tasks.get(tid)
        if task is None:
            raise IllegalTransitionError(tid=tid, from_state="RETIRED", to_state=how)
        nxt = _TASK_MOVES.get((task.state, how))
        if nxt is None:
            raise IllegalTransitionError(tid=tid, from_state=task.state.name, to_state=how)
        task.state = nxt
        return task

    def copy_landed(self, tid: Tid) -> Task:
        """The task's host rows are complete: its clones are no longer needed (BUDGET-1)."""
        task = self.move(tid, TaskMove.COPY_LANDED)
        self._release_tickets(task)
        self._escalated.discard(task.tid)
        return task

    def fail(self, tid: Tid) -> Task:
        """The task failed: it gives up its clones (the caller retires it)."""
        task = self.move(tid, TaskMove.FAIL)
        self._release_tickets(task)
        self._escalated.discard(task.tid)
        return task

    def retire(self, task: Task) -> int | None:
        """Drop a WRITTEN or FAILED task from the registry; return the page it held, if any."""
        del self._tasks[task.tid]
        for key in task.slots:
            self._writers[key] -= 1
        self._unwritten_step_writes.discard(task.tid)
        self._escalated.discard(task.tid)
        if task.req_id is not None:
            writes = self._requests.get(task.req_id)
            if writes is not None:
                if task.tid in writes.tids:
                    writes.tids.remove(task.tid)
                if writes.open_tid == task.tid:
                    writes.open_tid = None
                self._drop_if_idle(task.req_id, writes)
        return task.page

    def escalate(self, task: Task) -> None:
        """Queue `task` at the front and have the next save wait for it (TASK-3, BUDGET-2)."""
        if task.state is TaskState.PENDING:
            self.move(task.tid, TaskMove.QUEUE)
        task.escalated = True
        if task.state.value < TaskState.HOST_READY.value:
            self._escalated.add(task.tid)
        if task.req_id is not None:
            writes = self._requests.get(task.req_id)
            if writes is not None and writes.open_tid == task.tid:
                writes.open_tid = None  # BUDGET-2: the next save opens a new write

    def end_request(self, req_id: ReqId, *, ended: bool) -> list[Tid]:
        """TASK-4: escalate a finished, aborted or preempted request's writes, newest first.

        `ended`: the request finished or was aborted, so its record goes; a preempted one keeps
        tracking its unfinished writes.
        """
        writes = self._requests.get(req_id)
        if writes is None:
            return []
        tids = [tid for tid in reversed(writes.tids) if tid in self._tasks]
        for tid in tids:
            self.escalate(self._tasks[tid])
        writes.open_tid = None
        if ended:
            del self._requests[req_id]
        else:
            self._drop_if_idle(req_id, writes)
        return tids

    def _drop_if_idle(self, req_id: ReqId, writes: _RequestWrites) -> None:
        # A request with no writes left has no record, so equal states snapshot equal.
        if writes.open_tid is None and not writes.tids:
            del self._requests[req_id]

    # -----------------------------------------------------------------------------------------
    # State.

    def snapshot(self) -> tuple[Any, ...]:
        """A canonical, hashable value of this unit's state."""
        return (
            self._next_tid,
            tuple(
                (
                    t.tid,
                    t.schedule.value,
                    t.req_id,
                    t.state.name,
                    t.page,
                    t.step_id,
                    t.chunks,
                    t.escalated,
                    tuple((k, tuple(concat(v).tolist())) for k, v in sorted(t.slots.items())),
                    tuple(
                        (k, tuple(sorted(set(concat(v).tolist()))))
                        for k, v in sorted(t.tombstones.items())
                        if v
                    ),
                    tuple(sorted(t.tickets)),
                )
                for t in sorted(self._tasks.values(), key=lambda t: t.tid)
            ),
            tuple(
                (i, t.nbytes, tuple(sorted(t.viewers))) for i, t in sorted(self._tickets.items())
            ),
            self._next_ticket,
            self._budget_used,
            self._reserved,
            tuple((r, w.open_tid, tuple(w.tids)) for r, w in sorted(self._requests.items())),
            tuple(sorted(self._unwritten_step_writes)),
            tuple(sorted(self._escalated)),
        )

    def check_invariants(self) -> None:
        """Check the registry, the budget's tickets and the open writes.

        Raises:
            InvariantError: One does not hold (a bug in this library).
        """

        def need(ok: bool, what: str) -> None:
            if not ok:
                raise InvariantError(what)

        for task in self._tasks.values():
            need(task.state not in (TaskState.WRITTEN, TaskState.FAILED), "terminal task kept")
            if task.schedule is WriteSchedule.JOIN_ON_FINISH:
                need(task.page is None, "deferred task holds a page")
        # BUDGET-1: the charge equals the live tickets plus the pending reservation.
        need(
            self._reserved >= 0
            and self._budget_used == sum(t.nbytes for t in self._tickets.values()) + self._reserved,
            "budget charge does not match live tickets",
        )
        for ident, ticket in self._tickets.items():
            need(bool(ticket.viewers), f"ticket {ident} has no viewer")
            for tid in ticket.viewers:
                viewer = self._tasks.get(tid)
                need(
                    viewer is not None
                    and viewer.state.value < TaskState.HOST_READY.value
                    and ident in viewer.tickets,
                    f"ticket {ident} viewed by task {tid} that no longer needs its clone",
                )
        writers: dict[TensorName, int] = {}
        for task in self._tasks.values():
            for key in task.slots:
                writers[key] = writers.get(key, 0) + 1
        need(
            {k: c for k, c in self._writers.items() if c} == writers,
            f"writers per key {self._writers} != the registered writes' keys {writers}",
        )
        # D2: a request's open deferred write is PENDING and not escalated.
        for req_id, writes in self._requests.items():
            if writes.open_tid is not None:
                open_task = self._tasks.get(writes.open_tid)
                need(
                    open_task is not None
                    and open_task.state is TaskState.PENDING
                    and not open_task.escalated,
                    f"request {req_id}: open deferred write {writes.open_tid} is not appendable",
                )
            for tid in writes.tids:
                need(tid in self._tasks, f"request {req_id} tracks retired task {tid}")
        for tid in self._unwritten_step_writes | self._escalated:
            need(tid in self._tasks, f"waited task {tid} is not registered")
        need(self._next_tid - 1 <= MAX_TID, "tid overflow")
