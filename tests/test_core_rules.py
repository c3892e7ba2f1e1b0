"""Unit tests of the transition core, one or more per SPEC rule the core owns.

Each test names its rule id (SPEC.md) or design decision (spec/DESIGN.md) in its name and
docstring. Every error path checks the typed error and that `snapshot()` did not change (except
where a rule says the step counts as consumed), and every core built by the `make_core` fixture
passes `check_invariants()` when its test ends.

Default geometry (tests/core_helpers.py): 8 blocks of 4 slots (block ``b`` is slots
``4b .. 4b + 3``), 4 pages of 32 rows, 1 s waits, a 1000-byte device-clone budget.
"""

from __future__ import annotations

import copy
import math
import pickle
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from omni_cache_core import (
    HIDDEN_KEY,
    BadInputError,
    ConfigError,
    HitUnreadableError,
    IllegalTransitionError,
    InvariantError,
    ModelCachePolicy,
    OmniPrefixCacheStagingTimeoutError,
    OmniPrefixCacheUnmatchError,
    OversizeStepError,
    PageTimeoutError,
    ReqId,
    ShutDownError,
    StepAlreadyConsumedError,
    StepId,
    TensorName,
    Tid,
    UnknownStepError,
    WaitTimeoutError,
    WriteFailedError,
)
from omni_cache_core._core import CacheCore
from omni_cache_core._occupancy import ABSENT, OccupancyTable
from omni_cache_core._pages import HolderKind
from omni_cache_core._save import _SAVE_MOVES, PendingSave, SaveOutcome, SavePhase
from omni_cache_core._tasks import _TASK_MOVES, TaskMove
from omni_cache_core._tasks import MAX_TID as _MAX_TID
from omni_cache_core._values import (
    AwaitPage,
    AwaitTasks,
    ConsumeBegin,
    ConsumeEnd,
    ConsumePlan,
    CopyLanded,
    CopyStarted,
    DeferredChunk,
    EscalateTasks,
    PageClaimed,
    PrefetchRead,
    Preserve,
    ReadPlan,
    SaveAbort,
    SaveBegin,
    SaveCommit,
    SaveProceed,
    ShutDown,
    SlotSource,
    StepWrite,
    TaskState,
    Tombstone,
    WriteFailed,
    WriteLanded,
)
from tests.core_helpers import (
    BLOCK,
    DEF,
    MM,
    TIMEOUT_NS,
    MakeCore,
    aborted,
    blocks,
    config,
    consume,
    deferred_policy,
    effects_of,
    finished,
    land,
    positions,
    raises_unchanged,
    save,
    save_input,
    start,
    started,
    step_writes,
)

POOL = SlotSource.POOL.value
AFTER_WRITE = SlotSource.AFTER_WRITE.value
TASK = SlotSource.TASK.value
ZEROS = SlotSource.ZEROS.value
THIS_STEP = SlotSource.THIS_STEP.value


def _reads(plan: Any, req: str) -> dict[TensorName, ReadPlan]:
    """The read plans of one request in a consume plan, by key."""
    return {r.key: r for r in plan.reads if r.req_id == req}


def _sources(read: ReadPlan) -> list[int]:
    return [int(x) for x in read.source]


def _deferred_tid(effects: Any, req: str) -> Tid:
    (chunk,) = [e for e in effects if isinstance(e, DeferredChunk) and e.req_id == req]
    return chunk.tid


def _proceed(core: CacheCore, now_ns: int = 0) -> Any:
    return core.save_proceed(SaveProceed(now_ns=now_ns))


# =============================================================================================
# STEP: exactly once.


def test_step_1_each_save_returns_a_fresh_increasing_step_id(make_core: MakeCore) -> None:
    """Every save returns a new step id, allocated from 1 upward, also after consumes (STEP-1)."""
    core = make_core()
    start(core, started("a"))
    ids = []
    for i in range(6):
        published = save(core, [("a", [i])])
        ids.append(published.step_id)
        if i % 2:
            consume(core, published.step_id)
    assert ids == [1, 2, 3, 4, 5, 6]
    assert core.open_step_ids == (1, 3, 5)


def test_step_1_steps_are_consumed_by_id_in_any_order(make_core: MakeCore) -> None:
    """Steps are consumed by id, not by age: the newest first, then the oldest (STEP-1).

    The steps share no request, so no order of delivery is at stake (DLV-5).
    """
    core = make_core()
    start(core, started("a"), started("b"), started("c"))
    first = save(core, [("a", blocks(0))]).step_id
    second = save(core, [("b", blocks(1))]).step_id
    third = save(core, [("c", blocks(2))]).step_id
    assert core.open_step_ids == (first, second, third)
    consume(core, third, ["c"])
    assert core.open_step_ids == (first, second)
    consume(core, first)
    assert core.open_step_ids == (second,)
    consume(core, second, ["b"])
    assert core.open_step_ids == ()
    assert core.pages_in_use == 0


@pytest.mark.parametrize("req_ids", [None, ("a",)], ids=["discard", "materialize"])
@pytest.mark.parametrize("bad", [0, -3, 2, 99])
def test_step_2_an_unknown_step_id_raises_and_changes_nothing(
    make_core: MakeCore, bad: int, req_ids: tuple[str, ...] | None
) -> None:
    """Consuming a never-issued id raises UnknownStepError naming it and the open ids (STEP-2)."""
    core = make_core()
    start(core, started("a"))
    save(core, [("a", blocks(0))])
    error = raises_unchanged(
        core,
        UnknownStepError,
        core.consume_begin,
        ConsumeBegin(step_id=StepId(bad), req_ids=req_ids, now_ns=0),
    )
    assert type(error) is UnknownStepError
    assert error.step_id == bad
    assert error.open_step_ids == (1,)
    assert f"step {bad}" in str(error) and "[1]" in str(error)


@pytest.mark.parametrize("req_ids", [None, ("a",)], ids=["discard", "materialize"])
def test_step_2_consuming_twice_raises_and_changes_nothing(
    make_core: MakeCore, req_ids: tuple[str, ...] | None
) -> None:
    """A second consume of an id raises StepAlreadyConsumedError and changes nothing (STEP-2)."""
    core = make_core()
    start(core, started("a"))
    first = save(core, [("a", blocks(0))]).step_id
    save(core, [("a", blocks(1))])
    consume(core, first, ["a"])
    error = raises_unchanged(
        core,
        StepAlreadyConsumedError,
        core.consume_begin,
        ConsumeBegin(step_id=first, req_ids=req_ids, now_ns=0),
    )
    assert error.step_id == first
    assert error.open_step_ids == (2,)
    assert "already consumed" in str(error) and "[2]" in str(error)
    assert isinstance(error, OmniPrefixCacheUnmatchError)


def test_step_2_a_consume_in_progress_cannot_be_consumed_again(make_core: MakeCore) -> None:
    """A step whose materialize began is consumed: a second consume raises, unchanged (STEP-2)."""
    core = make_core()
    start(core, started("a"))
    step_id = save(core, [("a", blocks(0))]).step_id
    consume(core, step_id, ["a"], end=False)
    assert core.open_step_ids == ()
    for req_ids in (None, (ReqId("a"),)):
        raises_unchanged(
            core,
            StepAlreadyConsumedError,
            core.consume_begin,
            ConsumeBegin(step_id=step_id, req_ids=req_ids, now_ns=0),
        )
    core.consume_end(ConsumeEnd(step_id=step_id))
    raises_unchanged(core, BadInputError, core.consume_end, ConsumeEnd(step_id=step_id))
    assert core.pages_in_use == 0


def test_step_3_materialize_reads_the_context_captured_at_save(make_core: MakeCore) -> None:
    """Later starts, finishes, keys and writes do not change what an earlier step reads (STEP-3)."""
    core = make_core()
    start(core, started("a"))
    save(core, [("a", blocks(0))], immediate=(HIDDEN_KEY, MM))
    start(core, started("b", hit_end=BLOCK, block_ids=(0, 1)))
    step = save(core, [("b", blocks(1))], immediate=(HIDDEN_KEY, MM)).step_id
    # The live batch moves on: b finishes, c takes b's hit blocks with a new key set.
    start(core, finished("b"), started("c", hit_end=BLOCK, block_ids=(1, 2)))
    later = save(core, [("c", blocks(0, 2))], immediate=(HIDDEN_KEY, TensorName("zeta")))
    assert effects_of(later.effects, Preserve), "the new tenant must preserve b's planned rows"
    plan = consume(core, step, ["b"])
    assert plan.keys == (HIDDEN_KEY, MM)
    reads = _reads(plan, "b")
    assert set(reads) == {HIDDEN_KEY, MM}
    for read in reads.values():
        assert read.slots.tolist() == blocks(0)
        assert _sources(read) == [POOL] * BLOCK
        assert read.preserved.all()
    later_plan = consume(core, later.step_id, ["c"])
    assert later_plan.keys == (HIDDEN_KEY, TensorName("zeta"))


def _step_4_scenario(core: CacheCore) -> StepId:
    start(core, started("a"))
    save(core, [("a", blocks(0))])
    start(core, started("b", hit_end=BLOCK, block_ids=(0, 1)), started("c"))
    return save(core, [("b", blocks(1)), ("c", blocks(2))]).step_id


@pytest.mark.parametrize("outside", [("zz",), ("b", "zz"), ("a",)])
def test_step_4_materialize_with_a_request_outside_the_layout_raises_and_consumes_the_step(
    make_core: MakeCore, outside: tuple[str, ...]
) -> None:
    """A request id outside the step's layout raises; the step ends as a discard would (STEP-4)."""
    core, twin = make_core(), make_core()
    step_id = _step_4_scenario(core)
    assert _step_4_scenario(twin) == step_id
    consume(twin, step_id)
    with pytest.raises(BadInputError) as info:
        core.consume_begin(
            ConsumeBegin(step_id=step_id, req_ids=tuple(map(ReqId, outside)), now_ns=0)
        )
    assert "STEP-4" in str(info.value)
    assert core.snapshot() == twin.snapshot()
    assert step_id not in core.open_step_ids
    assert core.pages_in_use == 1, "only the earlier, unconsumed step still holds a page"
    raises_unchanged(
        core,
        StepAlreadyConsumedError,
        core.consume_begin,
        ConsumeBegin(step_id=step_id, req_ids=None, now_ns=0),
    )


def test_step_4_materialize_of_a_subset_returns_only_its_reads(make_core: MakeCore) -> None:
    """A subset of the layout's requests gets exactly those requests' reads (STEP-4)."""
    core = make_core()
    start(core, started("a"))
    save(core, [("a", blocks(0, 1))])
    start(
        core,
        started("b", hit_end=BLOCK, block_ids=(0, 2)),
        started("c", hit_end=BLOCK, block_ids=(1, 3)),
    )
    step_id = save(core, [("b", blocks(2)), ("c", blocks(3))]).step_id
    plan = consume(core, step_id, ["c"])
    assert [(r.req_id, r.slots.tolist()) for r in plan.reads] == [("c", blocks(1))]


def test_step_5_an_aborted_save_leaves_no_trace(make_core: MakeCore) -> None:
    """A save aborted after claiming its page and budget leaves the state as before (STEP-5)."""
    core = make_core(deferred_policy())
    start(core, started("a"), started("b"))
    save(core, [("a", blocks(0))], deferred=(DEF,), deferred_bytes=100)
    before = core.snapshot()
    core.save_begin(
        save_input(
            [("a", blocks(1)), ("b", blocks(2))],
            deferred=(DEF,),
            immediate_bytes=50,
            deferred_bytes=200,
        )
    )
    assert isinstance(_proceed(core), PageClaimed)
    assert core.budget_used == 350
    assert core.snapshot() != before
    core.save_abort(SaveAbort())
    assert core.snapshot() == before
    core.save_abort(SaveAbort())  # idempotent
    assert core.snapshot() == before
    published = save(core, [("a", blocks(1))], deferred=(DEF,))
    assert published.step_id == 2


def test_step_5_a_save_that_timed_out_leaves_no_trace_after_abort(make_core: MakeCore) -> None:
    """A save whose barrier ran out leaves no trace once aborted; the next save works (STEP-5)."""
    core = make_core()
    start(core, started("a"))
    (write,) = step_writes(save(core, [("a", blocks(0))], land_writes=False))
    before = core.snapshot()
    core.save_begin(save_input([("a", blocks(1))], immediate_bytes=10))
    assert isinstance(_proceed(core, 0), AwaitTasks)
    raises_unchanged(core, WaitTimeoutError, _proceed, core, TIMEOUT_NS)
    core.save_abort(SaveAbort())
    assert core.snapshot() == before
    land(core, write.tid)
    assert save(core, [("a", blocks(1))]).step_id == 2


# =============================================================================================
# PAGE: staging pages.


def test_page_1_the_pool_has_staging_depth_pages(make_core: MakeCore) -> None:
    """`staging_depth` saves get `staging_depth` distinct pages; the next one waits (PAGE-1)."""
    core = make_core(staging_depth=3)
    start(core, started("a"))
    pages = [step_writes(save(core, [("a", blocks(i))]))[0].page for i in range(3)]
    assert sorted(pages) == [0, 1, 2]
    assert core.pages_in_use == 3
    core.save_begin(save_input([("a", blocks(3))]))
    assert isinstance(_proceed(core), AwaitPage)
    core.save_abort(SaveAbort())


def test_page_2_a_save_with_nothing_to_copy_still_claims_a_page(make_core: MakeCore) -> None:
    """An empty save claims a page and issues a step id, so depth bounds open steps (PAGE-2)."""
    core = make_core(staging_depth=2)
    first = save(core, [])
    assert first.step_id == 1 and first.effects == ()
    assert core.pages_in_use == 1
    second = save(core, [])
    assert core.open_step_ids == (first.step_id, second.step_id)
    core.save_begin(save_input([]))
    assert isinstance(_proceed(core), AwaitPage)
    consume(core, first.step_id)
    claimed = _proceed(core)
    assert isinstance(claimed, PageClaimed)
    core.save_commit(SaveCommit(now_ns=0))
    assert len(core.open_step_ids) == 2


def test_page_3_a_page_stays_held_until_its_step_and_its_write_let_go(
    make_core: MakeCore,
) -> None:
    """The step and its write both hold the page; it frees only when both release it (PAGE-3)."""
    core = make_core(staging_depth=1)
    start(core, started("a"))
    published = save(core, [("a", blocks(0))], land_writes=False)
    (write,) = step_writes(published)
    consume(core, published.step_id)
    assert core.pages_in_use == 1, "the in-flight write still views the page"
    core.report(CopyStarted(tid=write.tid))
    core.report(CopyLanded(tid=write.tid))
    assert core.pages_in_use == 1, "host rows are not in the pool yet"
    core.report(WriteLanded(tid=write.tid))
    assert core.pages_in_use == 0
    core.save_begin(save_input([("a", blocks(1))]))
    assert _proceed(core) == PageClaimed(page=0)
    assert core.pages_in_use == 1, "the save in progress holds its page"
    core.save_abort(SaveAbort())
    assert core.pages_in_use == 0


def test_page_7_a_save_claims_the_page_that_was_free_at_its_begin(make_core: MakeCore) -> None:
    """The save knows its page from its begin and claims it, though a lower one freed up while
    it waited at the barrier; a save that found no page free claims the lowest freed (PAGE-7)."""
    core = make_core(staging_depth=3)
    start(core, started("a"))
    assert core.save_page is None, "no save in progress"
    first = save(core, [("a", blocks(0))], land_writes=False)
    (write,) = step_writes(first)
    assert write.page == 0
    consume(core, first.step_id)  # page 0 is held by the write alone now
    core.save_begin(save_input([("a", blocks(1))]))
    assert core.save_page == 1, "page 0 is held by the write the barrier waits for"
    assert isinstance(_proceed(core), AwaitTasks)
    land(core, write.tid)
    assert core.pages_in_use == 0, "page 0 is free again, and lower"
    assert core.save_page == 1
    assert _proceed(core) == PageClaimed(page=1)
    core.save_commit(SaveCommit(now_ns=0))
    assert core.save_page is None

    # Every page held at the begin: no page is known until one frees up, the lowest one then.
    full = make_core(staging_depth=2)
    steps = [save(full, []).step_id for _ in range(2)]
    full.save_begin(save_input([]))
    assert full.save_page is None
    assert isinstance(_proceed(full), AwaitPage)
    consume(full, steps[1])
    consume(full, steps[0])
    assert _proceed(full) == PageClaimed(page=0)
    assert full.save_page == 0


def test_page_3_a_held_page_is_never_handed_out(make_core: MakeCore) -> None:
    """While the only page is held by an open step, a save waits instead of taking it (PAGE-3)."""
    core = make_core(staging_depth=1)
    start(core, started("a"))
    step_id = save(core, [("a", blocks(0))]).step_id
    core.save_begin(save_input([("a", blocks(1))]))
    for now in (0, 10, 20):
        assert isinstance(_proceed(core, now), AwaitPage)
    consume(core, step_id)
    assert _proceed(core, 30) == PageClaimed(page=0)
    core.save_commit(SaveCommit(now_ns=30))


def test_page_4_a_page_wait_times_out_naming_open_steps_and_writes(make_core: MakeCore) -> None:
    """A save with no free page waits until its deadline, then raises PageTimeoutError (PAGE-4)."""
    core = make_core(staging_depth=2)
    start(core, started("a"))
    save(core, [("a", blocks(0))])
    save(core, [("a", blocks(1))])
    before = core.snapshot()
    t0 = 5_000
    core.save_begin(save_input([("a", blocks(2))], now_ns=t0))
    assert _proceed(core, t0) == AwaitPage(deadline_ns=t0 + TIMEOUT_NS)
    assert _proceed(core, t0 + TIMEOUT_NS - 1) == AwaitPage(deadline_ns=t0 + TIMEOUT_NS)
    error = raises_unchanged(core, PageTimeoutError, _proceed, core, t0 + TIMEOUT_NS)
    assert isinstance(error, OmniPrefixCacheStagingTimeoutError)
    assert error.open_step_ids == (1, 2)
    assert error.tasks_in_flight == ()
    assert error.timeout_s == 1.0
    assert "[1, 2]" in str(error)
    core.save_abort(SaveAbort())
    assert core.snapshot() == before
    assert core.counters.page_timeouts == 1


def test_page_4_a_zero_timeout_fails_at_once(make_core: MakeCore) -> None:
    """With `staging_claim_timeout_s == 0` a save that finds no page fails at once (PAGE-4)."""
    core = make_core(staging_depth=1, staging_claim_timeout_s=0)
    start(core, started("a"))
    save(core, [("a", blocks(0))])
    before = core.snapshot()
    core.save_begin(save_input([("a", blocks(1))], now_ns=7))
    raises_unchanged(core, PageTimeoutError, _proceed, core, 7)
    core.save_abort(SaveAbort())
    assert core.snapshot() == before


@pytest.mark.parametrize("bad", [-1.0, -1, math.inf, math.nan, 1e300])
def test_page_4_a_negative_or_non_finite_timeout_is_rejected_by_the_config(bad: float) -> None:
    """A negative or non-finite wait bound is rejected when the config is built (PAGE-4, FAIL-5)."""
    with pytest.raises(ConfigError) as info:
        config(staging_claim_timeout_s=bad)
    assert info.value.field == "staging_claim_timeout_s"


def test_page_5_a_step_larger_than_a_page_raises_before_claiming(make_core: MakeCore) -> None:
    """More immediate rows than a page holds raises OversizeStepError, unchanged (PAGE-5)."""
    core = make_core(staging_capacity_tokens=BLOCK)
    start(core, started("a"))
    error = raises_unchanged(
        core, OversizeStepError, core.save_begin, save_input([("a", [*blocks(0), 4])])
    )
    assert (error.rows, error.capacity) == (BLOCK + 1, BLOCK)
    assert isinstance(error, OmniPrefixCacheUnmatchError)
    assert core.pages_in_use == 0
    assert save(core, [("a", blocks(0))]).step_id == 1


def test_page_5_deferred_rows_are_not_bounded_by_the_page(make_core: MakeCore) -> None:
    """A step whose rows are all deferred is not an oversize step (PAGE-5 counts immediate rows)."""
    core = make_core(deferred_policy(hidden=False), staging_capacity_tokens=BLOCK)
    start(core, started("a"))
    published = save(core, [("a", blocks(0, 1))], immediate=(), deferred=(DEF,))
    assert not step_writes(published)
    assert _deferred_tid(published.effects, "a") > 0


# =============================================================================================
# SLOT: occupancy, versions, reuse.


def test_slot_1_a_slot_goes_unknown_in_transit_committed_absent_per_key(
    make_core: MakeCore,
) -> None:
    """Each (slot, key) moves UNKNOWN -> IN_TRANSIT -> COMMITTED, or to ABSENT (SLOT-1)."""
    core = make_core()
    assert core.presence(HIDDEN_KEY, 0) == (-2, 0)
    start(core, started("a"))
    published = save(core, [("a", blocks(0))], immediate=(HIDDEN_KEY, MM), land_writes=False)
    (write,) = step_writes(published)
    for key in (HIDDEN_KEY, MM):
        assert core.presence(key, 0) == (write.tid, 1)
        assert core.presence(key, 4) == (-2, 0)
    land(core, write.tid)
    for key in (HIDDEN_KEY, MM):
        assert core.presence(key, 0) == (0, 1)
    save(core, [("a", blocks(1))])
    # A version numbers the table's claims (D3): the second claim of each key stamps 2.
    assert core.presence(HIDDEN_KEY, 4) == (0, 2)
    assert core.presence(MM, 4) == (-1, 2), "a key the step did not write is ABSENT"
    assert core.presence(MM, 0) == (0, 1), "keys are independent of each other"


def test_slot_2_a_newer_claim_tombstones_the_in_flight_owner(make_core: MakeCore) -> None:
    """A write taking an in-flight slot owns it; the old owner gets a tombstone (SLOT-2)."""
    core = make_core(deferred_policy())
    start(core, started("a"), started("b"))
    first = save(core, [("a", blocks(0))], deferred=(DEF,))
    loser = _deferred_tid(first.effects, "a")
    second = save(core, [("b", [0, 1])], deferred=(DEF,))
    winner = _deferred_tid(second.effects, "b")
    (tomb,) = effects_of(second.effects, Tombstone)
    assert (tomb.tid, tomb.key, tomb.slots.tolist()) == (loser, DEF, [0, 1])
    assert core.presence(DEF, 0) == (winner, 2)
    assert core.presence(DEF, 2) == (loser, 1)
    claims = core.task_claims(loser)
    assert claims is not None and claims.tombstones[DEF][0].tolist() == [0, 1]


@pytest.mark.parametrize("y_owned_it", [False, True], ids=["fresh", "y-owned-it"])
def test_slot_2_a_slot_claimed_twice_in_one_step_goes_to_the_last_row(
    make_core: MakeCore, y_owned_it: bool
) -> None:
    """A slot claimed twice in a step goes to the last row's write (SLOT-2, TASK-5)."""
    core = make_core(deferred_policy())
    start(core, started("x"), started("y"))
    if y_owned_it:
        save(core, [("y", [0])], deferred=(DEF,))
    published = save(core, [("x", [0, 1]), ("y", [0])], deferred=(DEF,))
    tx, ty = _deferred_tid(published.effects, "x"), _deferred_tid(published.effects, "y")
    tombs = [(t.tid, t.key, t.slots.tolist()) for t in effects_of(published.effects, Tombstone)]
    assert tombs == [(tx, DEF, [0])], "only the earlier row's write loses the slot"
    version = 1 + y_owned_it  # the step's claim is the table's first or second (D3)
    assert core.presence(DEF, 0) == (ty, version)
    assert core.presence(DEF, 1) == (tx, version)
    start(core, finished("y"))
    land(core, ty)
    start(core, finished("x"))
    land(core, tx)
    assert [core.presence(DEF, s) for s in (0, 1)] == [(0, version), (0, version)]


def test_slot_3_a_landing_write_commits_only_the_slots_it_still_owns(make_core: MakeCore) -> None:
    """A write that lost slots commits the rest; the newer owner keeps the lost ones (SLOT-3)."""
    core = make_core(deferred_policy())
    start(core, started("a"), started("b"))
    loser = _deferred_tid(save(core, [("a", blocks(0))], deferred=(DEF,)).effects, "a")
    winner = _deferred_tid(save(core, [("b", [0, 1])], deferred=(DEF,)).effects, "b")
    effects = start(core, finished("a"))
    assert effects_of(effects, EscalateTasks) == [EscalateTasks(tids=(loser,))]
    land(core, loser)
    assert [core.presence(DEF, s) for s in (0, 1)] == [(winner, 2)] * 2
    assert [core.presence(DEF, s) for s in (2, 3)] == [(0, 1)] * 2


def test_slot_4_a_key_the_step_does_not_emit_becomes_absent_and_reads_zeros(
    make_core: MakeCore,
) -> None:
    """A cached key missing from a step turns its slots ABSENT; a later hit reads zeros (SLOT-4)."""
    core = make_core()
    start(core, started("a"))
    save(core, [("a", blocks(0))], immediate=(HIDDEN_KEY, MM))
    assert core.presence(MM, 0) == (0, 1)
    start(core, finished("a"), started("n"))
    save(core, [("n", blocks(0))])  # a new tenant of block 0 emits no MM
    assert [core.presence(MM, s) for s in blocks(0)] == [(-1, 2)] * BLOCK
    start(core, started("b", hit_end=BLOCK, block_ids=(0, 1)))
    step_id = save(core, [("b", blocks(1))], immediate=(HIDDEN_KEY, MM)).step_id
    reads = _reads(consume(core, step_id, ["b"]), "b")
    assert _sources(reads[MM]) == [ZEROS] * BLOCK
    assert _sources(reads[HIDDEN_KEY]) == [POOL] * BLOCK


def test_slot_4_absence_tombstones_a_displaced_writer(make_core: MakeCore) -> None:
    """Explicit absence displaces an in-flight owner with a tombstone, like a claim (SLOT-4)."""
    core = make_core(deferred_policy())
    start(core, started("a"), started("b"))
    loser = _deferred_tid(save(core, [("a", blocks(0))], deferred=(DEF,)).effects, "a")
    published = save(core, [("b", blocks(0))])
    (tomb,) = effects_of(published.effects, Tombstone)
    assert (tomb.tid, tomb.key, tomb.slots.tolist()) == (loser, DEF, blocks(0))
    assert [core.presence(DEF, s) for s in blocks(0)] == [(-1, 2)] * BLOCK


def test_slot_5_a_write_that_lost_a_slot_gets_no_new_rows_for_it(make_core: MakeCore) -> None:
    """A request resumed onto a slot its open write lost opens a new write (SLOT-5, D2)."""
    core = make_core(deferred_policy())
    start(core, started("a"), started("b"))
    first = _deferred_tid(save(core, [("a", blocks(0))], deferred=(DEF,)).effects, "a")
    save(core, [("b", [0])], deferred=(DEF,))
    resumed = save(core, [("a", [0])], deferred=(DEF,))
    (chunk,) = effects_of(resumed.effects, DeferredChunk)
    assert chunk.new_task and chunk.tid != first
    assert core.presence(DEF, 0) == (chunk.tid, 3)
    claims = core.task_claims(first)
    assert claims is not None
    assert claims.slots[DEF][0].tolist() == blocks(0), "no rows appended to the loser"
    assert core.open_write(ReqId("a")) == chunk.tid
    # The new write takes later chunks that it did not lose.
    (more,) = effects_of(save(core, [("a", [1])], deferred=(DEF,)).effects, DeferredChunk)
    assert (more.tid, more.new_task) == (chunk.tid, False)
    # Both writes are the request's: a finish escalates both (TASK-4).
    (escalate,) = effects_of(start(core, finished("a")), EscalateTasks)
    assert set(escalate.tids) == {first, chunk.tid}


def test_slot_6_occupancy_costs_eight_bytes_per_slot_and_key(make_core: MakeCore) -> None:
    """The occupancy tables cost 8 bytes per (slot, key) in total (SLOT-6, D3)."""
    core = make_core(deferred_policy())
    assert core.occupancy_metadata_bytes() == 0
    start(core, started("a"))
    save(core, [("a", blocks(0))], immediate=(HIDDEN_KEY, MM), deferred=(DEF,))
    num_slots = core.config.num_slots
    assert core.occupancy_metadata_bytes() == 8 * num_slots * 3
    for key in core.installed_keys:
        owners, versions = core.slot_owners(key), core.slot_versions(key)
        assert owners is not None and versions is not None
        assert (owners.dtype, versions.dtype) == (np.int32, np.uint32)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_d3_a_copied_table_keeps_owner_and_version_on_its_own_entries(how: str) -> None:
    """A copy's owner and version stay views of the copy's entries, not of the original (D3)."""
    table = OccupancyTable(8)
    table.take(np.array([1, 2]), 5)
    clone = copy.deepcopy(table) if how == "deepcopy" else pickle.loads(pickle.dumps(table))
    clone.commit(5, np.array([1, 2]))
    clone.take(np.array([2]), ABSENT)
    assert clone.owner.tolist()[:4] == [-2, 0, -1, -2]
    assert clone.version.tolist()[:4] == [0, 1, 2, 0]
    assert clone.claims == 2
    assert table.owner.tolist()[:4] == [-2, 5, 5, -2], "the original is untouched"
    assert (table.claims, table.version.tolist()[:4]) == (1, [0, 1, 1, 0])


def test_d3_a_claim_of_a_key_no_write_holds_skips_the_owner_lookup_only() -> None:
    """Told that nothing is in flight, a claim still stamps and owns every slot (D3)."""
    looked, skipped = OccupancyTable(8), OccupancyTable(8)
    for table, in_flight in ((looked, True), (skipped, False)):
        assert table.take(np.array([0, 3, 3]), 7, writes_in_flight=in_flight) == []
        assert (
            table.take(
                np.array([4, 5]), np.array([2, 3], dtype=np.int32), writes_in_flight=in_flight
            )
            == []
        )
    assert looked.owner.tolist() == skipped.owner.tolist() == [7, -2, -2, 7, 2, 3, -2, -2]
    assert looked.version.tolist() == skipped.version.tolist() == [1, 0, 0, 1, 2, 2, 0, 0]
    lost = looked.take(np.array([3, 4]), 9)
    assert [(tid, slots.tolist()) for tid, slots in lost] == [(2, [4]), (7, [3])]


# =============================================================================================
# TASK: write tasks.


def test_task_1_one_step_write_covers_every_immediate_key(make_core: MakeCore) -> None:
    """A step's immediate keys are written by one step write over the whole step (TASK-1, D1)."""
    core = make_core()
    start(core, started("a"), started("b"))
    published = save(
        core, [("a", blocks(0)), ("b", blocks(1))], immediate=(HIDDEN_KEY, MM), land_writes=False
    )
    (write,) = step_writes(published)
    assert write.keys == (HIDDEN_KEY, MM)
    assert write.step_id == published.step_id
    for key in (HIDDEN_KEY, MM):
        assert [core.presence(key, s)[0] for s in blocks(0, 1)] == [write.tid] * 8
    assert core.task_state(write.tid) is TaskState.QUEUED
    land(core, write.tid)


def test_task_1_one_open_deferred_write_per_request_takes_later_steps(
    make_core: MakeCore,
) -> None:
    """Each request has one open deferred write that later steps append to (TASK-1, D2)."""
    core = make_core(deferred_policy())
    start(core, started("a"), started("b"))
    first = save(core, [("a", [0]), ("b", [4])], deferred=(DEF,))
    chunks = effects_of(first.effects, DeferredChunk)
    assert [(c.req_id, c.new_task, c.row_start, c.row_end) for c in chunks] == [
        ("a", True, 0, 1),
        ("b", True, 1, 2),
    ]
    tids = {c.req_id: c.tid for c in chunks}
    assert len(set(tids.values())) == 2
    second = save(core, [("b", [5]), ("a", [1])], deferred=(DEF,))
    again = effects_of(second.effects, DeferredChunk)
    assert [(c.req_id, c.tid, c.new_task) for c in again] == [
        ("b", tids["b"], False),
        ("a", tids["a"], False),
    ]
    claims = core.task_claims(tids["a"])
    assert claims is not None and claims.chunks == 2
    assert core.task_state(tids["a"]) is TaskState.PENDING


SPEC_PATH = (TaskState.PENDING, TaskState.QUEUED, TaskState.COPYING, TaskState.HOST_READY)
MOVES = ("queue", "copy_started", "copy_landed", "write_landed", "fail")


def test_task_2_the_move_table_is_exactly_the_spec_path() -> None:
    """The move table holds the SPEC path plus FAILED from every non-terminal state (TASK-2)."""
    path = [*SPEC_PATH, TaskState.WRITTEN]
    expected = {
        (path[i], how): path[i + 1]
        for i, how in enumerate(("queue", "copy_started", "copy_landed", "write_landed"))
    }
    expected.update({(state, "fail"): TaskState.FAILED for state in SPEC_PATH})
    assert dict(_TASK_MOVES) == expected


def _deferred_task_in(make_core: MakeCore, state: TaskState) -> tuple[CacheCore, Tid]:
    """A core with request a's deferred write in `state` (WRITTEN and FAILED: retired)."""
    core = make_core(deferred_policy())
    start(core, started("a"))
    tid = _deferred_tid(save(core, [("a", blocks(0))], deferred=(DEF,)).effects, "a")
    if state is TaskState.PENDING:
        return core, tid
    start(core, finished("a"))  # TASK-4: escalation is the only way to QUEUED
    if state is TaskState.FAILED:
        core.report(WriteFailed(tid=tid, reason="disk full"))
    else:
        land(core, tid, state)
    assert core.task_state(tid) is (None if state.value >= TaskState.WRITTEN.value else state)
    return core, tid


def _apply_move(core: CacheCore, tid: Tid, how: str) -> None:
    if how == "queue":
        core._writes.move(
            tid, TaskMove(how)
        )  # no report queues a task; the table is still the only gate
    elif how == "copy_started":
        core.report(CopyStarted(tid=tid))
    elif how == "copy_landed":
        core.report(CopyLanded(tid=tid))
    elif how == "write_landed":
        core.report(WriteLanded(tid=tid))
    else:
        core.report(WriteFailed(tid=tid, reason="copy failed"))


@pytest.mark.parametrize(("state", "how"), sorted(_TASK_MOVES, key=lambda p: (p[0].value, p[1])))
def test_task_2_every_legal_move_moves_the_task(
    make_core: MakeCore, state: TaskState, how: str
) -> None:
    """Each (state, move) pair of the table moves the task to the table's next state (TASK-2)."""
    core, tid = _deferred_task_in(make_core, state)
    target = _TASK_MOVES[(state, how)]
    if how == "queue":
        start(core, finished("a"))  # the public way a PENDING write is queued
    else:
        _apply_move(core, tid, how)
    if target in (TaskState.WRITTEN, TaskState.FAILED):
        assert core.task_state(tid) is None, "a terminal task leaves the registry"
        assert (core.fatal is not None) == (target is TaskState.FAILED)
    else:
        assert core.task_state(tid) is target


ILLEGAL = [(state, how) for state in TaskState for how in MOVES if (state, how) not in _TASK_MOVES]


@pytest.mark.parametrize(("state", "how"), ILLEGAL)
def test_task_2_every_other_move_raises_and_changes_nothing(
    make_core: MakeCore, state: TaskState, how: str
) -> None:
    """A (state, move) pair outside the table raises IllegalTransitionError, unchanged (TASK-2)."""
    core, tid = _deferred_task_in(make_core, state)
    error = raises_unchanged(core, IllegalTransitionError, _apply_move, core, tid, how)
    assert error.tid == tid
    retired = state in (TaskState.WRITTEN, TaskState.FAILED)
    assert error.from_state == ("RETIRED" if retired else state.name)


def test_task_2_escalation_never_requeues_a_copying_write(make_core: MakeCore) -> None:
    """A budget flush of a write already copying waits on it instead of re-queueing it (TASK-2)."""
    core = make_core(deferred_policy())
    start(core, started("a"), started("b"))
    victim = _deferred_tid(
        save(core, [("a", blocks(0))], deferred=(DEF,), deferred_bytes=600).effects, "a"
    )
    core.save_begin(save_input([("b", blocks(1))], deferred=(DEF,), deferred_bytes=600))
    assert _proceed(core) == EscalateTasks(tids=(victim,))
    core.report(CopyStarted(tid=victim))
    again = _proceed(core)
    assert isinstance(again, AwaitTasks) and again.what == "budget flush"
    assert again.waits == ((victim, TaskState.WRITTEN),)
    assert core.task_state(victim) is TaskState.COPYING
    core.report(CopyLanded(tid=victim))
    # BUDGET-2: copied is not enough, the flushed write is awaited until it is written.
    assert _proceed(core) == again
    core.report(WriteLanded(tid=victim))
    assert isinstance(_proceed(core), PageClaimed)
    core.save_commit(SaveCommit(now_ns=0))


def test_task_3_the_next_save_waits_until_the_step_write_is_written(make_core: MakeCore) -> None:
    """The next save proceeds only once the previous step write is WRITTEN (TASK-3, D8)."""
    core = make_core()
    start(core, started("a"))
    (write,) = step_writes(save(core, [("a", blocks(0))], land_writes=False))
    core.save_begin(save_input([("a", blocks(1))], now_ns=100))
    wait = _proceed(core, 100)
    assert wait == AwaitTasks(
        waits=((write.tid, TaskState.WRITTEN),),
        deadline_ns=100 + TIMEOUT_NS,
        what="save barrier",
    )
    core.report(CopyStarted(tid=write.tid))
    core.report(CopyLanded(tid=write.tid))
    assert _proceed(core, 200) == wait, "HOST_READY is not enough: the pool write may be pending"
    core.report(WriteLanded(tid=write.tid))
    assert isinstance(_proceed(core, 300), PageClaimed)
    core.save_commit(SaveCommit(now_ns=300))


def test_task_3_the_next_save_waits_for_escalated_deferred_writes_to_be_host_ready(
    make_core: MakeCore,
) -> None:
    """An escalated deferred write must be at least HOST_READY before the next save (TASK-3)."""
    core = make_core(deferred_policy())
    start(core, started("a"))
    tid = _deferred_tid(save(core, [("a", blocks(0))], deferred=(DEF,)).effects, "a")
    start(core, finished("a"), started("b"))
    core.save_begin(save_input([("b", blocks(1))]))
    wait = _proceed(core)
    assert isinstance(wait, AwaitTasks)
    assert wait.waits == ((tid, TaskState.HOST_READY),)
    core.report(CopyStarted(tid=tid))
    assert _proceed(core) == wait
    core.report(CopyLanded(tid=tid))
    assert isinstance(_proceed(core), PageClaimed)
    core.save_commit(SaveCommit(now_ns=0))
    assert core.task_state(tid) is TaskState.HOST_READY
    land(core, tid)


def test_task_3_a_barrier_that_runs_out_raises_naming_the_task_and_its_state(
    make_core: MakeCore,
) -> None:
    """A barrier past its deadline raises WaitTimeoutError naming the write and state (TASK-3)."""
    core = make_core()
    start(core, started("a"))
    (write,) = step_writes(save(core, [("a", blocks(0))], land_writes=False))
    core.report(CopyStarted(tid=write.tid))
    core.save_begin(save_input([("a", blocks(1))]))
    _proceed(core, 0)
    error = raises_unchanged(core, WaitTimeoutError, _proceed, core, TIMEOUT_NS)
    assert (error.what, error.tid, error.state, error.timeout_s) == (
        "save barrier",
        write.tid,
        "COPYING",
        1.0,
    )
    assert f"write task {write.tid}" in str(error) and "COPYING" in str(error)
    core.save_abort(SaveAbort())
    land(core, write.tid)


def _task_4_scenario(core: CacheCore, end: Any) -> tuple[Tid, Tid, Any]:
    start(core, started("a"), started("b"))
    published = save(core, [("a", blocks(0)), ("b", blocks(1))], deferred=(DEF,))
    ta, tb = _deferred_tid(published.effects, "a"), _deferred_tid(published.effects, "b")
    return ta, tb, start(core, end("a"))


@pytest.mark.parametrize("end", [finished, aborted], ids=["finished", "aborted"])
def test_task_4_a_finish_escalates_open_writes_and_rolls_nothing_back(
    make_core: MakeCore, end: Any
) -> None:
    """A finished or aborted request's writes are escalated and still serve hits (TASK-4)."""
    core = make_core(deferred_policy())
    ta, tb, effects = _task_4_scenario(core, end)
    assert effects == (EscalateTasks(tids=(ta,)),)
    assert core.task_state(ta) is TaskState.QUEUED
    assert core.task_state(tb) is TaskState.PENDING
    assert core.presence(DEF, 0) == (ta, 1), "nothing is rolled back"
    start(core, started("c", hit_end=BLOCK, block_ids=(0, 2)))
    step_id = save(core, [("c", blocks(2))], deferred=(DEF,)).step_id
    reads = _reads(consume(core, step_id, ["c"]), "c")
    assert _sources(reads[DEF]) == [TASK] * BLOCK
    assert reads[DEF].writer.tolist() == [ta] * BLOCK
    assert reads[DEF].chunk_limit == ((ta, 1),)
    assert _sources(reads[HIDDEN_KEY]) == [POOL] * BLOCK


def test_task_4_finish_and_abort_are_treated_alike(make_core: MakeCore) -> None:
    """A finish and an abort of the same request leave identical states (TASK-4)."""
    done, killed = make_core(deferred_policy()), make_core(deferred_policy())
    assert _task_4_scenario(done, finished) == _task_4_scenario(killed, aborted)
    assert done.snapshot() == killed.snapshot()


def test_task_5_the_last_row_of_a_repeated_slot_wins(make_core: MakeCore) -> None:
    """A slot written twice in a step reads its last row; chunks keep their order (TASK-5)."""
    core = make_core(deferred_policy())
    start(core, started("a"), started("b", hit_end=BLOCK, block_ids=(0, 1)))
    published = save(core, [("a", [0, 1, 2, 3, 0]), ("b", blocks(1))], deferred=(DEF,))
    reads = _reads(consume(core, published.step_id, ["b"]), "b")
    for read in reads.values():
        assert _sources(read) == [THIS_STEP] * BLOCK
        assert read.step_row.tolist() == [4, 1, 2, 3]
    tid = _deferred_tid(published.effects, "a")
    save(core, [("a", [1])], deferred=(DEF,))
    claims = core.task_claims(tid)
    assert claims is not None
    chunks = [c.tolist() for c in claims.slots[DEF]]
    assert chunks == [[0, 1, 2, 3, 0], [1]], "chunks stay in append order for the writer"


@pytest.mark.parametrize("fails", [False, True], ids=["landed", "failed"])
def test_task_6_a_finished_write_leaves_and_releases_its_page_in_the_same_input(
    make_core: MakeCore, fails: bool
) -> None:
    """The input that ends a write retires it and frees its page and charge at once (TASK-6)."""
    core = make_core()
    start(core, started("a"))
    published = save(core, [("a", blocks(0))], immediate_bytes=64, land_writes=False)
    (write,) = step_writes(published)
    consume(core, published.step_id)
    core.report(CopyStarted(tid=write.tid))
    assert (core.pages_in_use, core.budget_used) == (1, 64)
    if fails:
        core.report(WriteFailed(tid=write.tid, reason="pool write failed"))
    else:
        core.report(CopyLanded(tid=write.tid))
        core.report(WriteLanded(tid=write.tid))
    assert core.task_state(write.tid) is None
    assert (core.pages_in_use, core.budget_used) == (0, 0)


# =============================================================================================
# BUDGET: device-clone bytes.


def test_budget_1_a_clone_is_charged_once_however_many_writes_view_it(
    make_core: MakeCore,
) -> None:
    """One clone viewed by two writes is charged once and freed by the last viewer (BUDGET-1)."""
    core = make_core(deferred_policy())
    start(core, started("a"), started("b"))
    published = save(
        core, [("a", blocks(0)), ("b", blocks(1))], deferred=(DEF,), deferred_bytes=300
    )
    assert core.budget_used == 300
    ta, tb = _deferred_tid(published.effects, "a"), _deferred_tid(published.effects, "b")
    start(core, finished("a"))
    land(core, ta)
    assert core.budget_used == 300, "b still views the clone"
    start(core, finished("b"))
    land(core, tb, TaskState.COPYING)
    assert core.budget_used == 300
    land(core, tb, TaskState.HOST_READY)
    assert core.budget_used == 0
    land(core, tb)


def test_budget_1_immediate_clones_are_charged_until_their_copy_lands(
    make_core: MakeCore,
) -> None:
    """The step's immediate clone is charged from the save until its copy is done (BUDGET-1)."""
    core = make_core()
    start(core, started("a"))
    (write,) = step_writes(save(core, [("a", blocks(0))], immediate_bytes=200, land_writes=False))
    assert core.budget_used == 200
    core.report(CopyStarted(tid=write.tid))
    assert core.budget_used == 200
    core.report(CopyLanded(tid=write.tid))
    assert core.budget_used == 0
    core.report(WriteLanded(tid=write.tid))
    assert core.budget_used == 0


def test_budget_1_a_charge_no_write_views_is_given_back_at_commit(make_core: MakeCore) -> None:
    """Bytes announced for a save that clones nothing are not kept charged (BUDGET-1)."""
    core = make_core()
    core.save_begin(save_input([], immediate_bytes=100, deferred_bytes=50))
    assert isinstance(_proceed(core), PageClaimed)
    assert core.budget_used == 150
    core.save_commit(SaveCommit(now_ns=0))
    assert core.budget_used == 0


def _budget_2_scenario(core: CacheCore) -> tuple[Tid, Tid]:
    start(core, started("a"), started("b"), started("c"))
    ta = _deferred_tid(
        save(core, [("a", blocks(0))], deferred=(DEF,), deferred_bytes=600).effects, "a"
    )
    tb = _deferred_tid(
        save(core, [("b", blocks(1))], deferred=(DEF,), deferred_bytes=300).effects, "b"
    )
    assert core.budget_used == 900
    core.save_begin(save_input([("c", blocks(2))], deferred=(DEF,), deferred_bytes=500))
    return ta, tb


def test_budget_2_a_save_over_budget_flushes_the_oldest_write_first(make_core: MakeCore) -> None:
    """An over-budget save escalates the oldest write, waits it, then fits (BUDGET-2)."""
    core = make_core(deferred_policy())
    ta, tb = _budget_2_scenario(core)
    assert _proceed(core) == EscalateTasks(tids=(ta,))
    assert core.counters.budget_flushes == 1
    assert core.task_state(ta) is TaskState.QUEUED
    wait = _proceed(core, 10)
    assert wait == AwaitTasks(
        waits=((ta, TaskState.WRITTEN),), deadline_ns=10 + TIMEOUT_NS, what="budget flush"
    )
    land(core, ta)
    assert core.budget_used == 300
    assert isinstance(_proceed(core, 20), PageClaimed)
    assert core.budget_used == 800
    core.save_commit(SaveCommit(now_ns=20))
    assert core.task_state(tb) is TaskState.PENDING, "only as much as needed is flushed"
    (chunk,) = effects_of(save(core, [("a", blocks(3))], deferred=(DEF,)).effects, DeferredChunk)
    assert chunk.new_task and chunk.tid != ta, "the flushed write was closed"


def test_budget_2_a_copied_write_is_still_flushed_first_and_awaited_until_written(
    make_core: MakeCore,
) -> None:
    """The oldest unfinished write is the victim even once it copied; then the next (BUDGET-2)."""
    core = make_core(deferred_policy())
    start(core, started("a"), started("b"), started("c"))
    ta = _deferred_tid(
        save(core, [("a", blocks(0))], deferred=(DEF,), deferred_bytes=600).effects, "a"
    )
    tb = _deferred_tid(
        save(core, [("b", blocks(1))], deferred=(DEF,), deferred_bytes=300).effects, "b"
    )
    assert start(core, finished("a")) == (EscalateTasks(tids=(ta,)),)
    core.report(CopyStarted(tid=ta))
    core.report(CopyLanded(tid=ta))
    assert core.budget_used == 300, "a copied write holds no charge"
    core.save_begin(save_input([("c", blocks(2))], deferred=(DEF,), deferred_bytes=800))
    # ta frees nothing by itself, but it is the oldest unfinished write: "copy and write".
    assert _proceed(core) == AwaitTasks(
        waits=((ta, TaskState.WRITTEN),), deadline_ns=TIMEOUT_NS, what="budget flush"
    )
    core.report(WriteLanded(tid=ta))
    assert _proceed(core) == EscalateTasks(tids=(tb,)), "still over: the next oldest"
    land(core, tb)
    assert isinstance(_proceed(core), PageClaimed)
    assert core.budget_used == 800


def test_budget_2_with_nothing_left_to_flush_a_save_is_admitted(make_core: MakeCore) -> None:
    """A step larger than the whole budget is admitted instead of waiting forever (BUDGET-2)."""
    core = make_core()
    start(core, started("a"))
    core.save_begin(save_input([("a", blocks(0))], immediate_bytes=5000))
    assert isinstance(_proceed(core), PageClaimed)
    published = core.save_commit(SaveCommit(now_ns=0))
    assert core.budget_used == 5000
    land(core, step_writes(published)[0].tid)
    assert core.budget_used == 0


def test_budget_2_a_budget_flush_that_runs_out_raises(make_core: MakeCore) -> None:
    """A budget flush past its deadline raises WaitTimeoutError naming the write (BUDGET-2)."""
    core = make_core(deferred_policy())
    ta, _ = _budget_2_scenario(core)
    _proceed(core, 0)
    _proceed(core, 0)
    error = raises_unchanged(core, WaitTimeoutError, _proceed, core, TIMEOUT_NS)
    assert (error.what, error.tid, error.state) == ("budget flush", ta, "QUEUED")
    core.save_abort(SaveAbort())
    assert core.budget_used == 900
    land(core, ta)


# =============================================================================================
# HIT: planning where each hit row comes from.


def test_hit_1_a_start_with_a_hit_asks_to_prefetch_its_committed_rows(
    make_core: MakeCore,
) -> None:
    """A hit registered at start asks to prefetch its committed rows, per key (HIT-1, HIT-7)."""
    core = make_core()
    start(core, started("a"))
    save(core, [("a", blocks(0, 1))], immediate=(HIDDEN_KEY, MM))
    effects = start(core, started("b", hit_end=2 * BLOCK, block_ids=(0, 3, 2)))
    prefetch = effects_of(effects, PrefetchRead)
    assert [(p.req_id, p.key) for p in prefetch] == [("b", HIDDEN_KEY), ("b", MM)]
    for p in prefetch:
        assert p.positions.tolist() == [0, 1, 2, 3], "block 3 was never written"
        assert p.slots.tolist() == blocks(0)
    assert len({p.read_id for p in prefetch}) == 2
    assert core.counters.hit_requests == 1


def test_hit_7_a_start_without_prefetch_asks_for_none_and_plans_the_same_reads(
    make_core: MakeCore,
) -> None:
    """An adapter that does not prefetch gets no PrefetchRead; the save plans the same reads,
    read ids included, and the consume hands out the same plan (HIT-7)."""
    plans = []
    for prefetch in (True, False):
        core = make_core()
        start(core, started("a"))
        save(core, [("a", blocks(0, 1))], immediate=(HIDDEN_KEY, MM))
        effects = start(
            core, started("b", hit_end=2 * BLOCK, block_ids=(0, 1, 2)), prefetch=prefetch
        )
        assert bool(effects_of(effects, PrefetchRead)) is prefetch
        step_id = save(core, [("b", blocks(2))], immediate=(HIDDEN_KEY, MM)).step_id
        plans.append((core.snapshot(), consume(core, step_id, ["b"])))
    (with_snapshot, with_plan), (without_snapshot, without_plan) = plans
    assert without_snapshot == with_snapshot

    def reads(plan: ConsumePlan) -> list[tuple[object, ...]]:
        return [
            (r.read_id, r.req_id, r.key, r.slots.tolist(), r.source.tolist()) for r in plan.reads
        ]

    assert reads(without_plan) == reads(with_plan)
    assert len(with_plan.reads) == 2
    assert positions(without_plan) == positions(with_plan) == [(0, 3 * BLOCK)]


@pytest.mark.parametrize(
    ("hit_end", "block_ids", "names"),
    [
        (3, (0,), ["hit_end=3", "block_size=4", "multiple of block_size"]),
        (BLOCK, (), ["hit_end=4", "block_size=4", "no block ids"]),
        (2 * BLOCK, (0,), ["hit_end=8", "block_size=4", "1 blocks"]),
        (BLOCK, (8,), ["[0, 8)", "[8]"]),
    ],
    ids=["unaligned", "no-blocks", "too-few-blocks", "block-out-of-range"],
)
def test_hit_1_a_bad_hit_raises_naming_the_request_and_changes_nothing(
    make_core: MakeCore, hit_end: int, block_ids: tuple[int, ...], names: list[str]
) -> None:
    """An unaligned or blockless hit raises naming request and sizes; no record applies (HIT-1)."""
    core = make_core(deferred_policy())
    start(core, started("a"))
    save(core, [("a", blocks(0))], deferred=(DEF,))
    error = raises_unchanged(
        core,
        BadInputError,
        start,
        core,
        finished("a"),
        started("b", hit_end=hit_end, block_ids=block_ids),
    )
    for name in ("'b'", *names):
        assert name in str(error)
    assert ReqId("a") in core.request_states(), (
        "the finish before the bad start is not applied either"
    )


def test_hit_1_a_continuation_opens_no_new_hit(make_core: MakeCore) -> None:
    """A live request that re-enters as started registers no hit and prefetches nothing (HIT-1)."""
    core = make_core()
    start(core, started("a"))
    first = save(core, [("a", blocks(0))]).step_id
    assert start(core, started("a", hit_end=BLOCK, block_ids=(0, 1))) == ()
    step_id = save(core, [("a", blocks(1))]).step_id
    consume(core, first, ["a"])
    assert consume(core, step_id, ["a"]).reads == ()
    assert core.counters.hit_requests == 0


def test_hit_1_a_hit_request_missing_from_the_save_raises(make_core: MakeCore) -> None:
    """A save whose layout leaves out a request that started with a hit raises (HIT-1, SPEC 12)."""
    core = make_core()
    start(core, started("a"))
    save(core, [("a", blocks(0))])
    start(core, started("b", hit_end=BLOCK, block_ids=(0, 1)), started("c"))
    error = raises_unchanged(core, BadInputError, core.save_begin, save_input([("c", blocks(2))]))
    assert "'b'" in str(error)
    step_id = save(core, [("b", [4]), ("c", blocks(2))]).step_id
    (read,) = consume(core, step_id, ["b"]).reads
    assert read.slots.tolist() == blocks(0)


def test_hit_1_a_hit_whose_start_no_save_followed_must_end_first(make_core: MakeCore) -> None:
    """A hit whose start no save followed makes its request unsaveable until it ends (D10)."""
    core = make_core()
    start(core, started("a"))
    save(core, [("a", blocks(0))])
    start(core, started("b", hit_end=BLOCK, block_ids=(0, 1)))
    start(core)  # the forward failed: no save for that start
    error = raises_unchanged(core, BadInputError, core.save_begin, save_input([("b", [4])]))
    assert "'b'" in str(error) and "lost their hit" in str(error)
    start(core, aborted("b"), started("b", hit_end=BLOCK, block_ids=(0, 1)))
    step_id = save(core, [("b", [4])]).step_id
    (read,) = consume(core, step_id, ["b"]).reads
    assert read.slots.tolist() == blocks(0)


def test_hit_2_finishes_apply_before_starts(make_core: MakeCore) -> None:
    """A request finished and re-admitted in one step is a new request with a new hit (HIT-2)."""
    core = make_core(deferred_policy())
    start(core, started("a"))
    old = _deferred_tid(save(core, [("a", blocks(0))], deferred=(DEF,)).effects, "a")
    effects = start(core, started("a", hit_end=BLOCK, block_ids=(0, 1)), finished("a"))
    assert effects[0] == EscalateTasks(tids=(old,))
    assert [(p.req_id, p.key) for p in effects_of(effects, PrefetchRead)] == [("a", HIDDEN_KEY)]
    published = save(core, [("a", blocks(1))], deferred=(DEF,))
    (chunk,) = effects_of(published.effects, DeferredChunk)
    assert chunk.new_task and chunk.tid != old
    reads = _reads(consume(core, published.step_id, ["a"]), "a")
    assert _sources(reads[HIDDEN_KEY]) == [POOL] * BLOCK
    assert _sources(reads[DEF]) == [TASK] * BLOCK
    assert reads[DEF].writer.tolist() == [old] * BLOCK


def test_hit_3_each_row_is_planned_from_its_slot_state(make_core: MakeCore) -> None:
    """Rows read the pool if committed, their write if deferred in flight, else zeros (HIT-3)."""
    core = make_core(deferred_policy())
    start(core, started("a"))
    first = save(core, [("a", blocks(0))], immediate=(HIDDEN_KEY, MM), deferred=(DEF,))
    ta = _deferred_tid(first.effects, "a")
    save(core, [("a", blocks(1))], deferred=(DEF,))  # MM absent on block 1
    start(core, started("c", hit_end=2 * BLOCK, block_ids=(0, 1, 4)))
    step_id = save(core, [("c", blocks(4))], immediate=(HIDDEN_KEY, MM), deferred=(DEF,)).step_id
    save(core, [("a", blocks(5))], deferred=(DEF,))  # a chunk appended after planning
    reads = _reads(consume(core, step_id, ["c"]), "c")
    assert set(reads) == {HIDDEN_KEY, MM, DEF}
    assert _sources(reads[HIDDEN_KEY]) == [POOL] * 8
    assert _sources(reads[MM]) == [POOL] * 4 + [ZEROS] * 4
    assert _sources(reads[DEF]) == [TASK] * 8
    assert reads[DEF].writer.tolist() == [ta] * 8
    assert reads[DEF].chunk_limit == ((ta, 2),), "rows appended later belong to a newer tenant"
    assert reads[HIDDEN_KEY].writer.tolist() == [0] * 8


def test_hit_3_an_immediate_write_reaches_the_pool_before_a_hit_reads_it(
    make_core: MakeCore,
) -> None:
    """A hit on a step write's slots is planned on the pool once the write lands (HIT-3)."""
    core = make_core()
    start(core, started("a"))
    (write,) = step_writes(save(core, [("a", blocks(0))], land_writes=False))
    start(core, started("b", hit_end=BLOCK, block_ids=(0, 1)))
    core.save_begin(save_input([("b", blocks(1))]))
    wait = _proceed(core)
    assert isinstance(wait, AwaitTasks) and wait.waits == ((write.tid, TaskState.WRITTEN),)
    land(core, write.tid)
    assert isinstance(_proceed(core), PageClaimed)
    step_id = core.save_commit(SaveCommit(now_ns=0)).step_id
    (read,) = consume(core, step_id, ["b"]).reads
    assert _sources(read) == [POOL] * BLOCK, "never a staging view that may be recycled"
    assert AFTER_WRITE not in _sources(read)


def test_hit_3_a_key_first_seen_after_the_prefix_reads_zeros(make_core: MakeCore) -> None:
    """A key unknown when the prefix was written is planned at save and reads zeros (HIT-3, D4)."""
    core = make_core()
    start(core, started("a"))
    save(core, [("a", blocks(0))])
    zeta = TensorName("zeta")
    effects = start(core, started("b", hit_end=BLOCK, block_ids=(0, 1)))
    assert [p.key for p in effects_of(effects, PrefetchRead)] == [HIDDEN_KEY]
    step_id = save(core, [("b", blocks(1))], immediate=(HIDDEN_KEY, zeta)).step_id
    reads = _reads(consume(core, step_id, ["b"]), "b")
    assert _sources(reads[zeta]) == [ZEROS] * BLOCK
    assert _sources(reads[HIDDEN_KEY]) == [POOL] * BLOCK


def test_hit_4_a_hidden_hit_on_unknown_rows_raises_and_is_never_a_miss(
    make_core: MakeCore,
) -> None:
    """A hidden-state hit on never-written slots raises HitUnreadableError at consume (HIT-4)."""
    core = make_core()
    start(core, started("a"))
    save(core, [("a", blocks(1))])
    start(core, started("b", hit_end=2 * BLOCK, block_ids=(0, 1, 2)))
    step_id = save(core, [("b", blocks(2))]).step_id
    with pytest.raises(HitUnreadableError) as info:
        consume(core, step_id, ["b"])
    error = info.value
    assert (error.req_id, error.key, error.slot_count) == ("b", HIDDEN_KEY, 8)
    assert "4 of 8" in error.reason
    assert core.open_step_ids == (1,), "the step counts as consumed"
    assert core.pages_in_use == 1
    raises_unchanged(
        core,
        StepAlreadyConsumedError,
        core.consume_begin,
        ConsumeBegin(step_id=step_id, req_ids=None, now_ns=0),
    )


def test_hit_4_an_unreadable_hit_does_not_block_a_discard_or_other_requests(
    make_core: MakeCore,
) -> None:
    """Only a materialize that asks for the unreadable request raises (HIT-4)."""
    core = make_core()
    start(core, started("a"), started("b", hit_end=BLOCK, block_ids=(0, 1)))
    first = save(core, [("a", blocks(2)), ("b", blocks(1))]).step_id
    assert consume(core, first, ["a"]).reads == ()
    start(core, started("c", hit_end=BLOCK, block_ids=(3, 4)))
    second = save(core, [("c", blocks(4))]).step_id
    assert consume(core, second).discard


def test_hit_5_a_same_step_producer_wins_over_an_older_tenant(make_core: MakeCore) -> None:
    """A hit on slots another request of the step writes reads that request's rows (HIT-5)."""
    core = make_core()
    start(core, started("a"))
    save(core, [("a", blocks(0))], immediate=(HIDDEN_KEY, MM))
    start(core, finished("a"), started("c"), started("b", hit_end=BLOCK, block_ids=(0, 1)))
    step_id = save(core, [("c", blocks(0)), ("b", blocks(1))], immediate=(HIDDEN_KEY, MM)).step_id
    reads = _reads(consume(core, step_id, ["b"]), "b")
    for read in reads.values():
        assert _sources(read) == [THIS_STEP] * BLOCK
        assert read.step_row.tolist() == [0, 1, 2, 3]
        assert not read.preserved.any()


def _hit_6_scenario(core: CacheCore) -> StepId:
    start(core, started("a"))
    save(core, [("a", blocks(0))], immediate=(HIDDEN_KEY, MM))
    start(core, started("b", hit_end=BLOCK, block_ids=(0, 1)))
    return save(core, [("b", blocks(1))], immediate=(HIDDEN_KEY, MM)).step_id


def test_hit_6_a_delayed_read_is_preserved_before_a_new_tenant_writes(
    make_core: MakeCore,
) -> None:
    """Rows an unconsumed step planned on are preserved before a new write claims them (HIT-6)."""
    core = make_core()
    delayed = _hit_6_scenario(core)
    start(core, finished("a"), started("c"))
    published = save(core, [("c", [2, 3, 8])], immediate=(HIDDEN_KEY, MM), land_writes=False)
    kinds = [type(e) for e in published.effects]
    preserve = effects_of(published.effects, Preserve)
    assert [p.key for p in preserve] == [HIDDEN_KEY, MM]
    for p in preserve:
        assert p.positions.tolist() == [2, 3] and p.slots.tolist() == [2, 3]
    assert max(i for i, k in enumerate(kinds) if k is Preserve) < kinds.index(StepWrite)
    land(core, step_writes(published)[0].tid)
    reads = _reads(consume(core, delayed, ["b"]), "b")
    for read in reads.values():
        assert read.preserved.tolist() == [False, False, True, True]
        assert _sources(read) == [POOL] * BLOCK
        assert {p.read_id for p in preserve} >= {read.read_id}


def test_hit_6_a_slot_changed_behind_a_delayed_read_makes_it_raise(make_core: MakeCore) -> None:
    """A planned slot whose version moved without a preserved copy makes the read raise (HIT-6)."""
    core = make_core()
    delayed = _hit_6_scenario(core)
    # Corrupt on purpose, in the slot tables themselves: slot 0 changes tenant without passing
    # through copy-on-write.
    core._slots.by_key[HIDDEN_KEY].version[0] += 1
    start(core, finished("a"), started("c"))
    published = save(core, [("c", blocks(0))])
    preserve = {p.key: p.positions.tolist() for p in effects_of(published.effects, Preserve)}
    assert preserve == {HIDDEN_KEY: [1, 2, 3], MM: [0, 1, 2, 3]}
    with pytest.raises(HitUnreadableError) as info:
        consume(core, delayed, ["b"])
    assert "HIT-6" in info.value.reason
    assert delayed not in core.open_step_ids


def test_hit_6_a_write_preserves_only_the_rows_it_takes_from_unconsumed_reads(
    make_core: MakeCore,
) -> None:
    """With several steps unconsumed, a write preserves exactly the planned rows it takes, read
    by read in read order, and a write that takes none of them preserves nothing (HIT-6)."""
    core = make_core(num_blocks=16)
    start(core, started("a"), started("e"), started("f"))
    warm = save(
        core, [("a", blocks(0)), ("e", blocks(2)), ("f", blocks(4))], immediate=(HIDDEN_KEY, MM)
    )
    consume(core, warm.step_id)
    start(core, started("b", hit_end=BLOCK, block_ids=(0, 1)))
    first = save(core, [("b", blocks(1))], immediate=(HIDDEN_KEY, MM)).step_id
    # Two hits in one step: the second one's rows follow the first's in the step's reads.
    start(
        core,
        started("c", hit_end=BLOCK, block_ids=(2, 3)),
        started("d", hit_end=BLOCK, block_ids=(4, 5)),
    )
    second = save(core, [("c", blocks(3)), ("d", blocks(5))], immediate=(HIDDEN_KEY, MM)).step_id
    # A write on slots no unconsumed step planned on.
    start(core, finished("a"), finished("e"), finished("f"), started("x"))
    published = save(core, [("x", blocks(6))], immediate=(HIDDEN_KEY, MM))
    assert effects_of(published.effects, Preserve) == []
    consume(core, published.step_id)
    # A write over two of d's hit rows (slots 17 and 18) and none of b's or c's.
    start(core, started("y"))
    published = save(core, [("y", [17, 18, 40])], immediate=(HIDDEN_KEY, MM))
    preserve = effects_of(published.effects, Preserve)
    for p in preserve:
        assert p.positions.tolist() == [1, 2] and p.slots.tolist() == [17, 18]
    plan = consume(core, second, ["c", "d"])
    touched = _reads(plan, "d")
    assert [(p.read_id, p.key) for p in preserve] == [
        (touched[HIDDEN_KEY].read_id, HIDDEN_KEY),
        (touched[MM].read_id, MM),
    ]
    for read in touched.values():
        assert read.preserved.tolist() == [False, True, True, False]
    untouched = [*_reads(plan, "c").values(), *_reads(consume(core, first, ["b"]), "b").values()]
    assert len(untouched) == 4
    for read in untouched:
        assert not read.preserved.any() and _sources(read) == [POOL] * BLOCK


def test_hit_7_the_final_plan_overrides_prefetched_rows_of_the_same_read(
    make_core: MakeCore,
) -> None:
    """A prefetched read keeps its id, and rows the step itself writes switch to it (HIT-7, D4)."""
    core = make_core()
    start(core, started("a"))
    save(core, [("a", blocks(0, 1))])
    effects = start(core, started("c"), started("b", hit_end=2 * BLOCK, block_ids=(0, 1, 2)))
    (prefetch,) = effects_of(effects, PrefetchRead)
    assert prefetch.positions.tolist() == list(range(8))
    step_id = save(core, [("c", blocks(1)), ("b", blocks(2))]).step_id
    (read,) = consume(core, step_id, ["b"]).reads
    assert read.read_id == prefetch.read_id
    assert _sources(read) == [POOL] * 4 + [THIS_STEP] * 4


# =============================================================================================
# OUT: outputs per step (the core's part).


def test_out_6_a_cached_key_the_step_did_not_emit_has_no_output(make_core: MakeCore) -> None:
    """A step that did not emit a cached key returns and plans nothing for it (OUT-6, D4)."""
    core = make_core()
    start(core, started("a"))
    save(core, [("a", blocks(0))], immediate=(HIDDEN_KEY, MM))
    effects = start(core, started("b", hit_end=BLOCK, block_ids=(0, 1)))
    assert [p.key for p in effects_of(effects, PrefetchRead)] == [HIDDEN_KEY, MM]
    step_id = save(core, [("b", blocks(1))]).step_id
    plan = consume(core, step_id, ["b"])
    assert plan.keys == (HIDDEN_KEY,)
    assert [r.key for r in plan.reads] == [HIDDEN_KEY]


def test_out_6_keys_are_hidden_first_then_mm_sorted(make_core: MakeCore) -> None:
    """A step's output keys are hidden first, then its mm keys (deferred too) sorted (OUT-6)."""
    core = make_core(deferred_policy())
    start(core, started("a"))
    zeta = TensorName("zeta")
    step_id = save(
        core, [("a", blocks(0))], immediate=(zeta, HIDDEN_KEY, MM), deferred=(DEF,)
    ).step_id
    assert consume(core, step_id, ["a"]).keys == (HIDDEN_KEY, DEF, MM, zeta)


def test_out_7_without_hidden_caching_no_hidden_read_is_planned(make_core: MakeCore) -> None:
    """A policy without hidden states plans only mm keys, so unknown rows are zeros (OUT-7)."""
    core = make_core(ModelCachePolicy(needs_full_hidden_states=False))
    start(core, started("b", hit_end=BLOCK, block_ids=(0, 1)))
    step_id = save(core, [("b", blocks(1))], immediate=(MM,)).step_id
    plan = consume(core, step_id, ["b"])
    assert plan.keys == (MM,)
    (read,) = plan.reads
    assert (read.key, _sources(read)) == (MM, [ZEROS] * BLOCK)


# =============================================================================================
# FAIL: failures, deadlines, shutdown, bad input.


def test_fail_1_a_failed_write_releases_everything_and_poisons_the_cache(
    make_core: MakeCore,
) -> None:
    """A failed write frees its page and charge, and every later call raises (FAIL-1)."""
    core = make_core()
    start(core, started("a"))
    published = save(core, [("a", blocks(0))], immediate_bytes=100, land_writes=False)
    (write,) = step_writes(published)
    consume(core, published.step_id)
    core.report(CopyStarted(tid=write.tid))
    core.report(WriteFailed(tid=write.tid, reason="pool write: out of memory"))
    assert core.task_state(write.tid) is None
    assert (core.pages_in_use, core.budget_used) == (0, 0)
    assert core.presence(HIDDEN_KEY, 0) == (-1, 2), "lost rows are never served"
    assert core.fatal is not None and core.fatal.tids == (write.tid,)
    assert core.counters.writes_failed == 1
    calls: list[tuple[Callable[..., Any], Any]] = [
        (core.start_step, None),
        (core.save_begin, save_input([("a", blocks(1))])),
        (core.save_proceed, SaveProceed(now_ns=0)),
        (core.save_commit, SaveCommit(now_ns=0)),
        (core.consume_begin, ConsumeBegin(step_id=StepId(1), req_ids=None, now_ns=0)),
        (core.register_policy, ModelCachePolicy()),
    ]
    for call, arg in calls:
        if arg is None:
            error = raises_unchanged(core, WriteFailedError, start, core, started("z"))
        else:
            error = raises_unchanged(core, WriteFailedError, call, arg)
        assert error.tids == (write.tid,) and "out of memory" in error.reason


def test_fail_1_a_failure_during_a_save_ends_it_and_abort_still_cleans_up(
    make_core: MakeCore,
) -> None:
    """A write failing while a save waits on it makes the save raise; abort still works (FAIL-1)."""
    core = make_core()
    start(core, started("a"))
    (write,) = step_writes(save(core, [("a", blocks(0))], land_writes=False))
    core.save_begin(save_input([("a", blocks(1))], immediate_bytes=10))
    assert isinstance(_proceed(core), AwaitTasks)
    core.report(WriteFailed(tid=write.tid, reason="copy failed"))
    raises_unchanged(core, WriteFailedError, _proceed, core)
    core.save_abort(SaveAbort())
    assert core.budget_used == 0


def _wait_in(make_core: MakeCore, kind: str, t0: int, **overrides: Any) -> CacheCore:
    """A core whose pending save is at its first `kind` wait, reached with ``now_ns == t0``."""
    if kind == "barrier":
        core = make_core(**overrides)
        start(core, started("a"))
        save(core, [("a", blocks(0))], land_writes=False)
        core.save_begin(save_input([("a", blocks(1))], now_ns=t0))
    elif kind == "budget":
        core = make_core(deferred_policy(), **overrides)
        _budget_2_scenario(core)
        assert isinstance(_proceed(core, t0 - 1), EscalateTasks)
    else:
        core = make_core(staging_depth=1, **overrides)
        start(core, started("a"))
        save(core, [("a", blocks(0))])
        core.save_begin(save_input([("a", blocks(1))], now_ns=t0))
    return core


WAITS = [("barrier", WaitTimeoutError), ("budget", WaitTimeoutError), ("page", PageTimeoutError)]


@pytest.mark.parametrize(("kind", "error"), WAITS, ids=[k for k, _ in WAITS])
def test_fail_3_every_save_wait_raises_once_now_reaches_its_deadline(
    make_core: MakeCore, kind: str, error: type[Exception]
) -> None:
    """Each save wait keeps its deadline and raises its typed error at it (FAIL-3, D7)."""
    t0 = 10_000
    core = _wait_in(make_core, kind, t0)
    assert core.next_deadline_ns() is None
    first = _proceed(core, t0)
    assert isinstance(first, AwaitTasks | AwaitPage)
    assert first.deadline_ns == t0 + TIMEOUT_NS
    assert core.next_deadline_ns() == t0 + TIMEOUT_NS
    again = _proceed(core, t0 + TIMEOUT_NS - 1)
    assert again == first, "re-asking does not move the deadline"
    raises_unchanged(core, error, _proceed, core, t0 + TIMEOUT_NS)
    core.save_abort(SaveAbort())
    assert core.next_deadline_ns() is None
    assert isinstance(error, type) and issubclass(error, OmniPrefixCacheUnmatchError)


@pytest.mark.parametrize(("kind", "error"), WAITS, ids=[k for k, _ in WAITS])
def test_fail_3_with_a_zero_bound_every_save_wait_fails_at_once(
    make_core: MakeCore, kind: str, error: type[Exception]
) -> None:
    """With a zero bound, the first wait of each kind raises at once, unchanged (FAIL-3, PAGE-4)."""
    core = _wait_in(make_core, kind, 500, staging_claim_timeout_s=0)
    raises_unchanged(core, error, _proceed, core, 500)
    core.save_abort(SaveAbort())


def test_fail_3_each_phase_gets_its_own_deadline(make_core: MakeCore) -> None:
    """A page wait after a barrier wait is bounded from its own start (FAIL-3, D7)."""
    core = make_core(staging_depth=1)
    start(core, started("a"))
    published = save(core, [("a", blocks(0))], land_writes=False)
    core.save_begin(save_input([("a", blocks(1))]))
    assert _proceed(core, 0).deadline_ns == TIMEOUT_NS
    land(core, step_writes(published)[0].tid)
    late = TIMEOUT_NS - 5
    assert _proceed(core, late) == AwaitPage(deadline_ns=late + TIMEOUT_NS)
    assert core.next_deadline_ns() == late + TIMEOUT_NS
    consume(core, published.step_id)
    assert isinstance(_proceed(core, late + 1), PageClaimed)
    assert core.next_deadline_ns() is None
    core.save_commit(SaveCommit(now_ns=late + 1))


def test_fail_4_after_shutdown_every_engine_input_raises(make_core: MakeCore) -> None:
    """A shut-down core refuses every engine input with ShutDownError, unchanged (FAIL-4)."""
    core = make_core()
    start(core, started("a"))
    step_id = save(core, [("a", blocks(0))]).step_id
    before = core.snapshot()
    core.shut_down(ShutDown())
    core.shut_down(ShutDown())  # idempotent
    assert core.closed
    assert core.snapshot()[1:] == before[1:], "shutting down changes nothing but the flag"
    raises_unchanged(core, ShutDownError, start, core, started("b"))
    raises_unchanged(core, ShutDownError, core.save_begin, save_input([("a", blocks(1))]))
    raises_unchanged(core, ShutDownError, core.save_proceed, SaveProceed(now_ns=0))
    raises_unchanged(core, ShutDownError, core.save_commit, SaveCommit(now_ns=0))
    raises_unchanged(
        core,
        ShutDownError,
        core.consume_begin,
        ConsumeBegin(step_id=step_id, req_ids=(ReqId("a"),), now_ns=0),
    )
    raises_unchanged(core, ShutDownError, core.register_policy, ModelCachePolicy())


def _layout(req_ids: tuple[str, ...], bounds: list[int], slots: list[int], **kw: Any) -> SaveBegin:
    fields: dict[str, Any] = {
        "now_ns": 0,
        "req_ids": tuple(map(ReqId, req_ids)),
        "row_bounds": np.asarray(bounds, dtype=np.int64),
        "slots": np.asarray(slots, dtype=np.int64),
        "num_tokens": len(slots),
        "immediate_keys": (HIDDEN_KEY,),
    }
    fields.update(kw)
    return SaveBegin(**fields)


BAD_SAVES: dict[str, SaveBegin] = {
    "slot-count": _layout(("a",), [0, 4], [0, 1, 2], num_tokens=4),
    "negative-count": _layout((), [0], [], num_tokens=-1, immediate_keys=()),
    "bounds-length": _layout(("a", "b"), [0, 4], [0, 1, 2, 3]),
    "bounds-start": _layout(("a",), [1, 4], [0, 1, 2, 3]),
    "bounds-end": _layout(("a",), [0, 3], [0, 1, 2, 3]),
    "bounds-order": _layout(("a", "b"), [0, 5, 4], [0, 1, 2, 3]),
    "bounds-order-unsigned": _layout(
        ("a", "b"), [0, 5, 4], [0, 1, 2, 3], row_bounds=np.asarray([0, 5, 4], dtype=np.uint64)
    ),
    "bounds-order-three": _layout(("a", "b", "c"), [0, 3, 1, 4], [0, 1, 2, 3]),
    "slot-negative": _layout(("a",), [0, 2], [-1, 0]),
    "slot-too-large": _layout(("a",), [0, 2], [0, 32]),
    "repeated-request": _layout(("a", "a"), [0, 1, 2], [0, 1]),
    "request-not-started": _layout(("zz",), [0, 1], [0]),
    "unknown-deferred-key": _layout(("a",), [0, 1], [0], deferred_keys=(MM,)),
    "deferred-key-as-immediate": _layout(("a",), [0, 1], [0], immediate_keys=(HIDDEN_KEY, DEF)),
    "hidden-missing": _layout(("a",), [0, 1], [0], immediate_keys=(MM,)),
    "hidden-on-zero-rows": _layout((), [0], [], immediate_keys=(HIDDEN_KEY,)),
    "keys-on-zero-rows": _layout((), [0], [], immediate_keys=(), deferred_keys=(DEF,)),
    "repeated-key": _layout(("a",), [0, 1], [0], immediate_keys=(HIDDEN_KEY, MM, MM)),
    "negative-bytes": _layout(("a",), [0, 1], [0], deferred_bytes=-1),
}


@pytest.mark.parametrize("name", sorted(BAD_SAVES))
def test_fail_5_a_bad_save_raises_a_typed_error_and_changes_nothing(
    make_core: MakeCore, name: str
) -> None:
    """Each malformed save raises BadInputError saying what was expected, unchanged (FAIL-5)."""
    core = make_core(deferred_policy())
    start(core, started("a"), started("b"))
    save(core, [("a", blocks(0))], deferred=(DEF,))
    error = raises_unchanged(core, BadInputError, core.save_begin, BAD_SAVES[name])
    assert error.what and error.expected and error.got
    assert isinstance(error, ValueError) and isinstance(error, OmniPrefixCacheUnmatchError)
    assert save(core, [("a", blocks(1))], deferred=(DEF,)).step_id == 2, "the cache stays usable"


def test_fail_5_hidden_rows_for_a_policy_without_hidden_raise(make_core: MakeCore) -> None:
    """Hidden rows given to a cache whose policy does not cache them raise, unchanged (FAIL-5)."""
    core = make_core(ModelCachePolicy(needs_full_hidden_states=False))
    start(core, started("a"))
    error = raises_unchanged(core, BadInputError, core.save_begin, _layout(("a",), [0, 1], [0]))
    assert error.what == "hidden states"


def test_fail_5_inputs_out_of_order_raise_and_change_nothing(make_core: MakeCore) -> None:
    """Inputs in the wrong order raise BadInputError and leave the state as it was (FAIL-5, D6)."""
    core = make_core()
    raises_unchanged(core, BadInputError, core.save_proceed, SaveProceed(now_ns=0))
    raises_unchanged(core, BadInputError, core.save_commit, SaveCommit(now_ns=0))
    raises_unchanged(core, BadInputError, core.consume_end, ConsumeEnd(step_id=StepId(1)))
    start(core, started("a"))
    raises_unchanged(core, BadInputError, core.register_policy, ModelCachePolicy())
    raises_unchanged(core, BadInputError, start, core, started("b"), started("b"))
    (write,) = step_writes(save(core, [("a", blocks(0))], land_writes=False))
    core.save_begin(save_input([("a", blocks(1))]))
    raises_unchanged(core, BadInputError, core.save_begin, save_input([("a", blocks(2))]))
    raises_unchanged(core, BadInputError, start, core, started("c"))
    raises_unchanged(core, BadInputError, core.save_commit, SaveCommit(now_ns=0))
    core.save_abort(SaveAbort())
    land(core, write.tid)


def test_fail_5_a_policy_may_be_replaced_only_before_the_first_step(make_core: MakeCore) -> None:
    """`register_policy` works before the first step and raises after it (FAIL-5)."""
    core = make_core()
    policy = deferred_policy()
    core.register_policy(policy)
    assert core.policy is policy
    start(core, started("a"))
    error = raises_unchanged(core, BadInputError, core.register_policy, ModelCachePolicy())
    assert error.what == "register_policy"


# =============================================================================================
# Design decisions (spec/DESIGN.md).


def test_d3_versions_move_on_claims_and_absence_never_on_commits(make_core: MakeCore) -> None:
    """A slot's version changes with each claim and each absence, never with a commit (D3)."""
    core = make_core()
    start(core, started("a"))
    versions = []
    for immediate in ((HIDDEN_KEY, MM), (HIDDEN_KEY, MM), (HIDDEN_KEY,), (HIDDEN_KEY, MM)):
        published = save(core, [("a", [0])], immediate=immediate, land_writes=False)
        versions.append(core.presence(MM, 0)[1])
        land(core, step_writes(published)[0].tid)
        assert core.presence(MM, 0)[1] == versions[-1], "a commit keeps the version"
    assert versions == [1, 2, 3, 4]


def test_d3_task_ids_stop_before_the_owner_table_wraps(make_core: MakeCore) -> None:
    """The last int32 tid is used as is; a save needing one more raises before changing (D3)."""
    core = make_core(deferred_policy(hidden=False))
    start(core, started("a"))
    # No input issues two billion ids in a test's time: jump the tasks' id counter there.
    core._writes._next_tid = _MAX_TID
    (write,) = step_writes(save(core, [("a", [0])], immediate=(MM,), land_writes=False))
    assert write.tid == _MAX_TID
    assert core.presence(MM, 0) == (_MAX_TID, 1)
    land(core, write.tid)
    for keys in ({"immediate": (MM,)}, {"immediate": (), "deferred": (DEF,)}):
        error = raises_unchanged(
            core, InvariantError, core.save_begin, save_input([("a", [1])], **keys)
        )
        assert "2**31 - 1" in str(error)
    assert save(core, []).step_id == 2, "a save that needs no write id still works"


def test_d5_a_materialize_holds_its_page_until_consume_end(make_core: MakeCore) -> None:
    """A materialize keeps its step's page until ConsumeEnd; a discard frees it at once (D5)."""
    core = make_core(staging_depth=1)
    start(core, started("a"))
    step_id = save(core, [("a", blocks(0))]).step_id
    plan = consume(core, step_id, ["a"], end=False)
    assert plan.page == 0 and not plan.discard
    core.save_begin(save_input([("a", blocks(1))]))
    assert isinstance(_proceed(core), AwaitPage)
    core.consume_end(ConsumeEnd(step_id=step_id))
    assert _proceed(core) == PageClaimed(page=0)
    second = core.save_commit(SaveCommit(now_ns=0)).step_id
    land(core, Tid(2))
    assert consume(core, second).discard
    assert core.pages_in_use == 0


def test_d6_save_begin_changes_only_the_pending_record(make_core: MakeCore) -> None:
    """SaveBegin records the pending save and nothing else; commit publishes it whole (D6)."""
    core = make_core()
    start(core, started("a"))
    before = core.snapshot()
    core.save_begin(save_input([("a", blocks(0))], immediate_bytes=10))
    during = core.snapshot()
    assert during[:-1] == before[:-1] and before[-1] is None and during[-1] is not None
    assert core.pages_in_use == 0 and core.budget_used == 0
    assert isinstance(_proceed(core), PageClaimed)
    published = core.save_commit(SaveCommit(now_ns=0))
    assert core.snapshot()[-1] is None
    assert core.open_step_ids == (published.step_id,)
    assert core.presence(HIDDEN_KEY, 0)[0] == step_writes(published)[0].tid
    land(core, step_writes(published)[0].tid)


def test_d8_a_report_for_a_task_never_registered_raises(make_core: MakeCore) -> None:
    """A report about a write the core does not know raises IllegalTransitionError (D8, TASK-2)."""
    core = make_core()
    for report in (CopyStarted(tid=Tid(9)), CopyLanded(tid=Tid(9)), WriteLanded(tid=Tid(9))):
        error = raises_unchanged(core, IllegalTransitionError, core.report, report)
        assert error.from_state == "RETIRED"


def test_d9_a_save_for_a_request_not_live_raises(make_core: MakeCore) -> None:
    """A layout naming a request never started, or already finished, raises unchanged (D9)."""
    core = make_core()
    start(core, started("a"), started("b"))
    start(core, finished("b"))
    for req in ("b", "never"):
        error = raises_unchanged(core, BadInputError, core.save_begin, save_input([(req, [0])]))
        assert "D9" in error.expected
    assert start(core, finished("never")) == (), "a finish of an unknown request is a no-op"
    assert save(core, [("a", [0])]).step_id == 1


# =============================================================================================
# The invariant checker can fail.


def _healthy_core() -> CacheCore:
    core = CacheCore(config(), deferred_policy())
    start(core, started("a"), started("b"))
    save(core, [("a", blocks(0))], deferred=(DEF,), deferred_bytes=100, land_writes=False)
    core.check_invariants()
    return core


# Each corruption reaches into the machine that owns the state it breaks: that is its purpose.


def _corrupt_budget(core: CacheCore) -> None:
    core._writes._budget_used += 1


def _corrupt_page_holder(core: CacheCore) -> None:
    core._pages.hold(1, HolderKind.STEP, 99)


def _corrupt_owner(core: CacheCore) -> None:
    core._slots.by_key[HIDDEN_KEY].owner[20] = 77


def _corrupt_open_write(core: CacheCore) -> None:
    open_tid = core.open_write(ReqId("a"))
    assert open_tid is not None
    task = core._writes.get(open_tid)
    assert task is not None
    task.state = TaskState.COPYING


def _corrupt_retired_waiter(core: CacheCore) -> None:
    core._writes._unwritten_step_writes.add(Tid(55))


def _corrupt_terminal_task(core: CacheCore) -> None:
    task = core._writes.get(Tid(1))
    assert task is not None
    task.state = TaskState.WRITTEN


def _corrupt_writer_count(core: CacheCore) -> None:
    core._writes._writers[HIDDEN_KEY] = 0  # a claim would then skip looking for in-flight owners


def _corrupt_version(core: CacheCore) -> None:
    table = core._slots.by_key[HIDDEN_KEY]
    table.version[3] = table.claims + 1


CORRUPTIONS = {
    "budget": _corrupt_budget,
    "page-holder": _corrupt_page_holder,
    "owner": _corrupt_owner,
    "open-write": _corrupt_open_write,
    "retired-waiter": _corrupt_retired_waiter,
    "terminal-task": _corrupt_terminal_task,
    "writer-count": _corrupt_writer_count,
    "version": _corrupt_version,
}


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_check_invariants_catches_a_corrupted_state(name: str) -> None:
    """A state corrupted on purpose makes `check_invariants()` raise InvariantError."""
    core = _healthy_core()
    CORRUPTIONS[name](core)
    with pytest.raises(InvariantError):
        core.check_invariants()


# ---------------------------------------------------------------------------------------------
# The save's phases (D6): a table of (phase, outcome) -> phase.


def test_d6_the_save_phase_table_is_barrier_budget_page_ready() -> None:
    """A save waits in each phase or passes to the next, in the order barrier, budget, page;
    the budget phase may also flush and stay (BUDGET-2, TASK-3, PAGE-2)."""
    P, Out = SavePhase, SaveOutcome
    expected = {
        (P.BARRIER, Out.WAIT): P.BARRIER,
        (P.BARRIER, Out.CLEAR): P.BUDGET,
        (P.BUDGET, Out.WAIT): P.BUDGET,
        (P.BUDGET, Out.FLUSH): P.BUDGET,
        (P.BUDGET, Out.ADMITTED): P.PAGE,
        (P.PAGE, Out.WAIT): P.PAGE,
        (P.PAGE, Out.CLAIMED): P.READY,
    }
    assert dict(_SAVE_MOVES) == expected


def _pending_in(phase: SavePhase) -> PendingSave:
    save = PendingSave.__new__(PendingSave)  # only the fields `move` reads
    save.phase, save.deadline_ns = phase, 123
    return save


@pytest.mark.parametrize(
    ("phase", "outcome"), [(p, o) for p in SavePhase for o in SaveOutcome], ids=str
)
def test_d6_a_save_moves_only_by_the_table(phase: SavePhase, outcome: SaveOutcome) -> None:
    """Each (phase, outcome) pair moves as the table says, a new phase without a deadline (D7);
    a pair outside the table is a bug and raises InvariantError, the phase unchanged."""
    save = _pending_in(phase)
    target = _SAVE_MOVES.get((phase, outcome))
    if target is None:
        with pytest.raises(InvariantError, match="has no move"):
            save.move(outcome)
        assert (save.phase, save.deadline_ns) == (phase, 123)
    else:
        save.move(outcome)
        assert save.phase is target
        assert save.deadline_ns == (123 if target is phase else None)
