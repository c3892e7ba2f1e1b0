"""Test support: a simulated adapter over integers, a naive reference model, a stateful machine.

This module ships with the package so that the same stateful machine can drive the pure core
(through `IntPoolDriver`), and later the CPU and CUDA adapters (through a tensor driver), the way
``zarr.testing.stateful`` does. It needs hypothesis (the ``test`` extra); ``import
omni_cache_core`` never imports it.

Pieces
------
- `IntPoolDriver` plays the adapter: it executes the core's effects against integer data. Every
  saved row carries a unique value (its *write identity*, see `row_value`), the pool is one dict
  ``slot -> value`` per key, pages hold a step's immediate rows, deferred writes keep their
  chunks, tombstones are honoured by pool writes, `Preserve` copies pool rows into reads. Its
  committer does nothing on its own: the test decides when each write task moves one stage
  (`land`) or fails (`fail`), so any interleaving across tasks can be explored; within one task
  the stages run in pipeline order (TASK-2). Reports reach the core at the next public call, as
  they do from a committer thread (D8).
- `ReferenceModel` is written differently from the core on purpose: it keeps an append-only
  history of the saves that succeeded and answers every query by replaying that history (the
  newest value of a (slot, key) as of a step's save, explicit absence, HIT-4, HIT-5), plus which
  step ids are open and which error a call must raise. Per admission of a request it keeps its
  next position, its delivery cursor and the positions handed out (LIFE, DLV): which positions a
  materialize hands out, which rows are cut below the cursor, and when one is refused (DLV-5).
- `CacheMachine` is a hypothesis `RuleBasedStateMachine` that drives a driver and the model side
  by side and compares every materialize row by row and position by position.

Driver interface
----------------
A driver is anything with the methods of `CacheDriver`. The machine only talks to it through:

- ``start(events)``: one `new_step_starts` with these lifecycle records (finishes, aborts,
  preemptions, resumes and starts, with or without hits). Raises what the cache raises.
- ``save(spec, *, stall=False, on_page_wait=None) -> StepId``: one `save_outputs` of `SaveSpec`
  (requests in batch order, their slots, one integer per row per emitted key). With
  ``stall=True`` the committer does no work while the save waits, so time runs to the deadline;
  otherwise the awaited tasks are landed. ``on_page_wait`` is called once if the save has to wait
  for a page (another thread consuming a step meanwhile, CONC-3); without it time runs out.
- ``materialize(step_id, req_ids) -> Delivered``: its ``rows``, per key (hidden first when
  cached, then the step's mm keys) and request, are the rows of the positions handed out: hit
  rows then this step's rows, less those below the delivery cursor (DLV-2); zeros read as
  ``0``. Its ``positions`` are each request's ``(start, end)`` (DLV-7).
- ``discard(step_id)``, ``shutdown()``, ``register_policy(policy)``.
- ``in_flight() -> tuple[Tid, ...]``: write tasks the committer holds and has not finished;
  ``land(tid)`` moves one of them one stage (copy started, copy landed, rows in the pool);
  ``fail(tid)`` fails it (FAIL-1).
- ``advance_clock(ns)``, ``snapshot()``, ``check_invariants()`` (the core's and the driver's own),
  ``open_step_ids``, ``sync()`` (feed pending committer reports in) and ``save_touched`` (the
  last save fed reports in or escalated tasks: committer progress, not a trace of the save).

A driver that cannot pause its committer may land work as soon as it is queued; the machine then
explores fewer interleavings but every check still holds.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar, NamedTuple, Protocol, TypeAlias, assert_never

import attrs
import numpy as np

from omni_cache_core._contract import (
    HIDDEN_KEY,
    ModelCachePolicy,
    PrefixCacheConfig,
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
    PrefixCacheStep,
    ReqId,
    StepId,
    TensorName,
    Tid,
)
from omni_cache_core._core import CacheCore
from omni_cache_core._errors import (
    BadInputError,
    DeliveryOrderError,
    HitUnreadableError,
    LifecycleError,
    OversizeStepError,
    PageTimeoutError,
    ShutDownError,
    StepAlreadyConsumedError,
    UnknownStepError,
    WaitTimeoutError,
    WriteFailedError,
)
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

try:
    from hypothesis import seed, settings
    from hypothesis import strategies as st
    from hypothesis.stateful import (
        Bundle,
        RuleBasedStateMachine,
        consumes,
        get_state_machine_test,
        initialize,
        invariant,
        multiple,
        precondition,
        rule,
    )
except ImportError as exc:  # pragma: no cover - only without the test extra
    raise ImportError(
        "omni_cache_core.testing needs hypothesis: pip install 'omni-cache[test]'"
    ) from exc

__all__ = [
    "DEFERRED_KEY",
    "MM_KEY",
    "CacheDriver",
    "CacheMachine",
    "Delivered",
    "DriverError",
    "IntPoolDriver",
    "ModelMismatch",
    "ReferenceModel",
    "Rows",
    "SaveSpec",
    "reach_every_case",
    "row_value",
]

#: An immediate mm key (copied at save).
MM_KEY = TensorName("talker.h")
#: A deferred mm key (copied at finish, abort or budget flush).
DEFERRED_KEY = TensorName("codes.audio")

#: Per key (hidden first when cached, then mm keys sorted), per request: the row values.
Rows: TypeAlias = dict[TensorName, dict[ReqId, tuple[int, ...]]]


class Delivered(NamedTuple):
    """What one materialize handed out.

    Attributes:
        rows: Per key, per request, the rows of the positions handed out, in position order.
        positions: Per request, the ``(start, end)`` of those positions (DLV-7).
    """

    rows: Rows
    positions: dict[ReqId, tuple[int, int]]


_KEY_CODE: dict[TensorName, int] = {HIDDEN_KEY: 1, MM_KEY: 2, DEFERRED_KEY: 3}


def row_value(attempt: int, row: int, key: TensorName) -> int:
    """The write identity of one saved row: save attempt, row in the step, and key.

    Never 0, so a zero read back always means "zeros" (HIT-3), never a real row.
    """
    return attempt * 1000 + row * 10 + _KEY_CODE.get(key, 9)


@attrs.frozen(kw_only=True)
class SaveSpec:
    """One save as the engine lays it out.

    Attributes:
        req_ids: Requests in batch order.
        slots: Per request, the KV slot of each of its rows in this step.
        values: ``(key, row values)`` per key the step emits; one value per step row.
    """

    req_ids: tuple[ReqId, ...]
    slots: tuple[tuple[int, ...], ...]
    values: tuple[tuple[TensorName, tuple[int, ...]], ...] = ()

    @property
    def num_tokens(self) -> int:
        """Rows of the step."""
        return sum(len(s) for s in self.slots)

    @property
    def flat_slots(self) -> tuple[int, ...]:
        """Every row's slot, in batch order."""
        return tuple(slot for run in self.slots for slot in run)

    @property
    def bounds(self) -> dict[ReqId, tuple[int, int]]:
        """Row range ``[start, end)`` of each request."""
        out: dict[ReqId, tuple[int, int]] = {}
        start = 0
        for req_id, run in zip(self.req_ids, self.slots, strict=True):
            out[req_id] = (start, start + len(run))
            start += len(run)
        return out

    def value_map(self) -> dict[TensorName, tuple[int, ...]]:
        """The emitted keys and their row values."""
        return dict(self.values)


class CacheDriver(Protocol):
    """What `CacheMachine` needs from the system under test (see the module docstring)."""

    now_ns: int
    save_touched: bool

    @property
    def open_step_ids(self) -> tuple[StepId, ...]: ...

    def sync(self) -> None: ...

    def start(self, events: Sequence[PrefixCacheRequestEvent]) -> None: ...

    def save(
        self,
        spec: SaveSpec,
        *,
        stall: bool = False,
        on_page_wait: Callable[[], None] | None = None,
    ) -> StepId: ...

    def materialize(self, step_id: StepId, req_ids: Sequence[ReqId]) -> Delivered: ...

    def discard(self, step_id: StepId) -> None: ...

    def register_policy(self, policy: ModelCachePolicy) -> None: ...

    def shutdown(self) -> None: ...

    def in_flight(self) -> tuple[Tid, ...]: ...

    def land(self, tid: Tid) -> None: ...

    def fail(self, tid: Tid) -> None: ...

    def advance_clock(self, ns: int) -> None: ...

    def snapshot(self) -> Any: ...

    def check_invariants(self) -> None: ...


# ---------------------------------------------------------------------------------------------
# The simulated adapter.

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


# ---------------------------------------------------------------------------------------------
# The reference model.

#: An outcome the model allows: an error class, or None for success.
Outcome: TypeAlias = type[BaseException] | None


class ModelMismatch(AssertionError):
    """The system under test and the reference model disagree."""


@attrs.define
class _Admission:
    """One admission of a request id, from STARTED until FINISHED or ABORTED (LIFE-1)."""

    number: int
    req_id: ReqId
    #: The position the request's next row takes (DLV-1).
    computed: int
    #: The delivery cursor (DLV-2): no position below it is handed out again.
    cursor: int = 0
    preempted: bool = False
    ended: bool = False


@attrs.define
class _Carried:
    """What a step carries for one request: positions ``[lo, hi)``, its own rows from `own`."""

    admission: int
    lo: int
    own: int
    hi: int
    #: Whether its hit rows come from a RESUMED record (DLV-3).
    resumed: bool = False


@attrs.define
class _Saved:
    step_id: StepId
    spec: SaveSpec
    out_keys: tuple[TensorName, ...]
    hits: dict[ReqId, tuple[int, ...]]
    carried: dict[ReqId, _Carried]


#: A DLV-5 refusal the model allows: ``(request, earlier step, positions it owes)``.
Refusal: TypeAlias = tuple[ReqId, StepId, tuple[int, int]]


class ReferenceModel:
    """A deliberately naive model of what the cache must answer.

    It does not track slots, owners, versions, tasks, pages or budget. It keeps the saves that
    succeeded, in order, and answers a read of a (slot, key) by walking that history backwards
    from the consuming step's save: the last save whose layout holds the slot decides, with its
    last row for that slot (TASK-5); a save that held the slot but did not emit the key means
    explicit absence (SLOT-4). Absent or never written reads as 0 for mm keys and makes a hidden
    hit unreadable (HIT-3, HIT-4). The consuming step's own rows count (HIT-5), later saves do not
    (HIT-6: a delayed read never sees a newer tenant).

    Requests and delivery (SPEC section 12) are kept per admission: its next position, its
    delivery cursor, running or preempted (LIFE-1..4). A step carries, per request, the positions
    of its hit rows (from the block of the cursor on, for a resume: DLV-3) and of its own rows
    (DLV-1); a materialize hands out those at or above the cursor (DLV-2), a discard hands out
    nothing (DLV-4), and a materialize that would move a request's cursor while an earlier open
    step of the admission still owes it rows is refused (DLV-5: rows come out in save order).
    Every delivered row is the newest write, as of the step's save, of the slot that holds its
    position (DLV-6). `delivered` records the positions the system under test reported per
    admission, so that a position handed out twice shows (DLV-2, DLV-7).

    Args:
        config: The cache's sizes.
        policy: The cache's policy.
    """

    def __init__(self, config: PrefixCacheConfig, policy: ModelCachePolicy) -> None:
        self.config = config
        self.policy = policy
        self.history: list[_Saved] = []
        self.consumed: set[StepId] = set()
        #: Live requests: running or preempted (LIFE-1).
        self.live: set[ReqId] = set()
        self.preempted: set[ReqId] = set()
        #: Every admission so far, by number, and the live requests' current ones.
        self.admissions: list[_Admission] = []
        self.admission_of: dict[ReqId, _Admission] = {}
        #: Hits registered by the last start, served by the next save that succeeds: their slots
        #: and their first position (0, or a resume's cursor block: DLV-3).
        self.hits: dict[ReqId, tuple[int, ...]] = {}
        self.hit_lo: dict[ReqId, int] = {}
        self.resumed_hits: set[ReqId] = set()
        #: Live requests whose hit no save served: unsaveable until they end (D10).
        self.lost: set[ReqId] = set()
        #: Per admission: the positions the system under test handed out (DLV-2).
        self.delivered: dict[int, set[int]] = {}
        #: Per admission: positions carried by steps that were discarded (DLV-4).
        self.discarded: dict[int, set[int]] = {}
        #: The refusals the last `consume` allowed (DLV-5).
        self.refusals: frozenset[Refusal] = frozenset()
        #: What the last `consume` showed, for the machine's coverage counts.
        self.shown: list[str] = []
        self.closed = False
        self.failed = False
        self.started = False

    # -----------------------------------------------------------------------------------------
    # Queries.

    @property
    def next_step_id(self) -> StepId:
        """The id the next successful save returns (STEP-1: from 1, one per save)."""
        return StepId(len(self.history) + 1)

    @property
    def running(self) -> set[ReqId]:
        """Live requests that are not preempted."""
        return self.live - self.preempted

    def open_step_ids(self) -> tuple[StepId, ...]:
        """Saved, not yet consumed step ids (STEP-1)."""
        return tuple(s.step_id for s in self.history if s.step_id not in self.consumed)

    def saved(self, step_id: StepId) -> _Saved:
        """The record of a saved step."""
        return self.history[step_id - 1]

    def _refusal(self) -> Outcome:
        # FAIL-4 wins over FAIL-1: a closed cache says so first.
        if self.closed:
            return ShutDownError
        if self.failed:
            return WriteFailedError
        return None

    def newest(self, key: TensorName, slot: int, upto: StepId) -> int | None:
        """The newest value of (slot, key) as of step `upto`'s save, or None (absent, unknown)."""
        for saved in reversed(self.history[:upto]):
            flat = saved.spec.flat_slots
            if slot in flat:
                row = len(flat) - 1 - flat[::-1].index(slot)
                values = saved.spec.value_map().get(key)
                return None if values is None else values[row]
        return None

    def writer_of(self, slot: int, upto: StepId | None = None) -> tuple[int, int] | None:
        """``(admission, position)`` of the newest row in `slot` as of step `upto`'s save."""
        for saved in reversed(self.history[: len(self.history) if upto is None else upto]):
            flat = saved.spec.flat_slots
            if slot in flat:
                row = len(flat) - 1 - flat[::-1].index(slot)
                for req_id, (lo, hi) in saved.spec.bounds.items():
                    if lo <= row < hi:
                        carried = saved.carried[req_id]
                        return carried.admission, carried.own + row - lo
        return None

    def owed_by_earlier(self, step_id: StepId, req_ids: Sequence[ReqId]) -> frozenset[Refusal]:
        """The DLV-5 refusals a materialize of these requests allows; empty if it is in order.

        Per admission, rows come out in save order: a materialize that would move a request's
        cursor (hand it rows, or pass over positions below its rows: DLV-4) is held back while
        an earlier open step of the same admission still owes it rows (carries positions at or
        above the cursor). Each refusal names the earlier step and the positions it owes.
        """
        saved = self.saved(step_id)
        out: set[Refusal] = set()
        for req_id in req_ids:
            carried = saved.carried[req_id]
            cursor = self.admissions[carried.admission].cursor
            if carried.hi <= cursor:
                continue  # every position below the cursor: it moves nothing, never refused
            for earlier in self.history[: step_id - 1]:
                other = earlier.carried.get(req_id)
                if (
                    earlier.step_id not in self.consumed
                    and other is not None
                    and other.admission == carried.admission
                    and other.hi > max(other.lo, cursor)
                ):
                    out.add((req_id, earlier.step_id, (max(other.lo, cursor), other.hi)))
        return frozenset(out)

    # -----------------------------------------------------------------------------------------
    # Engine calls: each returns what must happen and applies it when it succeeds.

    def start(self, events: Sequence[PrefixCacheRequestEvent]) -> Outcome:
        """A `new_step_starts`: the error it must raise, else None (applied)."""
        refusal = self._refusal()
        if refusal is not None:
            return refusal
        bs = self.config.block_size
        seen: set[str] = set()
        ending: list[PrefixCacheRequestEvent] = []
        starting: list[PrefixCacheRequestEvent] = []
        for event in events:
            if event.kind not in (PrefixCacheEventKind.STARTED, PrefixCacheEventKind.RESUMED):
                ending.append(event)
                continue
            starting.append(event)
            if event.req_id in seen:
                return BadInputError  # one STARTED or RESUMED record per request and step
            seen.add(event.req_id)
            if event.hit_end:
                blocks = event.block_ids
                wanted = event.hit_end // bs
                # HIT-1, LIFE-4: aligned, with blocks, enough of them, each in range.
                if (
                    not blocks
                    or event.hit_end % bs
                    or wanted > len(blocks)
                    or not all(0 <= b < self.config.num_blocks for b in blocks[:wanted])
                ):
                    return BadInputError
        # LIFE-2: ends and preemptions first, in order, then starts and resumes.
        state: dict[str, str] = {}

        def state_of(req_id: str) -> str:
            if req_id in state:
                return state[req_id]
            if req_id in self.preempted:
                return "preempted"
            return "running" if req_id in self.live else "not live"

        for event in ending:
            if event.kind is PrefixCacheEventKind.PREEMPTED:
                if state_of(event.req_id) != "running":
                    return LifecycleError
                state[event.req_id] = "preempted"
            else:
                state[event.req_id] = "not live"  # FINISHED, ABORTED: any state, even unknown
        for event in starting:
            now = state_of(event.req_id)
            if (event.kind is PrefixCacheEventKind.RESUMED) != (now == "preempted"):
                return LifecycleError  # RESUMED only of a preempted request, STARTED never
        self.started = True
        # D10: a hit that the next save did not serve is lost for good.
        self.lost |= set(self.hits)
        for event in ending:
            req_id = ReqId(event.req_id)
            if req_id not in self.live:
                continue
            self.lost.discard(req_id)
            admission = self.admission_of[req_id]
            if event.kind is PrefixCacheEventKind.PREEMPTED:
                self.preempted.add(req_id)  # LIFE-3: live for delivery, not for saves
                admission.preempted = True
            else:
                self.live.discard(req_id)
                self.preempted.discard(req_id)
                del self.admission_of[req_id]
                admission.ended = True
        self.hits, self.hit_lo, self.resumed_hits = {}, {}, set()
        for event in starting:
            req_id = ReqId(event.req_id)
            if event.kind is PrefixCacheEventKind.RESUMED:
                self.preempted.discard(req_id)
                admission = self.admission_of[req_id]
                admission.preempted = False
                admission.computed = event.hit_end  # LIFE-4: positions restart at hit_end
                # DLV-3: only the blocks from the cursor's on are read again.
                first = admission.cursor // bs * bs
            elif req_id in self.live:
                continue  # HIT-1: a continuation opens no hit
            else:
                admission = _Admission(
                    number=len(self.admissions), req_id=req_id, computed=event.hit_end
                )
                self.admissions.append(admission)
                self.admission_of[req_id] = admission
                self.live.add(req_id)
                first = 0
            if event.hit_end > first:
                blocks = event.block_ids[first // bs : event.hit_end // bs]
                self.hits[req_id] = tuple(b * bs + o for b in blocks for o in range(bs))
                self.hit_lo[req_id] = first
                if event.kind is PrefixCacheEventKind.RESUMED:
                    self.resumed_hits.add(req_id)
        return None

    def save_outcomes(
        self, spec: SaveSpec, *, stall: bool = False, relief: bool = False
    ) -> frozenset[Outcome]:
        """The outcomes a `save_outputs` may have.

        Args:
            spec: The save.
            stall: The committer does no work while the save waits: a wait may time out.
            relief: A step is consumed while the save waits for a page.
        """
        refusal = self._refusal()
        if refusal is not None:
            return frozenset({refusal})
        n = spec.num_tokens
        keys = set(spec.value_map())
        caches_hidden = self.policy.needs_full_hidden_states
        if (
            any(not 0 <= s < self.config.num_slots for s in spec.flat_slots)
            or len(set(spec.req_ids)) != len(spec.req_ids)
            or not set(spec.req_ids) <= self.live  # D9
            or bool(set(spec.req_ids) & self.preempted)  # LIFE-3: its blocks are gone
            or bool(set(spec.req_ids) & self.lost)  # D10: its rows would miss their prefix
            or not set(self.hits) <= set(spec.req_ids)  # D10: a hit must never vanish
            or (HIDDEN_KEY in keys) != (caches_hidden and n > 0)
            or (n == 0 and keys)
        ):
            return frozenset({BadInputError})
        immediate = {k for k in keys if k not in self.policy.deferred_keys}
        if immediate and n > self.config.staging_capacity_tokens:
            return frozenset({OversizeStepError})  # PAGE-5
        # PAGE-2: every open step holds a page; nobody consumes while an inline save waits.
        full = len(self.open_step_ids()) >= self.config.staging_depth and not relief
        last: Outcome = PageTimeoutError if full else None
        if stall or self.config.staging_claim_timeout_s == 0:
            # TASK-3, BUDGET-2: with the committer stalled, or a zero bound that never waits
            # (PAGE-4), a wait on unfinished writes may run out first.
            return frozenset({WaitTimeoutError, last})
        return frozenset({last})

    def save(self, spec: SaveSpec) -> StepId:
        """Record a save that succeeded; return its step id."""
        step_id = self.next_step_id
        mm = sorted(k for k in spec.value_map() if k != HIDDEN_KEY)
        out_keys = ((HIDDEN_KEY,) if self.policy.needs_full_hidden_states else ()) + tuple(mm)
        carried: dict[ReqId, _Carried] = {}
        for req_id, run in zip(spec.req_ids, spec.slots, strict=True):
            # DLV-1: the request's rows take the next positions; a hit registered for this save
            # carries its rows first, from its first position on.
            admission = self.admission_of[req_id]
            own = admission.computed
            admission.computed = own + len(run)
            lo = self.hit_lo.get(req_id, own)
            if req_id in self.hits and own - lo != len(self.hits[req_id]):
                raise ModelMismatch(f"the model's hit of {req_id} does not end at its positions")
            carried[req_id] = _Carried(
                admission.number, lo, own, own + len(run), req_id in self.resumed_hits
            )
        hits = dict(self.hits)
        self.history.append(
            _Saved(step_id=step_id, spec=spec, out_keys=out_keys, hits=hits, carried=carried)
        )
        self.hits, self.hit_lo, self.resumed_hits = {}, {}, set()
        return step_id

    def consume(
        self, step_id: StepId, req_ids: Sequence[ReqId] | None
    ) -> tuple[Outcome, Delivered | None]:
        """A `materialize` (``req_ids``) or `discard_step` (None): the error or what it hands out.

        On a DLV-5 refusal `refusals` holds the ``(request, earlier step, positions it owes)``
        the error may name, and the step stays open.
        """
        self.refusals = frozenset()
        self.shown = []
        refusal = self._refusal()
        if refusal is not None:
            return refusal, None
        if not 0 < step_id <= len(self.history):
            return UnknownStepError, None  # STEP-2
        if step_id in self.consumed:
            return StepAlreadyConsumedError, None  # STEP-1, STEP-2
        saved = self.saved(step_id)
        if req_ids is None:
            self.consumed.add(step_id)
            # DLV-4: a discard is not delivery; the cursors stay where they are.
            for carried in saved.carried.values():
                self.discarded.setdefault(carried.admission, set()).update(
                    range(carried.lo, carried.hi)
                )
            return None, None
        if not set(req_ids) <= set(saved.spec.req_ids):
            self.consumed.add(step_id)
            return BadInputError, None  # STEP-4: and the step counts as consumed
        self.refusals = self.owed_by_earlier(step_id, req_ids)
        if self.refusals:
            return DeliveryOrderError, None  # DLV-5: nothing changes, the step stays open
        self.consumed.add(step_id)
        bounds = saved.spec.bounds
        values = saved.spec.value_map()
        rows: Rows = {}
        positions: dict[ReqId, tuple[int, int]] = {}
        for req_id in req_ids:
            carried = saved.carried[req_id]
            admission = self.admissions[carried.admission]
            start = max(carried.lo, admission.cursor)
            positions[req_id] = (start, max(carried.hi, start))
        for key in saved.out_keys:
            per: dict[ReqId, tuple[int, ...]] = {}
            for req_id in req_ids:
                prefix: list[int] = []
                for slot in saved.hits.get(req_id, ()):
                    value = self.newest(key, slot, step_id)
                    if value is None and key == HIDDEN_KEY:
                        return HitUnreadableError, None  # HIT-4: never a miss
                    prefix.append(0 if value is None else value)
                lo, hi = bounds[req_id]
                skip = positions[req_id][0] - saved.carried[req_id].lo
                per[req_id] = (*prefix, *values.get(key, ())[lo:hi])[skip:]
            rows[key] = per
        for req_id in req_ids:
            self._note_delivery(saved, req_id, positions[req_id])
        return None, Delivered(rows, positions)

    def _note_delivery(self, saved: _Saved, req_id: ReqId, delivered: tuple[int, int]) -> None:
        """Move the cursor (DLV-2) and note what the delivery showed (for coverage counts)."""
        carried = saved.carried[req_id]
        admission = self.admissions[carried.admission]
        start = delivered[0]
        if start > carried.lo:
            self.shown.append("rows cut below the cursor")
        if carried.lo > admission.cursor:
            self.shown.append("gap passed over")
        if admission.preempted:
            self.shown.append("late materialize of a preempted request")
        if admission.ended:
            self.shown.append("late materialize of an ended admission")
        # Hit rows of a resume that serve the request's own earlier rows (blocks that stayed
        # cached), and positions a discard left behind that a resume hit serves (DLV-4).
        hit_end = carried.own
        if carried.resumed and start < hit_end:
            self.shown.append("resume hit delivered")
            slots = saved.hits.get(req_id, ())
            own = [
                p
                for p in range(start, hit_end)
                if self.writer_of(slots[p - carried.lo], saved.step_id) == (carried.admission, p)
            ]
            if own:
                self.shown.append("resume hit serves the request's own rows")
            if set(range(start, hit_end)) & self.discarded.get(carried.admission, set()):
                self.shown.append("discarded positions served by a resume hit")
        admission.cursor = max(admission.cursor, carried.hi)

    def check_delivery(self, step_id: StepId, got: Delivered) -> None:
        """Check what a materialize handed out, before comparing it with the model's answer.

        Each request's positions are a range, every key has one row per position (in position
        order: DLV-7), and no position of an admission is handed out twice (DLV-2).

        Raises:
            ModelMismatch: One of these does not hold.
        """
        saved = self.saved(step_id)
        for req_id, (start, end) in got.positions.items():
            carried = saved.carried.get(req_id)
            if carried is None or not start <= end:
                raise ModelMismatch(f"step {step_id}: positions {start, end} for {req_id}")
            for key, per in got.rows.items():
                count = len(per.get(req_id, ()))
                if count != end - start:
                    raise ModelMismatch(
                        f"step {step_id}: {count} {key} rows for {req_id}, whose positions are "
                        f"[{start}, {end}) (DLV-7)"
                    )
            seen = self.delivered.setdefault(carried.admission, set())
            again = seen.intersection(range(start, end))
            if again:
                raise ModelMismatch(
                    f"step {step_id}: positions {sorted(again)} of {req_id} (admission "
                    f"{carried.admission}) handed out again (DLV-2)"
                )
            seen.update(range(start, end))


# ---------------------------------------------------------------------------------------------
# The stateful machine.

#: Request ids the machine uses; a finished id may start again (HIT-2).
REQS: tuple[ReqId, ...] = tuple(ReqId(f"r{i}") for i in range(4))
OUTSIDER = ReqId("outsider")


#: Lifecycle records LIFE-2 refuses, tried on purpose by the `misuse` rule.
_LIFECYCLE_MISUSE = (
    "resume a running request",
    "preempt twice",
    "preempt after the end",
    "start a preempted request",
    "start and resume in one step",
)


def _describe(outcomes: Iterable[Outcome]) -> str:
    return " or ".join(sorted("success" if o is None else o.__name__ for o in outcomes))


def _diff(got: Rows, want: Rows) -> str:
    lines = []
    for key in sorted(set(got) | set(want)):
        g, w = got.get(key), want.get(key)
        if g != w:
            lines.append(f"  {key}: got {g}, model {w}")
    return "\n".join(lines)


class CacheMachine(RuleBasedStateMachine):
    """Drive a cache through a driver and the reference model side by side.

    Each run draws a policy (hidden cached or not), 2 or 3 pages, a budget (roomy, or small
    enough that saves flush deferred writes), prefetch on or off, a wait bound of 1 s or 0,
    whether committer failures may happen, whether reads are late, and whether the engine
    preempts. The KV cache has 4 blocks of 2 slots; up to 4 request ids start, finish, abort and
    start again; with preemption, running requests are preempted (their blocks go back to the
    pool), and preempted ones finish, abort or resume with a new block list and a hit that ends
    nowhere, below, at or above the delivery cursor, over the blocks that still hold their rows,
    or beyond what they computed (LIFE-1..4, DLV-3).

    Rules: `engine` (a step start or the save after it, with background committer work and
    sometimes a catch-up consume), `save_while_a_step_is_consumed`, `consume`, `misuse` (every
    error path, illegal lifecycle records included), `committer` (one stage, all of it, a
    failure, or time passing) and a late `shut_down`. Every outcome is checked against
    `ReferenceModel`: each materialize's positions and rows (each position once per admission,
    DLV-2, DLV-7), and its DLV-5 refusals, which must change nothing, after which the output
    builder consumes something else. The invariant checks the core's invariants, the driver's
    page ownership and the open step ids. `coverage` counts the lifecycle and delivery cases
    runs reach.

    Subclasses set `driver_factory` to run the same rules against another driver.
    """

    #: Builds the system under test: ``(config, policy, prefetch) -> driver``.
    driver_factory: ClassVar[Callable[[PrefixCacheConfig, ModelCachePolicy, bool], CacheDriver]]
    driver_factory = staticmethod(
        lambda config, policy, prefetch: IntPoolDriver(config, policy, prefetch=prefetch)
    )
    num_blocks: ClassVar[int] = 4
    block_size: ClassVar[int] = 2
    #: Rules run before a shutdown may happen (it ends the useful part of a run).
    shutdown_after: ClassVar[int] = 55
    #: Rules run before a committer failure may happen (it is sticky, FAIL-1).
    fail_after: ClassVar[int] = 40
    #: Runs spend every rule on slots and writes: no preemption, and reads always late (what
    #: HIT-6 needs); the controls of those rules use it. Otherwise each run draws both.
    slots_only: ClassVar[bool] = False
    #: What runs reached, counted across runs (lifecycle and delivery cases); a subclass that
    #: wants its own counts sets its own Counter.
    coverage: ClassVar[Counter[str]] = Counter()

    steps = Bundle("steps")

    def __init__(self) -> None:
        super().__init__()
        self.driver: CacheDriver | None = None
        self.model = ReferenceModel(
            PrefixCacheConfig(num_blocks=1, block_size=1), ModelCachePolicy()
        )
        self.phase = "start"
        #: Per live request: its block ids and how many of them its hit covered.
        self.blocks: dict[ReqId, tuple[tuple[int, ...], int]] = {}
        #: The engine's view of each live request's KV: position -> (slot, the row that was
        #: there when the request's KV got there: ``(admission, position)`` of its writer).
        self.kv: dict[ReqId, dict[int, tuple[int, tuple[int, int] | None]]] = {}
        self.attempt = 0
        self.rules_run = 0
        #: Slots some successful save wrote.
        self.written_slots: set[int] = set()
        self.allow_failures = False
        self.late_reads = False
        self.preemption = False

    # -----------------------------------------------------------------------------------------
    # Helpers.

    @property
    def sut(self) -> CacheDriver:
        assert self.driver is not None
        return self.driver

    def _usable(self) -> bool:
        return self.driver is not None and not (self.model.closed or self.model.failed)

    def _expect(self, outcomes: Iterable[Outcome], what: str, call: Callable[[], Any]) -> Any:
        """Run `call`; its outcome must be one of `outcomes` (exact error classes)."""
        allowed = frozenset(outcomes)
        try:
            result = call()
        except Exception as exc:
            if type(exc) not in allowed:
                raise ModelMismatch(
                    f"{what}: raised {type(exc).__name__} ({exc}); model: {_describe(allowed)}"
                ) from exc
            return exc
        if None not in allowed:
            raise ModelMismatch(f"{what}: succeeded; model: {_describe(allowed)}")
        return result

    def _quiet_snapshot(self) -> Any:
        """The state after pending committer reports are in (so they are not a trace)."""
        self.sut.sync()
        return self.sut.snapshot()

    def _unchanged(self, before: Any, what: str) -> None:
        if self.sut.snapshot() != before:
            raise ModelMismatch(f"{what} raised but changed the cache's state")

    def _may_consume(self) -> bool:
        """Whether a step may be consumed now: reads are often late (HIT-6).

        A lone open step is consumed on every other rule only; with late reads, a step is
        consumed only once every page is taken (an output builder that lags behind).
        """
        open_count = len(self.model.open_step_ids())
        if open_count >= self.model.config.staging_depth:
            return True
        return not self.late_reads and (self.rules_run % 2 == 0 or open_count >= 2)

    def _hit_blocks(self, req_id: ReqId) -> tuple[int, ...]:
        """The blocks a live request's start hit."""
        blocks, hit_blocks = self.blocks.get(req_id, ((), 0))
        return blocks[:hit_blocks]

    def _own_offset(self, req_id: ReqId) -> int:
        """How many rows the request computed since its hit: its next own slot's index."""
        _, hit_blocks = self.blocks.get(req_id, ((), 0))
        return self.model.admission_of[req_id].computed - hit_blocks * self.block_size

    def _cached_prefix(self, req_id: ReqId) -> list[int]:
        """Blocks that still hold the request's first positions, in order.

        Block ``k`` of the result holds positions ``[k * block_size, (k + 1) * block_size)``
        at its offsets, and no save rewrote those slots since the request's KV got there (its
        own rows, or the rows its hit read): what an engine's prefix cache still has after a
        preemption.
        """
        bs = self.block_size
        kv = self.kv.get(req_id, {})
        out: list[int] = []
        for k in range(self.num_blocks):
            held = [kv.get(k * bs + o) for o in range(bs)]
            first = held[0]
            block = -1 if first is None else first[0] // bs
            if any(
                h is None or h[0] != block * bs + o or self.model.writer_of(h[0]) != h[1]
                for o, h in enumerate(held)
            ):
                break
            out.append(block)
        return out

    def _note_kv(self, req_id: ReqId, positions: Iterable[tuple[int, int]]) -> None:
        """The request's KV of these ``(position, slot)`` is now there (a hit or a save)."""
        kv = self.kv.setdefault(req_id, {})
        for pos, slot in positions:
            kv[pos] = (slot, self.model.writer_of(slot))

    def _draw_resume(
        self, req_id: ReqId, data: st.DataObject, freed: Sequence[int]
    ) -> tuple[tuple[int, ...], int, list[str]]:
        """A resumed request's new block list, its hit and how the hit ends (LIFE-4, DLV-3).

        The hit ends nowhere (no hit), below, at or above the delivery cursor, over every block
        that still holds the request's own rows, or beyond every position it computed (blocks
        another request wrote, a shared prefix). Blocks that still hold its rows come first;
        further hit blocks are blocks some save wrote. One or two blocks to compute in follow,
        given-back blocks first.
        """
        bs, nb = self.block_size, self.num_blocks
        admission = self.model.admission_of[req_id]
        cursor, computed = admission.cursor, admission.computed
        cached = self._cached_prefix(req_id)
        ends = [0, (cursor // bs + 1) * bs, (computed // bs + 1) * bs, len(cached) * bs]
        if cursor > bs:
            ends += [(cursor - 1) // bs * bs] * 3
        if cursor and cursor % bs == 0:
            ends += [cursor] * 3
        hit_end = data.draw(st.sampled_from([e for e in ends if e <= nb * bs]))
        hit_blocks = hit_end // bs
        blocks = cached[:hit_blocks]
        written = sorted({s // bs for s in self.written_slots})
        while len(blocks) < hit_blocks:
            blocks.append(
                data.draw(st.sampled_from([b for b in [*written, *range(nb)] if b not in blocks]))
            )
        for _ in range(data.draw(st.integers(1, 2))):
            spare = [b for b in [*freed, *freed, *range(nb)] if b not in blocks]
            if spare:
                blocks.append(data.draw(st.sampled_from(spare)))
        if not hit_end:
            cases = ["resume without a hit"]
        else:
            where = {-1: "below", 0: "at", 1: "above"}[(hit_end > cursor) - (hit_end < cursor)]
            cases = [f"resume hit {where} the cursor"]
            if hit_end > computed:
                cases.append("resume hit beyond what was computed")
            if hit_blocks <= len(cached):
                cases.append("resume hit over blocks that stayed cached")
        return tuple(blocks), hit_blocks, cases

    def _show(self, *labels: str) -> None:
        """Count what a run reached (the tests check every case occurs)."""
        type(self).coverage.update(labels)

    def _slots_of(self, req_id: ReqId) -> list[int]:
        """Slots a request computes, in order: its blocks past the hit (the last if all hit)."""
        bs = self.block_size
        blocks, hit_blocks = self.blocks.get(req_id, ((), 0))
        own = blocks[hit_blocks:] or blocks[-1:]
        return [b * bs + o for b in own for o in range(bs)]

    def _draw_spec(self, data: st.DataObject, *, max_rows: int = 3) -> SaveSpec:
        # Requests whose hit waits for this save are in it (D10), others often; at most 3.
        # A request whose hit was lost (D10) cannot be saved again; it waits for its finish.
        saveable = sorted(self.model.running - self.model.lost)
        hits = [r for r in saveable if r in self.model.hits]
        others = [
            r
            for r in saveable
            if r not in self.model.hits and data.draw(st.sampled_from([True, True, False]))
        ]
        chosen = hits + others[: max(0, 3 - len(hits))]
        reqs = list(data.draw(st.permutations(chosen))) if chosen else []
        every = list(range(self.num_blocks * self.block_size))
        used: set[int] = set()
        runs: list[tuple[int, ...]] = []
        # Rarely, two requests write one slot in the same step: its last row wins (TASK-5).
        overlap = data.draw(st.sampled_from([False] * 5 + [True]))
        for req_id in reqs:
            own = self._slots_of(req_id)
            # Mostly one to three rows; sometimes none (a request scheduled for 0 tokens).
            count = min(max_rows, data.draw(st.sampled_from([1, 2, 3, 1, 2, 0])))
            how = data.draw(
                st.sampled_from(["next", "next", "recompute", "anywhere", "recycle", "recycle"])
            )
            # Slots a delayed read of an open step planned on (HIT-6).
            planned = sorted(
                {
                    slot
                    for step_id in self.model.open_step_ids()
                    for slots in self.model.saved(step_id).hits.values()
                    for slot in slots
                }
            )
            if how == "recycle" and planned:
                # The engine recycles a block that an unconsumed step's hit read from.
                run = data.draw(
                    st.lists(
                        st.sampled_from(planned),
                        unique=True,
                        min_size=min(1, count),
                        max_size=count,
                    )
                )
            elif how in ("anywhere", "recycle") or not own:
                # A slot of any block: a recycled block, another tenant's block.
                run = data.draw(st.lists(st.sampled_from(every), unique=True, max_size=count))
            else:
                # The request's next positions, in the slots its block list gives them (so a
                # resume may find them still cached); "recompute" writes from its first own slot
                # again (its own deferred write may have lost those slots meanwhile: SLOT-5).
                at = 0 if how == "recompute" else self._own_offset(req_id)
                run = [own[(at + i) % len(own)] for i in range(min(count, len(own)))]
            if not overlap:
                run = [s for s in run if s not in used]
            used.update(run)
            runs.append(tuple(run))
        n = sum(len(r) for r in runs)
        keys: list[TensorName] = []
        if n:
            if self.model.policy.needs_full_hidden_states:
                keys.append(HIDDEN_KEY)
            # Sparse keys (SLOT-4, OUT-6): each mm key is emitted on some steps only.
            if data.draw(st.booleans()):
                keys.append(MM_KEY)
            if data.draw(st.booleans()):
                keys.append(DEFERRED_KEY)
        self.attempt += 1
        values = tuple((k, tuple(row_value(self.attempt, r, k) for r in range(n))) for k in keys)
        return SaveSpec(req_ids=tuple(reqs), slots=tuple(runs), values=values)

    def _save(
        self, spec: SaveSpec, *, stall: bool, relief: Callable[[], None] | None = None
    ) -> Any:
        before = self._quiet_snapshot()
        outcomes = self.model.save_outcomes(spec, stall=stall, relief=relief is not None)
        result = self._expect(
            outcomes,
            f"save {spec}",
            lambda: self.sut.save(spec, stall=stall, on_page_wait=relief),
        )
        if isinstance(result, Exception):
            if isinstance(result, WaitTimeoutError) and result.tid not in self.sut.in_flight():
                raise ModelMismatch(f"save timed out on task {result.tid}, which is not in flight")
            if not self.sut.save_touched:
                self._unchanged(before, f"save ({type(result).__name__})")  # STEP-5
            if isinstance(result, PageTimeoutError | WaitTimeoutError):
                self.phase = "start"
            return multiple()
        want = self.model.save(spec)
        self.written_slots.update(spec.flat_slots)
        for req_id, run in zip(spec.req_ids, spec.slots, strict=True):
            own = self.model.saved(want).carried[req_id].own
            self._note_kv(req_id, ((own + i, slot) for i, slot in enumerate(run)))
        if result != want:
            raise ModelMismatch(f"save returned step {result}, model {want}")
        self.phase = "start"
        return result

    def _catch_up(self) -> None:
        """The committer lands every write in flight."""
        while self.sut.in_flight():
            self.sut.land(self.sut.in_flight()[0])

    def _consume(
        self, step_id: StepId, how: str, data: st.DataObject, *, must_end: bool = False
    ) -> None:
        """Materialize or discard a step; ``must_end``: a refusal (DLV-5) turns into a discard."""
        if data.draw(st.sampled_from([False, False, True])):
            # The output builder lags behind the committer: a later save's write has reached
            # the pool rows this step's hit planned on (HIT-6 shows only then).
            self._catch_up()
        req_ids: list[ReqId] | None = None
        if how == "materialize":
            layout = list(self.model.saved(step_id).spec.req_ids)
            # Usually every request of the step, in any order; sometimes a subset.
            req_ids = [
                r
                for r in (data.draw(st.permutations(layout)) if layout else [])
                if data.draw(st.sampled_from([True, True, True, False]))
            ]
            if data.draw(st.sampled_from([False] * 7 + [True])):
                req_ids.append(OUTSIDER)  # STEP-4
            elif (
                must_end
                and step_id in self.model.open_step_ids()
                and self.model.owed_by_earlier(step_id, req_ids)
            ):
                req_ids = None  # the consume beside a page wait must free the page
        outcome, want = self.model.consume(step_id, req_ids)
        if req_ids is None:
            self._expect({outcome}, f"discard({step_id})", lambda: self.sut.discard(step_id))
            return
        asked = tuple(req_ids)
        what = f"materialize({step_id}, {list(asked)})"
        if outcome is DeliveryOrderError:
            self._refused(step_id, asked, data)
            return
        got = self._expect({outcome}, what, lambda: self.sut.materialize(step_id, asked))
        if outcome is None:
            assert want is not None
            self.model.check_delivery(step_id, got)
            if got.positions != want.positions:
                raise ModelMismatch(
                    f"{what} handed out positions {got.positions}, model {want.positions} (DLV-7)"
                )
            if got.rows != want.rows:
                raise ModelMismatch(
                    f"{what} rows differ from the model:\n" + _diff(got.rows, want.rows)
                )
            self._show(*self.model.shown)

    def _refused(self, step_id: StepId, asked: tuple[ReqId, ...], data: st.DataObject) -> None:
        """A materialize while an earlier open step still owes the request rows is refused (DLV-5).

        The error names the request, the earlier step and the positions it owes; the state is
        unchanged and the step stays open. The output builder then consumes something else:
        mostly the step that owes the rows (and then, often, the refused step again), sometimes
        the oldest open step (never refused).
        """
        allowed = self.model.refusals
        what = f"materialize({step_id}, {list(asked)})"
        before = self._quiet_snapshot()
        error = self._expect(
            {DeliveryOrderError}, what, lambda: self.sut.materialize(step_id, asked)
        )
        named = (ReqId(error.req_id), StepId(error.earlier_step_id), tuple(error.gap))
        if error.step_id != step_id or named not in allowed:
            raise ModelMismatch(f"{what} refused naming {named}; the model allows {allowed}")
        self._unchanged(before, what)
        self._show("delivery order refused", *self.model.shown)
        then = data.draw(st.sampled_from(["earlier", "earlier", "oldest", "nothing"]))
        how = data.draw(st.sampled_from(["materialize", "materialize", "discard"]))
        if then == "earlier":
            self._consume(named[1], how, data)
            if step_id in self.model.open_step_ids() and data.draw(st.booleans()):
                # Then the refused step again (refused again while another step owes rows).
                self._consume(step_id, "materialize", data)
        elif then == "oldest":
            self._consume(self.model.open_step_ids()[0], how, data)

    # -----------------------------------------------------------------------------------------
    # Setup and invariants.

    @initialize(
        hidden=st.sampled_from([True, False]),
        depth=st.sampled_from([2, 3]),
        budget=st.sampled_from([64, 6, 3]),
        prefetch=st.booleans(),
        failures=st.sampled_from([False, False, False, True]),
        timeout_s=st.sampled_from([1.0, 1.0, 1.0, 0.0]),
        late_reads=st.booleans(),
        preemption=st.sampled_from([False, True, True]),
    )
    def setup(
        self,
        hidden: bool,
        depth: int,
        budget: int,
        prefetch: bool,
        failures: bool,
        timeout_s: float,
        late_reads: bool,
        preemption: bool,
    ) -> None:
        """Build the cache: policy, depth, budget, prefetch and the wait bound vary per run.

        So does whether the engine preempts requests at all: runs without preemption spend
        every step on the slot and write rules (HIT-6 needs long runs of saves and late reads).
        """
        config = PrefixCacheConfig(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            staging_depth=depth,
            staging_capacity_tokens=5,
            gpu_staging_bytes=budget,
            staging_claim_timeout_s=timeout_s,
        )
        policy = ModelCachePolicy(needs_full_hidden_states=hidden, deferred_keys={DEFERRED_KEY})
        self.driver = type(self).driver_factory(config, policy, prefetch)
        self.model = ReferenceModel(config, policy)
        self.allow_failures = failures
        self.late_reads = late_reads or self.slots_only
        self.preemption = preemption and not self.slots_only

    @invariant()
    def agrees_with_model(self) -> None:
        """The core's invariants hold and its open step ids are the model's."""
        if self.driver is None:
            return
        self.rules_run += 1
        self.driver.check_invariants()
        got, want = self.driver.open_step_ids, self.model.open_step_ids()
        if got != want:
            raise ModelMismatch(f"open step ids {got}, model {want}")

    # -----------------------------------------------------------------------------------------
    # Engine rules.

    def _background(self, data: st.DataObject) -> None:
        """The committer runs while the engine works: land a few stages of in-flight tasks."""
        for _ in range(data.draw(st.integers(0, 3))):
            tids = self.sut.in_flight()
            if not tids:
                return
            self.sut.land(data.draw(st.sampled_from(tids)))

    @precondition(lambda self: self.driver is not None)
    @rule(target=steps, data=st.data(), stall=st.sampled_from([False, False, False, True]))
    def engine(self, data: st.DataObject, stall: bool) -> Any:
        """The engine's next call: a step start, or the save that follows it.

        One rule for both, so that swarm testing (which turns rules off per run) never leaves
        the engine half on. The committer does some work in the background first, and the
        output builder may catch up with an open step (a consume outside the `steps` bundle:
        the bundle may then offer that id again, which must raise StepAlreadyConsumedError).
        """
        self._background(data)
        open_ids = self.model.open_step_ids()
        if open_ids and self._may_consume() and data.draw(st.sampled_from([False, False, True])):
            step_id = data.draw(st.sampled_from(open_ids))
            how = data.draw(st.sampled_from(["materialize", "materialize", "discard"]))
            self._consume(step_id, how, data)
        if self.phase == "start":
            self._start_step(data)
            return multiple()
        # A save (n == 0 too, sparse keys); a stalled committer lets waits run out.
        return self._save(self._draw_spec(data), stall=stall)

    def _start_step(self, data: st.DataObject) -> None:
        """One step's lifecycle records, legal in every order they come in (HIT-1, HIT-2, LIFE-2).

        Some live requests finish or abort (preempted ones too), some running ones are
        preempted (their blocks go back to the pool, LIFE-3), some preempted ones resume with
        a new block list and a hit drawn around what was delivered (LIFE-4, DLV-3), and some
        ids start: new, reused after an end, or a continuation of a running request.
        """
        if data.draw(st.sampled_from([False, False, False, True])):
            # The committer caught up before this step: hits then read committed pool rows,
            # which a later save must preserve for a late read (HIT-6).
            self._catch_up()
        model = self.model
        live = sorted(model.live)
        events: list[PrefixCacheRequestEvent] = []
        ended: set[ReqId] = set()
        if live:
            for req_id in data.draw(st.lists(st.sampled_from(live), unique=True, max_size=2)):
                kind = data.draw(
                    st.sampled_from([PrefixCacheEventKind.FINISHED, PrefixCacheEventKind.ABORTED])
                )
                events.append(PrefixCacheRequestEvent(req_id=req_id, kind=kind))
                ended.add(req_id)
        running = sorted(model.running - ended)
        # One draw each for a preemption and a resume (draws are what a step costs).
        preempting: list[ReqId] = []
        if running and self.preemption:
            # Mostly a request that has rows delivered already (preempted mid-decode).
            delivered = [(r,) for r in running if model.admission_of[r].cursor]
            options = [(), (), *((r,) for r in running), *delivered, *delivered]
            preempting = list(data.draw(st.sampled_from(options)))
            events.extend(
                PrefixCacheRequestEvent(req_id=r, kind=PrefixCacheEventKind.PREEMPTED)
                for r in preempting
            )
        # The blocks an ending request hit come free now, while the read of its hit may still be
        # pending (late reads): a new tenant recomputing them is the HIT-6 case, made likely. A
        # preempted request gives all its blocks back.
        freed = sorted(
            {b for r in ended for b in self._hit_blocks(r)}
            | {b for r in preempting for b in self.blocks.get(r, ((), 0))[0]}
        )
        blocks_of: dict[ReqId, tuple[tuple[int, ...], int]] = {}
        # RESUMED: a request preempted earlier, or in this very step (LIFE-2 applies the
        # preemption first).
        resumable = sorted(model.preempted - ended) + preempting
        resuming: list[ReqId] = []
        if resumable:
            options = [(r,) for r in resumable]
            resuming = list(data.draw(st.sampled_from([(), *options, *options])))
        if resuming and data.draw(st.sampled_from([False, True, True])):
            # The output builder caught up with the request's steps before it resumes, and
            # needed some of them (a resume hit serves what it discarded: DLV-4).
            for step_id in self.model.open_step_ids():
                if resuming[0] in self.model.saved(step_id).carried:
                    how = data.draw(st.sampled_from(["materialize", "materialize", "discard"]))
                    self._consume(step_id, how, data)
        cases: list[str] = []
        for req_id in resuming:
            blocks, hit_blocks, where = self._draw_resume(req_id, data, freed)
            cases.extend(where)
            blocks_of[req_id] = (blocks, hit_blocks)
            events.append(
                PrefixCacheRequestEvent(
                    req_id=req_id,
                    kind=PrefixCacheEventKind.RESUMED,
                    hit_end=hit_blocks * self.block_size,
                    block_ids=blocks,
                    scheduled_tokens=1,
                )
            )
        # STARTED: any id that is neither preempted (LIFE-2) nor resuming in this step.
        startable = [
            r
            for r in REQS
            if r not in resuming
            and r not in preempting
            and (r not in model.preempted or r in ended)
        ]
        chosen = (
            data.draw(st.lists(st.sampled_from(startable), unique=True, max_size=2))
            if startable
            else []
        )
        for req_id in chosen:
            # Hit blocks come mostly from blocks some save wrote (so hits read the pool and
            # later saves may reuse them under a delayed read: HIT-6), else from any block.
            written = sorted({s // self.block_size for s in self.written_slots})
            first = data.draw(
                st.sampled_from(freed * 6 + written * 3 + list(range(self.num_blocks)))
            )
            rest = data.draw(st.lists(st.integers(0, self.num_blocks - 1), min_size=1, max_size=2))
            blocks = tuple(dict.fromkeys([first, *rest]))
            if len(blocks) == 1:
                blocks = (first, (first + 1) % self.num_blocks)
            # Mostly a one-block hit followed by blocks to compute; sometimes no hit, or a hit
            # over every block (the request then recomputes in its last block).
            recompute = [0, 0, 0, 1] if first in freed else [1, 1, 1, 0, len(blocks)]
            hit_blocks = data.draw(st.sampled_from(recompute))
            blocks_of[req_id] = (blocks, hit_blocks)
            events.append(
                PrefixCacheRequestEvent(
                    req_id=req_id,
                    kind=PrefixCacheEventKind.STARTED,
                    hit_end=hit_blocks * self.block_size,
                    block_ids=blocks,
                    scheduled_tokens=1,
                )
            )
        if len(events) > 1 and data.draw(st.booleans()):
            # LIFE-2: ends and preemptions apply before starts and resumes, whatever the order.
            events = list(data.draw(st.permutations(events)))
        # A continuation keeps its blocks; a new or restarted id (HIT-2) and a resume take the
        # drawn ones.
        fresh = {r for r in blocks_of if r not in model.live or r in ended or r in resuming}
        shown = ["preempted"] * len(preempting) + cases
        shown += ["ended while preempted" for r in ended if r in model.preempted]
        shown += [
            "id reused"
            for r in chosen
            if (r not in model.live or r in ended) and any(a.req_id == r for a in model.admissions)
        ]
        outcome = model.start(events)
        self._expect({outcome}, f"start {events}", lambda: self.sut.start(events))
        if outcome is None:
            bs = self.block_size
            for req_id in fresh:
                self.blocks[req_id] = blocks_of[req_id]
                # The engine's KV of the request is its hit blocks now (LIFE-3: the rest is gone).
                table, hit_blocks = blocks_of[req_id]
                self.kv[req_id] = {}
                self._note_kv(
                    req_id, ((p, table[p // bs] * bs + p % bs) for p in range(hit_blocks * bs))
                )
            self._show(*shown)
            self.phase = "save"

    @precondition(
        lambda self: (
            self._usable()
            and self.phase == "save"
            and len(self.model.open_step_ids()) >= self.model.config.staging_depth
            # A zero bound fails at once instead of waiting for the page (PAGE-4).
            and self.model.config.staging_claim_timeout_s > 0
        )
    )
    @rule(
        target=steps,
        relief=consumes(steps),
        how=st.sampled_from(["materialize", "discard"]),
        data=st.data(),
    )
    def save_while_a_step_is_consumed(self, relief: StepId, how: str, data: st.DataObject) -> Any:
        """A save waiting for a page gets the one a concurrent consume frees (PAGE-4, CONC-3)."""
        open_ids = self.model.open_step_ids()
        if relief not in open_ids:
            # The engine rule's catch-up consumed it already; relieve with an open step.
            relief = data.draw(st.sampled_from(open_ids))
        spec = self._draw_spec(data, max_rows=1)
        called: list[bool] = []

        def consume_meanwhile() -> None:
            called.append(True)
            self._consume(relief, how, data, must_end=True)

        result = self._save(spec, stall=False, relief=consume_meanwhile)
        if not called:
            self._consume(relief, how, data)
        return result

    @precondition(lambda self: self._may_consume())
    @rule(
        step=consumes(steps),
        how=st.sampled_from(["materialize", "materialize", "materialize", "discard"]),
        data=st.data(),
    )
    def consume(self, step: StepId, how: str, data: st.DataObject) -> None:
        """Materialize or discard a step, late and out of order (STEP-1, STEP-4, HIT-3..6)."""
        self._consume(step, how, data)

    # -----------------------------------------------------------------------------------------
    # Error paths, on purpose.

    # Misuse is one rule in three steps at most, so the engine keeps most of each run.
    @precondition(lambda self: self.driver is not None and self.rules_run % 3 == 0)
    @rule(
        kind=st.sampled_from(
            [
                "unaligned hit",
                "hit without blocks",
                "hit with too few blocks",
                "hit block out of range",
                "started twice",
                "request not live",
                "slot out of range",
                "hidden rows wrong",
                "hit request left out",
                "consume twice",
                "consume unknown",
                "register policy late",
                *_LIFECYCLE_MISUSE,
                "save a preempted request",
            ]
        ),
        data=st.data(),
    )
    def misuse(self, kind: str, data: st.DataObject) -> None:
        """Each misuse raises its typed error and leaves the state as SPEC says.

        STEP-2 and FAIL-5 for steps and layouts; LIFE-2 for lifecycle records in a state that
        does not allow them (LifecycleError); LIFE-3 for a save naming a preempted request.
        """
        before = self._quiet_snapshot()
        if kind in _LIFECYCLE_MISUSE:
            bad = self._bad_lifecycle(kind, data)
            if bad is None:
                return
            outcome = self.model.start(bad)
            if outcome is None:
                raise ModelMismatch(f"the model accepts a bad lifecycle: {kind}")
            self._expect({outcome}, kind, lambda: self.sut.start(bad))
            self._show(f"refused: {kind}")
        elif kind in ("consume twice", "consume unknown"):
            if kind == "consume twice" and self.model.consumed:
                step_id = data.draw(st.sampled_from(sorted(self.model.consumed)))
            else:
                offset = data.draw(st.sampled_from([0, 1, 7, -(10**6)]))
                step_id = StepId(self.model.next_step_id + offset)
            if data.draw(st.booleans()):
                outcome, _ = self.model.consume(step_id, None)
                self._expect({outcome}, f"discard({step_id})", lambda: self.sut.discard(step_id))
            else:
                outcome, _ = self.model.consume(step_id, [])
                self._expect(
                    {outcome},
                    f"materialize({step_id})",
                    lambda: self.sut.materialize(step_id, ()),
                )
        elif kind == "register policy late":
            if not self.model.started:
                return
            outcome = self.model._refusal() or BadInputError
            self._expect({outcome}, kind, lambda: self.sut.register_policy(self.model.policy))
        elif kind in (
            "request not live",
            "slot out of range",
            "hidden rows wrong",
            "hit request left out",
            "save a preempted request",
        ):
            if kind == "hit request left out" and not self.model.hits:
                return
            if kind == "save a preempted request" and not self.model.preempted:
                return
            spec = self._bad_spec(kind)
            outcomes = self.model.save_outcomes(spec)
            if None in outcomes:
                raise ModelMismatch(f"the model accepts a bad layout: {kind}")
            self._expect(outcomes, kind, lambda: self.sut.save(spec))
        else:
            events = self._bad_events(kind, data.draw(st.sampled_from(REQS)))
            outcome = self.model.start(events)
            if outcome is None:
                raise ModelMismatch(f"the model accepts a bad start: {kind}")
            self._expect({outcome}, kind, lambda: self.sut.start(events))
        self._unchanged(before, kind)

    def _bad_events(self, kind: str, req_id: ReqId) -> list[PrefixCacheRequestEvent]:
        bs, nb = self.block_size, self.num_blocks
        hit_end, blocks = {
            "unaligned hit": (bs + 1, (0, 1)),
            "hit without blocks": (bs, ()),
            "hit with too few blocks": (2 * bs, (0,)),
            "hit block out of range": (bs, (nb,)),
            "started twice": (0, (0,)),
        }[kind]
        event = PrefixCacheRequestEvent(
            req_id=req_id, kind=PrefixCacheEventKind.STARTED, hit_end=hit_end, block_ids=blocks
        )
        return [event, event] if kind == "started twice" else [event]

    def _bad_lifecycle(
        self, kind: str, data: st.DataObject
    ) -> list[PrefixCacheRequestEvent] | None:
        """Records that LIFE-2 forbids in the requests' current states; None: no such state."""
        model = self.model
        running, preempted = sorted(model.running), sorted(model.preempted)
        outside = next(r for r in (*REQS, OUTSIDER) if r not in model.live)
        kinds = PrefixCacheEventKind

        def record(req_id: ReqId, kind: PrefixCacheEventKind) -> PrefixCacheRequestEvent:
            return PrefixCacheRequestEvent(req_id=req_id, kind=kind, scheduled_tokens=1)

        if kind == "resume a running request":
            # RESUMED of a running request, or of one that is not live at all.
            req_id = data.draw(st.sampled_from(running)) if running else outside
            return [record(req_id, kinds.RESUMED)]
        if kind == "preempt twice":
            if preempted:
                return [record(data.draw(st.sampled_from(preempted)), kinds.PREEMPTED)]
            if running:
                req_id = data.draw(st.sampled_from(running))
                return [record(req_id, kinds.PREEMPTED), record(req_id, kinds.PREEMPTED)]
            return [record(outside, kinds.PREEMPTED)]
        if kind == "preempt after the end":
            req_id = data.draw(st.sampled_from(running)) if running else outside
            return [record(req_id, kinds.FINISHED), record(req_id, kinds.PREEMPTED)]
        if kind == "start a preempted request":
            if preempted:
                return [record(data.draw(st.sampled_from(preempted)), kinds.STARTED)]
            if not running:
                return None
            # Preempted by this very step: LIFE-2 applies the preemption first.
            req_id = data.draw(st.sampled_from(running))
            return [record(req_id, kinds.STARTED), record(req_id, kinds.PREEMPTED)]
        assert kind == "start and resume in one step", kind
        req_id = data.draw(st.sampled_from(preempted or list(REQS)))
        return [record(req_id, kinds.STARTED), record(req_id, kinds.RESUMED)]

    def _bad_spec(self, kind: str) -> SaveSpec:
        live = sorted(self.model.live)
        caches_hidden = self.model.policy.needs_full_hidden_states
        keys = [MM_KEY]
        if kind == "hit request left out":
            return SaveSpec(req_ids=(), slots=())  # D10: the pending hit would vanish
        if kind == "save a preempted request":
            reqs, slots = (sorted(self.model.preempted)[0],), ((0,),)  # LIFE-3, D9
        elif kind == "request not live" or not live:
            dead = next(r for r in (*REQS, OUTSIDER) if r not in self.model.live)
            reqs, slots = (dead,), ((0,),)
        elif kind == "slot out of range":
            reqs, slots = (live[0],), ((self.num_blocks * self.block_size,),)
        else:
            reqs, slots = (live[0],), ((0,),)
            caches_hidden = not caches_hidden  # hidden missing, or given to a policy without it
        if caches_hidden:
            keys.append(HIDDEN_KEY)
        self.attempt += 1
        return SaveSpec(
            req_ids=reqs,
            slots=slots,
            values=tuple((k, (row_value(self.attempt, 0, k),)) for k in keys),
        )

    # -----------------------------------------------------------------------------------------
    # Committer and clock rules.

    @precondition(lambda self: self.driver is not None)
    @rule(
        data=st.data(),
        how=st.sampled_from(["one stage", "one stage", "everything", "fail", "time passes"]),
    )
    def committer(self, data: st.DataObject, how: str) -> None:
        """The committer lands a stage, catches up or fails a write (FAIL-1); or time passes."""
        tids = self.sut.in_flight()
        if how == "time passes" or not tids:
            self.sut.advance_clock(data.draw(st.sampled_from([1, 400, 1500])) * 1_000_000)
        elif how == "fail" and self.allow_failures and self.rules_run >= self.fail_after:
            self.sut.fail(data.draw(st.sampled_from(tids)))
            self.model.failed = True
        elif how == "everything":
            self._catch_up()
        else:
            self.sut.land(data.draw(st.sampled_from(tids)))

    @precondition(
        lambda self: (
            self.driver is not None
            and not self.model.closed
            and self.rules_run >= self.shutdown_after
        )
    )
    @rule()
    def shut_down(self) -> None:
        """Shut the cache down: every later call raises ShutDownError (FAIL-4)."""
        self.sut.shutdown()
        self.model.closed = True


def reach_every_case(
    machine: type[CacheMachine], cases: Sequence[str], each: settings, *, rounds: int = 4
) -> Counter[str]:
    """Run `machine` (its own `coverage` Counter) until it reaches every one of `cases`.

    Each round is one hypothesis run with the settings `each` and a fixed seed (0, 1, ...), so
    a result reproduces; every round also checks the machine against the model. Why rounds and not
    one derandomized run: hypothesis draws some values from constants in the project's loaded
    modules, so one fixed run's sequence changes with what else the test session imported; a
    rare case reached when a test file runs alone can be missed inside the whole suite. Rounds
    make the requirement "within `rounds` runs" instead of "in this one sequence".

    Returns:
        What the rounds reached, every case included.

    Raises:
        AssertionError: Some case was never reached in `rounds` runs.
    """
    machine.coverage = Counter()
    for number in range(rounds):
        run = get_state_machine_test(machine, settings=each)
        seed(number)(run)()
        if all(machine.coverage[case] for case in cases):
            return machine.coverage
    missing = [case for case in cases if not machine.coverage[case]]
    raise AssertionError(f"never reached in {rounds} runs: {missing}")
