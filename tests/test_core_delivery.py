"""Unit tests of the request lifecycle and delivery rules (SPEC section 12: LIFE, DLV).

Each test drives a `CacheCore` through `tests.core_helpers` and names the rule it checks. Every
core built by the `make_core` fixture passes `check_invariants()` at the end of its test, and
every refused input is checked to leave the snapshot unchanged (`raises_unchanged`).

Block size is 4: block ``b`` holds slots ``4b .. 4b + 3``, and a request whose rows are saved into
whole blocks has positions ``4 * (its block index) ...``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from omni_cache_core import (
    HIDDEN_KEY,
    BadInputError,
    DeliveryOrderError,
    LifecycleError,
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
    ReqId,
    StepId,
)
from omni_cache_core._delivery import _FREE, _LIFECYCLE, RequestState
from omni_cache_core._values import (
    ConsumeBegin,
    ConsumePlan,
    EscalateTasks,
    PrefetchRead,
    StartStep,
    TaskState,
)
from omni_cache_core._values import PrefixCacheStep as _Step
from tests.core_helpers import (
    BLOCK,
    DEF,
    MakeCore,
    aborted,
    blocks,
    consume,
    deferred_policy,
    finished,
    positions,
    preempted,
    raises_unchanged,
    resumed,
    save,
    save_input,
    start,
    started,
)


def _skip(plan: ConsumePlan) -> list[int] | None:
    return None if plan.skip is None else [int(k) for k in plan.skip.tolist()]


def _hidden_read(plan: ConsumePlan, req: str) -> Any:
    (read,) = [r for r in plan.reads if r.req_id == req and r.key == HIDDEN_KEY]
    return read


def _steps(core: Any, *records: PrefixCacheRequestEvent) -> StartStep:
    return StartStep(step=_Step(events=records), now_ns=0)


# ---------------------------------------------------------------------------------------------
# LIFE: the request lifecycle.


def test_life_1_an_id_started_again_is_a_new_admission_while_its_old_step_is_open(
    make_core: MakeCore,
) -> None:
    """A finished id started again gets fresh positions and delivery; its old step keeps its own
    (LIFE-1, HIT-2)."""
    core = make_core()
    start(core, started("a"))
    old = save(core, [("a", blocks(0))]).step_id
    start(core, finished("a"), started("a"))
    new = save(core, [("a", blocks(1))]).step_id
    # The new admission's positions start at 0 again, and consuming it first is no gap: the
    # old step belongs to another admission (DLV-5 is per admission).
    assert positions(consume(core, new, ["a"])) == [(0, BLOCK)]
    assert positions(consume(core, old, ["a"])) == [(0, BLOCK)]


def test_life_1_entries_of_many_ending_requests_outlive_them_while_their_step_is_open(
    make_core: MakeCore,
) -> None:
    """Of a dozen requests ending together, those an unconsumed step carries keep their entries
    (ended) until it ends, the others are freed at once, and every carried one is still delivered
    (LIFE-1)."""
    core = make_core(num_blocks=64)
    reqs = [f"r{i}" for i in range(12)]
    start(core, *(started(r) for r in reqs))
    carried = reqs[::2]
    open_step = save(core, [(r, blocks(i)) for i, r in enumerate(carried)]).step_id
    live = dict(core._requests.entries_by_request)
    # More ends than a step's entries are searched for one by one; one started again at once.
    start(core, *(finished(r) for r in reqs), started("r0"))
    requests = core._requests
    assert requests.ended == {live[r] for r in carried}
    again = requests.entry_of(ReqId("r0"))  # the new admission takes a freed entry
    freed = {live[r] for r in reqs[1::2]}
    assert again in freed
    assert all(requests.state[e] == _FREE for e in freed - {again})
    assert positions(consume(core, open_step, carried)) == [(0, BLOCK)] * len(carried)
    assert requests.ended == set()


def _running_a(core: Any) -> None:
    start(core, started("a"))


def _preempted_a(core: Any) -> None:
    start(core, started("a"))
    start(core, preempted("a"))


@pytest.mark.parametrize(
    ("setup", "records", "event", "state"),
    [
        (_running_a, [resumed("a")], "resumed", "running"),
        (lambda core: None, [resumed("a")], "resumed", "not live"),
        (_preempted_a, [preempted("a")], "preempted", "preempted"),
        (_running_a, [preempted("a"), preempted("a")], "preempted", "preempted"),
        (lambda core: None, [preempted("a")], "preempted", "not live"),
        (_running_a, [finished("a"), preempted("a")], "preempted", "not live"),
        (_preempted_a, [started("a")], "started", "preempted"),
        (_running_a, [preempted("a"), started("a")], "started", "preempted"),
        (_preempted_a, [finished("a"), resumed("a")], "resumed", "not live"),
    ],
    ids=[
        "resume-running",
        "resume-unknown",
        "preempt-twice",
        "preempt-twice-in-one-step",
        "preempt-unknown",
        "preempt-after-finish",
        "start-preempted",
        "start-just-preempted",
        "resume-finished",
    ],
)
def test_life_2_an_illegal_record_raises_naming_the_request_and_changes_nothing(
    make_core: MakeCore, setup: Any, records: list[PrefixCacheRequestEvent], event: str, state: str
) -> None:
    """Every record illegal in its request's state raises LifecycleError naming the request, the
    record and the state; the whole step is refused (LIFE-2)."""
    core = make_core()
    setup(core)
    error = raises_unchanged(core, LifecycleError, core.start_step, _steps(core, *records))
    assert (error.req_id, error.event, error.state) == ("a", event, state)
    assert "'a'" in str(error) and event.upper() in str(error) and state in str(error)
    assert isinstance(error, BadInputError)


def test_life_2_two_starts_of_one_request_in_a_step_raise(make_core: MakeCore) -> None:
    """STARTED and RESUMED of one id in one step raise and change nothing (LIFE-2, HIT-1)."""
    core = make_core()
    _preempted_a(core)
    records = (resumed("a"), resumed("a"))
    raises_unchanged(core, BadInputError, core.start_step, _steps(core, *records))


@pytest.mark.parametrize("end", [finished, aborted], ids=["finished", "aborted"])
def test_life_2_legal_sequences_are_applied_ends_and_preemptions_first(
    make_core: MakeCore, end: Any
) -> None:
    """Preempt and resume in one step; end while preempted; reuse the id after (LIFE-2)."""
    core = make_core()
    start(core, started("a"))
    save(core, [("a", blocks(0))])
    start(core, resumed("a", hit_end=BLOCK, block_ids=(0, 1)), preempted("a"))  # any order
    save(core, [("a", blocks(1))])
    start(core, preempted("a"))
    start(core, end("a"))
    start(core, started("a"))  # a new admission
    save(core, [("a", blocks(2))])


def test_life_3_a_preemption_escalates_open_writes_and_keeps_its_steps_readable(
    make_core: MakeCore,
) -> None:
    """PREEMPTED escalates the request's open deferred write as a finish would; a save naming
    the preempted request raises; its unconsumed step is still materialized (LIFE-3, TASK-4)."""
    core = make_core(deferred_policy())
    start(core, started("a"), started("b"))
    published = save(core, [("a", blocks(0)), ("b", blocks(1))], deferred=(DEF,))
    (tid,) = {e.tid for e in published.effects if getattr(e, "req_id", None) == "a"}
    assert core.task_state(tid) is TaskState.PENDING
    effects = start(core, preempted("a"))
    assert effects == (EscalateTasks(tids=(tid,)),)
    assert core.task_state(tid) is TaskState.QUEUED
    error = raises_unchanged(
        core, BadInputError, core.save_begin, save_input([("a", [8]), ("b", [9])])
    )
    assert "preempted" in str(error) and "'a'" in str(error)
    plan = consume(core, published.step_id, ["a", "b"])
    assert positions(plan) == [(0, BLOCK), (0, BLOCK)]


def test_life_4_a_resume_hit_is_checked_like_a_start(make_core: MakeCore) -> None:
    """An unaligned resume hit, or one with too few blocks, raises and changes nothing (LIFE-4,
    HIT-1)."""
    core = make_core()
    _preempted_a(core)
    for record in (
        resumed("a", hit_end=BLOCK + 1, block_ids=(0, 1)),
        resumed("a", hit_end=2 * BLOCK, block_ids=(0,)),
    ):
        error = raises_unchanged(core, BadInputError, core.start_step, _steps(core, record))
        assert "'a'" in str(error) and f"block_size={BLOCK}" in str(error)


# ---------------------------------------------------------------------------------------------
# DLV: positions and delivery.


def test_dlv_1_positions_start_at_hit_end_and_grow_by_the_saved_rows(make_core: MakeCore) -> None:
    """A request's rows are the positions from its hit_end on, growing with each save; a step
    that registers a hit carries the hit rows first (DLV-1)."""
    core = make_core()
    start(core, started("a"))
    first = save(core, [("a", blocks(0))]).step_id
    start(core, started("b", hit_end=BLOCK, block_ids=(0, 1)))
    hit = save(core, [("a", [8]), ("b", [4, 5])]).step_id
    after = save(core, [("a", [9]), ("b", [6])]).step_id
    assert positions(consume(core, first, ["a"])) == [(0, BLOCK)]
    assert positions(consume(core, hit, ["a", "b"])) == [(BLOCK, BLOCK + 1), (0, BLOCK + 2)]
    assert positions(consume(core, after, ["b", "a"])) == [(BLOCK + 2, BLOCK + 3), (5, 6)]


def _delivered_two_blocks(core: Any) -> None:
    """Request a computes and delivers positions [0, 8) in blocks 0 and 1, then is preempted."""
    start(core, started("a"))
    for block in (0, 1):
        consume(core, save(core, [("a", blocks(block))]).step_id, ["a"])
    start(core, preempted("a"))


def test_dlv_2_a_resume_below_the_cursor_hands_out_only_new_positions(
    make_core: MakeCore,
) -> None:
    """Recomputed positions below the cursor are written but not handed out again (DLV-2)."""
    core = make_core()
    _delivered_two_blocks(core)
    # Resumed with a one-block hit: positions 4.. are recomputed into blocks 5 and 6.
    effects = start(core, resumed("a", hit_end=BLOCK, block_ids=(0, 5, 6)))
    assert effects == (), "a hit below the cursor opens no read (DLV-3)"
    published = save(core, [("a", [*blocks(5), 24, 25])])
    plan = consume(core, published.step_id, ["a"])
    assert positions(plan) == [(2 * BLOCK, 2 * BLOCK + 2)]
    assert _skip(plan) == [BLOCK], "the recomputed rows of positions 4..7 are cut"
    assert plan.reads == ()
    # The recomputed rows still went to the pool: they are the slots' newest tenant.
    assert core.presence(HIDDEN_KEY, 20)[0] == 0


def test_dlv_3_a_resume_above_the_cursor_reads_from_the_cursor_block(
    make_core: MakeCore,
) -> None:
    """A resume hit above the cursor reads the undelivered rows from the cursor's block on; it
    serves the positions of discarded steps too (DLV-3, DLV-4)."""
    core = make_core()
    start(core, started("a"))
    steps = [save(core, [("a", blocks(b))]).step_id for b in (0, 1, 2)]
    consume(core, steps[0], ["a"])  # cursor 4; steps 1 and 2 stay open
    start(core, preempted("a"))
    effects = start(core, resumed("a", hit_end=3 * BLOCK, block_ids=(0, 1, 2, 3)))
    (prefetch,) = [e for e in effects if isinstance(e, PrefetchRead)]
    assert prefetch.slots.tolist() == blocks(1) + blocks(2)
    resume = save(core, [("a", [12])]).step_id
    for step_id in steps[1:]:
        consume(core, step_id)  # discarded: positions 4..11 not delivered
    plan = consume(core, resume, ["a"])
    assert positions(plan) == [(BLOCK, 3 * BLOCK + 1)]
    assert _skip(plan) is None
    assert _hidden_read(plan, "a").slots.tolist() == blocks(1) + blocks(2)
    assert core.counters.hit_requests == 1


def test_dlv_3_steps_from_before_a_resume_deliver_first_then_the_resume_hands_out_the_rest(
    make_core: MakeCore,
) -> None:
    """Steps saved before the preemption are delivered first (DLV-5); the resume step's hit and
    recomputed rows below the cursor are then cut (DLV-2, DLV-3)."""
    core = make_core()
    start(core, started("a"))
    steps = [save(core, [("a", blocks(b))]).step_id for b in (0, 1, 2)]
    consume(core, steps[0], ["a"])
    start(core, preempted("a"))
    start(core, resumed("a", hit_end=2 * BLOCK, block_ids=(0, 1, 5, 6)))
    resume = save(core, [("a", [*blocks(5), 24])]).step_id
    error = raises_unchanged(
        core,
        DeliveryOrderError,
        core.consume_begin,
        ConsumeBegin(step_id=resume, req_ids=(ReqId("a"),), now_ns=0),
    )
    assert (error.earlier_step_id, error.gap) == (steps[1], (BLOCK, 2 * BLOCK))
    assert positions(consume(core, steps[1], ["a"])) == [(BLOCK, 2 * BLOCK)]
    assert positions(consume(core, steps[2], ["a"])) == [(2 * BLOCK, 3 * BLOCK)]
    plan = consume(core, resume, ["a"])
    # The step carries hit rows 4..7 and own rows 8..12; all but position 12 were delivered.
    assert positions(plan) == [(3 * BLOCK, 3 * BLOCK + 1)]
    assert _skip(plan) == [2 * BLOCK]


@pytest.mark.parametrize("hit", [0, 2 * BLOCK], ids=["zero", "at-the-cursor"])
def test_dlv_3_a_resume_at_or_below_the_cursor_opens_no_hit(make_core: MakeCore, hit: int) -> None:
    """A resume with hit_end 0 or at the cursor reads nothing; its own rows above the cursor are
    handed out (DLV-3, LIFE-4)."""
    core = make_core()
    _delivered_two_blocks(core)
    assert start(core, resumed("a", hit_end=hit, block_ids=(0, 1, 5, 6))) == ()
    rows = 3 * BLOCK - hit
    slots = (blocks(0) + blocks(1) + blocks(5))[hit:]
    plan = consume(core, save(core, [("a", slots)]).step_id, ["a"])
    assert positions(plan) == [(2 * BLOCK, 3 * BLOCK)]
    assert _skip(plan) == ([2 * BLOCK - hit] if hit < 2 * BLOCK else None)
    assert rows == len(slots)
    assert core.counters.hit_requests == 0


def test_dlv_3_a_resume_hit_beyond_what_was_computed_before_is_served(
    make_core: MakeCore,
) -> None:
    """A resume hit may reach past the positions the request computed before it was preempted
    (its later blocks stayed cached elsewhere): the whole undelivered range is read (DLV-3)."""
    core = make_core()
    start(core, started("a"), started("b"))
    first = save(core, [("a", blocks(0)), ("b", blocks(3) + blocks(4))]).step_id
    consume(core, first, ["b"])  # a is left out: nothing delivered to it (DLV-4)
    start(core, preempted("a"))
    start(core, resumed("a", hit_end=2 * BLOCK, block_ids=(3, 4, 5)))
    plan = consume(core, save(core, [("a", [20])]).step_id, ["a"])
    assert positions(plan) == [(0, 2 * BLOCK + 1)]
    assert _hidden_read(plan, "a").slots.tolist() == blocks(3) + blocks(4)


def test_dlv_4_a_discarded_steps_positions_come_back_with_a_resume_hit(
    make_core: MakeCore,
) -> None:
    """A discard delivers nothing; a later resume hit covering those positions serves them
    (DLV-4)."""
    core = make_core()
    start(core, started("a"))
    first = save(core, [("a", blocks(0))]).step_id
    second = save(core, [("a", blocks(1))]).step_id
    consume(core, first, ["a"])
    consume(core, second)  # discarded: positions 4..7 not delivered
    start(core, preempted("a"))
    start(core, resumed("a", hit_end=2 * BLOCK, block_ids=(0, 1, 2)))
    plan = consume(core, save(core, [("a", [8])]).step_id, ["a"])
    assert positions(plan) == [(BLOCK, 2 * BLOCK + 1)]
    assert _hidden_read(plan, "a").slots.tolist() == blocks(1)


def test_dlv_4_otherwise_discarded_positions_are_passed_over(make_core: MakeCore) -> None:
    """Without a resume, the next step hands out its own rows and never the discarded ones
    (DLV-4); a request left out of a materialize is treated the same way."""
    core = make_core()
    start(core, started("a"), started("b"))
    first = save(core, [("a", blocks(0)), ("b", blocks(1))]).step_id
    consume(core, first, ["b"])  # a is left out: not delivered
    second = save(core, [("a", [8]), ("b", [9])]).step_id
    consume(core, second)  # discarded
    third = save(core, [("a", [10]), ("b", [11])]).step_id
    plan = consume(core, third, ["a", "b"])
    assert positions(plan) == [(BLOCK + 1, BLOCK + 2), (BLOCK + 1, BLOCK + 2)]


def test_dlv_5_a_gap_an_earlier_step_carries_is_refused_and_changes_nothing(
    make_core: MakeCore,
) -> None:
    """Materializing a request's later step while an earlier one carrying the gap is open
    raises DeliveryOrderError naming both steps and the gap; the step stays open (DLV-5).
    A discard is never refused, and other requests' steps go in any order (STEP-1)."""
    core = make_core()
    start(core, started("a"), started("b"))
    first = save(core, [("a", blocks(0))]).step_id
    second = save(core, [("a", blocks(1)), ("b", blocks(2))]).step_id
    third = save(core, [("b", blocks(3))]).step_id
    error = raises_unchanged(
        core,
        DeliveryOrderError,
        core.consume_begin,
        ConsumeBegin(step_id=second, req_ids=(ReqId("a"), ReqId("b")), now_ns=0),
    )
    assert (error.req_id, error.step_id, error.earlier_step_id, error.gap) == (
        "a",
        second,
        first,
        (0, BLOCK),
    )
    assert f"step {first}" in str(error) and "'a'" in str(error)
    # b alone has no gap in that step; the refusal did not consume it.
    assert core.open_step_ids == (first, second, third)
    assert positions(consume(core, first, ["a"])) == [(0, BLOCK)]
    assert positions(consume(core, second, ["a", "b"])) == [(BLOCK, 2 * BLOCK), (0, BLOCK)]
    assert positions(consume(core, third, ["b"])) == [(BLOCK, 2 * BLOCK)]


def test_dlv_5_an_earlier_step_that_owes_nothing_does_not_refuse(make_core: MakeCore) -> None:
    """An earlier open step with no rows for the request, or only rows already delivered, does
    not hold a later step back (DLV-5); the discarded step's positions are passed over (DLV-4)."""
    core = make_core()
    start(core, started("a"), started("b"))
    first = save(core, [("a", blocks(0))]).step_id
    empty = save(core, [("a", []), ("b", blocks(1))]).step_id  # a scheduled for 0 tokens
    third = save(core, [("a", [8])]).step_id
    consume(core, first)  # discarded
    assert positions(consume(core, third, ["a"])) == [(BLOCK, BLOCK + 1)]
    assert positions(consume(core, empty, ["a", "b"])) == [(BLOCK + 1, BLOCK + 1), (0, BLOCK)]


def test_dlv_5_a_step_without_rows_does_not_pass_over_what_an_earlier_step_owes(
    make_core: MakeCore,
) -> None:
    """A step where the request has no rows would still move its cursor past positions an
    earlier open step owes: refused until that step is consumed (DLV-5, DLV-4)."""
    core = make_core()
    start(core, started("a"))
    owing = save(core, [("a", blocks(0))]).step_id
    idle = save(core, [("a", [])]).step_id
    error = raises_unchanged(
        core,
        DeliveryOrderError,
        core.consume_begin,
        ConsumeBegin(step_id=idle, req_ids=(ReqId("a"),), now_ns=0),
    )
    assert (error.earlier_step_id, error.gap) == (owing, (0, BLOCK))
    assert positions(consume(core, owing, ["a"])) == [(0, BLOCK)]
    assert positions(consume(core, idle, ["a"])) == [(BLOCK, BLOCK)]


def test_dlv_5_a_discard_of_a_later_step_is_never_refused(make_core: MakeCore) -> None:
    """Discarding delivers nothing, so no order applies to it (DLV-4, DLV-5)."""
    core = make_core()
    start(core, started("a"))
    first = save(core, [("a", blocks(0))]).step_id
    second = save(core, [("a", blocks(1))]).step_id
    assert consume(core, second).discard
    assert positions(consume(core, first, ["a"])) == [(0, BLOCK)]


def test_dlv_2_a_whole_life_with_preemptions_hands_out_every_position_once(
    make_core: MakeCore,
) -> None:
    """Over a life of saves, late consumes, discards, preemptions and resumes of every kind, the
    delivered ranges of an admission tile its computed positions exactly once, except those
    discarded and passed over (DLV-2, DLV-4)."""
    core = make_core(num_blocks=512)
    rng = np.random.default_rng(7)
    start(core, started("a"))
    computed = 0  # the positions computed so far: [0, computed)
    free = iter(range(512))
    slot_of: dict[int, int] = {}  # position -> its slot now
    delivered: list[int] = []
    skipped: set[int] = set()
    open_steps: list[tuple[StepId, int, int]] = []
    block = next(free)
    kinds: set[str] = set()  # the resume hits seen, against the cursor
    for _ in range(150):
        if rng.random() < 0.15:
            # Preempt, then resume with a hit of whole blocks: 0, below, at or above the cursor.
            start(core, preempted("a"))
            cursor = max(delivered, default=-1) + 1
            # Often the longest hit the blocks allow, so it can reach above the cursor.
            top = computed // BLOCK
            hit = (top if rng.random() < 0.4 else int(rng.integers(0, top + 1))) * BLOCK
            hit_blocks = [slot_of[p] // BLOCK for p in range(0, hit, BLOCK)]
            block = next(free)
            start(core, resumed("a", hit_end=hit, block_ids=(*hit_blocks, block)))
            kinds.add(
                "zero"
                if not hit
                else "below"
                if hit < cursor
                else "at"
                if hit == cursor
                else "above"
            )
            computed = hit
            for p in range(hit, hit + BLOCK):
                slot_of.pop(p, None)
            lo = cursor if hit > cursor else hit
        else:
            lo = computed
        rows = int(rng.integers(1, BLOCK - computed % BLOCK + 1))
        if computed % BLOCK == 0 and lo == computed:
            block = next(free)
        slots = [block * BLOCK + (computed + i) % BLOCK for i in range(rows)]
        for i, slot in enumerate(slots):
            slot_of[computed + i] = slot
        step_id = save(core, [("a", slots)]).step_id
        open_steps.append((step_id, lo, computed + rows))
        computed += rows
        # Consume the oldest open step (delivery order), sometimes as a discard.
        while len(open_steps) > int(rng.integers(0, 3)):
            step_id, lo, hi = open_steps.pop(0)
            if rng.random() < 0.1:
                consume(core, step_id)
                skipped.update(range(lo, hi))
                continue
            plan = consume(core, step_id, ["a"])
            ((begin, end),) = positions(plan)
            delivered.extend(range(begin, end))
    assert kinds >= {"zero", "below", "above"} and skipped, (kinds, skipped)
    assert len(delivered) == len(set(delivered)), "a position was handed out twice"
    assert delivered == sorted(delivered), "positions came out of order"
    assert set(delivered) | skipped >= set(range(max(delivered) + 1))


_RECORDS = {
    PrefixCacheEventKind.STARTED: started,
    PrefixCacheEventKind.RESUMED: resumed,
    PrefixCacheEventKind.PREEMPTED: preempted,
    PrefixCacheEventKind.FINISHED: finished,
    PrefixCacheEventKind.ABORTED: aborted,
}
_SETUPS = {
    RequestState.NOT_LIVE: lambda core: None,
    RequestState.RUNNING: _running_a,
    RequestState.PREEMPTED: _preempted_a,
}


@pytest.mark.parametrize("kind", list(PrefixCacheEventKind), ids=lambda k: k.name)
@pytest.mark.parametrize("state", list(RequestState), ids=lambda s: s.name)
def test_life_2_every_state_and_record_pair_moves_by_the_table_or_raises(
    make_core: MakeCore, state: RequestState, kind: PrefixCacheEventKind
) -> None:
    """Each (state, record) pair: a pair in `_LIFECYCLE` moves the request to the table's state;
    any other raises LifecycleError naming the pair and changes nothing (LIFE-2)."""
    core = make_core()
    _SETUPS[state](core)
    assert core.request_states().get("a", RequestState.NOT_LIVE) is state
    step = _steps(core, _RECORDS[kind]("a"))
    target = _LIFECYCLE.get((state, kind))
    if target is None:
        error = raises_unchanged(core, LifecycleError, core.start_step, step)
        assert (error.event, error.state) == (kind.value, state.value)
    else:
        core.start_step(step)
        assert core.request_states().get("a", RequestState.NOT_LIVE) is target
    core.check_invariants()


def test_life_2_the_record_table_is_the_spec() -> None:
    """`_LIFECYCLE` is LIFE-2 as SPEC section 12 writes it: a start of an id not live, a
    continuation of a running one, a preemption of a running one, a resume of a preempted one,
    and an end in any state (an end of an id not live is accepted and changes nothing)."""
    K, S = PrefixCacheEventKind, RequestState
    expected = {
        (S.NOT_LIVE, K.STARTED): S.RUNNING,
        (S.RUNNING, K.STARTED): S.RUNNING,
        (S.RUNNING, K.PREEMPTED): S.PREEMPTED,
        (S.PREEMPTED, K.RESUMED): S.RUNNING,
    }
    for state in S:
        expected[(state, K.FINISHED)] = expected[(state, K.ABORTED)] = S.NOT_LIVE
    assert dict(_LIFECYCLE) == expected


def test_d9_a_layout_in_a_new_order_is_checked_again_and_names_what_it_refuses(
    make_core: MakeCore,
) -> None:
    """A layout whose row order changed is checked in full (D9, LIFE-3): a repeat is refused
    before a request not live, each error names what it found, nothing changes, and a good
    layout in any order saves each request's own rows."""
    core = make_core()
    start(core, started("a"), started("b"), started("c"), started("d"))
    consume(core, save(core, [("a", [0]), ("b", [4]), ("c", [8]), ("d", [12])]).step_id)
    cases = [
        ([("b", [5]), ("a", [1]), ("b", [6])], "distinct request ids"),
        ([("x", [5]), ("a", [1]), ("x", [6])], "distinct request ids"),  # repeat first
        ([("c", [5]), ("x", [1]), ("y", [6])], "['x', 'y']"),
        ([("z", [5])], "['z']"),
    ]
    for layout, named in cases:
        error = raises_unchanged(core, BadInputError, core.save_begin, save_input(layout))
        assert named in f"{error.expected} {error.got}"
    start(core, preempted("c"))
    layout = [("d", [13]), ("c", [9]), ("a", [1])]
    error = raises_unchanged(core, BadInputError, core.save_begin, save_input(layout))
    assert "preempted requests ['c']" in error.got and "LIFE-3" in error.expected
    step = save(core, [("d", [13]), ("b", [5]), ("a", [1])]).step_id
    plan = consume(core, step, ["a", "d"])  # a subset, in another order again
    assert positions(plan) == [(1, 2), (1, 2)]
    with pytest.raises(BadInputError, match="outside the save snapshot"):
        consume(core, save(core, [("b", [6]), ("a", [2])]).step_id, ["a", "c"])
