"""The transition core: a deterministic, sans-IO state machine for the prefix cache.

Theory of operation
-------------------
The adapter feeds *inputs* in and executes the *effects* that come out. The core never waits,
never reads a clock (time arrives as ``now_ns``), never touches a tensor. An illegal input raises
a typed error and leaves the state exactly as it was; the few inputs whose rule says otherwise
(STEP-4, a consume that raises counts as consumed) say so.

`CacheCore` routes each input, in the documented order, to the machines that own the state;
each machine is a module with its own invariants and snapshot:

- **Steps** (STEP, `_steps`): `SaveCommit` issues a step id; `ConsumeBegin` hands out its plan
  exactly once (`discard_step` releases it at once, `materialize` holds its page until
  `ConsumeEnd`).
- **Pages** (PAGE, D5, `_pages`): `staging_depth` pages, each a set of holders: a STEP holder
  from commit until the consume ends, a TASK holder from the step write's registration until it
  is WRITTEN or FAILED, and the SAVE holder for the save in progress. Free iff no holder.
- **Slots** (SLOT, D3, `_occupancy`): per key an `OccupancyTable` (owner, version). `SaveCommit`
  claims the step's slots for every known key: the step write for immediate keys, each
  request's deferred write for deferred keys, explicit absence for keys the step did not emit
  (SLOT-4). Displaced owners get tombstones (SLOT-2); `WriteLanded` commits only still-owned
  slots (SLOT-3).
- **Tasks** and **budget** (TASK, BUDGET, `_tasks`): one step write per step (D1) and one open
  deferred write per request (D2), moving by `_TASK_MOVES` only. Committer progress arrives as
  reports (`CopyStarted`, `CopyLanded`, `WriteLanded`, `WriteFailed`), drained in order (D8).
  Device clone bytes are charged per clone allocation as a ticket whose viewers are the tasks
  reading it, released when the last viewer reaches HOST_READY or fails.
- **The save** (D6, `_save`): barrier, budget, page, ready. A save that does not fit escalates
  the oldest unfinished write and waits until it is WRITTEN, then checks again (BUDGET-2, D12).
- **Requests** (LIFE, DLV, `_delivery`): `StartStep` applies finishes, aborts and preemptions
  first, then starts (HIT-2); an end escalates the request's deferred writes (TASK-4). Each
  admission has its positions and delivery cursor there.
- **Reads** (HIT, D4, `_reads`): hits are planned at start for prefetch and finally at commit,
  after the step's own claims; reads of older, unconsumed steps are protected by copy-on-write
  (`Preserve`) or marked violated.

Deadlines: a save waits at most `staging_claim_timeout_s` in each of its phases (barrier, budget,
page), a consume at most that long for the writes its hits read; each deadline starts at the
``now_ns`` of the input that first had to wait. `next_deadline_ns()` is the earliest of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from omni_cache_core._contract import (
    ModelCachePolicy,
    PrefixCacheConfig,
    PrefixCacheEventKind,
    ReqId,
    StepId,
    TensorName,
    Tid,
)
from omni_cache_core._counters import CoreCounters
from omni_cache_core._delivery import Admissions, RequestState
from omni_cache_core._errors import (
    BadInputError,
    HitUnreadableError,
    InvariantError,
    ShutDownError,
    WaitTimeoutError,
    WriteFailedError,
)
from omni_cache_core._occupancy import ABSENT, OccupancyTable, SlotTables
from omni_cache_core._pages import HolderKind, PageHolders
from omni_cache_core._reads import HitReads
from omni_cache_core._save import (
    KeySets,
    PendingSave,
    SaveInProgress,
    check_save_shape,
    check_save_sizes,
    task_ids_needed,
)
from omni_cache_core._steps import Step, Steps
from omni_cache_core._tasks import Task, TaskMove, WriteTasks, concat
from omni_cache_core._values import (
    AwaitPage,
    AwaitTasks,
    ConsumeBegin,
    ConsumeEnd,
    ConsumePlan,
    CopyLanded,
    CopyStarted,
    Effect,
    EscalateTasks,
    PageClaimed,
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
        self._closed = False
        self._fatal: WriteFailedError | None = None
        self._started = False
        self._pages = PageHolders(config.staging_depth)
        self._slots = SlotTables(config.num_slots)
        self._writes = WriteTasks(config.gpu_staging_bytes)
        self._requests = Admissions()
        self._hits = HitReads(config.num_slots, config.block_size, config.num_blocks)
        self._saved = Steps(config.staging_claim_timeout_ns, config.staging_claim_timeout_s)
        self._save = SaveInProgress(config.staging_claim_timeout_ns, config.staging_claim_timeout_s)
        self._key_sets = KeySets()

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
        return self._writes.budget_used

    @property
    def pages_in_use(self) -> int:
        """Pages with at least one holder."""
        return self._pages.in_use

    @property
    def open_step_ids(self) -> tuple[StepId, ...]:
        """Saved steps not yet consumed, by id."""
        return self._saved.open_ids()

    @property
    def installed_keys(self) -> tuple[TensorName, ...]:
        """Cached keys seen so far, in first-seen order."""
        return tuple(self._slots.tables)

    @property
    def save_in_progress(self) -> bool:
        """Whether a save began and was neither committed nor aborted."""
        return self._save.pending is not None

    def request_states(self) -> dict[ReqId, RequestState]:
        """Every live request's lifecycle state, by id in sorted order (LIFE-1)."""
        return self._requests.live()

    def slot_owners(self, key: TensorName) -> npt.NDArray[np.int32] | None:
        """A read-only view of a cached key's owner codes per slot (SLOT-1), or None."""
        table = self._slots.get(key)
        if table is None:
            return None
        owners = table.owner.view()
        owners.setflags(write=False)
        return owners

    def occupancy_metadata_bytes(self) -> int:
        """Bytes of every occupancy table (SLOT-6), spare tables (`reserve_tables`) included."""
        return self._slots.metadata_bytes()

    def occupancy_bytes_per_key(self) -> int:
        """Bytes one cached key's occupancy table takes (SLOT-6, D3): 8 per slot."""
        return 8 * self._slots.num_slots

    def reserve_tables(self, keys: Iterable[TensorName]) -> None:
        """Allocate the occupancy tables of keys not seen yet, ahead of their first save.

        An allocation hint, not an input: the state (and `snapshot`) is unchanged, and a key's
        first save takes its spare table instead of allocating one. Keys already seen, or
        already reserved, are skipped. Works whatever the cache's state.

        Raises:
            MemoryError: A table could not be allocated; no table of this call is kept.
        """
        self._slots.reserve(keys)

    def task_state(self, tid: Tid) -> TaskState | None:
        """State of a registered task, or None once it left the registry (WRITTEN or FAILED)."""
        return self._writes.state_of(tid)

    def presence(self, key: TensorName, slot: int) -> tuple[int, int]:
        """Owner code and version of one (slot, key) (for tests and diagnostics)."""
        table = self._slots.get(key)
        if table is None:
            return (-2, 0)
        return (int(table.owner[slot]), int(table.version[slot]))

    def step_slots_of(self, step_id: StepId) -> tuple[tuple[ReqId, ...], SlotArray]:
        """Requests and row bounds of an unended step."""
        step = self._saved.by_id[step_id]
        return step.req_ids, step.row_bounds

    def has_step(self, step_id: StepId) -> bool:
        """Whether a step is saved and its consume has not ended."""
        return step_id in self._saved.by_id

    def reads_of(self, step_id: StepId) -> tuple[tuple[int, frozenset[Tid]], ...]:
        """The reads a step planned, each with the deferred writes whose own rows it reads.

        The adapter keeps those writes' rows reachable until the step's consume ends (HIT-3).
        """
        return self._hits.reads_of(step_id)

    def next_deadline_ns(self) -> int | None:
        """The earliest deadline of any wait in progress, or None."""
        deadlines = self._saved.deadlines()
        save = self._save.pending
        if save is not None and save.deadline_ns is not None:
            deadlines.append(save.deadline_ns)
        return min(deadlines) if deadlines else None

    # Read-only views of the machines' registries, for test helpers that inspect them.

    @property
    def _tasks(self) -> Mapping[Tid, Task]:
        return self._writes.tasks

    @property
    def _steps(self) -> Mapping[StepId, Step]:
        return MappingProxyType(self._saved.by_id)

    @property
    def _tables(self) -> Mapping[TensorName, OccupancyTable]:
        return self._slots.tables

    @property
    def _spare_tables(self) -> Mapping[TensorName, OccupancyTable]:
        return self._slots.spare

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
        self._save.refuse_if_pending("new_step_starts", "no save in progress")
        requests, hits = self._requests, self._hits
        ending, starting = requests.split_records(inp.step.events, hits.check_hit)
        # From here on nothing raises: the step is applied whole.
        self._started = True
        escalate: list[Tid] = []
        # D10: hits of a start that no save followed can never be served; their requests must
        # end (or be preempted and resumed) before they are saved again.
        hits.on_start()
        for req_id, kind in ending:
            if not requests.is_live(req_id):
                continue  # the end of a request the cache never saw: nothing to do
            hits.forget_request(req_id)
            preempted = kind is PrefixCacheEventKind.PREEMPTED
            escalate.extend(self._writes.end_request(req_id, ended=not preempted))
            if preempted:
                requests.preempt(req_id)  # LIFE-3: live for delivery, not for saves
            else:
                requests.end(req_id, self._saved.entry_arrays())
        block_size = self.config.block_size
        hit_list: list[tuple[ReqId, tuple[int, ...], int]] = []
        for req_id, kind, hit_end, block_ids in starting:
            if kind is PrefixCacheEventKind.RESUMED:
                cursor = requests.resume(req_id, hit_end)
                # DLV-3: only positions not delivered yet are read, from the cursor's block on.
                first = cursor // block_size * block_size
            elif requests.is_live(req_id):
                continue  # HIT-1: a continuation of a live request opens no hit.
            else:
                requests.admit(req_id, hit_end)
                first = 0
            if hit_end > first:
                hit_list.append(
                    (req_id, block_ids[first // block_size : hit_end // block_size], first)
                )
        effects: list[Effect] = []
        if hit_list:
            seen_keys = self._slots.seen_keys()
            hit_keys = [k for k in self.policy.get_hit_keys(seen_keys) if k in seen_keys]
            effects.extend(hits.register(hit_list, self._slots, hit_keys))
            self.counters.hit_requests += len(hit_list)
        if escalate:
            effects.insert(0, EscalateTasks(tids=tuple(escalate)))
        return tuple(effects)

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
        self._save.refuse_if_pending("save_outputs", "one save at a time")
        check_save_shape(inp, self._slots.num_slots)
        unique, entries = self._requests.check_layout(inp.req_ids)
        self._hits.check_layout(unique)
        keys = self._key_sets.check(inp, self.policy)
        check_save_sizes(inp, self.config.staging_capacity_tokens)
        # D3, STEP-5: raise now, while nothing has changed, rather than halfway through the commit.
        self._writes.check_tid_room(task_ids_needed(inp))
        self._save.begin(PendingSave(inp, unique, entries, keys))

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
        return self._save.proceed(
            inp.now_ns, self._writes, self._pages, self.counters, self._saved.open_ids
        )

    def save_abort(self, inp: SaveAbort) -> None:
        """Drop the pending save, its page claim and its budget charge (STEP-5). Idempotent."""
        self._save.abort(self._writes, self._pages)

    def save_commit(self, inp: SaveCommit) -> SavePublished:
        """Publish the pending save: claims, tombstones, absence, deferred chunks, reads.

        Raises:
            BadInputError: No save is ready (its page is not claimed yet); nothing changes.
        """
        self._check_usable()
        save = self._save.take_ready()
        sv, page = save.inp, cast(int, save.page)
        writes, slots_now = self._writes, self._slots
        step_id = self._saved.issue_id()
        self._pages.let_go(page, HolderKind.SAVE)
        self._pages.hold(page, HolderKind.STEP, step_id)
        n, slots = sv.num_tokens, sv.slots
        effects: list[Effect] = []
        slots_now.install((*sv.immediate_keys, *sv.deferred_keys))
        step_tid: Tid | None = None
        tickets_left = save.charged
        # Only a registered write owns slots (SLOT-1): a key no write holds has nothing in flight.
        busy = writes.busy_keys()
        if n:
            # HIT-6: protect older reads before anything changes the slots they planned on.
            effects.extend(self._hits.copy_on_write(slots, slots_now))
            if sv.immediate_keys:
                task = writes.register_step_write(step_id, page)
                step_tid = task.tid
                # PAGE-3: the write holds the page before it is visible.
                self._pages.hold(page, HolderKind.TASK, step_tid)
                for key in sv.immediate_keys:
                    writes.hold(task, key, slots)
                    effects.extend(self._take(key, slots, step_tid, key in busy))
                if sv.immediate_bytes:
                    writes.add_ticket(sv.immediate_bytes, {step_tid})
                    tickets_left -= sv.immediate_bytes
            if sv.deferred_keys:
                row_owner, deferred_tids = writes.stage_deferred(sv, effects)
                for key in sv.deferred_keys:
                    effects.extend(self._take(key, slots, row_owner, key in busy))
                if sv.deferred_bytes:
                    writes.add_ticket(sv.deferred_bytes, deferred_tids)
                    tickets_left -= sv.deferred_bytes
            emitted = {*sv.immediate_keys, *sv.deferred_keys}
            for key in slots_now.seen_keys():
                if key not in emitted:
                    # SLOT-4: the step's requests wrote nothing for this key: explicit absence.
                    effects.extend(self._take(key, slots, ABSENT, key in busy))
        # Charges with no viewer (nothing was cloned after all) are given back at once.
        writes.unreserve(tickets_left)
        self._hits.plan_step(
            step_id,
            sv,
            save.keys,
            step_tid,
            slots_now,
            self.policy.deferred_keys,
            writes.chunks_of,
        )
        # DLV-1: each request's rows are the positions from its count on; a request that
        # registered a hit here carries the hit rows before them.
        bounds = sv.row_bounds
        own, hi = self._requests.on_save(save.entries, bounds[1:] - bounds[:-1])
        lo = self._hits.step_positions(sv.req_ids, own)
        self._saved.add(
            Step(
                step_id,
                page,
                sv.req_ids,
                save.req_set,
                bounds,
                save.keys,
                step_tid,
                save.entries,
                lo,
                hi,
            )
        )
        self._hits.clear_start_hits()
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
        step = self._saved.open_step(inp.step_id)
        if inp.req_ids is None:
            self._end_step(step)
            self.counters.steps_discarded += 1
            return ConsumePlan(
                step_id=step.step_id, page=step.page, keys=(), reads=(), discard=True
            )
        requested = inp.req_ids
        # The usual call asks for the whole layout, in order: no set to build.
        whole = requested == step.req_ids
        if not whole and not step.req_set.issuperset(requested):
            self._end_step(step)
            outside = sorted(set(requested) - step.req_set)[:4]
            raise BadInputError(
                what=f"materialize(step {step.step_id}) request ids",
                expected="a subset of the requests saved in that step (STEP-4)",
                got=f"requests outside the save snapshot: {outside}",
            )
        entries, lo, hi = step.select(requested)
        cursors = self._requests.cursor
        cursor = cursors[entries]
        if not self._saved.is_oldest(step):
            # Not the oldest unended step: an earlier one may still owe these requests rows.
            self._saved.check_delivery_order(step, requested, entries, cursor, hi, cursors)
        reads = self._hits.of_step(step.step_id, None if whole else requested)
        if reads:
            try:
                waits = self._hits.writes_to_await(reads, self._writes.is_registered)
                if waits:
                    return self._saved.await_writes(
                        step, inp.now_ns, waits, self._writes.state_of, self.counters
                    )
            except (HitUnreadableError, WaitTimeoutError):
                self._end_step(step)  # HIT-4, HIT-6, FAIL-3: the step is consumed
                raise
        step.consuming = True
        step.consume_deadline_ns = None
        start, end, skip = self._requests.deliver(entries, cursor, lo, hi)
        step.handed = (entries, cursor, end)
        self.counters.steps_consumed += 1
        hit_rows = self._hits.hit_rows_of(step.step_id)
        if whole and hit_rows is not None:
            self.counters.hit_rows += hit_rows
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

    def consume_end(self, inp: ConsumeEnd) -> None:
        """Release a materialized step's page and drop its reads (D5).

        With ``delivered=False`` the outputs never reached the caller: each delivery cursor the
        consume moved goes back, unless another consume moved it on since (D19).

        Raises:
            BadInputError: The step is not being consumed; the cache is unchanged.
        """
        step = self._saved.consuming_step(inp.step_id)
        if not inp.delivered and step.handed is not None:
            self._requests.undeliver(*step.handed)
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
        writes = self._writes
        if isinstance(inp, CopyStarted):
            writes.move(inp.tid, TaskMove.COPY_STARTED)
        elif isinstance(inp, CopyLanded):
            writes.copy_landed(inp.tid)
        elif isinstance(inp, WriteLanded):
            task = writes.move(inp.tid, TaskMove.WRITE_LANDED)
            tables = self._slots.by_key
            for key, chunks in task.slots.items():
                # SLOT-3: a slot leaves a write only through a claim or an absence, which
                # tombstone it (SLOT-2): without tombstones the write still owns every slot.
                intact = key not in task.tombstones
                tables[key].commit(task.tid, concat(chunks), intact=intact)
            self._retire(task)
        elif isinstance(inp, WriteFailed):
            task = writes.fail(inp.tid)
            self.counters.writes_failed += 1
            tables = self._slots.by_key
            for key, chunks in task.slots.items():
                tables[key].forget(task.tid, concat(chunks))
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
        return (
            self._closed,
            None if self._fatal is None else (self._fatal.tids, self._fatal.reason),
            self._started,
            self._pages.snapshot(),
            self._saved.snapshot(self._hits.read_ids_by_request),
            self._writes.snapshot(),
            self._requests.snapshot(self._saved.entry_arrays()),
            self._hits.snapshot(),
            self._slots.snapshot(),
            self._save.snapshot(),
        )

    def check_invariants(self) -> None:
        """Check every invariant the state must satisfy: each machine's, then those across them.

        Raises:
            InvariantError: One does not hold; this is a bug in the library.
        """

        def need(ok: bool, what: str) -> None:
            if not ok:
                raise InvariantError(what)

        steps, tasks, save = self._saved.by_id, self._writes.tasks, self._save.pending
        self._pages.check_invariants()
        self._saved.check_invariants(self.config.staging_depth)
        self._writes.check_invariants()
        self._slots.check_invariants()
        self._hits.check_invariants()
        self._save.check_invariants()
        self._requests.check_invariants(self._saved.entry_arrays())
        # PAGE-2/PAGE-3: holders name live things, on the page they name.
        held_by_steps = set()
        for index, (kind, ident) in self._pages.holders():
            if kind is HolderKind.STEP:
                step = steps.get(StepId(ident))
                need(step is not None, f"page {index} held by dead step {ident}")
                need(step is not None and step.page == index, f"step {ident} on wrong page")
                held_by_steps.add(ident)
            elif kind is HolderKind.TASK:
                task = tasks.get(Tid(ident))
                need(task is not None, f"page {index} held by retired task {ident}")
                need(task is not None and task.page == index, f"task {ident} on wrong page")
            else:
                need(save is not None and save.page == index, f"page {index}: a stray save holder")
        need(held_by_steps == set(steps), "a step without its page holder")
        for task in tasks.values():
            if task.page is not None:
                holds = self._pages.holds(task.page, HolderKind.TASK, task.tid)
                need(holds, f"task {task.tid} lost page")
        if save is not None and save.page is not None:
            need(self._pages.holds(save.page, HolderKind.SAVE), "pending save lost its page")
        # BUDGET-1: the tasks' reservation is the save's admitted charge.
        need(
            self._writes.reserved == self._save.reserved,
            "budget charge does not match live tickets",
        )
        # SLOT-1/D3: an owner is a registered, non-terminal task that claimed that key.
        for key, table in self._slots.tables.items():
            for tid in np.unique(table.owner[table.owner > 0]).tolist():
                task = tasks.get(Tid(tid))
                need(task is not None, f"key {key}: slot owned by retired task {tid}")
                need(task is not None and key in task.slots, f"task {tid} owns an unclaimed key")
        live = self._requests.live()
        need(self._writes.requests_with_writes() <= live.keys(), "writes of a request not live")
        lost = self._hits.lost_hit_requests()
        need(lost <= live.keys(), "a lost hit of a request that ended (D10)")
        need(
            all(live.get(r) is not RequestState.PREEMPTED for r in self._hits.start_hit_requests()),
            "a hit of a preempted request",
        )
        need(self._hits.step_ids() <= steps.keys(), "a read outlived its step")
        if self._fatal is not None:
            need(self.counters.writes_failed > 0, "fatal without a failed write")

    # -----------------------------------------------------------------------------------------
    # Internals: what spans machines.

    def _check_usable(self) -> None:
        if self._closed:
            raise ShutDownError()
        if self._fatal is not None:
            raise WriteFailedError(tids=self._fatal.tids, reason=self._fatal.reason)

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
        table = self._slots.by_key[key]
        for tid, lost in table.take(slots, owner, writes_in_flight=writes_in_flight):
            self._writes.tombstone(Tid(tid), key, lost)
            effects.append(Tombstone(tid=Tid(tid), key=key, slots=lost))
        return effects

    def _retire(self, task: Task) -> None:
        """TASK-6: a WRITTEN or FAILED write leaves, and lets go of its page, in one input."""
        page = self._writes.retire(task)
        if page is not None:
            self._pages.let_go(page, HolderKind.TASK, task.tid)  # PAGE-3

    def _end_step(self, step: Step) -> None:
        """D5: a step ends (discarded, consumed, or refused): its page holder and reads go."""
        self._saved.remove(step)
        if self._requests.ended:
            self._requests.on_step_end(self._saved.entry_arrays())
        self._pages.let_go(step.page, HolderKind.STEP, step.step_id)
        self._hits.drop_step(step.step_id)


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
