"""The effect interpreter: feed one core input, execute exactly the effects it returns.

Each method is one round trip with the core: `start` (StartStep), `proceed` (SaveProceed, asked
again after every wait), `commit` (SaveCommit) and `consume` (ConsumeBegin, asked again after
every wait). Each dispatches its input's effects with one ``match`` over that input's closed
effect union (`omni_cache_core.StartEffect`, `SaveProceedEffect`, `CommitEffect`,
`ConsumeEffect`) ending in `assert_never`, so an effect nobody handles fails the type check.

Table work runs under the state lock; waits, escalations, prefetch submissions and preserves
run outside it (CONC-1). The interpreter decides no rule: what to wait for, which write to
force out and where each hit row comes from are the core's (SPEC section 11).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import assert_never, cast

import torch

from omni_cache_core import (
    AwaitPage,
    AwaitTasks,
    ConsumeBegin,
    ConsumeEffect,
    ConsumePlan,
    DeferredChunk,
    EscalateTasks,
    OmniPrefixCacheUnmatchError,
    PageClaimed,
    PageTimeoutError,
    PrefetchRead,
    PrefixCacheStep,
    Preserve,
    ReqId,
    SaveCommit,
    SaveProceed,
    SaveProceedEffect,
    StartStep,
    StepId,
    StepWrite,
    Tid,
    Tombstone,
    WaitTimeoutError,
)
from omni_cache_cuda._committer import Chunk, WriteJob
from omni_cache_cuda._log import log
from omni_cache_cuda._state import AdapterState, ReadRecord, StepContext

__all__ = ["EffectInterpreter"]

#: Bytes a hit read (one request, one key) must have to go to the prefetch worker (HIT-7, D34):
#: below it, the hand-off and its future cost the engine thread more than the consume's gather
#: of the read together with the step's other hits.
PREFETCH_MIN_BYTES = 512 << 10

#: NVTX range of each wait, by the name the core gives it.
_WAIT_RANGES = {
    "save barrier": "omni_cache.wait.save_barrier",
    "budget flush": "omni_cache.wait.budget_flush",
    "hit join": "omni_cache.wait.hit_join",
}


class EffectInterpreter:
    """Feeds the core's step, save and consume inputs and executes the effects they return."""

    def __init__(self, state: AdapterState) -> None:
        self._state = state
        #: Hit reads of fewer bytes are gathered by the consume, not prefetched (D34). The
        #: soak and the tests, whose rows are a few bytes wide, set it to 0.
        self.prefetch_min_bytes = PREFETCH_MIN_BYTES

    # -----------------------------------------------------------------------------------------
    # Step start.

    def start(self, step: PrefixCacheStep) -> None:
        """Feed a step's lifecycle records; escalate ended writes and start hit prefetches.

        Escalations are queued on the committer, or run now in inline mode; both outside the
        state lock (TASK-4, CONC-1). Blocks only for inline writes.
        """
        state = self._state
        jobs = state.jobs
        with state.lock:
            state.drain()
            effects = state.core.start_step(
                StartStep(
                    step=step, now_ns=time.monotonic_ns(), prefetch=state.prefetcher is not None
                )
            )
            # The core forgot the previous start's hits; a start never followed by a save
            # leaves its prefetch records behind.
            state.close_records(state.start_reads)
            start_reads: set[int] = set()
            escalate: list[WriteJob] = []
            prefetch: list[tuple[ReadRecord, PrefetchRead]] = []
            for effect in effects:
                match effect:
                    case EscalateTasks():
                        escalate.extend(jobs[tid] for tid in effect.tids if tid in jobs)
                    case PrefetchRead():
                        start_reads.add(effect.read_id)
                        if state.prefetcher is not None and (
                            len(effect.slots) * state.pool.shapes[effect.key].row_bytes
                            >= self.prefetch_min_bytes
                        ):
                            prefetch.append((state.record(effect.read_id), effect))
                    case Tombstone():
                        self._tombstone(effect)
                    case _:
                        assert_never(effect)
            state.start_reads = start_reads
        if escalate:
            state.committer.escalate(escalate)
        for record, read in prefetch:
            assert state.prefetcher is not None
            # Room for the request's rows of this step behind its prefix: a consume that finds
            # the whole prefix prefetched fills the rest and hands the buffer out (one copy).
            tail = step.scheduled_tokens.get(read.req_id, 0)
            future = state.prefetcher.submit(
                self._prefetch_gather, read, state.pool.tensors[read.key], tail
            )
            record.prefetch = (read.positions, future)
            record.prefetch_tail = tail
        if escalate and not state.threaded:
            with state.lock:
                state.drain()

    def _prefetch_gather(
        self, effect: PrefetchRead, pool_rows: torch.Tensor, tail: int = 0
    ) -> torch.Tensor:
        """On the prefetch worker: gather a hit's committed pool rows (HIT-7).

        Returns a buffer of ``len(slots) + tail`` rows whose first rows are the gathered ones;
        the ``tail`` rows are left for the consume to fill.
        """
        self._state.faults.fire("prefetch", effect)
        with self._state.ranges("omni_cache.hit_prefetch"):
            count = len(effect.slots)
            out = self._state.outputs.rows((count + tail, pool_rows.shape[1]), pool_rows.dtype)
            torch.index_select(pool_rows, 0, torch.from_numpy(effect.slots), out=out[:count])
            return out

    # -----------------------------------------------------------------------------------------
    # Save.

    def proceed(self) -> int:
        """Drive the pending save through barrier, budget and page claim; return the page.

        Waits outside the state lock, each at most until the deadline the core gives (DEV-3);
        a budget flush escalates its write outside the lock and asks again (BUDGET-2).

        Raises:
            WaitTimeoutError: The barrier or a budget flush ran out of time (logged first).
            PageTimeoutError: No page freed up in time (PAGE-4, logged first).
        """
        state = self._state
        core = state.core
        waited_since: int | None = None
        while True:
            seen = state.signal.generation
            # A budget flush to run outside the lock: its tids, jobs and the budget it found.
            flush: tuple[tuple[Tid, ...], list[WriteJob], int, int] | None = None
            try:
                with state.lock:
                    state.drain()
                    effect: SaveProceedEffect = core.save_proceed(
                        SaveProceed(now_ns=time.monotonic_ns())
                    )
                    match effect:
                        case PageClaimed():
                            if waited_since is not None:
                                state.page_wait_ns += time.monotonic_ns() - waited_since
                            return effect.page
                        case EscalateTasks():
                            jobs = [state.jobs[t] for t in effect.tids if t in state.jobs]
                            flush = (
                                effect.tids,
                                jobs,
                                core.budget_used,
                                core.counters.budget_flushes,
                            )
                        case AwaitPage():
                            wait_range, deadline_ns = "omni_cache.wait.page", effect.deadline_ns
                            if waited_since is None:
                                waited_since = time.monotonic_ns()
                                state.page_waits += 1
                        case AwaitTasks():
                            wait_range = _WAIT_RANGES.get(effect.what, "omni_cache.wait.other")
                            deadline_ns = effect.deadline_ns
                        case _:
                            assert_never(effect)
            except (WaitTimeoutError, PageTimeoutError) as exc:
                self._log_timeout(exc, None)
                raise
            if flush is not None:
                tids, jobs, budget_used, flushes = flush
                self._log_flush(tids, budget_used, flushes)
                state.committer.escalate(jobs)  # BUDGET-2: a flush, outside the lock
                continue
            with state.ranges(wait_range):
                state.wait_for_signal(seen, deadline_ns)

    def commit(
        self, ctx: StepContext, step_job: WriteJob | None, slots: torch.Tensor
    ) -> tuple[StepId, list[tuple[ReadRecord, Preserve]], list[StepContext]]:
        """Publish the pending save; register its jobs and context from the commit's effects.

        Returns the step id, the preserves to run before the step's write is dispatched
        (HIT-6), and, when the step has a write, the other unconsumed steps whose rows are
        read from the pool (D27), taken under the same lock; the save runs the preserves of
        both outside the state lock (`preserve_rows`, `SavePath`).
        """
        state = self._state
        jobs = state.jobs
        with state.lock:
            state.drain()
            published = state.core.save_commit(SaveCommit(now_ns=time.monotonic_ns()))
            step_id = published.step_id
            preserves: list[tuple[ReadRecord, Preserve]] = []
            for effect in published.effects:
                match effect:
                    case StepWrite():
                        assert step_job is not None
                        step_job.tid = effect.tid
                        jobs[effect.tid] = step_job
                    case DeferredChunk():
                        job = jobs.get(effect.tid)
                        if job is None:
                            job = WriteJob(effect.tid, tuple(ctx.deferred_rows))
                            jobs[effect.tid] = job
                        rows = slice(effect.row_start, effect.row_end)
                        job.chunks.append(
                            Chunk(slots[rows], {k: v[rows] for k, v in ctx.deferred_rows.items()})
                        )
                        job.keys = tuple(dict.fromkeys((*job.keys, *ctx.deferred_rows)))
                        # Events on one stream are ordered: the newest freeze covers every chunk.
                        job.freeze_event = ctx.freeze_event or job.freeze_event
                    case Tombstone():
                        self._tombstone(effect)
                    case Preserve():
                        preserves.append((state.record(effect.read_id), effect))
                    case _:
                        assert_never(effect)
            reads = published.reads
            ctx.read_ids = tuple(read_id for read_id, _ in reads)
            # D4: the save dropped the start's reads it did not plan; their records go too.
            state.close_records(state.start_reads.difference(ctx.read_ids))
            state.start_reads = set()
            ctx.task_jobs = {tid: jobs[tid] for _, tids in reads for tid in tids if tid in jobs}
            others = (
                [other for other in state.open_pooled_steps() if other is not ctx]
                if step_job is not None
                else []
            )
            state.steps[step_id] = ctx
        return step_id, preserves, others

    def _tombstone(self, effect: Tombstone) -> None:
        """SLOT-2, SPEC-3: the write must never put these rows in the pool (under the lock)."""
        tombstoned = self._state.jobs.get(effect.tid)
        if tombstoned is not None:
            tombstoned.add_tombstone(effect.key, torch.from_numpy(effect.slots))

    def preserve_rows(self, record: ReadRecord, effect: Preserve) -> None:
        """Copy pool rows into a read before a newer write overwrites them (HIT-6)."""
        with record.lock:
            if record.closed:
                return  # the read finished gathering before the new write was dispatched
            pool = self._state.pool.tensors[effect.key]
            rows = pool.index_select(0, torch.from_numpy(effect.slots))
            record.preserved.append((effect.positions, rows))

    # -----------------------------------------------------------------------------------------
    # Consume.

    def consume(
        self,
        step_id: StepId,
        wanted: tuple[str, ...] | None,
        computed: Mapping[ReqId, int] | None = None,
    ) -> tuple[ConsumePlan, StepContext, dict[int, ReadRecord]]:
        """Consume a step id: its plan, its context and its reads' records (STEP-1, CONC-3).

        Waits outside the state lock while the immediate writes its hits read are landing
        (HIT-3). A discard's context is dropped at once; a materialize's stays until its
        ConsumeEnd.

        Raises:
            OmniPrefixCacheUnmatchError: The core refused the consume (STEP-2, STEP-4); a
                refused consume of a known step still consumes it.
            WaitTimeoutError: The hit join ran out of time (logged first).
        """
        state = self._state
        core = state.core
        req_ids = cast(tuple[ReqId, ...] | None, wanted)
        while True:
            seen = state.signal.generation
            try:
                with state.lock:
                    state.drain()
                    try:
                        effect: ConsumeEffect = core.consume_begin(
                            ConsumeBegin(
                                step_id=step_id,
                                req_ids=req_ids,
                                now_ns=time.monotonic_ns(),
                                computed=computed,
                            )
                        )
                    except OmniPrefixCacheUnmatchError:
                        if step_id in state.steps and not core.has_step(step_id):
                            state.forget_step(step_id)  # STEP-4: a failed consume still consumes
                            state.signal.bump()
                        raise
                    match effect:
                        case ConsumePlan():
                            if effect.discard:
                                return effect, state.forget_step(step_id), {}
                            # Records stay registered until the consume ends, so a concurrent
                            # save's Preserve lands in the record this consume reads (HIT-6).
                            records = {r.read_id: state.record(r.read_id) for r in effect.reads}
                            return effect, state.steps[step_id], records
                        case AwaitTasks():
                            deadline_ns = effect.deadline_ns
                        case _:
                            assert_never(effect)
            except WaitTimeoutError as exc:
                self._log_timeout(exc, step_id)
                raise
            with state.ranges("omni_cache.wait.hit_join"):
                state.wait_for_signal(seen, deadline_ns)

    # -----------------------------------------------------------------------------------------
    # Log lines of the waits.

    def _log_flush(self, tids: Sequence[Tid], budget_used: int, flushes: int) -> None:
        """Log a budget flush (BUDGET-2), at most one line per interval."""
        state = self._state
        held = state.flush_log.ready()
        if held is None:
            return
        log(
            logging.INFO,
            "budget_flush",
            state.cache_id,
            "budget flush: deferred writes %s forced out early; %d of %d GPU budget bytes in "
            "use; flushes so far: %d (%d since the previous line)",
            list(tids),
            budget_used,
            state.config.gpu_staging_bytes,
            flushes,
            held + 1,
            tids=list(tids),
            budget_bytes_in_use=budget_used,
            budget_flushes=flushes,
        )

    def _log_timeout(
        self, exc: WaitTimeoutError | PageTimeoutError, step_id: StepId | None
    ) -> None:
        """Log a wait that ran out (FAIL-3, PAGE-4) before its error reaches the caller."""
        cache_id = self._state.cache_id
        if isinstance(exc, PageTimeoutError):
            tids = [tid for tid, _ in exc.tasks_in_flight]
            log(
                logging.WARNING,
                "wait_timeout",
                cache_id,
                "save_outputs timed out after %ss waiting for a staging page; open step ids %s "
                "hold pages, writes in flight %s",
                exc.timeout_s,
                list(exc.open_step_ids),
                [f"{tid}:{state}" for tid, state in exc.tasks_in_flight],
                wait="page",
                step_ids=list(exc.open_step_ids),
                tids=tids,
                timeout_s=exc.timeout_s,
            )
            return
        where = "save_outputs" if step_id is None else f"materialize of step {step_id}"
        log(
            logging.WARNING,
            "wait_timeout",
            cache_id,
            "%s timed out after %ss in the %s, waiting for write tid %d (%s)",
            where,
            exc.timeout_s,
            exc.what,
            exc.tid,
            exc.state,
            wait=exc.what,
            step_ids=[] if step_id is None else [step_id],
            tids=[exc.tid],
            timeout_s=exc.timeout_s,
        )
