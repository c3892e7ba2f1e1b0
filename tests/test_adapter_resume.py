"""Scenario tests of preemption, resume and delivery through `OmniPrefixCacheManager` (SPEC
section 12: LIFE, DLV), on the CPU, inline and with a committer thread.

Block size is 4: block ``b`` holds slots ``4b .. 4b + 3``. Each test drives the `Engine` of
`tests.adapter_helpers`, which predicts every delivered range and checks every returned row
against what it wrote; the tests also spell out the exact positions and rows they expect. Rows
encode (slot, key, write id), or, for a request started with its tokens, the token prefix and
position, so a recompute gives the same rows (`encode_content`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from omni_cache_cuda import (
    HIDDEN_KEY,
    BadInputError,
    DeliveryOrderError,
    LifecycleError,
    OmniPrefixCacheManager,
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
    PrefixCacheStep,
    PrefixCacheWriteLayout,
)
from tests.adapter_helpers import (
    BLOCK,
    DEF,
    MM,
    Engine,
    Saved,
    Workload,
    assert_rows,
    encode,
    encode_content,
    make_manager,
    settle,
)

Make = Callable[..., OmniPrefixCacheManager]
KEYS = (HIDDEN_KEY, MM, DEF)


def _rows(*parts: torch.Tensor) -> torch.Tensor:
    return torch.cat(parts)


def _assert_all_keys(out: Any, req: str, want: dict[str, torch.Tensor], what: str) -> None:
    """Hidden and every mm key of ``req`` are exactly ``want[key]``."""
    assert_rows(out.hidden_states[req], want[HIDDEN_KEY], f"{what}: hidden")
    for key in (MM, DEF):
        assert_rows(out.mm_outputs[key][req], want[key], f"{what}: {key}")


def _tail(saved: Saved, start: int) -> dict[str, torch.Tensor]:
    """The step's own rows from row ``start`` on, per key."""
    return {key: saved.rows[key][start:] for key in KEYS}


def _total_hit_rows(manager: OmniPrefixCacheManager) -> int:
    return sum(manager.stats().hit_rows.values())


# ---------------------------------------------------------------------------------------------
# DLV-2 and DLV-3: what a resume hands out.


def test_dlv_2_a_resume_below_the_cursor_hands_out_only_new_positions(make: Make) -> None:
    """A request resumed below what it was delivered recomputes those positions and receives only
    the new ones; the recomputed rows still reach the pool, where a later hit reads them, and
    the resume opens no hit (DLV-2, DLV-3, DLV-7, LIFE-4)."""
    manager = make()
    engine = Engine(manager)
    engine.start("a", [0, 1, 2])
    first = engine.step({"a": 6})
    assert engine.materialize(first).positions["a"] == (0, 6)
    engine.preempt("a")
    engine.materialize(engine.step({}))
    hits, hit_rows = manager.stats().hit_requests, _total_hit_rows(manager)
    engine.resume("a", [0, 3, 4], hit_end=4)  # block 0 stayed cached, block 1 did not
    again = engine.step({"a": 4})  # positions 4..7 into block 3
    out = engine.materialize(again)
    assert out.positions["a"] == (6, 8)
    _assert_all_keys(out, "a", _tail(again, 2), "positions 6 and 7 only")
    assert (manager.stats().hit_requests, _total_hit_rows(manager)) == (hits, hit_rows)
    assert engine.materialize(engine.step({"a": 1})).positions["a"] == (8, 9)
    # Positions 4 and 5 were not handed out again, but block 3 holds them: a hit reads them.
    engine.start("c", [0, 3, 5], hit_end=8)
    out = engine.materialize(engine.step({"c": 1}))
    for key in KEYS:
        got = out.hidden_states["c"] if key == HIDDEN_KEY else out.mm_outputs[key]["c"]
        assert_rows(got[:8], _rows(first.rows[key][:4], again.rows[key][:4]), f"{key} of c")


def test_dlv_3_a_resume_above_the_cursor_serves_the_gap_as_hit_rows(make: Make) -> None:
    """A resume whose hit ends above the cursor hands out the undelivered positions as hit rows,
    read from the cursor's block on, once no earlier step owes them: the step saved before the
    preemption goes first, and leaving the request out of it is not delivery (DLV-3, DLV-4,
    DLV-5, DLV-7)."""
    manager = make()
    engine = Engine(manager)
    engine.start("a", [0, 1, 2])
    engine.start("b", [4, 5, 6])
    engine.materialize(engine.step({"a": 6, "b": 6}))
    late = engine.step({"a": 2, "b": 2})  # positions 6 and 7 of each: not consumed yet
    engine.preempt("a")
    engine.preempt("b")
    engine.materialize(engine.step({}))
    hits, hit_rows = manager.stats().hit_requests, _total_hit_rows(manager)
    engine.resume("a", [0, 1, 3], hit_end=8)  # blocks 0 and 1 stayed cached
    engine.resume("b", [4, 5, 7], hit_end=8)
    resumed = engine.step({"a": 1, "b": 1})  # position 8 of each
    assert manager.stats().hit_requests == hits + 2
    with pytest.raises(DeliveryOrderError) as caught:  # the older step owes 6 and 7 first
        engine.materialize(resumed)
    error = caught.value
    assert (error.req_id, error.step_id, error.earlier_step_id, error.gap) == (
        "a",
        resumed.step_id,
        late.step_id,
        (6, 8),
    )
    out = engine.materialize(late, ["b"])  # b gets its rows 6 and 7; a is left out
    assert dict(out.positions) == {"b": (6, 8)}
    _assert_all_keys(out, "b", {key: late.rows[key][2:4] for key in KEYS}, "b's own rows")
    out = engine.materialize(resumed)
    assert dict(out.positions) == {"a": (6, 9), "b": (8, 9)}
    want = {key: _rows(late.rows[key][0:2], resumed.rows[key][0:1]) for key in KEYS}
    _assert_all_keys(out, "a", want, "a's hit rows 6, 7 then its row 8")
    _assert_all_keys(out, "b", {key: resumed.rows[key][1:2] for key in KEYS}, "b's row 8")
    # Each hit read only block 1 (or 5), from the cursor's block on: 4 rows a key and request.
    assert _total_hit_rows(manager) == hit_rows + 2 * 4 * len(KEYS)


def test_dlv_3_the_resume_step_after_the_earlier_steps_hands_out_its_own_rows(
    make: Make,
) -> None:
    """Preempted and resumed in one step, then consumed after the step that carried the gap, a
    resume step with a hit hands out only the positions above it (DLV-3, DLV-2, LIFE-2)."""
    manager = make()
    engine = Engine(manager)
    engine.start("a", [0, 1, 2])
    engine.materialize(engine.step({"a": 6}))
    late = engine.step({"a": 2})
    engine.preempt("a")
    engine.resume("a", [0, 1, 3], hit_end=8)  # preempted and resumed in one step (LIFE-2)
    resumed = engine.step({"a": 1})
    assert engine.materialize(late).positions["a"] == (6, 8)
    out = engine.materialize(resumed)
    assert out.positions["a"] == (8, 9)
    _assert_all_keys(out, "a", _tail(resumed, 0), "its own row")


def test_dlv_6_resumes_at_zero_and_beyond_the_prompt_give_the_recomputed_rows(
    make: Make,
) -> None:
    """Rows that are a function of the tokens: a resume hitting the request's own generated
    blocks beyond its prompt (serving positions of discarded steps), then a resume with no hit
    that recomputes from 0, deliver each position once with the value a full recompute gives
    there (DLV-6, DLV-2, DLV-3, DLV-4, LIFE-4)."""
    manager = make()
    engine = Engine(manager)
    tokens = list(range(500, 516))  # a 5-token prompt, then 11 generated tokens
    ids = engine.prefix_ids(tokens)
    engine.start("a", [0, 1, 2, 3], tokens=tokens)
    engine.materialize(engine.step({"a": 5}))
    for _ in range(5):  # decode positions 5..9
        engine.materialize(engine.step({"a": 1}))
    for _ in range(2):  # positions 10 and 11, discarded: not delivered (DLV-4)
        engine.discard(engine.step({"a": 1}))
    engine.preempt("a")
    engine.materialize(engine.step({}))
    engine.resume("a", [0, 1, 2, 4], hit_end=12)  # block 2 holds generated tokens 8..11
    resumed = engine.step({"a": 1})
    out = engine.materialize(resumed)
    assert out.positions["a"] == (10, 13)
    for key in KEYS:
        got = out.hidden_states["a"] if key == HIDDEN_KEY else out.mm_outputs[key]["a"]
        assert_rows(got, encode_content(key, ids[10:13], 10), f"{key} at 10..12")
    engine.preempt("a")
    engine.resume("a", [5, 6, 7, 8], hit_end=0)  # nothing cached any more
    again = engine.step({"a": 14})  # positions 0..13: only 13 is new
    out = engine.materialize(again)
    assert out.positions["a"] == (13, 14)
    assert_rows(out.hidden_states["a"], encode_content(HIDDEN_KEY, ids[13:14], 13), "row 13")
    assert engine.delivery.recomputed_checked == 14
    assert engine.delivery_violations() == []


# ---------------------------------------------------------------------------------------------
# DLV-4: discards and left-out requests.


def test_dlv_4_discarded_positions_come_from_a_resume_hit_or_never(make: Make) -> None:
    """Positions of a discarded step are served by a later resume hit that covers them, and
    otherwise passed over; a request left out of a materialize is not delivered either
    (DLV-4, DLV-3, DLV-7)."""
    manager = make()
    engine = Engine(manager)
    engine.start("a", [0, 1])
    engine.start("b", [2, 3])
    first = engine.step({"a": 4, "b": 4})
    engine.discard(first)
    engine.preempt("a")
    engine.resume("a", [0, 4], hit_end=4)  # block 0 holds a's discarded positions 0..3
    second = engine.step({"a": 1, "b": 1})
    out = engine.materialize(second)
    assert dict(out.positions) == {"a": (0, 5), "b": (4, 5)}
    want = {key: _rows(first.rows[key][:4], second.rows[key][:1]) for key in KEYS}
    _assert_all_keys(out, "a", want, "a's discarded rows from its resume hit")
    _assert_all_keys(out, "b", {key: second.rows[key][1:2] for key in KEYS}, "b: 0..3 passed")
    # Left out of a materialize: its cursor stays; its next step passes over those positions.
    engine.start("c", [5])
    engine.start("d", [6])
    both = engine.step({"c": 2, "d": 2})
    assert dict(engine.materialize(both, ["d"]).positions) == {"d": (0, 2)}
    out = engine.materialize(engine.step({"c": 1, "d": 1}))
    assert dict(out.positions) == {"c": (2, 3), "d": (2, 3)}
    assert engine.lost_and_recovered() == (4 + 2, 4)  # b's 0..3 and c's 0..1; a's 0..3 came back


# ---------------------------------------------------------------------------------------------
# DLV-5: order.


def test_dlv_5_rows_an_open_earlier_step_owes_come_first(
    make: Make,
) -> None:
    """A materialize that would hand a request rows while an earlier open step still owes it
    positions raises DeliveryOrderError naming both steps and those positions; nothing changes
    and the step stays open. A discarded earlier step, steps sharing no request and a step with
    nothing new are not held back; after a resume the older step goes first (DLV-5, STEP-1,
    DLV-4)."""
    manager = make()
    engine = Engine(manager)
    engine.start("a", [0, 1])
    engine.start("b", [2])
    first = engine.step({"a": 2})
    second = engine.step({"a": 2, "b": 1})
    before = manager.stats()
    with pytest.raises(DeliveryOrderError) as caught:
        engine.materialize(second)
    error = caught.value
    assert (error.req_id, error.step_id, error.earlier_step_id, error.gap) == (
        "a",
        second.step_id,
        first.step_id,
        (0, 2),
    )
    assert manager.stats() == before  # nothing changed
    assert engine.materialize(first).positions["a"] == (0, 2)
    out = engine.materialize(second)
    assert dict(out.positions) == {"a": (2, 4), "b": (0, 1)}
    _assert_all_keys(out, "a", {key: second.rows[key][:2] for key in KEYS}, "a after the gap")
    # A discarded earlier step holds nothing back: its positions are passed over.
    skipped, after = engine.step({"a": 1}), engine.step({"a": 1})
    engine.discard(skipped)
    assert engine.materialize(after).positions["a"] == (5, 6)
    # Steps sharing no request go in any order.
    of_b, of_a = engine.step({"b": 1}), engine.step({"a": 1})
    assert engine.materialize(of_a).positions["a"] == (6, 7)
    assert engine.materialize(of_b).positions["b"] == (1, 2)
    # After a resume the older step goes first; a step with nothing new is not held back.
    old = engine.step({"a": 1})  # position 7
    engine.preempt("a")
    engine.resume("a", [3, 4, 5], hit_end=0)
    below = engine.step({"a": 4})  # positions 0..3, all delivered already
    assert engine.materialize(below).positions["a"] == (7, 7)
    new = engine.step({"a": 5})  # positions 4..8: 7 and 8 are new, and `old` still owes 7
    with pytest.raises(DeliveryOrderError) as caught:
        engine.materialize(new)
    assert (caught.value.earlier_step_id, caught.value.gap) == (old.step_id, (7, 8))
    assert engine.materialize(old).positions["a"] == (7, 8)
    out = engine.materialize(new)
    assert out.positions["a"] == (8, 9)
    _assert_all_keys(out, "a", _tail(new, 4), "position 8 from the recompute")
    assert engine.delivery.refused == 2


def test_dlv_5_a_step_without_rows_passes_over_no_positions_an_earlier_step_owes(
    make: Make,
) -> None:
    """A request in a step's layout with no rows there, consumed before an earlier step that
    owes it positions, gets nothing; whether or not that materialize is refused, the earlier
    step then hands out every position it carries: a request with hit rows only, and one with
    own rows (DLV-5, DLV-4, DLV-2)."""
    manager = make()
    engine = Engine(manager)
    engine.start("a", [0, 1, 2])
    engine.materialize(engine.step({"a": 8}))
    engine.start("b", [0, 3], hit_end=4)  # b's first step carries its hit rows only
    owing = engine.step({"a": 2, "b": 0})
    idle = engine.step({"a": 0, "b": 0})

    def consume(saved: Saved) -> dict[str, tuple[int, int]]:
        try:
            return dict(engine.materialize(saved).positions)
        except DeliveryOrderError:
            return {}  # the model checked it is the refusal due

    held_back = consume(idle)
    assert held_back in ({}, {"a": (10, 10), "b": (4, 4)})
    out = engine.materialize(owing)
    assert dict(out.positions) == {"a": (8, 10), "b": (0, 4)}
    _assert_all_keys(out, "a", _tail(owing, 0), "a's rows 8 and 9")
    if not held_back:
        assert dict(engine.materialize(idle).positions) == {"a": (10, 10), "b": (4, 4)}
    assert engine.delivery_violations() == []


# ---------------------------------------------------------------------------------------------
# DLV-7: positions.


def test_dlv_7_positions_say_what_each_request_received(make: Make) -> None:
    """`positions` holds each requested request's delivered range; the output is still a
    two-field tuple, and a per-token leftover is cut to the same positions as the cached keys
    (DLV-7, DLV-2, OUT-5)."""
    manager = make()
    engine = Engine(manager)
    engine.start("a", [0, 1])
    engine.start("b", [2])
    out = engine.materialize(engine.step({"a": 6, "b": 1}))
    hidden, mm = out
    assert hidden is out.hidden_states and mm is out.mm_outputs
    assert dict(out.positions) == {"a": (0, 6), "b": (0, 1)}
    engine.preempt("a")
    engine.resume("a", [0, 3], hit_end=4)  # below the cursor: positions 4 and 5 are cut
    tok = torch.arange(5) * 10  # one value per row of the step: a's 4 rows, then b's
    saved = engine.step({"a": 4, "b": 1}, extra={"meta.tok": tok})
    out = engine.materialize(saved, ["b", "a"], leftover=["meta.tok"])
    assert list(out.positions) == ["b", "a"]
    assert dict(out.positions) == {"a": (6, 8), "b": (1, 2)}
    assert out.mm_outputs["meta.tok"]["a"].tolist() == [20, 30]  # a's rows 6 and 7
    assert out.mm_outputs["meta.tok"]["b"].tolist() == [40]
    assert_rows(out.hidden_states["a"], encode(HIDDEN_KEY, saved.slots[2:4], saved.write), "a")


# ---------------------------------------------------------------------------------------------
# LIFE: the lifecycle at the adapter.


def test_life_3_preemption_escalates_deferred_writes_and_keeps_steps_readable(
    make: Make,
) -> None:
    """PREEMPTED writes the request's deferred rows to the pool at once (as a finish does), its
    steps saved before stay readable, even after it ends while preempted, and a save naming it
    raises and changes nothing (LIFE-3, TASK-4, D9)."""
    manager = make()
    engine = Engine(manager)
    engine.start("a", [0, 1])
    first = engine.step({"a": 4})
    second = engine.step({"a": 2})
    assert settle(manager).rows_written.get(DEF, 0) == 0  # a's deferred write is still open
    engine.preempt("a")
    engine.begin({})
    assert settle(manager).rows_written[DEF] == 6  # escalated and written (LIFE-3)
    empty = engine.save()
    assert engine.materialize(first).positions["a"] == (0, 4)
    out = engine.materialize(second)
    assert out.positions["a"] == (4, 6)
    _assert_all_keys(out, "a", _tail(second, 0), "a step saved before the preemption")
    engine.materialize(empty)
    # A save whose layout names the preempted request raises; nothing changes (D9).
    layout = PrefixCacheWriteLayout.from_block_tables(
        ["a"], {"a": 1}, {"a": 6}, {"a": [0, 1]}, BLOCK
    )
    before = settle(manager)
    engine.begin({})
    with pytest.raises(BadInputError, match="preempted"):
        manager.save_outputs(
            encode(HIDDEN_KEY, torch.tensor([6]), 99),
            {},
            num_tokens_unpadded=1,
            write_layout=layout,
        )
    assert settle(manager) == before
    engine.materialize(engine.save())
    # The deferred rows are in the pool: a hit on a's block reads them there.
    pool_rows = manager.stats().hit_rows["POOL"]
    engine.start("b", [0, 2], hit_end=4)
    out = engine.materialize(engine.step({"b": 1}))
    assert_rows(out.mm_outputs[DEF]["b"][:4], first.rows[DEF], "deferred rows from the pool")
    assert manager.stats().hit_rows["POOL"] == pool_rows + 4 * len(KEYS)
    # Ended while preempted: its open step still materializes.
    engine.start("c", [3])
    kept = engine.step({"c": 3})
    engine.preempt("c")
    engine.materialize(engine.step({}))
    engine.finish("c", abort=True)
    engine.materialize(engine.step({}))
    out = engine.materialize(kept)
    assert out.positions["c"] == (0, 3)
    _assert_all_keys(out, "c", _tail(kept, 0), "the step of an aborted preempted request")
    assert engine.delivery_violations() == []


def test_life_1_an_id_started_again_while_its_old_steps_are_open(make: Make) -> None:
    """A finished id started again is a new admission: its positions and delivery start afresh,
    and the old admission's open step keeps its own, in either order (LIFE-1, HIT-2)."""
    manager = make()
    engine = Engine(manager)
    engine.start("a", [0])
    old = engine.step({"a": 3})
    engine.finish("a")
    engine.start("a", [1])
    new = engine.step({"a": 2})
    out = engine.materialize(new)
    assert out.positions["a"] == (0, 2)
    _assert_all_keys(out, "a", _tail(new, 0), "the new admission")
    out = engine.materialize(old)
    assert out.positions["a"] == (0, 3)
    _assert_all_keys(out, "a", _tail(old, 0), "the old admission")


def test_life_2_records_illegal_in_the_request_state_raise_and_change_nothing(
    make: Make,
) -> None:
    """RESUMED of a running request, PREEMPTED of a preempted one and STARTED of a preempted one
    raise LifecycleError naming the request, record and state; the cache is unchanged and the
    request goes on (LIFE-2)."""
    manager = make()
    engine = Engine(manager)
    engine.start("a", [0, 1])
    engine.materialize(engine.step({"a": 2}))

    def record(kind: PrefixCacheEventKind, **fields: Any) -> PrefixCacheStep:
        return PrefixCacheStep(events=[PrefixCacheRequestEvent(req_id="a", kind=kind, **fields)])

    before = settle(manager)
    with pytest.raises(LifecycleError) as caught:
        manager.new_step_starts(record(PrefixCacheEventKind.RESUMED))
    assert (caught.value.req_id, caught.value.event, caught.value.state) == (
        "a",
        "resumed",
        "running",
    )
    engine.preempt("a")
    engine.materialize(engine.step({}))
    for kind, fields in (
        (PrefixCacheEventKind.PREEMPTED, {}),
        (PrefixCacheEventKind.STARTED, {"block_ids": (2,)}),
    ):
        with pytest.raises(LifecycleError) as caught:
            manager.new_step_starts(record(kind, **fields))
        assert caught.value.state == "preempted"
    assert settle(manager).steps_saved == before.steps_saved + 1
    engine.resume("a", [2, 3], hit_end=0)
    assert engine.materialize(engine.step({"a": 3})).positions["a"] == (2, 3)


# ---------------------------------------------------------------------------------------------
# Modes agree.

#: A preempting workload over a small cache (see `Workload`).
PREEMPTING: dict[str, Any] = {
    "max_lag": 3,
    "preempt_p": 0.05,
    "resume_p": 0.6,
    "end_preempted_p": 0.05,
    "cut_hit_p": 0.25,
    "aim_hit_p": 0.3,
    "max_decode": 10,
}


def test_preempting_runs_agree_inline_and_threaded_with_prefetch_on_and_off() -> None:
    """A workload with preemptions, resumes, refusals and discards returns the same rows and
    positions inline and threaded (a builder thread for the threaded runs), with prefetch on and
    off (SPEC section 2, HIT-7, DLV-7)."""
    runs: dict[tuple[bool, bool], list[tuple[int, dict[str, Any]]]] = {}
    for threaded in (False, True):
        for prefetch in (True, False):
            manager = make_manager(threaded, prefetch=prefetch, num_blocks=24, staging_depth=6)
            with manager:
                workload = Workload(Engine(manager), seed=3, builder=threaded, **PREEMPTING)
                for _ in range(120):
                    workload.step()
                workload.close()
            assert not workload.errors, workload.errors[:3]
            counts = workload.counts
            assert counts.resumes >= 10 and counts.refusals >= 10, counts
            assert counts.resume_above + counts.resume_below >= 5, counts
            runs[(threaded, prefetch)] = workload.outputs
    first = runs[(False, True)]
    assert len(first) > 90
    for mode, outputs in runs.items():
        assert outputs == first, f"threaded, prefetch = {mode} differs"
