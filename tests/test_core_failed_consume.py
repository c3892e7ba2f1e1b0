"""A materialize whose outputs never reached the caller delivered nothing (D19, DLV-2, DLV-4).

The adapter ends such a consume with ``ConsumeEnd(delivered=False)`` (a hit gather failed after
the plan was made): the delivery cursors it moved go back, unless another consume moved them on
since. Block size is 4 (`tests.core_helpers`); every core passes `check_invariants()` at the end.
"""

from __future__ import annotations

from omni_cache_core import ReqId
from omni_cache_core._values import ConsumeEnd
from tests.core_helpers import (
    BLOCK,
    MakeCore,
    blocks,
    consume,
    positions,
    preempted,
    resumed,
    save,
    start,
    started,
)


def test_a_failed_build_puts_the_cursor_back(make_core: MakeCore) -> None:
    """A consume ended undelivered leaves the cursor where it was: a resume hit serves it all."""
    core = make_core()
    start(core, started("a"))
    first = save(core, [("a", blocks(0))]).step_id
    second = save(core, [("a", blocks(1))]).step_id
    consume(core, first, ["a"])
    plan = consume(core, second, ["a"], end=False)
    assert positions(plan) == [(BLOCK, 2 * BLOCK)]
    before = core.snapshot()
    core.consume_end(ConsumeEnd(step_id=second, delivered=False))
    assert core.snapshot() != before
    start(core, preempted("a"))
    start(core, resumed("a", hit_end=2 * BLOCK, block_ids=(0, 1, 2)))
    resume = save(core, [("a", [8])]).step_id
    # The cursor is back at 4: the resume's hit hands out 4..7 again, then its own row 8.
    assert positions(consume(core, resume, ["a"])) == [(BLOCK, 2 * BLOCK + 1)]


def test_a_delivered_end_keeps_the_cursor(make_core: MakeCore) -> None:
    """The counter-check: the same consume ended delivered keeps its positions delivered."""
    core = make_core()
    start(core, started("a"))
    first = save(core, [("a", blocks(0))]).step_id
    second = save(core, [("a", blocks(1))]).step_id
    consume(core, first, ["a"])
    consume(core, second, ["a"], end=False)
    core.consume_end(ConsumeEnd(step_id=second, delivered=True))
    start(core, preempted("a"))
    start(core, resumed("a", hit_end=2 * BLOCK, block_ids=(0, 1, 2)))
    resume = save(core, [("a", [8])]).step_id
    assert positions(consume(core, resume, ["a"])) == [(2 * BLOCK, 2 * BLOCK + 1)]


def test_a_cursor_moved_on_since_stays(make_core: MakeCore) -> None:
    """A later step consumed while the failed one was reading moved the cursor on: it stays."""
    core = make_core()
    start(core, started("a"))
    first = save(core, [("a", blocks(0))]).step_id
    second = save(core, [("a", blocks(1))]).step_id
    consume(core, first, ["a"], end=False)  # reading: cursor 4
    assert positions(consume(core, second, ["a"])) == [(BLOCK, 2 * BLOCK)]  # cursor 8
    core.consume_end(ConsumeEnd(step_id=first, delivered=False))
    start(core, preempted("a"))
    start(core, resumed("a", hit_end=2 * BLOCK, block_ids=(0, 1, 2)))
    resume = save(core, [("a", [8])]).step_id
    # The cursor stayed at 8: no hit, the own row 8 only (at 0 it would serve 0..8).
    assert positions(consume(core, resume, [ReqId("a")])) == [(2 * BLOCK, 2 * BLOCK + 1)]
