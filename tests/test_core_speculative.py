"""Unit tests of speculative decoding in the core (SPEC section 13: SPEC-1..SPEC-6).

Block size 4. Request ``a`` prefills positions 0..2 into slots 0..2, then a decode step computes
position 3 (slot 3, its confirmed row) and two drafts at positions 4 and 5 (slots 4 and 5): rows
``[3, 6)``, drafts base 4. The engine then reports the computed count ``c'`` in ``[4, 6]``: 4
rejects both drafts, 5 accepts one, 6 accepts both.
"""

from __future__ import annotations

import pytest

from omni_cache_core import HIDDEN_KEY, BadInputError, HitUnreadableError, ReqId
from omni_cache_core._occupancy import ABSENT
from omni_cache_core._values import ConsumeBegin, ConsumePlan, Tombstone
from tests.core_helpers import (
    MakeCore,
    blocks,
    consume,
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


def _prefilled(core: object) -> None:
    start(core, started("a"))  # type: ignore[arg-type]
    published = save(core, [("a", [0, 1, 2])])  # type: ignore[arg-type]
    consume(core, published.step_id, ["a"])  # type: ignore[arg-type]


def _drafted(core: object, **kwargs: object) -> object:
    """Save the decode step with two drafts; returns its `SavePublished`."""
    return save(core, [("a", [3, 4, 5])], drafts=[2], **kwargs)  # type: ignore[arg-type]


def _rows_handed(plan: ConsumePlan) -> list[int]:
    return [int(e - s) for s, e in plan.positions.tolist()]


def test_spec_1_a_step_materialized_before_acceptance_hands_out_its_confirmed_row_only(
    make_core: MakeCore,
) -> None:
    """Draft rows are not handed out while unconfirmed: the plan cuts them off the tail
    (SPEC-1)."""
    core = make_core()
    _prefilled(core)
    published = _drafted(core)
    plan = consume(core, published.step_id, ["a"])
    assert positions(plan) == [(3, 4)] and plan.cut_tail
    assert core.counters.draft_rows == 2


@pytest.mark.parametrize("computed", [4, 5, 6])
def test_spec_2_acceptance_at_the_next_start_sets_what_the_step_hands_out(
    make_core: MakeCore, computed: int
) -> None:
    """A computed count at the next start confirms the drafts below it: the step, consumed after
    that start, hands out ``[3, computed)``; the request's next rows start at `computed`
    (SPEC-2)."""
    core = make_core()
    _prefilled(core)
    published = _drafted(core)
    start(core, computed={"a": computed})
    plan = consume(core, published.step_id, ["a"])
    assert positions(plan) == [(3, computed)]
    assert plan.cut_tail == (computed < 6)
    nxt = save(core, [("a", [computed])])
    assert positions(consume(core, nxt.step_id, ["a"])) == [(computed, computed + 1)]
    assert core.counters.draft_rows_accepted == computed - 4
    assert core.counters.draft_rows_rejected == 6 - computed


def test_spec_2_a_materialize_may_report_the_count_itself(make_core: MakeCore) -> None:
    """``ConsumeBegin.computed`` confirms the step's drafts for its own delivery; the next
    start's count must agree with it, and nothing is read back (SPEC-2, DLV-2)."""
    core = make_core()
    _prefilled(core)
    published = _drafted(core)
    plan = consume(core, published.step_id, ["a"], computed={"a": 5})
    assert positions(plan) == [(3, 5)]
    bad = raises_unchanged(core, BadInputError, start, core, computed={"a": 6})
    assert "'a'" in str(bad) and "5" in str(bad)
    start(core, computed={"a": 5})
    assert int(core._slots.by_key[HIDDEN_KEY].owner[5]) == ABSENT
    nxt = save(core, [("a", [5])])
    plan = consume(core, nxt.step_id, ["a"])
    assert positions(plan) == [(5, 6)] and not plan.reads


def test_spec_2_counts_outside_the_drafts_range_raise_and_change_nothing(
    make_core: MakeCore,
) -> None:
    """A computed count below the drafts' base or above their end, at a start or a consume,
    raises naming the request and the range; so does a save of a request whose drafts wait
    for their count (SPEC-2, FAIL-5)."""
    core = make_core()
    _prefilled(core)
    published = _drafted(core)
    for count in (3, 7):
        error = raises_unchanged(core, BadInputError, start, core, computed={"a": count})
        assert "'a'" in str(error) and "[4, 6]" in str(error)
    start(core)  # a step that reports nothing for it
    error = raises_unchanged(core, BadInputError, core.save_begin, save_input([("a", [6])]))
    assert "'a'" in str(error) and "SPEC-2" in str(error)
    bad = ConsumeBegin(
        step_id=published.step_id, req_ids=(ReqId("a"),), now_ns=0, computed={ReqId("a"): 9}
    )
    raises_unchanged(core, BadInputError, core.consume_begin, bad)


def test_spec_2_draft_counts_must_leave_a_confirmed_row(make_core: MakeCore) -> None:
    """A request's drafts are fewer than its rows: its first row is its confirmed token
    (SPEC-1, FAIL-5)."""
    core = make_core()
    _prefilled(core)
    for drafts in ([3], [-1], [1, 1]):
        error = raises_unchanged(
            core, BadInputError, core.save_begin, save_input([("a", [3, 4, 5])], drafts=drafts)
        )
        assert "draft rows" in str(error)


def test_spec_3_rejected_slots_become_absent_and_their_write_is_tombstoned(
    make_core: MakeCore,
) -> None:
    """At the confirming start the rejected slots' every key becomes ABSENT with a new version,
    and the step write still carrying them gets a tombstone: its rows never reach the pool. The
    accepted slot keeps its writer (SPEC-3, SLOT-2)."""
    core = make_core()
    _prefilled(core)
    published = _drafted(core, land_writes=False)
    (write,) = [e for e in published.effects if type(e).__name__ == "StepWrite"]
    before = core._slots.by_key[HIDDEN_KEY].version[[4, 5]].copy()
    effects = start(core, computed={"a": 5})
    tombs = [e for e in effects if isinstance(e, Tombstone)]
    assert [(t.tid, t.key, t.slots.tolist()) for t in tombs] == [(write.tid, HIDDEN_KEY, [5])]
    table = core._slots.by_key[HIDDEN_KEY]
    assert int(table.owner[5]) == ABSENT and int(table.owner[4]) == write.tid
    assert table.version[5] != before[1] and table.version[4] == before[0]


def test_spec_3_a_hit_on_a_rejected_row_raises_and_the_recompute_is_the_newest_tenant(
    make_core: MakeCore,
) -> None:
    """An engine that serves a hit on a block holding a rejected row has diverged: the hidden
    hit raises (HIT-4). Once the position is recomputed, the new write owns the slot with a
    newer version (SPEC-3)."""
    core = make_core()
    _prefilled(core)
    # Four drafts fill block 1: without the marking its slots would hold committed rows.
    published = save(core, [("a", [3, 4, 5, 6, 7])], drafts=[4])
    consume(core, published.step_id, ["a"])
    table = core._slots.by_key[HIDDEN_KEY]
    assert [int(table.owner[s]) for s in range(4, 8)] == [0, 0, 0, 0]
    drafted = int(table.version[4])
    start(core, started("b", hit_end=8, block_ids=(0, 1)), computed={"a": 4})
    rejected = int(table.version[4])
    hit = save(core, [("a", [4]), ("b", [8])])
    with pytest.raises(HitUnreadableError, match="unknown or absent"):
        consume(core, hit.step_id, ["a", "b"])
    # The recompute of position 4 landed: COMMITTED, a newer version than the draft's.
    assert int(table.owner[4]) == 0
    assert drafted != rejected != int(table.version[4]) != drafted


def test_spec_4_accepted_rows_a_consumed_step_withheld_are_read_back_by_the_next_save(
    make_core: MakeCore,
) -> None:
    """The step was consumed before its count came: the next save carries the accepted rows
    ``[4, 5)`` as a read of their slots, then its own rows; each position once (SPEC-4, DLV-2)."""
    core = make_core()
    _prefilled(core)
    published = _drafted(core)
    assert positions(consume(core, published.step_id, ["a"])) == [(3, 4)]
    start(core, computed={"a": 5})
    nxt = save(core, [("a", [5, 6])], drafts=[1])
    plan = consume(core, nxt.step_id, ["a"])
    assert positions(plan) == [(4, 6)]
    (read,) = plan.reads
    assert read.slots.tolist() == [4]
    assert core.counters.draft_rows_read_back == 1


def test_spec_4_no_read_back_after_a_discard(make_core: MakeCore) -> None:
    """A discarded step delivered nothing: its accepted rows are passed over like its other
    positions (SPEC-4, DLV-4)."""
    core = make_core()
    _prefilled(core)
    published = _drafted(core)
    consume(core, published.step_id)
    start(core, computed={"a": 6})
    nxt = save(core, [("a", [6])])
    plan = consume(core, nxt.step_id, ["a"])
    assert not plan.reads and positions(plan) == [(6, 7)]


def test_spec_5_a_preemption_without_a_count_leaves_the_draft_rows_and_a_hit_reads_them(
    make_core: MakeCore,
) -> None:
    """PREEMPTED with drafts no count confirmed: the cache cannot tell accepted rows from
    rejected ones, so it leaves them as written. The engine accepted all four and hashed their
    block: another request's hit over it is served from those rows. The resume's positions
    restart at its hit and rows above the cursor are delivered once recomputed (SPEC-5,
    DLV-3)."""
    core = make_core()
    _prefilled(core)
    published = save(core, [("a", [3, 4, 5, 6, 7])], drafts=[4])
    assert positions(consume(core, published.step_id, ["a"])) == [(3, 4)]
    start(core, preempted("a"))
    table = core._slots.by_key[HIDDEN_KEY]
    assert ABSENT not in [int(table.owner[s]) for s in range(4, 8)]
    assert core.counters.draft_rows_unconfirmed == 4 and core.counters.draft_rows_rejected == 0
    start(core, started("b", hit_end=8, block_ids=(0, 1)))
    hit = save(core, [("b", [12])])
    plan = consume(core, hit.step_id, ["b"])
    assert positions(plan) == [(0, 9)] and len(plan.reads) == 1
    start(core, resumed("a", hit_end=0, block_ids=(2, 3)))
    again = save(core, [("a", [8, 9, 10, 11, 13])])
    assert positions(consume(core, again.step_id, ["a"])) == [(4, 5)]


def test_spec_5_a_preemption_after_a_reported_count_rejects_the_rest(
    make_core: MakeCore,
) -> None:
    """PREEMPTED after the drafted step's consume reported the count: the rows above it are
    rejected at the preemption, their slots ABSENT as SPEC-3 says (SPEC-5, SPEC-2)."""
    core = make_core()
    _prefilled(core)
    published = _drafted(core)
    assert positions(consume(core, published.step_id, ["a"], computed={"a": 5})) == [(3, 5)]
    start(core, preempted("a"))
    table = core._slots.by_key[HIDDEN_KEY]
    assert int(table.owner[4]) != ABSENT and int(table.owner[5]) == ABSENT
    assert core.counters.draft_rows_accepted == 1 and core.counters.draft_rows_rejected == 1
    assert core.counters.draft_rows_unconfirmed == 0
    start(core, started("b", hit_end=8, block_ids=(0, 1)))
    with pytest.raises(HitUnreadableError):
        consume(core, save(core, [("b", [12])]).step_id, ["b"])


def test_spec_5_a_finish_reports_its_last_steps_count_at_materialize(
    make_core: MakeCore,
) -> None:
    """The request finishes before a start could confirm its last step: a materialize that
    reports the count hands the accepted rows out; one that does not hands the confirmed row
    only (SPEC-5, SPEC-2)."""
    for report, expected in (({"a": 6}, (3, 6)), (None, (3, 4))):
        core = make_core()
        _prefilled(core)
        published = _drafted(core)
        start(core, finished("a"))
        plan = consume(core, published.step_id, ["a"], computed=report)
        assert positions(plan) == [expected]


def test_spec_1_a_step_without_drafts_has_no_tail_cut(make_core: MakeCore) -> None:
    """Without drafts the plan has no tail cut and the step's confirmed ends are its ends
    (SPEC-1)."""
    core = make_core()
    start(core, started("a"), started("b"))
    published = save(core, [("a", blocks(0)), ("b", blocks(1))])
    step = core._saved.get(published.step_id)
    assert step is not None and step.valid is step.hi
    plan = consume(core, published.step_id, ["a", "b"])
    assert not plan.cut_tail and _rows_handed(plan) == [4, 4]


def test_spec_5_an_end_of_a_request_whose_entry_never_drafted(make_core: MakeCore) -> None:
    """Drafts wait for one request while another, admitted later (an entry past any that ever
    drafted), ends: its end settles nothing and the waiting drafts stay (SPEC-5)."""
    core = make_core(num_blocks=80, staging_capacity_tokens=80)
    ids = [f"r{i}" for i in range(70)]
    start(core, *(started(r) for r in ids))
    consume(core, save(core, [(r, [4 * i]) for i, r in enumerate(ids)]).step_id)
    drafted = save(core, [("r0", [1, 2])], drafts=[1])
    start(core, finished("r69"))
    assert core.counters.draft_rows_unconfirmed == 0
    start(core, computed={"r0": 3})
    assert positions(consume(core, drafted.step_id, ["r0"])) == [(1, 3)]
