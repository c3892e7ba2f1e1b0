"""The simulated adapter: `IntPoolDriver` executes the core's effects against integer data.

Every saved row carries a unique value (its *write identity*, see `row_value`), the pool is one
dict ``slot -> value`` per key, pages hold a step's immediate rows, deferred writes keep their
chunks, tombstones are honoured by pool writes, `Preserve` copies pool rows into reads. Its
committer does nothing on its own: the test decides when each write task moves one stage
(`IntPoolDriver.land`) or fails (`IntPoolDriver.fail`), so any interleaving across tasks can be
explored; within one task the stages run in pipeline order (TASK-2). Reports reach the core at
the next public call, as they do from a committer thread (D8).

It checks the core as it goes: a page handed out while a step or a task still holds it, a wait on
a task the committer never received, a read of a slot nobody wrote raise `DriverError`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, assert_never

import attrs
import numpy as np

from omni_cache_core._contract import (
    HIDDEN_KEY,
    ModelCachePolicy,
    PrefixCacheConfig,
    PrefixCacheRequestEvent,
    PrefixCacheStep,
    ReqId,
    StepId,
    TensorName,
    Tid,
)
from omni_cache_core._core import CacheCore
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
from omni_cache_core.testing._interface import Delivered, Rows, SaveSpec

__all__ = ["DriverError", "IntPoolDriver"]

# Committer stages of a simulated task, in pipeline order (TASK-2).
_PENDING, _QUEUED, _COPYING, _HOST_READY, _WRITTEN, _FAILED = (
    "pending",
    "queued",
    "copying",
    "host_ready",
    "written",
    "failed",
)
_NEXT_STAGE = {_QUEUED: _COPYING, _COPYING: _HOST_READY, _HOST_READY: _WRITTEN}
_REACHED = {
    TaskState.HOST_READY: (_HOST_READY, _WRITTEN, _FAILED),
    TaskState.WRITTEN: (_WRITTEN, _FAILED),
}


class DriverError(AssertionError):
    """The simulated adapter caught the core asking for something impossible (a bug)."""


@attrs.define
class _Chunk:
    slots: tuple[int, ...]
    values: dict[TensorName, tuple[int, ...]]


@attrs.define
class _SimTask:
    tid: Tid
    deferred: bool
    stage: str
    step_id: StepId | None = None
    page: int | None = None
    keys: tuple[TensorName, ...] = ()
    chunks: list[_Chunk] = attrs.Factory(list)
    tombstones: dict[TensorName, set[int]] = attrs.Factory(dict)


@attrs.define
class _SimStep:
    step_id: StepId
    page: int
    spec: SaveSpec
    leftover: dict[TensorName, tuple[int, ...]]
    ended: bool = False


class IntPoolDriver:
    """A simulated adapter that runs the core's effects against integer rows.

    Args:
        config: Cache sizes.
        policy: Which keys are cached, and how.
        prefetch: Gather committed rows at `PrefetchRead` and use them at materialize (HIT-7);
            off reads everything at materialize. Results must not differ.
        row_bytes: Device-clone bytes per row and key, charged to the budget (BUDGET-1).
    """

    def __init__(
        self,
        config: PrefixCacheConfig,
        policy: ModelCachePolicy | None = None,
        *,
        prefetch: bool = True,
        row_bytes: int = 1,
    ) -> None:
        self.core = CacheCore(config, policy)
        self.prefetch = prefetch
        self.row_bytes = row_bytes
        self.now_ns = 0
        self.pool: dict[TensorName, dict[int, int]] = {}
        #: Per page: the save attempt (or step id, once committed) that filled it, and its rows.
        self.pages: list[tuple[str, dict[TensorName, tuple[int, ...]]]] = [
            ("free", {}) for _ in range(config.staging_depth)
        ]
        self.tasks: dict[Tid, _SimTask] = {}
        self.steps: dict[StepId, _SimStep] = {}
        self.preserved: dict[int, dict[int, int]] = {}
        self.prefetched: dict[int, dict[int, int]] = {}
        #: Committer reports not yet seen by the core (D8).
        self.outbox: list[Report] = []
        #: Whether the last save fed reports in or escalated tasks (it then left a trace that
        #: is committer progress, not the save's).
        self.save_touched = False
        self.attempts = 0

    # -----------------------------------------------------------------------------------------
    # Queries.

    @property
    def open_step_ids(self) -> tuple[StepId, ...]:
        """Step ids saved and not consumed, as the core reports them."""
        return self.core.open_step_ids

    def snapshot(self) -> Any:
        """The core's canonical state."""
        return self.core.snapshot()

    def sync(self) -> None:
        """Feed the committer's pending reports to the core, as every public call does (D8)."""
        self._drain()

    def in_flight(self) -> tuple[Tid, ...]:
        """Tasks the committer holds and has not finished, by tid."""
        return tuple(
            sorted(
                t.tid for t in self.tasks.values() if t.stage in (_QUEUED, _COPYING, _HOST_READY)
            )
        )

    def check_invariants(self) -> None:
        """Check the core's invariants and that no live step's page was overwritten (PAGE-3)."""
        self.core.check_invariants()
        for step in self.steps.values():
            if not step.ended and self.pages[step.page][0] != f"step {step.step_id}":
                raise DriverError(
                    f"page {step.page} of open step {step.step_id} was refilled by "
                    f"{self.pages[step.page][0]} (PAGE-3)"
                )

    # -----------------------------------------------------------------------------------------
    # Engine calls.

    def register_policy(self, policy: ModelCachePolicy) -> None:
        """Replace the policy (only before the first step)."""
        self._drain()
        self.core.register_policy(policy)

    def start(self, events: Sequence[PrefixCacheRequestEvent]) -> None:
        """Feed one step's lifecycle records and run the effects."""
        self._drain()
        effects = self.core.start_step(
            StartStep(step=PrefixCacheStep(events=tuple(events)), now_ns=self.now_ns)
        )
        self._run(effects, spec=None, step_id=None)

    def save(
        self,
        spec: SaveSpec,
        *,
        stall: bool = False,
        on_page_wait: Callable[[], None] | None = None,
    ) -> StepId:
        """Save one step as an inline adapter does; abort on any failure (STEP-5)."""
        self._drain()
        self.save_touched = False
        self.attempts += 1
        values = spec.value_map()
        policy = self.core.policy
        mm = sorted(k for k in values if k != HIDDEN_KEY)
        immediate = tuple(
            ([HIDDEN_KEY] if HIDDEN_KEY in values else [])
            + [k for k in mm if k not in policy.deferred_keys]
        )
        deferred = tuple(k for k in mm if k in policy.deferred_keys)
        n = spec.num_tokens
        bounds = [0]
        for run in spec.slots:
            bounds.append(bounds[-1] + len(run))
        self.core.save_begin(
            SaveBegin(
                now_ns=self.now_ns,
                req_ids=spec.req_ids,
                row_bounds=np.asarray(bounds, dtype=np.int64),
                slots=np.asarray(spec.flat_slots, dtype=np.int64).reshape(-1),
                num_tokens=n,
                immediate_keys=immediate,
                deferred_keys=deferred,
                immediate_bytes=n * len(immediate) * self.row_bytes,
                deferred_bytes=n * len(deferred) * self.row_bytes,
            )
        )
        relief = on_page_wait
        try:
            while True:
                effect = self.core.save_proceed(SaveProceed(now_ns=self.now_ns))
                match effect:
                    case PageClaimed():
                        break
                    case EscalateTasks():
                        self._escalate(effect.tids)
                    case AwaitTasks() if stall:
                        self.now_ns = max(self.now_ns, effect.deadline_ns)
                    case AwaitTasks():
                        self._work_until(effect.waits)
                        self._drain()
                    case AwaitPage() if relief is not None:
                        callback, relief = relief, None
                        callback()
                    case AwaitPage():
                        # Nobody consumes while an inline save waits: time runs out (PAGE-4).
                        self.now_ns = max(self.now_ns, effect.deadline_ns)
                    case _:
                        assert_never(effect)
            self._fill_page(effect.page, {k: values[k] for k in immediate})
            published = self.core.save_commit(SaveCommit(now_ns=self.now_ns))
        except BaseException:
            self.core.save_abort(SaveAbort())
            raise
        step_id = published.step_id
        self.pages[effect.page] = (f"step {step_id}", self.pages[effect.page][1])
        self.steps[step_id] = _SimStep(
            step_id=step_id,
            page=effect.page,
            spec=spec,
            leftover={k: values[k] for k in deferred},
        )
        self._run(published.effects, spec=spec, step_id=step_id)
        return step_id

    def materialize(self, step_id: StepId, req_ids: Sequence[ReqId]) -> Delivered:
        """Consume a step and assemble its rows from the plan (HIT-3, HIT-5, HIT-6, DLV-2)."""
        self._drain()
        while True:
            try:
                result = self.core.consume_begin(
                    ConsumeBegin(step_id=step_id, req_ids=tuple(req_ids), now_ns=self.now_ns)
                )
            except BaseException:
                self._sync_ended(step_id)
                raise
            if isinstance(result, ConsumePlan):
                break
            self._work_until(result.waits)
            self._drain()
        rows = self._assemble(result, tuple(req_ids))
        self.core.consume_end(ConsumeEnd(step_id=step_id))
        self._sync_ended(step_id)
        return rows

    def discard(self, step_id: StepId) -> None:
        """Consume a step without reading it."""
        self._drain()
        try:
            self.core.consume_begin(ConsumeBegin(step_id=step_id, req_ids=None, now_ns=self.now_ns))
        finally:
            self._sync_ended(step_id)

    def shutdown(self) -> None:
        """Close the cache (FAIL-4)."""
        self._drain()
        self.core.shut_down(ShutDown())

    def advance_clock(self, ns: int) -> None:
        """Let time pass."""
        self.now_ns += ns

    # -----------------------------------------------------------------------------------------
    # The committer, under the test's control.

    def land(self, tid: Tid) -> None:
        """Move one in-flight task one pipeline stage; the last stage writes the pool."""
        task = self.tasks[tid]
        if task.stage not in _NEXT_STAGE:
            raise DriverError(f"task {tid} is {task.stage}, not in flight")
        if task.stage == _QUEUED:
            self.outbox.append(CopyStarted(tid=tid))
        elif task.stage == _COPYING:
            self.outbox.append(CopyLanded(tid=tid))
        else:
            self._write_pool(task)
            self.outbox.append(WriteLanded(tid=tid))
        task.stage = _NEXT_STAGE[task.stage]

    def fail(self, tid: Tid) -> None:
        """Fail an in-flight task (FAIL-1)."""
        task = self.tasks[tid]
        if task.stage not in _NEXT_STAGE:
            raise DriverError(f"task {tid} is {task.stage}, not in flight")
        task.stage = _FAILED
        self.outbox.append(WriteFailed(tid=tid, reason="simulated copy failure"))

    # -----------------------------------------------------------------------------------------
    # Internals.

    def _drain(self) -> None:
        reports, self.outbox = self.outbox, []
        if reports:
            self.save_touched = True
        for report in reports:
            self.core.report(report)

    def _sync_ended(self, step_id: StepId) -> None:
        step = self.steps.get(step_id)
        if step is not None and step_id not in self.core.open_step_ids:
            step.ended = True

    def _escalate(self, tids: Iterable[Tid]) -> None:
        self.save_touched = True
        for tid in tids:
            task = self.tasks.get(tid)
            if task is None:
                raise DriverError(f"escalation of task {tid}, which was never registered")
            if task.stage == _PENDING:
                task.stage = _QUEUED  # TASK-2: a task already copying is left alone

    def _work_until(self, waits: Iterable[tuple[Tid, TaskState]]) -> None:
        for tid, state in waits:
            task = self.tasks.get(tid)
            if task is None or task.stage == _PENDING:
                raise DriverError(f"wait on task {tid}, which the committer never received")
            while task.stage not in _REACHED[state]:
                self.land(tid)

    def _fill_page(self, page: int, rows: dict[TensorName, tuple[int, ...]]) -> None:
        # PAGE-3: the core hands out only pages nobody holds; check it against our own records.
        for step in self.steps.values():
            if not step.ended and step.page == page:
                raise DriverError(f"page {page} handed out while open step {step.step_id} holds it")
        for task in self.tasks.values():
            if task.page == page and task.stage in (_QUEUED, _COPYING, _HOST_READY):
                raise DriverError(f"page {page} handed out while task {task.tid} views it")
        self.pages[page] = (f"save {self.attempts}", rows)

    def _run(
        self, effects: Iterable[Effect], *, spec: SaveSpec | None, step_id: StepId | None
    ) -> None:
        values = spec.value_map() if spec is not None else {}
        slots = spec.flat_slots if spec is not None else ()
        for effect in effects:
            match effect:
                case Tombstone():
                    task = self.tasks.get(effect.tid)
                    if task is None:
                        raise DriverError(f"tombstone for unknown task {effect.tid}")
                    task.tombstones.setdefault(effect.key, set()).update(effect.slots.tolist())
                case Preserve():
                    # HIT-6: the committed row, copied before the new write can land.
                    self._gather(effect.key, effect.positions, effect.slots, effect.read_id, True)
                case PrefetchRead():
                    if self.prefetch:  # HIT-7
                        self._gather(
                            effect.key, effect.positions, effect.slots, effect.read_id, False
                        )
                case EscalateTasks():
                    self._escalate(effect.tids)
                case DeferredChunk():
                    self._append_chunk(effect, slots, values)
                case StepWrite():
                    if effect.step_id != step_id:
                        raise DriverError(f"step write {effect.tid} names step {effect.step_id}")
                    self.tasks[effect.tid] = _SimTask(
                        tid=effect.tid,
                        deferred=False,
                        stage=_QUEUED,
                        step_id=effect.step_id,
                        page=effect.page,
                        keys=effect.keys,
                        chunks=[_Chunk(slots=slots, values={})],
                    )
                case AwaitTasks() | AwaitPage() | PageClaimed() | ConsumePlan() | SavePublished():
                    raise DriverError(f"unexpected effect {effect!r}")
                case _:
                    assert_never(effect)

    def _gather(
        self,
        key: TensorName,
        positions: SlotArray,
        slots: SlotArray,
        read_id: int,
        preserve: bool,
    ) -> None:
        pool = self.pool.get(key, {})
        into = (self.preserved if preserve else self.prefetched).setdefault(read_id, {})
        for pos, slot in zip(positions.tolist(), slots.tolist(), strict=True):
            if slot not in pool:
                raise DriverError(f"read {read_id}: committed slot {slot} ({key}) never written")
            into[pos] = pool[slot]

    def _append_chunk(
        self,
        effect: DeferredChunk,
        slots: tuple[int, ...],
        values: Mapping[TensorName, tuple[int, ...]],
    ) -> None:
        if effect.new_task:
            if effect.tid in self.tasks:
                raise DriverError(f"deferred task {effect.tid} opened twice")
            self.tasks[effect.tid] = _SimTask(tid=effect.tid, deferred=True, stage=_PENDING)
        task = self.tasks[effect.tid]
        if task.stage != _PENDING:
            # D2: only an open (PENDING) deferred write takes chunks.
            raise DriverError(f"chunk appended to task {effect.tid} in stage {task.stage}")
        lo, hi = effect.row_start, effect.row_end
        deferred = self.core.policy.deferred_keys
        task.chunks.append(
            _Chunk(
                slots=slots[lo:hi],
                values={k: v[lo:hi] for k, v in values.items() if k in deferred},
            )
        )

    def _write_pool(self, task: _SimTask) -> None:
        """Write a task's rows to the pool: later rows win (TASK-5), lost slots are skipped."""
        if task.deferred:
            for chunk in task.chunks:
                for key, vals in chunk.values.items():
                    self._scatter(task, key, chunk.slots, vals)
            return
        assert task.page is not None
        owner, rows = self.pages[task.page]
        if owner != f"step {task.step_id}":
            raise DriverError(f"task {task.tid} reads page {task.page} refilled by {owner}")
        for key in task.keys:
            self._scatter(task, key, task.chunks[0].slots, rows[key])

    def _scatter(
        self, task: _SimTask, key: TensorName, slots: Sequence[int], vals: Sequence[int]
    ) -> None:
        lost = task.tombstones.get(key, set())
        pool = self.pool.setdefault(key, {})
        for slot, value in zip(slots, vals, strict=True):
            if slot not in lost:
                pool[slot] = value

    def _step_rows(self, step: _SimStep, key: TensorName) -> tuple[int, ...]:
        if key in step.leftover:
            return step.leftover[key]
        owner, rows = self.pages[step.page]
        if owner != f"step {step.step_id}":
            raise DriverError(f"step {step.step_id} reads page {step.page} refilled by {owner}")
        return rows.get(key, ())

    def _assemble(self, plan: ConsumePlan, req_ids: tuple[ReqId, ...]) -> Delivered:
        step = self.steps[plan.step_id]
        bounds = step.spec.bounds
        if len(plan.starts) != len(req_ids) or len(plan.ends) != len(req_ids):
            raise DriverError(f"step {plan.step_id}: positions for {len(plan.starts)} requests")
        # DLV-2: the rows before each request's first delivered position are cut.
        skips = [0] * len(req_ids) if plan.skip is None else plan.skip.tolist()
        prefix: dict[tuple[TensorName, ReqId], list[int]] = {}
        for read in plan.reads:
            prefix[(read.key, read.req_id)] = self._read_rows(step, read)
        out: Rows = {}
        for key in plan.keys:
            rows = self._step_rows(step, key)
            per: dict[ReqId, tuple[int, ...]] = {}
            for req_id, skip in zip(req_ids, skips, strict=True):
                lo, hi = bounds[req_id]
                per[req_id] = (*prefix.get((key, req_id), ()), *rows[lo:hi])[skip:]
            out[key] = per
        for read in plan.reads:
            self.prefetched.pop(read.read_id, None)
            self.preserved.pop(read.read_id, None)
        positions = {
            req_id: (start, end)
            for req_id, start, end in zip(
                req_ids, plan.starts.tolist(), plan.ends.tolist(), strict=True
            )
        }
        return Delivered(out, positions)

    def _read_rows(self, step: _SimStep, read: ReadPlan) -> list[int]:
        key = read.key
        pool = self.pool.get(key, {})
        kept = self.preserved.get(read.read_id, {})
        gathered = self.prefetched.get(read.read_id, {}) if self.prefetch else {}
        limits = dict(read.chunk_limit)
        out: list[int] = []
        for pos, slot in enumerate(read.slots.tolist()):
            source = SlotSource(int(read.source[pos]))
            if read.preserved[pos]:
                out.append(kept[pos])
            elif source is SlotSource.POOL:
                if pos in gathered:
                    out.append(gathered[pos])
                elif slot in pool:
                    out.append(pool[slot])
                else:
                    raise DriverError(f"read {read.read_id}: slot {slot} ({key}) not in the pool")
            elif source is SlotSource.AFTER_WRITE:
                out.append(pool[slot])
            elif source is SlotSource.ZEROS:
                out.append(0)
            elif source is SlotSource.THIS_STEP:
                out.append(self._step_rows(step, key)[int(read.step_row[pos])])
            else:
                out.append(self._task_row(Tid(int(read.writer[pos])), limits, key, slot))
        return out

    def _task_row(self, tid: Tid, limits: Mapping[Tid, int], key: TensorName, slot: int) -> int:
        task = self.tasks.get(tid)
        if task is None or tid not in limits:
            raise DriverError(f"read from task {tid}, which cannot serve it")
        for chunk in reversed(task.chunks[: limits[tid]]):
            if key in chunk.values and slot in chunk.slots:
                at = len(chunk.slots) - 1 - chunk.slots[::-1].index(slot)
                return chunk.values[key][at]
        raise DriverError(f"task {tid} has no row for slot {slot} ({key})")
