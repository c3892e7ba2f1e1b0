"""Small drivers for unit tests of the transition core.

They play the inline adapter of `bench/core_step.py` in miniature: build the inputs, run a save
through its barrier, budget and page phases, land the writes the core asks for, and consume a
step. Nothing here decides a rule; each helper only feeds inputs and follows effects, so a test
that uses them still checks the core.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import pytest

from omni_cache_core import (
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
    SaveAbort,
    SaveBegin,
    SaveCommit,
    SaveProceed,
    SavePublished,
    StartStep,
    StepWrite,
    TaskState,
    WriteLanded,
)

#: An immediate mm key and a deferred mm key used across the tests.
MM = TensorName("talker.h")
DEF = TensorName("codes.audio")
#: Block size of the default test config: block ``b`` covers slots ``4b .. 4b + 3``.
BLOCK = 4
#: One second, the default wait bound of the test config, in nanoseconds.
TIMEOUT_NS = 1_000_000_000

E = TypeVar("E", bound=BaseException)

MakeCore = Callable[..., CacheCore]


def config(**overrides: Any) -> PrefixCacheConfig:
    """Build a small config: 8 blocks of 4 slots, 4 pages of 32 rows, 1 s waits, 1000 bytes."""
    fields: dict[str, Any] = {
        "num_blocks": 8,
        "block_size": BLOCK,
        "staging_depth": 4,
        "staging_capacity_tokens": 32,
        "staging_claim_timeout_s": 1.0,
        "gpu_staging_bytes": 1000,
    }
    fields.update(overrides)
    return PrefixCacheConfig(**fields)


def deferred_policy(*, hidden: bool = True) -> ModelCachePolicy:
    """A policy that defers `DEF` (and caches hidden states unless told otherwise)."""
    return ModelCachePolicy(needs_full_hidden_states=hidden, deferred_keys={DEF})


def blocks(*block_ids: int) -> list[int]:
    """The KV slots of whole blocks, in order."""
    return [b * BLOCK + o for b in block_ids for o in range(BLOCK)]


def started(
    req: str, *, hit_end: int = 0, block_ids: Sequence[int] = (), scheduled: int = 0
) -> PrefixCacheRequestEvent:
    """A STARTED record."""
    return PrefixCacheRequestEvent(
        req_id=req,
        kind=PrefixCacheEventKind.STARTED,
        hit_end=hit_end,
        block_ids=tuple(block_ids),
        scheduled_tokens=scheduled,
    )


def finished(req: str) -> PrefixCacheRequestEvent:
    """A FINISHED record."""
    return PrefixCacheRequestEvent(req_id=req, kind=PrefixCacheEventKind.FINISHED)


def aborted(req: str) -> PrefixCacheRequestEvent:
    """An ABORTED record."""
    return PrefixCacheRequestEvent(req_id=req, kind=PrefixCacheEventKind.ABORTED)


def preempted(req: str) -> PrefixCacheRequestEvent:
    """A PREEMPTED record."""
    return PrefixCacheRequestEvent(req_id=req, kind=PrefixCacheEventKind.PREEMPTED)


def resumed(
    req: str, *, hit_end: int = 0, block_ids: Sequence[int] = (), scheduled: int = 0
) -> PrefixCacheRequestEvent:
    """A RESUMED record."""
    return PrefixCacheRequestEvent(
        req_id=req,
        kind=PrefixCacheEventKind.RESUMED,
        hit_end=hit_end,
        block_ids=tuple(block_ids),
        scheduled_tokens=scheduled,
    )


def start(
    core: CacheCore,
    *events: PrefixCacheRequestEvent,
    now_ns: int = 0,
    computed: dict[str, int] | None = None,
    prefetch: bool = True,
) -> tuple[Effect, ...]:
    """Feed one step's lifecycle records (and computed-token counts: SPEC-2)."""
    step = PrefixCacheStep(events=events, computed_tokens=computed or {})
    return core.start_step(StartStep(step=step, now_ns=now_ns, prefetch=prefetch))


def save_input(
    layout: Sequence[tuple[str, Sequence[int]]],
    *,
    immediate: Sequence[str] | None = None,
    deferred: Sequence[str] = (),
    immediate_bytes: int = 0,
    deferred_bytes: int = 0,
    now_ns: int = 0,
    drafts: Sequence[int] | None = None,
) -> SaveBegin:
    """Build a `SaveBegin` from ``[(req, slots), ...]`` in batch order.

    `immediate` defaults to the hidden key alone when the step has rows, and to nothing otherwise.
    """
    req_ids = tuple(ReqId(r) for r, _ in layout)
    lengths = [len(s) for _, s in layout]
    slots = np.asarray([x for _, s in layout for x in s], dtype=np.int64)
    n = len(slots)
    if immediate is None:
        immediate = (HIDDEN_KEY,) if n else ()
    return SaveBegin(
        now_ns=now_ns,
        req_ids=req_ids,
        row_bounds=np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64),
        slots=slots,
        num_tokens=n,
        immediate_keys=tuple(TensorName(k) for k in immediate),
        deferred_keys=tuple(TensorName(k) for k in deferred),
        immediate_bytes=immediate_bytes,
        deferred_bytes=deferred_bytes,
        drafts=None if drafts is None else np.asarray(drafts, dtype=np.int64),
    )


_NEXT_REPORT = {
    TaskState.QUEUED: CopyStarted,
    TaskState.COPYING: CopyLanded,
    TaskState.HOST_READY: WriteLanded,
}


def land(core: CacheCore, tid: Tid, upto: TaskState = TaskState.WRITTEN) -> None:
    """Report a queued write's progress until it reaches `upto` (WRITTEN: it leaves the registry).

    A PENDING write cannot be moved by a report (only escalation queues it), so it is an error.
    """
    while True:
        state = core.task_state(tid)
        if state is None or state.value >= upto.value:
            return
        if state is TaskState.PENDING:
            raise AssertionError(f"task {tid} is PENDING: escalate it before landing it")
        core.report(_NEXT_REPORT[state](tid=tid))


def step_writes(published: SavePublished) -> list[StepWrite]:
    """The `StepWrite` effects of a published save."""
    return [e for e in published.effects if isinstance(e, StepWrite)]


def effects_of(effects: Sequence[Effect], kind: type[Any]) -> list[Any]:
    """The effects of one type, in order."""
    return [e for e in effects if isinstance(e, kind)]


def save(
    core: CacheCore,
    layout: Sequence[tuple[str, Sequence[int]]],
    *,
    land_writes: bool = True,
    now_ns: int = 0,
    **kwargs: Any,
) -> SavePublished:
    """Run one save as an inline adapter would, and land its step write unless told not to.

    Waits are served by landing the awaited writes at once; an escalation runs the escalated
    writes to the end; a page wait is a test failure (use the inputs directly to test it). Any
    error between `save_begin` and `save_commit` is followed by `save_abort`, as in the adapter.
    """
    core.save_begin(save_input(layout, now_ns=now_ns, **kwargs))
    try:
        for _ in range(100):
            effect = core.save_proceed(SaveProceed(now_ns=now_ns))
            if isinstance(effect, PageClaimed):
                break
            if isinstance(effect, AwaitTasks):
                for tid, state in effect.waits:
                    land(core, tid, state)
            elif isinstance(effect, EscalateTasks):
                for tid in effect.tids:
                    land(core, tid)
            elif isinstance(effect, AwaitPage):
                raise AssertionError("no free staging page")
        else:
            raise AssertionError("the save never claimed a page")
        published = core.save_commit(SaveCommit(now_ns=now_ns))
    except BaseException:
        core.save_abort(SaveAbort())
        raise
    if land_writes:
        for write in step_writes(published):
            land(core, write.tid)
    return published


def consume(
    core: CacheCore,
    step_id: StepId,
    req_ids: Sequence[str] | None = None,
    *,
    now_ns: int = 0,
    end: bool = True,
    computed: dict[str, int] | None = None,
) -> ConsumePlan:
    """Discard a step (`req_ids` None) or materialize it, landing the writes its hits wait on.

    `computed`: the computed-token counts the materialize reports (SPEC-2)."""
    wanted = None if req_ids is None else tuple(ReqId(r) for r in req_ids)
    reported = None if computed is None else {ReqId(r): c for r, c in computed.items()}
    for _ in range(100):
        result = core.consume_begin(
            ConsumeBegin(step_id=step_id, req_ids=wanted, now_ns=now_ns, computed=reported)
        )
        if isinstance(result, ConsumePlan):
            if end and not result.discard:
                core.consume_end(ConsumeEnd(step_id=step_id))
            return result
        for tid, state in result.waits:
            land(core, tid, state)
    raise AssertionError("the consume never got its plan")


def positions(plan: ConsumePlan) -> list[tuple[int, int]]:
    """A consume plan's delivered ``(start, end)`` per request, as plain ints."""
    return [(int(a), int(b)) for a, b in plan.positions.tolist()]


def raises_unchanged(
    core: CacheCore, error: type[E], call: Callable[..., Any], *args: Any, **kwargs: Any
) -> E:
    """Call `call`, expect exactly `error` (or a subclass), and check the state did not change."""
    before = core.snapshot()
    with pytest.raises(error) as info:
        call(*args, **kwargs)
    assert core.snapshot() == before, "the failed call changed the state"
    core.check_invariants()
    return info.value
