"""The transition core: a deterministic, sans-IO state machine for the prefix cache.

Theory of operation
-------------------
The adapter feeds *inputs* in and executes the *effects* that come out. The core never waits,
never reads a clock (time arrives as ``now_ns``), never touches a tensor. An illegal input raises
a typed error and leaves the state exactly as it was; the few inputs whose rule says otherwise
(STEP-4, a consume that raises counts as consumed) say so.

`CacheCore` routes each input, in the documented order, to the machines that own the state.
Each machine is a module with its own rules, transition table, invariants and snapshot; its
docstring says what it decides and what it does not:

- **Steps** (STEP, DLV-5, `_steps`): saved steps by id, consumed exactly once.
- **Pages** (PAGE, D5, `_pages`): who holds each staging page; free iff no holder.
- **Slots** (SLOT, D3, `_occupancy`): per key and slot, the owner and its version.
- **Tasks** and **budget** (TASK, BUDGET, `_tasks`): the write tasks, moved by `_TASK_MOVES`
  only, and the clone bytes they view; committer reports arrive in order (D8).
- **The save** (D6, `_save`): barrier, budget, page, ready, each with its deadline (D7).
- **Requests** (LIFE, DLV, `_delivery`): each admission, its positions and delivery cursor.
- **Reads** (HIT, D4, `_reads`): hits registered at start, planned at commit, protected by
  copy-on-write (HIT-6).
- **Drafts** (SPEC, `_drafts`): draft rows waiting for the engine's acceptance, per admission.

What spans machines stays here or in a module of its own: the claims of a commit
(`_commit`), the invariants across machines (`_invariants`), a write's retirement releasing its
page, and a step's end releasing its page, its reads and its ended admissions.

Deadlines: a save waits at most `staging_claim_timeout_s` in each of its phases (barrier, budget,
page), a consume at most that long for the writes its hits read; each deadline starts at the
``now_ns`` of the input that first had to wait. `next_deadline_ns()` is the earliest of them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from omni_cache_core._commit import claim_step, mark_absent
from omni_cache_core._contract import (
    ModelCachePolicy,
    PrefixCacheConfig,
    PrefixCacheEventKind,
    ReqId,
    StepId,
    Tid,
)
from omni_cache_core._counters import CoreCounters
from omni_cache_core._delivery import Admissions, RequestState, carried_among
from omni_cache_core._drafts import Confirmed, Drafts, distinct_counts
from omni_cache_core._errors import (
    BadInputError,
    HitUnreadableError,
    InvariantError,
    ShutDownError,
    WaitTimeoutError,
    WriteFailedError,
)
from omni_cache_core._invariants import check_machines
from omni_cache_core._occupancy import SlotTables, any_true
from omni_cache_core._pages import HolderKind, PageHolders
from omni_cache_core._queries import CoreQueries
from omni_cache_core._reads import HitReads
from omni_cache_core._save import (
    KeySets,
    PendingSave,
    SaveInProgress,
    check_save_shape,
    check_save_sizes,
)
from omni_cache_core._steps import Step, Steps
from omni_cache_core._tasks import Task, TaskMove, WriteTasks
from omni_cache_core._values import (
    AwaitPage,
    AwaitTasks,
    CommitEffect,
    ConsumeBegin,
    ConsumeEnd,
    ConsumePlan,
    CopyLanded,
    CopyStarted,
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
    StartEffect,
    StartStep,
    StepWrite,
    Tombstone,
    WriteFailed,
    WriteLanded,
)

__all__ = ["CacheCore", "CoreCounters"]

_PREEMPTED = PrefixCacheEventKind.PREEMPTED


class CacheCore(CoreQueries):
    """The prefix cache's state machine. Not thread-safe: the adapter serialises calls.

    Its read-only queries (`CoreQueries`) answer from the machines it composes.

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
        #: Closed or failed: every engine input raises (FAIL-1, FAIL-4). One flag, so the
        #: usual input pays one attribute test.
        self._unusable = False
        self._started = False
        self._pages = PageHolders(config.staging_depth)
        self._slots = SlotTables(config.num_slots)
        self._writes = WriteTasks(config.gpu_staging_bytes)
        self._requests = Admissions()
        self._hits = HitReads(config.num_slots, config.block_size, config.num_blocks)
        self._saved = Steps(config.staging_claim_timeout_ns, config.staging_claim_timeout_s)
        self._save = SaveInProgress(config.staging_claim_timeout_ns, config.staging_claim_timeout_s)
        self._key_sets = KeySets()
        self._drafts = Drafts()

    # -----------------------------------------------------------------------------------------
    # Engine inputs.

    def register_policy(self, policy: ModelCachePolicy) -> None:
        """Replace the policy; only before the first step.

        Raises:
            BadInputError: A step already started; the policy is unchanged.
        """
        if self._unusable:
            self._refuse()
        if self._started:
            raise BadInputError(
                what="register_policy",
                expected="a call before the first step",
                got="a call after a step started",
            )
        self.policy = policy
        self._key_sets.clear()

    def start_step(self, inp: StartStep) -> tuple[StartEffect, ...]:
        """Apply a step's lifecycle records: ends and preemptions first, then starts (HIT-2).

        FINISHED, ABORTED and PREEMPTED records are applied in the order given, then STARTED
        and RESUMED ones (LIFE-2). Returns an `EscalateTasks` for the writes of requests that
        ended or were preempted (TASK-4, LIFE-3) and one `PrefetchRead` per hit read with
        committed rows (HIT-7). A resume plans its hit from its delivery cursor on (DLV-3).

        Raises:
            LifecycleError: A record is illegal in its request's state (LIFE-2), for example
                RESUMED of a request that is not preempted; the cache is unchanged.
            BadInputError: An unaligned hit, a hit without enough blocks, a block id out of range,
                or a request started twice in one step (HIT-1, FAIL-5); a computed-token count
                outside the range of a request's unconfirmed drafts (SPEC-2). The cache is
                unchanged.

        A computed-token count confirms a request's drafts before its records apply (SPEC-2):
        rows below it are accepted, the rest rejected and marked absent (SPEC-3); accepted rows
        its step no longer hands out are read by its next save (SPEC-4). A request that ends
        or is preempted with unconfirmed drafts has the slots its step's consume reported
        rejected marked absent; without a report its draft rows stay as written (SPEC-5).
        """
        if self._unusable:
            self._refuse()
        if self._save.pending is not None:
            raise BadInputError(
                what="new_step_starts", expected="no save in progress", got="a save in progress"
            )
        requests, hits, drafts = self._requests, self._hits, self._drafts
        computed = inp.step.computed_tokens
        confirms = (
            drafts.check_confirm(computed, requests.entries_by_request)
            if drafts and computed
            else None
        )
        ending, starting = requests.split_records(inp.step.events, hits.check_hit)
        # From here on nothing raises: the step is applied whole.
        self._started = True
        escalate: list[Tid] = []
        tombstones: list[Tombstone] = []
        catch_up: list[tuple[ReqId, SlotArray, int, int]] = []
        if confirms:
            self._reject(self._confirm(confirms, catch_up), tombstones)
        # D10: hits of a start that no save followed can never be served; their requests must
        # end (or be preempted and resumed) before they are saved again.
        hits.on_start()
        live = requests.entries_by_request
        # Which ending admissions an unended step still carries: found once for them all.
        step_entries = self._saved.entry_arrays() if ending else []
        carried = (
            carried_among(
                [live[r] for r, kind in ending if kind is not _PREEMPTED and r in live],
                step_entries,
            )
            if step_entries
            else set()
        )
        # Only a request with deferred writes has writes to escalate as it ends (TASK-4).
        request_writes = bool(ending) and self._writes.any_request_writes
        gone: list[ReqId] = []
        for req_id, kind in ending:
            if req_id not in live:
                continue  # the end of a request the cache never saw: nothing to do
            gone.append(req_id)
            if drafts:
                self._settle_at_end(requests.entry_of(req_id), tombstones)
            preempted = kind is _PREEMPTED
            if request_writes:
                escalate.extend(self._writes.end_request(req_id, ended=not preempted))
            if preempted:
                requests.preempt(req_id)  # LIFE-3: live for delivery, not for saves
            else:
                requests.end(req_id, carried=bool(carried) and live[req_id] in carried)
        if gone:
            hits.forget_requests(gone)
        block_size = self.config.block_size
        hit_list: list[tuple[ReqId, tuple[int, ...], int]] = []
        for req_id, kind, hit_end, block_ids in starting:
            if kind is PrefixCacheEventKind.RESUMED:
                cursor = requests.resume(req_id, hit_end)
                # DLV-3: only positions not delivered yet are read, from the cursor's block on.
                first = cursor // block_size * block_size
            elif req_id in live:
                continue  # HIT-1: a continuation of a live request opens no hit.
            else:
                requests.admit(req_id, hit_end)
                first = 0
            if hit_end > first:
                hit_list.append(
                    (req_id, block_ids[first // block_size : hit_end // block_size], first)
                )
        effects: list[StartEffect] = [*tombstones]
        # SPEC-4: only an admission still running reads its accepted rows.
        reads_back = [
            (r, slots, first)
            for r, slots, first, entry in catch_up
            if live.get(r) == entry and requests.state_of(r) is RequestState.RUNNING
        ]
        if hit_list or reads_back:
            seen_keys = self._slots.seen_keys()
            hit_keys = [k for k in self.policy.get_hit_keys(seen_keys) if k in seen_keys]
            effects.extend(
                hits.register(hit_list, self._slots, hit_keys, reads_back, prefetch=inp.prefetch)
            )
            self.counters.hit_requests += len(hit_list)
            self.counters.draft_rows_read_back += sum(len(s) for _, s, _ in reads_back)
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
        if self._unusable:
            self._refuse()
        if self._save.pending is not None:
            raise BadInputError(
                what="save_outputs", expected="one save at a time", got="a save in progress"
            )
        rows = check_save_shape(inp, self._slots.num_slots)
        entries = self._requests.check_layout(inp.req_ids)
        self._hits.check_layout(inp.req_ids)
        self._drafts.check_layout(inp.req_ids, entries)
        keys = self._key_sets.check(inp, self.policy)
        check_save_sizes(inp, self.config.staging_capacity_tokens)
        # D3, STEP-5: raise now, while nothing has changed, rather than halfway through the commit.
        self._writes.check_tid_room(inp)
        self._save.begin(PendingSave(inp, entries, rows, keys, self._pages.lowest_free()))

    @property
    def save_page(self) -> int | None:
        """The page the save in progress copies its rows into (PAGE-7), or None.

        Known from the save's begin when a page was free then (the page its `PageClaimed` will
        name), or from its claim; None without a save in progress, or before a page is known.
        """
        save = self._save.pending
        if save is None:
            return None
        return save.page if save.page is not None else save.hint

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
        if self._unusable:
            self._refuse()
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
        if self._unusable:
            self._refuse()
        save, page = self._save.take_ready()
        sv = save.inp
        step_id = self._saved.issue_id()
        self._slots.install((*sv.immediate_keys, *sv.deferred_keys))
        # HIT-6: protect older reads before anything changes the slots they planned on.
        effects: list[CommitEffect] = []
        if sv.num_tokens:
            effects.extend(self._hits.copy_on_write(sv.slots, self._slots))
        step_tid = claim_step(sv, save.charged, step_id, page, self._writes, self._slots, effects)
        self._pages.publish(page, step_id, step_tid)  # PAGE-3: held by the step and its write
        # DLV-1: each request's rows are the positions from its count on; a request that
        # registered a hit here carries the hit rows before them (the reads' planning says).
        bounds = sv.row_bounds
        own, hi = self._requests.on_save(save.entries, save.rows)
        valid = None
        if sv.drafts is not None and any_true(sv.drafts > 0):
            valid = self._drafts.on_save(step_id, save.entries, hi, sv.drafts, bounds, sv.slots)
            self.counters.draft_rows += int(sv.drafts.sum())
        lo = self._hits.plan_step(
            step_id,
            sv,
            save.keys,
            step_tid,
            self._slots,
            self.policy.deferred_keys,
            self._writes.chunks_of,
            own,
        )
        self._saved.add(
            Step(
                step_id,
                page,
                sv.req_ids,
                bounds,
                save.keys,
                step_tid,
                save.entries,
                lo,
                hi,
                valid,
            )
        )
        if step_tid is not None:
            effects.append(
                StepWrite(tid=step_tid, step_id=step_id, page=page, keys=sv.immediate_keys)
            )
        self.counters.steps_saved += 1
        return SavePublished(
            step_id=step_id, effects=tuple(effects), reads=self._hits.reads_of(step_id)
        )

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
        if self._unusable:
            self._refuse()
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
        if inp.computed and step.valid is not step.hi and self._drafts:
            self._report(step, inp.computed)
        if whole:
            entries, lo, hi, valid = step.entries, step.lo, step.hi, step.valid
        else:
            entries, lo, hi, valid = step.select(requested)
        cursors = self._requests.cursor
        cursor = cursors[entries]
        if next(iter(self._saved.by_id)) != step.step_id:
            # Not the oldest unended step: an earlier one may still owe these requests rows.
            self._saved.check_delivery_order(step, requested, entries, cursor, valid, cursors)
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
        # SPEC-1: positions from `valid` on are drafts not confirmed, or rejected: never handed.
        start, end, skip = self._requests.deliver(entries, cursor, lo, valid)
        cut_tail = valid is not hi and any_true(end < hi)
        step.handed = (entries, cursor, end)
        self.counters.steps_consumed += 1
        if reads:
            hit_rows = self._hits.hit_rows_of(step.step_id) if whole else None
            if hit_rows is None:
                sources = np.concatenate([read.plan.source for read in reads])
                hit_rows = np.bincount(sources, minlength=len(SlotSource))
            self.counters.hit_rows += hit_rows
        return ConsumePlan(
            step_id=step.step_id,
            page=step.page,
            keys=step.keys,
            reads=tuple([read.plan for read in reads]),
            discard=False,
            starts=start,
            ends=end,
            skip=skip,
            cut_tail=cut_tail,
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
        self._closed = self._unusable = True

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
            self._slots.commit_write(task.tid, task.slots, task.tombstones)  # SLOT-3
            self._retire(task)
        elif isinstance(inp, WriteFailed):
            task = writes.fail(inp.tid)
            self.counters.writes_failed += 1
            self._slots.forget_write(task.tid, task.slots)
            self._retire(task)
            if self._fatal is None:
                # FAIL-1: rows behind hashes the engine already published are lost for good.
                self._fatal = WriteFailedError(tids=(task.tid,), reason=inp.reason)
                self._unusable = True
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
            self._drafts.snapshot(self._requests.entries_by_request),
            self._hits.snapshot(),
            self._slots.snapshot(),
            self._save.snapshot(),
        )

    def check_invariants(self) -> None:
        """Check every invariant the state must satisfy: each machine's, then those across them.

        Raises:
            InvariantError: One does not hold; this is a bug in the library.
        """

        check_machines(
            depth=self.config.staging_depth,
            pages=self._pages,
            steps=self._saved,
            writes=self._writes,
            slots=self._slots,
            hits=self._hits,
            save=self._save,
            requests=self._requests,
        )
        self._drafts.check_invariants(set(self._requests.entries_by_request.values()))
        if self._fatal is not None and self.counters.writes_failed == 0:
            raise InvariantError("fatal without a failed write")
        if self._unusable != (self._closed or self._fatal is not None):
            raise InvariantError("the unusable flag disagrees with closed and fatal")

    # -----------------------------------------------------------------------------------------
    # Internals: what spans machines.

    def _refuse(self) -> None:
        """FAIL-4, FAIL-1: a closed or failed core refuses every engine input."""
        if self._closed:
            raise ShutDownError()
        if self._fatal is not None:
            raise WriteFailedError(tids=self._fatal.tids, reason=self._fatal.reason)

    def _retire(self, task: Task) -> None:
        """TASK-6: a WRITTEN or FAILED write leaves, and lets go of its page, in one input."""
        page = self._writes.retire(task)
        if page is not None:
            self._pages.let_go(page, HolderKind.TASK, task.tid)  # PAGE-3

    def _confirm(
        self, confirmed: Confirmed, catch_up: list[tuple[ReqId, SlotArray, int, int]]
    ) -> SlotArray:
        """SPEC-2: the engine computed `counts` positions of the requests: accept their drafts
        below them and roll their next positions back. Returns the rejected drafts' slots,
        which the caller marks at once (SPEC-3)."""
        drafts = self._drafts
        entries, counts = confirmed.entries, confirmed.counts
        steps, index, base = drafts.where(entries)
        accepted = counts - base
        self.counters.draft_rows_accepted += int(accepted.sum())
        for s, _ in distinct_counts(steps):
            mine = steps == s
            step = self._saved.get(StepId(s))
            if step is not None and not step.consuming:
                step.valid[index[mine]] = counts[mine]  # its materialize hands them out
                continue
            # SPEC-4: the step handed out its confirmed rows only; the request's next save
            # carries the accepted ones, read back from their slots like a hit.
            owed = mine & (accepted > 0) & (self._requests.cursor[entries] == base)
            for i in np.flatnonzero(owed).tolist():
                e, count = int(entries[i]), int(counts[i])
                slots = drafts.accepted_slots(e, count)
                catch_up.append((confirmed.req_ids[i], slots, int(base[i]), e))
        self._requests.computed[entries] = counts
        return drafts.take(confirmed)

    def _settle_at_end(self, entry: int, tombstones: list[Tombstone]) -> None:
        """SPEC-5: the request ends or is preempted with drafts waiting for their count.

        With a count its step's consume reported, the rows above it are rejected (SPEC-3).
        Without one the cache cannot tell accepted rows from rejected ones: they stay in their
        slots as written. The engine hashes a block only over tokens it accepted, so a later
        hit over them finds accepted rows; a rejected row's slot is written again before any
        block holding it is hashed.
        """
        drafts = self._drafts
        step_id = drafts.step_of(entry)
        if step_id is None:
            return
        step = self._saved.get(step_id)
        settled = drafts.settle_at_end(entry, step is not None and not step.consuming)
        if settled is None:
            return
        accepted, slots = settled
        if accepted < 0:
            self.counters.draft_rows_unconfirmed += len(slots)
            return
        self.counters.draft_rows_accepted += accepted
        self._reject(slots, tombstones)

    def _reject(self, slots: SlotArray, tombstones: list[Tombstone]) -> None:
        """SPEC-3: rows that must never be served: reads planned on them fail, their slots
        become ABSENT and the writes carrying them are tombstoned."""
        if not len(slots):
            return
        self._hits.invalidate(slots, self._slots)
        mark_absent(slots, self._writes, self._slots, tombstones)
        self.counters.draft_rows_rejected += len(slots)

    def _report(self, step: Step, computed: Mapping[ReqId, int]) -> None:
        """SPEC-2: a consume reports computed counts after its step's sampler: they confirm
        the step's drafts for its delivery (the slots roll back at the next start, or at the
        request's end: SPEC-5). Counts of requests without unreported drafts here are ignored.

        Raises:
            BadInputError: A count outside the drafts' range; nothing changes.
        """
        n = len(computed)
        counts = np.fromiter(computed.values(), np.int64, n)
        if tuple(computed) == step.req_ids:
            rows = np.arange(n, dtype=np.int64)
            req_ids = list(step.req_ids)
        else:
            rows = step.rows_of(computed)
            known = rows >= 0
            req_ids = [ReqId(r) for r, k in zip(computed, known.tolist(), strict=True) if k]
            rows, counts = rows[known], counts[known]
        entries = step.entries[rows]
        fresh = self._drafts.check_report(step.step_id, req_ids, entries, counts)
        step.valid[rows[fresh]] = counts[fresh]
        self._drafts.report(entries[fresh], counts[fresh])

    def _end_step(self, step: Step) -> None:
        """D5: a step ends (discarded, consumed, or refused): its page holder and reads go."""
        self._saved.remove(step)
        if self._drafts:
            self._drafts.on_step_end(step.step_id, step.entries)
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
