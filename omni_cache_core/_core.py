"""The transition core: a deterministic, sans-IO state machine for the prefix cache.

Theory of operation
-------------------
The adapter feeds *inputs* in and executes the *effects* that come out. The core never waits,
never reads a clock (time arrives as ``now_ns``), never touches a tensor. An illegal input raises
a typed error and leaves the state exactly as it was; the few inputs whose rule says otherwise
(STEP-4, a consume that raises counts as consumed) say so.

Machines and the inputs each sees:

- **Steps** (STEP): `SaveCommit` issues a step id; `ConsumeBegin` hands out its plan exactly once
  (`discard_step` releases it at once, `materialize` holds its page until `ConsumeEnd`).
- **Pages** (PAGE, D5): `staging_depth` pages, each a set of holders: ``("step", id)`` from
  commit until the consume ends, ``("task", tid)`` from the step write's registration until it is
  WRITTEN or FAILED, and ``("save", 0)`` for the save in progress. Free iff no holder.
- **Slots** (SLOT, D3): per key an `OccupancyTable` (owner, version). `SaveCommit` claims the
  step's slots for every known key: the step write for immediate keys, each request's deferred
  write for deferred keys, explicit absence for keys the step did not emit (SLOT-4). Displaced
  owners get tombstones (SLOT-2); `WriteLanded` commits only still-owned slots (SLOT-3).
- **Tasks** (TASK): one step write per step (D1) and one open deferred write per request (D2),
  moving by `_TASK_MOVES` only. Committer progress arrives as reports (`CopyStarted`,
  `CopyLanded`, `WriteLanded`, `WriteFailed`), drained in order (D8).
- **Requests**: `StartStep` applies finishes and aborts first, then starts (HIT-2); a finish
  escalates the request's deferred writes (TASK-4).
- **Budget** (BUDGET): bytes of device clones, charged per clone allocation as a ticket whose
  viewers are the tasks reading it; released when the last viewer reaches HOST_READY or fails.
  A save that does not fit escalates the oldest unfinished write and waits until it is WRITTEN,
  then checks again (BUDGET-2, D12).
- **Reads** (HIT, D4): hits are planned at start for prefetch and finally at commit, after the
  step's own claims; reads of older, unconsumed steps are protected by copy-on-write (`Preserve`)
  or marked violated.

Deadlines: a save waits at most `staging_claim_timeout_s` in each of its phases (barrier, budget,
page), a consume at most that long for the writes its hits read; each deadline starts at the
``now_ns`` of the input that first had to wait. `next_deadline_ns()` is the earliest of them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Any, Final, cast

import numpy as np
import numpy.typing as npt

from omni_cache_core._contract import (
    HIDDEN_KEY,
    ModelCachePolicy,
    PrefixCacheConfig,
    PrefixCacheEventKind,
    ReqId,
    StepId,
    TensorName,
    Tid,
    WriteSchedule,
)
from omni_cache_core._delivery import Admissions, carried_by
from omni_cache_core._errors import (
    BadInputError,
    DeliveryOrderError,
    HitUnreadableError,
    IllegalTransitionError,
    InvariantError,
    LifecycleError,
    OversizeStepError,
    PageTimeoutError,
    ShutDownError,
    StepAlreadyConsumedError,
    UnknownStepError,
    WaitTimeoutError,
    WriteFailedError,
)
from omni_cache_core._occupancy import ABSENT, COMMITTED, UNKNOWN, OccupancyTable, any_true
from omni_cache_core._values import (
    AwaitPage,
    AwaitTasks,
    ConsumeBegin,
    ConsumeEnd,
    ConsumePlan,
    CopyLanded,
    CopyStarted,
    DeferredChunk,
    Effect,
    EscalateTasks,
    PageClaimed,
    PrefetchRead,
    Preserve,
    ReadPlan,
    Report,
    SaveAbort,
    SaveBegin,
    SaveCommit,
    SaveProceed,
    SavePublished,
    ShutDown,
    SlotArray,
    SlotSource,
    StartStep,
    StepWrite,
    TaskState,
    Tombstone,
    WriteFailed,
    WriteLanded,
)

__all__ = ["CacheCore", "CoreCounters"]

_MAX_TID: Final = 2**31 - 1  # owner table is int32 (D3)

# TASK-2: the only legal moves, as (state, report) -> next state. Anything else raises.
_TASK_MOVES: Final[dict[tuple[TaskState, str], TaskState]] = {
    (TaskState.PENDING, "queue"): TaskState.QUEUED,
    (TaskState.QUEUED, "copy_started"): TaskState.COPYING,
    (TaskState.COPYING, "copy_landed"): TaskState.HOST_READY,
    (TaskState.HOST_READY, "write_landed"): TaskState.WRITTEN,
    (TaskState.PENDING, "fail"): TaskState.FAILED,
    (TaskState.QUEUED, "fail"): TaskState.FAILED,
    (TaskState.COPYING, "fail"): TaskState.FAILED,
    (TaskState.HOST_READY, "fail"): TaskState.FAILED,
}

_POOL: Final = np.int8(SlotSource.POOL.value)
_AFTER_WRITE: Final = np.int8(SlotSource.AFTER_WRITE.value)
_TASK: Final = np.int8(SlotSource.TASK.value)
_ZEROS: Final = np.int8(SlotSource.ZEROS.value)
_THIS_STEP: Final = np.int8(SlotSource.THIS_STEP.value)

_EMPTY_SLOTS: Final = np.zeros(0, dtype=np.int64)

# (immediate keys, deferred keys, has rows): what `_check_keys` validates.
_KeySignature = tuple[tuple[TensorName, ...], tuple[TensorName, ...], bool]

# Save phases, in order.
_BARRIER, _BUDGET, _PAGE, _READY = "barrier", "budget", "page", "ready"


class CoreCounters:
    """Plain counters the core keeps for `stats()`; not part of the snapshot."""

    __slots__ = (
        "budget_flushes",
        "hit_requests",
        "hit_rows",
        "page_timeouts",
        "steps_consumed",
        "steps_discarded",
        "steps_saved",
        "wait_timeouts",
        "writes_failed",
    )

    def __init__(self) -> None:
        self.steps_saved = 0
        self.steps_consumed = 0
        self.steps_discarded = 0
        self.hit_requests = 0
        #: Hit rows handed out, indexed by `SlotSource` value.
        self.hit_rows = np.zeros(len(SlotSource), dtype=np.int64)
        self.budget_flushes = 0
        self.page_timeouts = 0
        self.wait_timeouts = 0
        self.writes_failed = 0


class _Task:
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


class _Ticket:
    __slots__ = ("nbytes", "viewers")

    def __init__(self, nbytes: int, viewers: set[Tid]) -> None:
        self.nbytes = nbytes
        self.viewers = viewers


class _Request:
    __slots__ = ("entry", "open_tid", "tids")

    def __init__(self, entry: int) -> None:
        self.entry = entry  # the admission's entry in `Admissions` (LIFE-1)
        self.open_tid: Tid | None = None
        self.tids: list[Tid] = []  # unfinished deferred writes, oldest first


class _Read:
    """A planned hit read: its plan, final at planning (D4), and what may still change.

    The plan is built once, when the read is planned, and handed out as is at consume: its
    arrays are final then except `preserved`, which copy-on-write marks in place (HIT-6).
    """

    __slots__ = ("error", "has_writers", "plan", "step_id", "version", "violated")

    def __init__(
        self, plan: ReadPlan, step_id: StepId, version: npt.NDArray[np.uint32], has_writers: bool
    ) -> None:
        self.plan = plan
        self.step_id = step_id
        #: Per hit row, the slot version it was planned at.
        self.version = version
        #: Whether any row is owned by an in-flight write (AFTER_WRITE or TASK).
        self.has_writers = has_writers
        self.error: str | None = None
        self.violated = 0

    def canonical(self) -> tuple[Any, ...]:
        plan = self.plan
        return (
            plan.read_id,
            plan.req_id,
            plan.key,
            self.step_id,
            tuple(plan.slots.tolist()),
            tuple(plan.source.tolist()),
            tuple(plan.writer.tolist()),
            tuple(self.version.tolist()),
            tuple(plan.step_row.tolist()),
            tuple(plan.preserved.tolist()),
            plan.chunk_limit,
            self.error,
            self.violated,
        )


class _Step:
    __slots__ = (
        "consume_deadline_ns",
        "consuming",
        "entries",
        "handed",
        "hi",
        "hit_rows",
        "keys",
        "lo",
        "page",
        "reads",
        "req_ids",
        "req_set",
        "row_bounds",
        "step_id",
        "tid",
    )

    def __init__(
        self,
        step_id: StepId,
        page: int,
        req_ids: tuple[ReqId, ...],
        req_set: frozenset[ReqId],
        row_bounds: SlotArray,
        keys: tuple[TensorName, ...],
        tid: Tid | None,
        reads: dict[ReqId, list[_Read]],
        hit_rows: npt.NDArray[np.int64] | None,
        entries: npt.NDArray[np.int64],
        lo: npt.NDArray[np.int64],
        hi: npt.NDArray[np.int64],
    ) -> None:
        self.step_id = step_id
        self.page = page
        self.req_ids = req_ids
        self.req_set = req_set
        self.row_bounds = row_bounds
        self.keys = keys
        self.tid = tid
        self.reads = reads
        #: Rows of all reads per `SlotSource`, counted when a consume takes them all.
        self.hit_rows = hit_rows
        #: Per request in layout order: its admission entry and the positions ``[lo, hi)``
        #: the step carries for it (its hit rows, when it registered a hit here, then its own
        #: rows: DLV-1).
        self.entries = entries
        self.lo = lo
        self.hi = hi
        self.consuming = False
        self.consume_deadline_ns: int | None = None
        #: While a materialize consumes it: the entries it delivered to, their cursors before
        #: and after (a failed build puts them back: D19).
        self.handed: tuple[npt.NDArray[np.int64], ...] | None = None


class _PendingSave:
    __slots__ = (
        "charged",
        "deadline_ns",
        "entries",
        "flushing",
        "inp",
        "page",
        "phase",
        "req_set",
    )

    def __init__(
        self, inp: SaveBegin, req_set: frozenset[ReqId], entries: npt.NDArray[np.int64]
    ) -> None:
        self.inp = inp
        self.req_set = req_set
        self.entries = entries
        self.phase = _BARRIER
        self.deadline_ns: int | None = None
        self.charged = 0
        self.page: int | None = None
        #: The write the budget flush escalated and now waits for until it is WRITTEN.
        self.flushing: Tid | None = None


class CacheCore:
    """The prefix cache's state machine. Not thread-safe: the adapter serialises calls.

    Args:
        config: Sizes and the timeout.
        policy: Which keys are cached and how (`register_policy` may replace it before the
            first step).
    """

    def __init__(self, config: PrefixCacheConfig, policy: ModelCachePolicy | None = None) -> None:
        self.config = config
        self.policy = policy if policy is not None else ModelCachePolicy()
        self.counters = CoreCounters()
        self._timeout_ns = config.staging_claim_timeout_ns
        self._num_slots = config.num_slots
        #: Scratch membership marks, all False between calls (`_plan_step_reads`).
        self._slot_mark = np.zeros(config.num_slots, dtype=np.bool_)
        self._closed = False
        self._fatal: WriteFailedError | None = None
        self._started = False
        self._next_step_id = 1
        self._next_tid = 1
        self._next_read_id = 1
        #: Per key, how many registered writes hold slots of it (derived from the tasks: with
        #: none, no slot of that key can be in flight, and a claim skips looking).
        self._writers: dict[TensorName, int] = {}
        self._pages: list[set[tuple[str, int]]] = [set() for _ in range(config.staging_depth)]
        self._steps: dict[StepId, _Step] = {}
        self._tasks: dict[Tid, _Task] = {}
        self._tickets: dict[int, _Ticket] = {}
        self._next_ticket = 1
        self._budget_used = 0
        #: Live requests: running or preempted (LIFE-1).
        self._live: dict[ReqId, _Request] = {}
        self._preempted: set[ReqId] = set()
        self._admissions = Admissions()
        #: The last layout found distinct and running, with its admission entries, kept until a
        #: request ends or is preempted (a cache only: not part of the state).
        self._known_layout: (
            tuple[tuple[ReqId, ...], frozenset[ReqId], npt.NDArray[np.int64]] | None
        ) = None
        self._tables: dict[TensorName, OccupancyTable] = {}
        #: Tables allocated ahead of a key's first save (`reserve_tables`): an allocation cache,
        #: not state. A key's first save takes its spare instead of allocating one.
        self._spare_tables: dict[TensorName, OccupancyTable] = {}
        # Hits registered by the last start, waiting for the next save: req -> (slots, key -> id).
        self._start_hits: dict[ReqId, tuple[SlotArray, dict[TensorName, int]]] = {}
        #: All of those hits' slots in one array, with each hit's bounds in it (derived).
        self._start_hit_slots: tuple[SlotArray, list[int]] = (_EMPTY_SLOTS, [0])
        #: First hit position of those hits that do not start at 0 (a resume reads from the
        #: block of its delivery cursor on: DLV-3).
        self._start_hit_lo: dict[ReqId, int] = {}
        # Live requests whose hit was registered by a start that no save followed (D10).
        self._lost_hits: set[ReqId] = set()
        self._reads: dict[int, _Read] = {}  # planned reads of saved, not yet ended steps
        self._unwritten_step_writes: set[Tid] = set()  # TASK-3: next save waits WRITTEN
        self._escalated: set[Tid] = set()  # TASK-3: next save waits HOST_READY
        self._save: _PendingSave | None = None
        #: Key sets `_check_keys` accepted under the current policy, each with the keys a
        #: consume returns (a cache: not state).
        self._key_sets: dict[_KeySignature, tuple[TensorName, ...]] = {}

    # -----------------------------------------------------------------------------------------
    # Queries.

    @property
    def closed(self) -> bool:
        """Whether `ShutDown` was fed in."""
        return self._closed

    @property
    def fatal(self) -> WriteFailedError | None:
        """The sticky write failure (FAIL-1), if any."""
        return self._fatal

    @property
    def budget_used(self) -> int:
        """Device clone bytes currently charged (BUDGET-1)."""
        return self._budget_used

    @property
    def pages_in_use(self) -> int:
        """Pages with at least one holder."""
        return sum(1 for holders in self._pages if holders)

    @property
    def open_step_ids(self) -> tuple[StepId, ...]:
        """Saved steps not yet consumed, by id."""
        return tuple(sorted(s for s, step in self._steps.items() if not step.consuming))

    @property
    def installed_keys(self) -> tuple[TensorName, ...]:
        """Cached keys seen so far, in first-seen order."""
        return tuple(self._tables)

    def occupancy_metadata_bytes(self) -> int:
        """Bytes of every occupancy table (SLOT-6), spare tables (`reserve_tables`) included."""
        tables = (*self._tables.values(), *self._spare_tables.values())
        return sum(t.metadata_bytes for t in tables)

    def occupancy_bytes_per_key(self) -> int:
        """Bytes one cached key's occupancy table takes (SLOT-6, D3): 8 per slot."""
        return 8 * self._num_slots

    def reserve_tables(self, keys: Iterable[TensorName]) -> None:
        """Allocate the occupancy tables of keys not seen yet, ahead of their first save.

        An allocation hint, not an input: the state (and `snapshot`) is unchanged, and a key's
        first save takes its spare table instead of allocating one. Keys already seen, or
        already reserved, are skipped. Works whatever the cache's state.

        Raises:
            MemoryError: A table could not be allocated; no table of this call is kept.
        """
        new = {
            key: OccupancyTable(self._num_slots)
            for key in dict.fromkeys(keys)
            if key not in self._tables and key not in self._spare_tables
        }
        self._spare_tables.update(new)

    def task_state(self, tid: Tid) -> TaskState | None:
        """State of a registered task, or None once it left the registry (WRITTEN or FAILED)."""
        task = self._tasks.get(tid)
        return task.state if task is not None else None

    def presence(self, key: TensorName, slot: int) -> tuple[int, int]:
        """Owner code and version of one (slot, key) (for tests and diagnostics)."""
        table = self._tables.get(key)
        if table is None:
            return (-2, 0)
        return (int(table.owner[slot]), int(table.version[slot]))

    def step_slots_of(self, step_id: StepId) -> tuple[tuple[ReqId, ...], SlotArray]:
        """Requests and row bounds of an unended step."""
        step = self._steps[step_id]
        return step.req_ids, step.row_bounds

    def has_step(self, step_id: StepId) -> bool:
        """Whether a step is saved and its consume has not ended."""
        return step_id in self._steps

    def reads_of(self, step_id: StepId) -> tuple[tuple[int, frozenset[Tid]], ...]:
        """The reads a step planned, each with the deferred writes whose own rows it reads.

        The adapter keeps those writes' rows reachable until the step's consume ends (HIT-3).
        """
        step = self._steps.get(step_id)
        if step is None:
            return ()
        return tuple(
            (read.plan.read_id, frozenset(tid for tid, _ in read.plan.chunk_limit))
            for reads in step.reads.values()
            for read in reads
        )

    def next_deadline_ns(self) -> int | None:
        """The earliest deadline of any wait in progress, or None."""
        deadlines = [s.consume_deadline_ns for s in self._steps.values()]
        if self._save is not None:
            deadlines.append(self._save.deadline_ns)
        present = [d for d in deadlines if d is not None]
        return min(present) if present else None

    # -----------------------------------------------------------------------------------------
    # Engine inputs.

    def register_policy(self, policy: ModelCachePolicy) -> None:
        """Replace the policy; only before the first step.

        Raises:
            BadInputError: A step already started; the policy is unchanged.
        """
        self._check_usable()
        if self._started:
            raise BadInputError(
                what="register_policy",
                expected="a call before the first step",
                got="a call after a step started",
            )
        self.policy = policy
        self._key_sets.clear()

    def start_step(self, inp: StartStep) -> tuple[Effect, ...]:
        """Apply a step's lifecycle records: ends and preemptions first, then starts (HIT-2).

        FINISHED, ABORTED and PREEMPTED records are applied in the order given, then STARTED
        and RESUMED ones (LIFE-2). Returns an `EscalateTasks` for the writes of requests that
        ended or were preempted (TASK-4, LIFE-3) and one `PrefetchRead` per hit read with
        committed rows (HIT-7). A resume plans its hit from its delivery cursor on (DLV-3).

        Raises:
            LifecycleError: A record is illegal in its request's state (LIFE-2), for example
                RESUMED of a request that is not preempted; the cache is unchanged.
            BadInputError: An unaligned hit, a hit without enough blocks, a block id out of range,
                or a request started twice in one step (HIT-1, FAIL-5); the cache is unchanged.
        """
        self._check_usable()
        if self._save is not None:
            raise BadInputError(
                what="new_step_starts", expected="no save in progress", got="a save in progress"
            )
        step = inp.step
        block_size = self.config.block_size
        ending: list[tuple[ReqId, PrefixCacheEventKind]] = []
        starting: list[tuple[ReqId, PrefixCacheEventKind, int, tuple[int, ...]]] = []
        seen: set[str] = set()
        for event in step.events:
            req_id = cast(ReqId, event.req_id)
            kind = event.kind
            if kind is PrefixCacheEventKind.STARTED or kind is PrefixCacheEventKind.RESUMED:
                if req_id in seen:
                    raise BadInputError(
                        what=f"request {req_id!r}",
                        expected="at most one STARTED or RESUMED record per step",
                        got="two",
                    )
                seen.add(req_id)
                if event.hit_end:
                    self._check_hit(req_id, event.hit_end, event.block_ids)
                starting.append((req_id, kind, event.hit_end, event.block_ids))
            else:
                ending.append((req_id, kind))
        if (
            ending
            or self._preempted
            or any(kind is PrefixCacheEventKind.RESUMED for _, kind, _, _ in starting)
        ):
            self._check_lifecycle(ending, starting)
        # From here on nothing raises: the step is applied whole.
        self._started = True
        escalate: list[Tid] = []
        admissions = self._admissions
        # D10: hits of a start that no save followed can never be served; their requests must
        # end (or be preempted and resumed) before they are saved again.
        self._lost_hits |= self._start_hits.keys()
        if ending:
            self._known_layout = None
        for req_id, kind in ending:
            request = self._live.get(req_id)
            if request is None:
                continue  # the end of a request the cache never saw: nothing to do
            self._lost_hits.discard(req_id)
            escalate.extend(self._escalate_request(request))
            if kind is PrefixCacheEventKind.PREEMPTED:
                self._preempted.add(req_id)  # LIFE-3: live for delivery, not for saves
                admissions.preempt(request.entry)
            else:
                del self._live[req_id]
                self._preempted.discard(req_id)
                admissions.end(
                    request.entry,
                    carried_by(request.entry, (s.entries for s in self._steps.values())),
                )
        self._clear_start_hits()
        effects: list[Effect] = []
        hits: list[tuple[ReqId, tuple[int, ...]]] = []
        for req_id, kind, hit_end, block_ids in starting:
            if kind is PrefixCacheEventKind.RESUMED:
                self._preempted.discard(req_id)
                cursor = admissions.resume(self._live[req_id].entry, hit_end)
                # DLV-3: only positions not delivered yet are read, from the cursor's block on.
                first = cursor // block_size * block_size
            elif req_id in self._live:
                continue  # HIT-1: a continuation of a live request opens no hit.
            else:
                self._live[req_id] = _Request(admissions.admit(hit_end))
                first = 0
            if hit_end > first:
                hits.append((req_id, block_ids[first // block_size : hit_end // block_size]))
                if first:
                    self._start_hit_lo[req_id] = first
        if hits:
            effects.extend(self._register_hits(hits))
        if escalate:
            effects.insert(0, EscalateTasks(tids=tuple(escalate)))
        return tuple(effects)

    def _check_lifecycle(
        self,
        ending: list[tuple[ReqId, PrefixCacheEventKind]],
        starting: list[tuple[ReqId, PrefixCacheEventKind, int, tuple[int, ...]]],
    ) -> None:
        """LIFE-2: check the step's records against each request's state, changing nothing."""
        after: dict[ReqId, str] = {}  # the state each request reaches within this step

        def state(req_id: ReqId) -> str:
            if req_id in after:
                return after[req_id]
            if req_id in self._preempted:
                return "preempted"
            return "running" if req_id in self._live else "not live"

        for req_id, kind in ending:
            if kind is PrefixCacheEventKind.PREEMPTED:
                now = state(req_id)
                if now != "running":
                    raise LifecycleError(req_id=req_id, event=kind.value, state=now)
                after[req_id] = "preempted"
            else:
                after[req_id] = "not live"  # an unknown request's end is ignored
        for req_id, kind, _, _ in starting:
            now = state(req_id)
            if kind is PrefixCacheEventKind.RESUMED and now != "preempted":
                raise LifecycleError(req_id=req_id, event=kind.value, state=now)
            if kind is PrefixCacheEventKind.STARTED and now == "preempted":
                raise LifecycleError(req_id=req_id, event=kind.value, state=now)

    def _register_hits(self, hits: list[tuple[ReqId, tuple[int, ...]]]) -> list[PrefetchRead]:
        """Open one read per hit and cached key; ask to prefetch its committed rows (HIT-7).

        Every hit's slots come from one array and one gather per key, so a step with many
        hits costs a few numpy calls per key, not per hit.
        """
        block_size = self.config.block_size
        every = _block_slots(list(itertools.chain.from_iterable(b for _, b in hits)), block_size)
        bounds = [0, *itertools.accumulate(len(b) * block_size for _, b in hits)]
        hit_keys = self._hit_keys(self._tables)
        first_id = self._next_read_id
        self._next_read_id += len(hits) * len(hit_keys)
        # The usual hit: every row is in the pool (owner COMMITTED, code 0).
        pending = {key: self._tables[key].owner[every] != COMMITTED for key in hit_keys}
        all_committed = {key: not any_true(mask) for key, mask in pending.items()}
        effects: list[PrefetchRead] = []
        ranges: dict[int, npt.NDArray[np.int64]] = {}  # hits are mostly of one length
        for i, (req_id, _) in enumerate(hits):
            lo, hi = bounds[i], bounds[i + 1]
            hit_slots = every[lo:hi]
            read_ids = {key: first_id + i * len(hit_keys) + k for k, key in enumerate(hit_keys)}
            self._start_hits[req_id] = (hit_slots, read_ids)
            for key in hit_keys:
                if all_committed[key]:
                    positions = ranges.get(hi - lo)
                    if positions is None:
                        positions = ranges[hi - lo] = np.arange(hi - lo)
                    slots = hit_slots
                else:
                    positions = np.flatnonzero(~pending[key][lo:hi])
                    if not len(positions):
                        continue
                    slots = hit_slots[positions]
                effects.append(
                    PrefetchRead(
                        read_id=read_ids[key],
                        req_id=req_id,
                        key=key,
                        positions=positions,
                        slots=slots,
                    )
                )
        self._start_hit_slots = (every, bounds)
        self.counters.hit_requests += len(hits)
        return effects

    def save_begin(self, inp: SaveBegin) -> None:
        """Validate a save and open it; nothing else changes until `save_commit` (D6).

        Raises:
            BadInputError: A malformed layout, a slot out of range, a request not live, a key
                the policy does not allow, or a save already in progress (OUT-3, FAIL-5, D9).
            OversizeStepError: More immediate rows than a page holds (PAGE-5).
            InvariantError: The save would need a write task id past 2**31 - 1 (D3).
            In every case the cache is unchanged.
        """
        self._check_usable()
        if self._save is not None:
            raise BadInputError(
                what="save_outputs", expected="one save at a time", got="a save in progress"
            )
        n = inp.num_tokens
        req_ids = inp.req_ids
        bounds = inp.row_bounds
        slots = inp.slots
        if n < 0 or len(slots) != n:
            raise BadInputError(
                what="write layout slots",
                expected=f"one slot per unpadded token ({n})",
                got=f"{len(slots)} slots",
            )
        if (
            len(bounds) != len(req_ids) + 1
            or bounds[0] != 0
            or bounds[-1] != n
            or (len(bounds) > 2 and any_true(bounds[1:] < bounds[:-1]))
        ):
            raise BadInputError(
                what="write layout rows",
                expected=f"contiguous row ranges from 0 to {n} in batch order",
                got=f"bounds {bounds.tolist()[:8]}... for {len(req_ids)} requests",
            )
        # argmin/argmax: a fraction of min()/max()'s fixed cost on a decode step's few slots.
        if n and (slots[slots.argmin()] < 0 or slots[slots.argmax()] >= self._num_slots):
            raise BadInputError(
                what="slot ids",
                expected=f"ids in [0, {self._num_slots})",
                got=f"ids in [{int(slots.min())}, {int(slots.max())}]",
            )
        known = self._known_layout
        if known is not None and req_ids == known[0]:
            # Decode steps repeat the layout: checked already, still running.
            unique, entries = known[1], known[2]
        else:
            unique = frozenset(req_ids)
            if len(unique) != len(req_ids):
                raise BadInputError(
                    what="write layout requests", expected="distinct request ids", got="a repeat"
                )
            if not unique <= self._live.keys():
                missing = sorted(unique - self._live.keys())[:4]
                raise BadInputError(
                    what="write layout requests",
                    expected="requests STARTED and not finished (D9)",
                    got=f"unknown requests {missing}",
                )
            if self._preempted and not self._preempted.isdisjoint(unique):
                preempted = sorted(self._preempted & unique)[:4]
                raise BadInputError(
                    what="write layout requests",
                    expected="running requests: a preempted request has no blocks (LIFE-3, D9)",
                    got=f"preempted requests {preempted}",
                )
            live = self._live
            entries = np.fromiter(
                (live[r].entry for r in req_ids), dtype=np.int64, count=len(req_ids)
            )
            self._known_layout = (req_ids, unique, entries)
        if self._lost_hits and not self._lost_hits.isdisjoint(unique):
            lost = sorted(self._lost_hits & unique)[:4]
            raise BadInputError(
                what="write layout requests",
                expected="requests whose hit can be served (abort a request whose start was "
                "not followed by a save)",
                got=f"requests that lost their hit: {lost}",
            )
        if self._start_hits and not self._start_hits.keys() <= unique:
            # SPEC section 13: a hit that cannot be served must raise, never vanish. A request
            # that starts with a hit is scheduled in that very step by every engine we know.
            dropped = sorted(self._start_hits.keys() - unique)[:4]
            raise BadInputError(
                what="write layout requests",
                expected="every request that started with a hit this step",
                got=f"hit requests missing from the layout: {dropped}",
            )
        self._check_keys(inp)
        if inp.immediate_keys and n > self.config.staging_capacity_tokens:
            raise OversizeStepError(rows=n, capacity=self.config.staging_capacity_tokens)
        if inp.immediate_bytes < 0 or inp.deferred_bytes < 0:
            raise BadInputError(what="clone bytes", expected=">= 0", got="a negative count")
        # D3, STEP-5: owners are int32, so task ids stop at 2**31 - 1. Count the ids this save
        # may take (its step write, one new deferred write per request with rows) and raise
        # now, while nothing has changed, rather than halfway through the commit.
        needed = 1 if n and inp.immediate_keys else 0
        if n and inp.deferred_keys:
            needed += int((bounds[1:] > bounds[:-1]).sum())
        if self._next_tid - 1 + needed > _MAX_TID:
            raise InvariantError(
                f"write task ids exhausted (2**31 - 1): a save needing {needed} more cannot start"
            )
        self._save = _PendingSave(inp, unique, entries)

    def save_proceed(
        self, inp: SaveProceed
    ) -> AwaitTasks | EscalateTasks | AwaitPage | PageClaimed:
        """Advance the pending save through the barrier, the budget and the page claim.

        Returns the wait the adapter must do before asking again (`AwaitTasks`, or an
        `EscalateTasks` to run first, then ask again), or `PageClaimed` when the save may copy.

        Raises:
            WaitTimeoutError: The barrier (TASK-3) or a budget flush (BUDGET-2) passed its
                deadline (FAIL-3).
            PageTimeoutError: No page freed up in time (PAGE-4).
            In every case the pending save stays as this input found it; the adapter aborts it
            (`save_abort`).
        """
        self._check_usable()
        save = self._require_save()
        entry = (save.phase, save.deadline_ns, save.charged, save.flushing)
        try:
            return self._advance_save(save, inp.now_ns)
        except (WaitTimeoutError, PageTimeoutError):
            # FAIL-3, STEP-5: a wait that ran out changes nothing, not even a phase passed or a
            # deadline set on the way in this same input (a zero bound fails at first sight).
            self._budget_used -= save.charged - entry[2]
            save.phase, save.deadline_ns, save.charged, save.flushing = entry
            raise

    def _advance_save(
        self, save: _PendingSave, now: int
    ) -> AwaitTasks | EscalateTasks | AwaitPage | PageClaimed:
        """Run the pending save's phases in order: barrier, budget, page (`save_proceed`)."""
        if save.phase == _BARRIER:
            if self._unwritten_step_writes or self._escalated:
                return self._await(save, now, self._barrier_waits(), "save barrier")
            save.phase, save.deadline_ns = _BUDGET, None
        if save.phase == _BUDGET:
            flushing = save.flushing
            if flushing is not None and flushing in self._tasks:
                # BUDGET-2: a flushed write is awaited until WRITTEN ("copy and write"), even if
                # its copy alone released enough budget; the budget is checked again after.
                return self._await(save, now, ((flushing, TaskState.WRITTEN),), "budget flush")
            need = save.inp.immediate_bytes + save.inp.deferred_bytes
            victim = self._flush_victim() if self._budget_used + need > self._budget_cap() else None
            if victim is not None:
                save.flushing = victim.tid
                if not victim.escalated:
                    self.counters.budget_flushes += 1
                    self._escalate_task(victim)
                    return EscalateTasks(tids=(victim.tid,))
                return self._await(save, now, ((victim.tid, TaskState.WRITTEN),), "budget flush")
            save.flushing = None
            # BUDGET-2: fits, or nothing left to flush: admitted (an oversized step must not hang).
            save.charged = need
            self._budget_used += need
            save.phase, save.deadline_ns = _PAGE, None
        if save.phase == _PAGE:
            free = self._free_page()
            if free is None:
                if save.deadline_ns is None:
                    save.deadline_ns = now + self._timeout_ns
                if now >= save.deadline_ns:
                    self.counters.page_timeouts += 1
                    raise PageTimeoutError(
                        timeout_s=self.config.staging_claim_timeout_s,
                        open_step_ids=self.open_step_ids,
                        tasks_in_flight=[
                            (t.tid, t.state.name)
                            for t in self._tasks.values()
                            if t.page is not None
                        ],
                    )
                return AwaitPage(deadline_ns=save.deadline_ns)
            self._pages[free].add(("save", 0))
            save.page = free
            save.phase, save.deadline_ns = _READY, None
        assert save.page is not None
        return PageClaimed(page=save.page)

    def save_abort(self, inp: SaveAbort) -> None:
        """Drop the pending save, its page claim and its budget charge (STEP-5). Idempotent."""
        save = self._save
        if save is None:
            return
        if save.page is not None:
            self._pages[save.page].discard(("save", 0))
        self._budget_used -= save.charged
        self._save = None

    def save_commit(self, inp: SaveCommit) -> SavePublished:
        """Publish the pending save: claims, tombstones, absence, deferred chunks, reads.

        Raises:
            BadInputError: No save is ready (its page is not claimed yet); nothing changes.
        """
        self._check_usable()
        save = self._require_save()
        if save.phase != _READY or save.page is None:
            raise BadInputError(
                what="save commit", expected="a claimed page", got=f"phase {save.phase}"
            )
        sv = save.inp
        page = save.page
        step_id = StepId(self._next_step_id)
        self._next_step_id += 1
        self._save = None
        self._pages[page].discard(("save", 0))
        self._pages[page].add(("step", step_id))
        n = sv.num_tokens
        slots = sv.slots
        effects: list[Effect] = []
        for key in (*sv.immediate_keys, *sv.deferred_keys):
            if key not in self._tables:
                spare = self._spare_tables.pop(key, None)
                self._tables[key] = spare if spare is not None else OccupancyTable(self._num_slots)

        step_tid: Tid | None = None
        tickets_left = save.charged
        # Only a registered write owns slots (SLOT-1): a key no write holds has nothing in flight.
        busy = {key for key, count in self._writers.items() if count}
        if n:
            # HIT-6: protect older reads before anything changes the slots they planned on.
            effects.extend(self._copy_on_write(slots))
            if sv.immediate_keys:
                step_tid = self._new_tid()
                task = _Task(
                    step_tid,
                    WriteSchedule.JOIN_NEXT_STEP,
                    TaskState.QUEUED,  # registered and dispatched in one go
                    page=page,
                    step_id=step_id,
                )
                task.chunks = 1
                self._tasks[step_tid] = task
                self._pages[page].add(("task", step_tid))  # PAGE-3: held before it is visible
                self._unwritten_step_writes.add(step_tid)
                for key in sv.immediate_keys:
                    self._hold(task, key, slots)
                    effects.extend(self._take(key, slots, step_tid, key in busy))
                if sv.immediate_bytes:
                    self._add_ticket(sv.immediate_bytes, {step_tid})
                    tickets_left -= sv.immediate_bytes
            if sv.deferred_keys:
                row_owner, deferred_tids = self._stage_deferred(sv, effects)
                for key in sv.deferred_keys:
                    effects.extend(self._take(key, slots, row_owner, key in busy))
                if sv.deferred_bytes:
                    self._add_ticket(sv.deferred_bytes, deferred_tids)
                    tickets_left -= sv.deferred_bytes
            emitted = {*sv.immediate_keys, *sv.deferred_keys}
            for key in self._tables:
                if key not in emitted:
                    # SLOT-4: the step's requests wrote nothing for this key: explicit absence.
                    effects.extend(self._take(key, slots, ABSENT, key in busy))
        # Charges with no viewer (nothing was cloned after all) are given back at once.
        self._budget_used -= tickets_left

        keys = self._key_sets[(sv.immediate_keys, sv.deferred_keys, n > 0)]
        reads, hit_rows = self._plan_step_reads(step_id, sv, keys, step_tid)
        # DLV-1: each request's rows are the positions from its count on; a request that
        # registered a hit here carries the hit rows before them.
        bounds = sv.row_bounds
        own, hi = self._admissions.on_save(save.entries, bounds[1:] - bounds[:-1])
        lo = own
        if self._start_hits:
            lo = own.copy()
            for req_id in self._start_hits:
                lo[sv.req_ids.index(req_id)] = self._start_hit_lo.get(req_id, 0)
        self._steps[step_id] = _Step(
            step_id,
            page,
            sv.req_ids,
            save.req_set,
            sv.row_bounds,
            keys,
            step_tid,
            reads,
            hit_rows,
            save.entries,
            lo,
            hi,
        )
        self._clear_start_hits()
        if step_tid is not None:
            effects.append(
                StepWrite(tid=step_tid, step_id=step_id, page=page, keys=sv.immediate_keys)
            )
        self.counters.steps_saved += 1
        return SavePublished(step_id=step_id, effects=tuple(effects))

    def consume_begin(self, inp: ConsumeBegin) -> ConsumePlan | AwaitTasks:
        """Consume a step by id, exactly once (STEP-1).

        A discard releases the page at once. A materialize returns the plan and keeps the page
        until `consume_end`, or asks to wait for the immediate writes its hits read (HIT-3).

        Raises:
            UnknownStepError: The id was never issued; the cache is unchanged (STEP-2).
            StepAlreadyConsumedError: The id was consumed; the cache is unchanged (STEP-2).
            BadInputError: A request outside the step's layout (STEP-4); the step is consumed.
            DeliveryOrderError: An earlier unconsumed step still owes a request rows that this
                step would hand out after (DLV-5); nothing changes and the step stays open.
            HitUnreadableError: A hit cannot be served (HIT-4, HIT-6); the step is consumed.
            WaitTimeoutError: A write a hit reads did not land in time; the step is consumed.
        """
        self._check_usable()
        step = self._steps.get(inp.step_id)
        if step is None or step.consuming:
            self._raise_unknown_step(inp.step_id)
        assert step is not None
        if inp.req_ids is None:
            self._end_step(step)
            self.counters.steps_discarded += 1
            return ConsumePlan(
                step_id=step.step_id, page=step.page, keys=(), reads=(), discard=True
            )
        requested = inp.req_ids
        # The usual call asks for the whole layout, in order: no set to build.
        if requested != step.req_ids and not step.req_set.issuperset(requested):
            self._end_step(step)
            outside = sorted(set(requested) - step.req_set)[:4]
            raise BadInputError(
                what=f"materialize(step {step.step_id}) request ids",
                expected="a subset of the requests saved in that step (STEP-4)",
                got=f"requests outside the save snapshot: {outside}",
            )
        whole = requested == step.req_ids
        if whole:
            entries, lo, hi = step.entries, step.lo, step.hi
        else:
            index = {r: i for i, r in enumerate(step.req_ids)}
            at = np.fromiter((index[r] for r in requested), dtype=np.int64, count=len(requested))
            entries, lo, hi = step.entries[at], step.lo[at], step.hi[at]
        cursor = self._admissions.cursor[entries]
        if next(iter(self._steps)) != step.step_id:
            # Not the oldest unended step: an earlier one may still owe these requests rows.
            self._check_delivery_order(step, requested, entries, cursor, lo, hi)
        if not step.reads:
            reads = []
        elif whole:
            reads = [r for rs in step.reads.values() for r in rs]
        else:
            wanted = set(requested)
            reads = [r for req, rs in step.reads.items() if req in wanted for r in rs]
        waits: list[tuple[Tid, TaskState]] = []
        for read in reads:
            plan = read.plan
            if read.error is not None or read.violated:
                self._end_step(step)
                reason = read.error or (
                    f"{read.violated} hit slots reassigned before this delayed read (HIT-6)"
                )
                raise HitUnreadableError(
                    req_id=plan.req_id, key=plan.key, reason=reason, slot_count=len(plan.slots)
                )
            if read.has_writers:
                pending = plan.writer[(plan.source == _AFTER_WRITE) & ~plan.preserved]
                for tid in np.unique(pending).tolist():
                    if Tid(tid) in self._tasks:
                        waits.append((Tid(tid), TaskState.WRITTEN))
        if waits:
            if step.consume_deadline_ns is None:
                step.consume_deadline_ns = inp.now_ns + self._timeout_ns
            if inp.now_ns >= step.consume_deadline_ns:
                self._end_step(step)
                self.counters.wait_timeouts += 1
                tid = waits[0][0]
                raise WaitTimeoutError(
                    what="hit join",
                    tid=tid,
                    state=self._tasks[tid].state.name,
                    timeout_s=self.config.staging_claim_timeout_s,
                )
            return AwaitTasks(
                waits=tuple(sorted(set(waits))),
                deadline_ns=step.consume_deadline_ns,
                what="hit join",
            )
        step.consuming = True
        step.consume_deadline_ns = None
        start, end, skip = self._admissions.deliver(entries, cursor, lo, hi)
        step.handed = (entries, cursor, end)
        self.counters.steps_consumed += 1
        if whole and step.hit_rows is not None:
            self.counters.hit_rows += step.hit_rows
        elif reads:
            sources = np.concatenate([read.plan.source for read in reads])
            self.counters.hit_rows += np.bincount(sources, minlength=len(SlotSource))
        return ConsumePlan(
            step_id=step.step_id,
            page=step.page,
            keys=step.keys,
            reads=tuple(read.plan for read in reads),
            discard=False,
            starts=start,
            ends=end,
            skip=skip,
        )

    def _check_delivery_order(
        self,
        step: _Step,
        requested: tuple[ReqId, ...],
        entries: npt.NDArray[np.int64],
        cursor: npt.NDArray[np.int64],
        lo: npt.NDArray[np.int64],
        hi: npt.NDArray[np.int64],
    ) -> None:
        """DLV-5: refuse to move a request's cursor while an earlier step still owes it rows.

        An earlier unconsumed step that carries positions at or above a request's cursor would
        hand them out after this step's, out of position order, or find them passed over: this
        step would move the cursor past them (handing out rows, or passing over positions as
        DLV-4 does, even from a step with no rows of the request). So this step waits for it. A
        step whose positions for a request all lie below its cursor is never refused for it, and
        a discard is never refused at all (it moves no cursor).
        """
        gives = hi > cursor  # the cursor would move to hi
        if not any_true(gives):
            return
        for other in self._steps.values():  # in step id order
            if other.step_id == step.step_id:
                return
            if other.consuming:
                continue  # its rows are handed out already
            owes = other.hi > np.maximum(other.lo, self._admissions.cursor[other.entries])
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
                    gap=(max(int(other.lo[j]), int(cursor[i])), int(other.hi[j])),
                )

    def consume_end(self, inp: ConsumeEnd) -> None:
        """Release a materialized step's page and drop its reads (D5).

        With ``delivered=False`` the outputs never reached the caller: each delivery cursor the
        consume moved goes back, unless another consume moved it on since (D19).

        Raises:
            BadInputError: The step is not being consumed; the cache is unchanged.
        """
        step = self._steps.get(inp.step_id)
        if step is None or not step.consuming:
            raise BadInputError(
                what=f"consume end of step {inp.step_id}",
                expected="a step whose consume began",
                got="no such consume",
            )
        if not inp.delivered and step.handed is not None:
            self._admissions.undeliver(*step.handed)
        self._end_step(step)

    def shut_down(self, inp: ShutDown) -> None:
        """Close the core: every later engine input raises `ShutDownError` (FAIL-4)."""
        self._closed = True

    # -----------------------------------------------------------------------------------------
    # Committer reports.

    def report(self, inp: Report) -> None:
        """Apply one committer report (D8).

        Raises:
            IllegalTransitionError: The move is not in the TASK-2 table (a bug in the adapter);
                the cache is unchanged.
        """
        if isinstance(inp, CopyStarted):
            self._move(inp.tid, "copy_started")
        elif isinstance(inp, CopyLanded):
            task = self._move(inp.tid, "copy_landed")
            self._release_tickets(task)
            self._escalated.discard(task.tid)
        elif isinstance(inp, WriteLanded):
            task = self._move(inp.tid, "write_landed")
            for key, chunks in task.slots.items():
                # A slot leaves a write only through a claim or an absence, which tombstone it
                # (SLOT-2): without tombstones the write still owns every slot it claimed.
                intact = key not in task.tombstones
                self._tables[key].commit(task.tid, _concat(chunks), intact=intact)
            self._retire(task)
        elif isinstance(inp, WriteFailed):
            task = self._move(inp.tid, "fail")
            self.counters.writes_failed += 1
            for key, chunks in task.slots.items():
                self._tables[key].forget(task.tid, _concat(chunks))
            self._release_tickets(task)
            self._escalated.discard(task.tid)
            self._retire(task)
            if self._fatal is None:
                # FAIL-1: rows behind hashes the engine already published are lost for good.
                self._fatal = WriteFailedError(tids=(task.tid,), reason=inp.reason)
        else:  # pragma: no cover - the type checker sees every report kind
            raise BadInputError(what="report", expected="a committer report", got=repr(inp))

    # -----------------------------------------------------------------------------------------
    # State: snapshot and invariants.

    def snapshot(self) -> tuple[Any, ...]:
        """Return a canonical, hashable value of the whole state (counters excluded)."""
        save = self._save
        return (
            self._closed,
            None if self._fatal is None else (self._fatal.tids, self._fatal.reason),
            self._started,
            self._next_step_id,
            self._next_tid,
            self._next_read_id,
            tuple(tuple(sorted(holders)) for holders in self._pages),
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
                    tuple(
                        (r, tuple(x.plan.read_id for x in rs)) for r, rs in sorted(s.reads.items())
                    ),
                    tuple(s.lo.tolist()),
                    tuple(s.hi.tolist()),
                )
                for s in sorted(self._steps.values(), key=lambda s: s.step_id)
            ),
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
                    tuple((k, tuple(_concat(v).tolist())) for k, v in sorted(t.slots.items())),
                    tuple(
                        (k, tuple(sorted(set(_concat(v).tolist()))))
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
            tuple((r, q.open_tid, tuple(q.tids)) for r, q in sorted(self._live.items())),
            tuple(sorted(self._preempted)),
            self._admissions.canonical(
                {r: q.entry for r, q in self._live.items()},
                [s.entries for s in sorted(self._steps.values(), key=lambda s: s.step_id)],
            ),
            tuple(sorted(self._start_hit_lo.items())),
            tuple(
                (r, tuple(s.tolist()), tuple(sorted(ids.items())))
                for r, (s, ids) in sorted(self._start_hits.items())
            ),
            tuple(sorted(self._lost_hits)),
            tuple(read.canonical() for _, read in sorted(self._reads.items())),
            tuple(
                (k, t.claims, t.owner.tobytes(), t.version.tobytes())
                for k, t in self._tables.items()
            ),
            tuple(sorted(self._unwritten_step_writes)),
            tuple(sorted(self._escalated)),
            None
            if save is None
            else (
                save.phase,
                save.deadline_ns,
                save.charged,
                save.page,
                save.flushing,
                save.inp.req_ids,
                tuple(save.inp.row_bounds.tolist()),
                tuple(save.inp.slots.tolist()),
                save.inp.immediate_keys,
                save.inp.deferred_keys,
                save.inp.immediate_bytes,
                save.inp.deferred_bytes,
            ),
        )

    def check_invariants(self) -> None:
        """Check every invariant the state must satisfy.

        Raises:
            InvariantError: One does not hold; this is a bug in the library.
        """

        def need(ok: bool, what: str) -> None:
            if not ok:
                raise InvariantError(what)

        depth = self.config.staging_depth
        # PAGE-2/PAGE-3: holders name live things; at most depth unconsumed steps.
        need(len(self._steps) <= depth, "more unended steps than pages")
        held_by_steps = set()
        for index, holders in enumerate(self._pages):
            for kind, ident in holders:
                if kind == "step":
                    need(ident in self._steps, f"page {index} held by dead step {ident}")
                    need(self._steps[StepId(ident)].page == index, f"step {ident} on wrong page")
                    held_by_steps.add(ident)
                elif kind == "task":
                    task = self._tasks.get(Tid(ident))
                    need(task is not None, f"page {index} held by retired task {ident}")
                    need(task is not None and task.page == index, f"task {ident} on wrong page")
                else:
                    need(
                        kind == "save" and self._save is not None and self._save.page == index,
                        f"page {index} has a stray holder {kind}",
                    )
        need(held_by_steps == set(self._steps), "a step without its page holder")
        for task in self._tasks.values():
            need(task.state not in (TaskState.WRITTEN, TaskState.FAILED), "terminal task kept")
            if task.page is not None:
                need(("task", task.tid) in self._pages[task.page], f"task {task.tid} lost page")
            if task.schedule is WriteSchedule.JOIN_ON_FINISH:
                need(task.page is None, "deferred task holds a page")
        # BUDGET-1: the charge equals the live tickets plus the pending reservation.
        pending = self._save.charged if self._save is not None else 0
        need(
            self._budget_used == sum(t.nbytes for t in self._tickets.values()) + pending,
            "budget charge does not match live tickets",
        )
        for ident, ticket in self._tickets.items():
            need(bool(ticket.viewers), f"ticket {ident} has no viewer")
            for tid in ticket.viewers:
                task = self._tasks.get(tid)
                need(
                    task is not None
                    and task.state.value < TaskState.HOST_READY.value
                    and ident in task.tickets,
                    f"ticket {ident} viewed by task {tid} that no longer needs its clone",
                )
        # SLOT-1/D3: an owner is a registered, non-terminal task that claimed that key.
        for key, table in self._tables.items():
            owners = np.unique(table.owner[table.owner > 0]).tolist()
            for tid in owners:
                task = self._tasks.get(Tid(tid))
                need(task is not None, f"key {key}: slot owned by retired task {tid}")
                need(task is not None and key in task.slots, f"task {tid} owns an unclaimed key")
            need(bool((table.owner >= -2).all()), f"key {key}: bad owner code")
            if table.claims < 2**32:
                need(
                    int(table.version.max()) <= table.claims,
                    f"key {key}: a version above the table's {table.claims} claims",
                )
        for key, table in self._spare_tables.items():
            need(key not in self._tables, f"key {key}: a spare table beside the one in use")
            need(
                table.claims == 0 and bool((table.owner == UNKNOWN).all()),
                f"key {key}: a spare table that is not fresh",
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
        for req_id, request in self._live.items():
            if request.open_tid is not None:
                task = self._tasks.get(request.open_tid)
                need(
                    task is not None and task.state is TaskState.PENDING and not task.escalated,
                    f"request {req_id}: open deferred write {request.open_tid} is not appendable",
                )
            for tid in request.tids:
                need(tid in self._tasks, f"request {req_id} tracks retired task {tid}")
        need(self._lost_hits <= self._live.keys(), "a lost hit of a request that ended (D10)")
        # LIFE-1, DLV-1: admissions and the steps that carry them.
        need(self._preempted <= self._live.keys(), "a preempted request that is not live")
        need(not (self._preempted & self._start_hits.keys()), "a hit of a preempted request")
        for step in self._steps.values():
            need(
                step.handed is None or step.consuming, f"step {step.step_id}: handed, not consumed"
            )
            need(
                len(step.entries) == len(step.req_ids) == len(step.lo) == len(step.hi)
                and bool((step.lo <= step.hi).all()),
                f"step {step.step_id}: positions do not match its layout",
            )
        self._admissions.check(
            {r: q.entry for r, q in self._live.items()},
            self._preempted,
            [s.entries for s in self._steps.values()],
        )
        for tid in self._unwritten_step_writes | self._escalated:
            need(tid in self._tasks, f"waited task {tid} is not registered")
        for read in self._reads.values():
            need(
                read.step_id is not None and read.step_id in self._steps,
                f"read {read.plan.read_id} outlived its step",
            )
        if self._save is not None and self._save.page is not None:
            need(("save", 0) in self._pages[self._save.page], "pending save lost its page")
        need(self._next_tid - 1 <= _MAX_TID, "tid overflow")
        if self._fatal is not None:
            need(self.counters.writes_failed > 0, "fatal without a failed write")

    # -----------------------------------------------------------------------------------------
    # Internals.

    def _check_usable(self) -> None:
        if self._closed:
            raise ShutDownError()
        if self._fatal is not None:
            raise WriteFailedError(tids=self._fatal.tids, reason=self._fatal.reason)

    def _require_save(self) -> _PendingSave:
        if self._save is None:
            raise BadInputError(what="save", expected="a save in progress", got="none")
        return self._save

    def _raise_unknown_step(self, step_id: StepId) -> None:
        open_ids = self.open_step_ids
        if 0 < step_id < self._next_step_id:
            raise StepAlreadyConsumedError(step_id=step_id, open_step_ids=open_ids)
        raise UnknownStepError(step_id=step_id, open_step_ids=open_ids)

    def _check_hit(self, req_id: ReqId, hit_end: int, block_ids: tuple[int, ...]) -> None:
        block_size = self.config.block_size

        def what() -> str:  # HIT-1: every refusal names the request, hit_end and the block size
            return f"hit of request {req_id!r} (hit_end={hit_end}, block_size={block_size})"

        if not block_ids:
            raise BadInputError(
                what=what(),
                expected="the request's block ids",
                got="no block ids",
            )
        if hit_end % block_size:
            raise BadInputError(
                what=what(),
                expected=f"hit_end a multiple of block_size={block_size}",
                got=f"hit_end={hit_end}",
            )
        if hit_end > len(block_ids) * block_size:
            raise BadInputError(
                what=what(),
                expected=f"at least {hit_end // block_size} blocks for hit_end={hit_end}",
                got=f"{len(block_ids)} blocks",
            )
        hit_blocks = block_ids[: hit_end // block_size]
        if min(hit_blocks) < 0 or max(hit_blocks) >= self.config.num_blocks:
            raise BadInputError(
                what=f"block ids of request {req_id!r}",
                expected=f"ids in [0, {self.config.num_blocks})",
                got=f"{list(hit_blocks)[:8]}",
            )

    def _check_keys(self, inp: SaveBegin) -> None:
        signature = (inp.immediate_keys, inp.deferred_keys, inp.num_tokens > 0)
        if signature in self._key_sets:
            return  # every step of a model passes the same keys: checked once
        deferred = self.policy.deferred_keys
        if set(inp.deferred_keys) - deferred or set(inp.immediate_keys) & deferred:
            raise BadInputError(
                what="save keys",
                expected=f"deferred keys exactly those of the policy ({sorted(deferred)})",
                got=f"immediate {list(inp.immediate_keys)}, deferred {list(inp.deferred_keys)}",
            )
        caches_hidden = self.policy.needs_full_hidden_states
        has_hidden = HIDDEN_KEY in inp.immediate_keys
        if has_hidden != (caches_hidden and inp.num_tokens > 0):
            raise BadInputError(
                what="hidden states",
                expected="hidden rows exactly when the policy caches them and the step has rows",
                got="hidden given" if has_hidden else "no hidden rows",
            )
        if inp.num_tokens == 0 and (inp.immediate_keys or inp.deferred_keys):
            raise BadInputError(what="save keys", expected="no cached keys for 0 rows", got="keys")
        if len(set(inp.immediate_keys)) != len(inp.immediate_keys) or len(
            set(inp.deferred_keys)
        ) != len(inp.deferred_keys):
            raise BadInputError(what="save keys", expected="distinct keys", got="a repeat")
        self._key_sets[signature] = self._out_keys(inp)

    def _hit_keys(self, keys: Iterable[TensorName]) -> list[TensorName]:
        return [k for k in self.policy.get_hit_keys(keys) if k in self._tables]

    def _out_keys(self, sv: SaveBegin) -> tuple[TensorName, ...]:
        """The keys a consume returns: hidden first (when cached), then mm keys sorted."""
        mm = sorted(k for k in (*sv.immediate_keys, *sv.deferred_keys) if k != HIDDEN_KEY)
        if self.policy.needs_full_hidden_states:
            return (HIDDEN_KEY, *mm)
        return tuple(mm)

    def _new_tid(self) -> Tid:
        if self._next_tid > _MAX_TID:
            raise InvariantError("write task ids exhausted (2**31 - 1)")
        tid = Tid(self._next_tid)
        self._next_tid += 1
        return tid

    def _clear_start_hits(self) -> None:
        self._start_hits = {}
        self._start_hit_slots = (_EMPTY_SLOTS, [0])
        if self._start_hit_lo:
            self._start_hit_lo = {}

    def _hold(self, task: _Task, key: TensorName, slots: SlotArray) -> None:
        """Add a chunk of `key` slots to `task`'s write."""
        chunks = task.slots.get(key)
        if chunks is None:
            task.slots[key] = [slots]
            self._writers[key] = self._writers.get(key, 0) + 1
        else:
            chunks.append(slots)

    def _new_read_id(self) -> int:
        read_id = self._next_read_id
        self._next_read_id += 1
        return read_id

    def _budget_cap(self) -> int:
        return self.config.gpu_staging_bytes

    def _free_page(self) -> int | None:
        for page, holders in enumerate(self._pages):
            if not holders:
                return page
        return None

    def _barrier_waits(self) -> tuple[tuple[Tid, TaskState], ...]:
        waits = [(tid, TaskState.WRITTEN) for tid in sorted(self._unwritten_step_writes)]
        waits += [(tid, TaskState.HOST_READY) for tid in sorted(self._escalated)]
        return tuple(waits)

    def _await(
        self,
        save: _PendingSave,
        now_ns: int,
        waits: tuple[tuple[Tid, TaskState], ...],
        what: str,
    ) -> AwaitTasks:
        if save.deadline_ns is None:
            save.deadline_ns = now_ns + self._timeout_ns
        if now_ns >= save.deadline_ns:
            self.counters.wait_timeouts += 1
            tid = waits[0][0]
            raise WaitTimeoutError(
                what=what,
                tid=tid,
                state=self._tasks[tid].state.name,
                timeout_s=self.config.staging_claim_timeout_s,
            )
        return AwaitTasks(waits=waits, deadline_ns=save.deadline_ns, what=what)

    def _flush_victim(self) -> _Task | None:
        """The oldest unfinished write (BUDGET-2), or None.

        SPEC has the flush force that write to "copy and write", so a write that has copied
        (HOST_READY, its charge already gone) is still the victim and is awaited until WRITTEN;
        the loop then moves to the next oldest, until the save fits or nothing is left.
        """
        # Terminal tasks retire at once, and tasks are kept in tid (insertion) order: the first
        # one kept is the oldest unfinished write.
        return next(iter(self._tasks.values()), None)

    def _escalate_task(self, task: _Task) -> None:
        if task.state is TaskState.PENDING:
            self._move(task.tid, "queue")
        task.escalated = True
        if task.state.value < TaskState.HOST_READY.value:
            self._escalated.add(task.tid)
        if task.req_id is not None:
            request = self._live.get(task.req_id)
            if request is not None and request.open_tid == task.tid:
                request.open_tid = None  # BUDGET-2: the next save opens a new write

    def _escalate_request(self, request: _Request) -> list[Tid]:
        """TASK-4: escalate a finished or aborted request's unfinished writes, newest first."""
        tids = [tid for tid in reversed(request.tids) if tid in self._tasks]
        for tid in tids:
            self._escalate_task(self._tasks[tid])
        request.open_tid = None
        return tids

    def _move(self, tid: Tid, how: str) -> _Task:
        task = self._tasks.get(tid)
        if task is None:
            raise IllegalTransitionError(tid=tid, from_state="RETIRED", to_state=how)
        nxt = _TASK_MOVES.get((task.state, how))
        if nxt is None:
            raise IllegalTransitionError(tid=tid, from_state=task.state.name, to_state=how)
        task.state = nxt
        return task

    def _retire(self, task: _Task) -> None:
        del self._tasks[task.tid]
        for key in task.slots:
            self._writers[key] -= 1
        if task.page is not None:
            self._pages[task.page].discard(("task", task.tid))
        self._unwritten_step_writes.discard(task.tid)
        self._escalated.discard(task.tid)
        if task.req_id is not None:
            request = self._live.get(task.req_id)
            if request is not None:
                if task.tid in request.tids:
                    request.tids.remove(task.tid)
                if request.open_tid == task.tid:
                    request.open_tid = None

    def _add_ticket(self, nbytes: int, viewers: set[Tid]) -> None:
        ident = self._next_ticket
        self._next_ticket += 1
        self._tickets[ident] = _Ticket(nbytes, set(viewers))
        for tid in viewers:
            self._tasks[tid].tickets.add(ident)

    def _release_tickets(self, task: _Task) -> None:
        """BUDGET-1: a task no longer needs its clones; the last viewer uncharges them."""
        for ident in task.tickets:
            ticket = self._tickets[ident]
            ticket.viewers.discard(task.tid)
            if not ticket.viewers:
                self._budget_used -= ticket.nbytes
                del self._tickets[ident]
        task.tickets = set()

    def _take(
        self,
        key: TensorName,
        slots: SlotArray,
        owner: int | npt.NDArray[np.int32],
        writes_in_flight: bool,
    ) -> list[Tombstone]:
        """Claim (or mark absent) `slots` for `key`; tombstone displaced writes (SLOT-2).

        `writes_in_flight`: whether a write registered before this save's own holds `key`.
        """
        effects: list[Tombstone] = []
        table = self._tables[key]
        for tid, lost in table.take(slots, owner, writes_in_flight=writes_in_flight):
            self._tasks[Tid(tid)].tombstones.setdefault(key, []).append(lost)
            effects.append(Tombstone(tid=Tid(tid), key=key, slots=lost))
        return effects

    def _stage_deferred(
        self, sv: SaveBegin, effects: list[Effect]
    ) -> tuple[npt.NDArray[np.int32], set[Tid]]:
        """Append each request's rows to its open deferred write, or open one (D2, SLOT-5)."""
        bounds = sv.row_bounds.tolist()
        owners = np.zeros(sv.num_tokens, dtype=np.int32)
        used: set[Tid] = set()
        for i, req_id in enumerate(sv.req_ids):
            start, end = bounds[i], bounds[i + 1]
            if start == end:
                continue
            request = self._live[req_id]
            chunk = sv.slots[start:end]
            task = self._tasks.get(request.open_tid) if request.open_tid is not None else None
            new_task = task is None or task.lost_any(sv.deferred_keys, chunk)
            if new_task:
                task = _Task(
                    self._new_tid(), WriteSchedule.JOIN_ON_FINISH, TaskState.PENDING, req_id=req_id
                )
                self._tasks[task.tid] = task
                request.open_tid = task.tid
                request.tids.append(task.tid)
            assert task is not None
            task.chunks += 1
            for key in sv.deferred_keys:
                self._hold(task, key, chunk)
            owners[start:end] = task.tid
            used.add(task.tid)
            effects.append(
                DeferredChunk(
                    tid=task.tid, req_id=req_id, new_task=new_task, row_start=start, row_end=end
                )
            )
        return owners, used

    def _copy_on_write(self, slots: SlotArray) -> list[Preserve]:
        """HIT-6: preserve committed rows older reads planned on, before `slots` change."""
        if not self._reads:
            return []
        ordered = np.sort(slots)
        effects: list[Preserve] = []
        for read in self._reads.values():
            plan = read.plan
            table = self._tables.get(plan.key)
            if table is None:
                continue
            hit = _member(ordered, plan.slots)
            hit &= ~plan.preserved & ((plan.source == _POOL) | (plan.source == _AFTER_WRITE))
            if not any_true(hit):
                continue
            positions = np.flatnonzero(hit)
            planned = plan.slots[positions]
            intact = (table.owner[planned] == COMMITTED) & (
                table.version[planned] == read.version[positions]
            )
            if any_true(intact):
                keep = positions[intact]
                plan.preserved[keep] = True
                effects.append(
                    Preserve(
                        read_id=plan.read_id, key=plan.key, positions=keep, slots=plan.slots[keep]
                    )
                )
            read.violated += len(intact) - int(np.count_nonzero(intact))
        return effects

    def _plan_step_reads(
        self,
        step_id: StepId,
        sv: SaveBegin,
        keys: tuple[TensorName, ...],
        step_tid: Tid | None,
    ) -> tuple[dict[ReqId, list[_Read]], npt.NDArray[np.int64] | None]:
        """Plan the hits of this save's requests against the post-claim state (D4).

        All hit slots of the step are planned together, one gather per key, and each read gets
        its slice: a prefill with many hits costs a few numpy calls per key, not per read.
        Returns the reads per request and their rows per `SlotSource`.
        """
        hits = list(self._start_hits.items())  # save_begin checked they are all in the layout
        if not hits:
            return {}, None
        every, bounds = self._start_hit_slots
        owners = {key: self._owners_at(key, every) for key in keys}
        # HIT-5: a producer of this very step wins over any older tenant. The step write just
        # claimed all of the step's slots, so its fresh tid marks them; without one, a
        # membership mark costs far less than sorting the step.
        if step_tid is not None:
            # `keys` holds every key the save passed (`_out_keys`), so the step key's owners
            # are gathered already.
            any_mine = any_true(owners[sv.immediate_keys[0]][0] == step_tid)
        else:
            mark = self._slot_mark
            mark[sv.slots] = True
            any_mine = any_true(mark[every])
            mark[sv.slots] = False
        if any_mine:
            order = np.argsort(sv.slots, kind="stable")
            step_row = _last_row(sv.slots[order], order, every).astype(np.int32)
            mine = step_row >= 0
        else:
            step_row = np.full(len(every), -1, dtype=np.int32)
            step_row.setflags(write=False)  # shared by every read of the step
            mine = None
        reads: dict[ReqId, list[_Read]] = {r: [] for r, _ in hits}
        no_writer = np.zeros(len(every), dtype=np.int32)
        no_writer.setflags(write=False)  # shared by every read of every key without writers
        hit_rows = np.zeros(len(SlotSource), dtype=np.int64)
        for key in keys:
            owner, version = owners[key]
            source = np.where(owner == COMMITTED, _POOL, _ZEROS)
            in_transit = owner > 0
            if mine is not None:
                in_transit &= ~mine
                source[mine] = _THIS_STEP
            has_writers = any_true(in_transit)
            writer = np.where(in_transit, owner, 0).astype(np.int32) if has_writers else no_writer
            if has_writers:
                deferred = key in self.policy.deferred_keys
                source[in_transit] = _TASK if deferred else _AFTER_WRITE
            counts = np.bincount(source, minlength=len(SlotSource))
            hit_rows += counts
            missing = None
            if key == HIDDEN_KEY and counts[_ZEROS]:
                missing = np.add.reduceat(source == _ZEROS, bounds[:-1])
            preserved = np.zeros(len(every), dtype=np.bool_)  # sliced per read: one allocation
            for i, (req_id, (slots, read_ids)) in enumerate(hits):
                lo, hi = bounds[i], bounds[i + 1]
                read_writer = writer[lo:hi]
                reads_writers = has_writers and any_true(in_transit[lo:hi])
                chunk_limit, error = (
                    self._limit_task_reads(read_writer, source[lo:hi])
                    if reads_writers
                    else ((), None)
                )
                read = _Read(
                    ReadPlan(
                        read_id=read_ids.get(key) or self._new_read_id(),
                        req_id=req_id,
                        key=key,
                        slots=slots,
                        source=source[lo:hi],
                        writer=read_writer,
                        chunk_limit=chunk_limit,
                        step_row=step_row[lo:hi],
                        preserved=preserved[lo:hi],
                    ),
                    step_id,
                    version[lo:hi],
                    reads_writers,
                )
                read.error = error
                if missing is not None and missing[i]:
                    # HIT-4: never a miss: the cache and the engine's KV state diverged.
                    read.error = (
                        f"{int(missing[i])} of {hi - lo} hidden-state rows are unknown or absent "
                        "(never written, or written by another tenant)"
                    )
                self._reads[read.plan.read_id] = read
                reads[req_id].append(read)
        return reads, hit_rows

    def _owners_at(
        self, key: TensorName, slots: SlotArray
    ) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.uint32]]:
        """Owner and version of `slots` for `key` (UNKNOWN, version 0 for a key never seen)."""
        table = self._tables.get(key)
        if table is None:
            return (
                np.full(len(slots), -2, dtype=np.int32),
                np.zeros(len(slots), dtype=np.uint32),
            )
        return table.owner[slots], table.version[slots]

    def _limit_task_reads(
        self, writer: npt.NDArray[np.int32], source: npt.NDArray[np.int8]
    ) -> tuple[tuple[tuple[Tid, int], ...], str | None]:
        """Pin TASK rows to the chunks that exist now; a vanished writer is an error (HIT-4).

        Returns the read's chunk limits, in tid order, and its error, if any.
        """
        limits: list[tuple[Tid, int]] = []
        error = None
        for tid in np.unique(writer[source == _TASK]).tolist():
            task = self._tasks.get(Tid(tid))
            if task is None:
                error = f"in-flight write {tid} cannot serve its rows"
            else:
                limits.append((Tid(tid), task.chunks))
        return tuple(limits), error

    def _end_step(self, step: _Step) -> None:
        del self._steps[step.step_id]
        if self._admissions.ended:
            self._admissions.on_step_end([s.entries for s in self._steps.values()])
        self._pages[step.page].discard(("step", step.step_id))
        for reads in step.reads.values():
            for read in reads:
                self._reads.pop(read.plan.read_id, None)


def _block_slots(block_ids: list[int], block_size: int) -> SlotArray:
    blocks = np.asarray(block_ids, dtype=np.int64)
    return (blocks[:, None] * block_size + np.arange(block_size, dtype=np.int64)).reshape(-1)


def _concat(chunks: list[SlotArray]) -> SlotArray:
    if not chunks:
        return _EMPTY_SLOTS
    return chunks[0] if len(chunks) == 1 else np.concatenate(chunks)


def _member(ordered: SlotArray, values: SlotArray) -> npt.NDArray[np.bool_]:
    """Which `values` occur in the sorted array `ordered`."""
    if not len(ordered):
        return np.zeros(len(values), dtype=np.bool_)
    at = np.searchsorted(ordered, values)
    at[at >= len(ordered)] = len(ordered) - 1
    return np.asarray(ordered[at] == values)


def _last_row(ordered: SlotArray, order: SlotArray, values: SlotArray) -> npt.NDArray[np.int64]:
    """Row of the last occurrence of each value in the step (TASK-5), or -1."""
    if not len(ordered):
        return np.full(len(values), -1, dtype=np.int64)
    at = np.searchsorted(ordered, values, side="right") - 1
    found = at >= 0
    found[found] = ordered[at[found]] == values[found]
    return np.where(found, order[np.maximum(at, 0)], -1)


def dispatch(core: CacheCore) -> dict[type, Callable[[Any], Any]]:
    """Map each input type to the core method that handles it (for generic drivers)."""
    return {
        StartStep: core.start_step,
        SaveBegin: core.save_begin,
        SaveProceed: core.save_proceed,
        SaveCommit: core.save_commit,
        SaveAbort: core.save_abort,
        ConsumeBegin: core.consume_begin,
        ConsumeEnd: core.consume_end,
        ShutDown: core.shut_down,
        CopyStarted: core.report,
        CopyLanded: core.report,
        WriteLanded: core.report,
        WriteFailed: core.report,
    }
