"""Scenario tests of `OmniPrefixCacheManager` on the CPU, inline and with a committer thread.

Every scenario runs in both modes (SPEC section 2: both must give identical results) and checks
exact tensor values against what the engine wrote (`tests.adapter_helpers`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from omni_cache_cuda import (
    HIDDEN_KEY,
    BadInputError,
    HitUnreadableError,
    ModelCachePolicy,
    OmniPrefixCacheManager,
    OmniPrefixCacheStagingTimeoutError,
    OmniPrefixCacheUnmatchError,
    OversizeStepError,
    PageTimeoutError,
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
    PrefixCacheStep,
    PrefixCacheWrite,
    PrefixCacheWriteLayout,
    ShutDownError,
    StageCacheOutputs,
    StepAlreadyConsumedError,
    UnknownStepError,
    WriteFailedError,
)
from omni_cache_cuda import _effects as effects_module
from omni_cache_cuda import _manager as manager_module
from omni_cache_cuda._committer import copy_in_pieces
from tests.adapter_helpers import (
    BLOCK,
    DEF,
    MM,
    WIDE,
    Engine,
    Workload,
    assert_rows,
    config,
    encode,
    make_manager,
    policy,
    settle,
)

Make = Callable[..., OmniPrefixCacheManager]


def started(req: str, *, hit_end: int = 0, blocks: tuple[int, ...] = ()) -> PrefixCacheStep:
    """A step whose only record starts ``req`` with one scheduled token."""
    event = PrefixCacheRequestEvent(
        req_id=req,
        kind=PrefixCacheEventKind.STARTED,
        hit_end=hit_end,
        block_ids=blocks,
        scheduled_tokens=1,
    )
    return PrefixCacheStep(events=[event], scheduled_tokens={req: 1})


def empty_step() -> PrefixCacheStep:
    """A step with no records and nothing scheduled."""
    return PrefixCacheStep(events=[], scheduled_tokens={})


# ---------------------------------------------------------------------------------------------
# Hits and misses.


def test_no_hit_passthrough(make: Make) -> None:
    """A step without hits returns exactly each request's own rows for hidden and mm (OUT-1)."""
    engine = Engine(make())
    engine.start("a", [0, 1])
    engine.start("b", [2])
    saved = engine.step({"a": 6, "b": 3})
    out = engine.materialize(saved)
    assert_rows(out.hidden_states["a"], encode(HIDDEN_KEY, saved.slots[:6], saved.write), "a")
    assert_rows(out.mm_outputs[DEF]["b"], encode(DEF, saved.slots[6:], saved.write), "b")


def test_hit_merged_from_pool(make: Make) -> None:
    """A hit on committed blocks returns the pool's prefix rows followed by the step's rows (HIT-3)."""
    manager = make()
    engine = Engine(manager)
    engine.start("a", [0, 1, 2])
    first = engine.step({"a": 8})
    engine.materialize(first)
    engine.materialize(engine.step({"a": 1}))  # the barrier lands a's first write in the pool
    engine.finish("a")
    engine.start("b", [0, 1, 3], hit_end=8)
    pool_rows = manager.stats().hit_rows["POOL"]
    saved = engine.step({"b": 3})
    out = engine.materialize(saved)
    assert_rows(out.hidden_states["b"][:8], first.rows[HIDDEN_KEY][:8], "prefix of b")
    assert_rows(out.mm_outputs[MM]["b"][:8], first.rows[MM][:8], "mm prefix of b")
    assert out.hidden_states["b"].shape[0] == 11
    assert manager.stats().hit_rows["POOL"] - pool_rows >= 16  # hidden and MM from the pool


def test_partial_match_on_shared_prefix(make: Make) -> None:
    """Requests sharing one or two blocks of a prefix get those rows, then their own tails (HIT-3)."""
    engine = Engine(make())
    engine.start("a", [0, 1, 2])
    first = engine.step({"a": 12})
    engine.materialize(first)
    engine.start("b", [0, 3, 4], hit_end=4)
    engine.start("c", [0, 1, 5], hit_end=8)
    saved = engine.step({"b": 5, "c": 2})
    out = engine.materialize(saved)
    assert_rows(out.hidden_states["b"][:4], first.rows[HIDDEN_KEY][:4], "shared block of b")
    assert_rows(out.hidden_states["c"][:8], first.rows[HIDDEN_KEY][:8], "shared blocks of c")
    assert_rows(out.hidden_states["b"][4:], saved.rows[HIDDEN_KEY][:5], "tail of b")
    assert_rows(out.mm_outputs[DEF]["c"][8:], saved.rows[DEF][5:], "tail of c")


def test_returned_rows_own_their_memory_after_the_page_is_reused(make: Make) -> None:
    """Rows handed out by a step with a hit request and one without (same-step hit included)
    stay intact while later steps reuse every staging page (STEP-3, PAGE-1)."""
    engine = Engine(make(staging_depth=2))
    engine.start("a", [0, 1])
    engine.start("b", [2, 3])
    engine.start("c", [0, 1, 4], hit_end=8)
    saved = engine.step({"a": 8, "b": 8, "c": 2})
    out = engine.materialize(saved)
    kept = {
        key: {req: rows.clone() for req, rows in by_req.items()}
        for key, by_req in (("hidden", out.hidden_states), *out.mm_outputs.items())
    }
    engine.finish("a")
    engine.finish("b")
    engine.finish("c")
    for i in range(4):  # two pages, each reused twice, by steps of other rows
        engine.start(f"x{i}", [8 + i])
        engine.materialize(engine.step({f"x{i}": 4}))
    for key, by_req in (("hidden", out.hidden_states), *out.mm_outputs.items()):
        for req, rows in by_req.items():
            assert torch.equal(rows, kept[key][req]), f"{key} rows of {req} changed"
    assert_rows(out.hidden_states["c"][:8], saved.rows[HIDDEN_KEY][:8], "prefix of c from a")


def _storages(out: StageCacheOutputs) -> set[int]:
    """Where the memory behind each returned tensor starts."""
    by_key = [out.hidden_states or {}, *out.mm_outputs.values()]
    return {rows.untyped_storage().data_ptr() for rows_of in by_key for rows in rows_of.values()}


def test_out_8_rows_the_caller_holds_are_not_handed_out_again_until_it_lets_go(
    make: Make,
) -> None:
    """Every returned buffer is kept for reuse here (D40): while the caller holds a step's rows,
    steps of the same shape get other memory and the held rows stay as they were; once it lets
    go of them (and holds the others), the next step's rows come in that memory, and are right
    (OUT-8)."""
    manager = make()
    engine = Engine(manager)

    def two_requests(first: str, second: str) -> StageCacheOutputs:
        engine.start(first, [0, 1])
        engine.start(second, [2, 3])
        out = engine.materialize(engine.step({first: 8, second: 8}))  # checks every row
        engine.finish(first)
        engine.finish(second)
        return out

    held = two_requests("a", "b")
    values = {
        (key, req): rows.clone()
        for key, rows_of in (("hidden", held.hidden_states), *held.mm_outputs.items())
        for req, rows in rows_of.items()
    }
    memory = _storages(held)
    later = []  # held too: once the first step's rows are let go, only theirs are free
    for i in range(4):
        later.append(two_requests(f"c{i}", f"d{i}"))
        assert not memory & _storages(later[-1])
    for (key, req), rows in values.items():
        source = held.hidden_states if key == "hidden" else held.mm_outputs[key]
        assert torch.equal(source[req], rows), f"held {key} rows of {req} changed"
    assert manager.stats().output_bytes_kept > 0
    del held
    assert memory & _storages(two_requests("e", "f"))


def test_hit_with_no_rows_this_step(make: Make) -> None:
    """A hit request scheduled 0 tokens beside others gets exactly its prefix rows (HIT-3)."""
    engine = Engine(make())
    engine.start("a", [0, 1, 2])
    first = engine.step({"a": 8})
    engine.materialize(first)
    engine.start("b", [0, 3], hit_end=4)
    out = engine.materialize(engine.step({"a": 1, "b": 0}))
    assert_rows(out.hidden_states["b"], first.rows[HIDDEN_KEY][:4], "prefix only")
    assert_rows(out.mm_outputs[DEF]["b"], first.rows[DEF][:4], "deferred prefix only")


def test_live_request_restarting_is_not_a_hit(make: Make) -> None:
    """A live request that re-enters as started opens no hit and gets only its rows (HIT-1)."""
    manager = make()
    engine = Engine(manager)
    engine.start("a", [0, 1])
    engine.materialize(engine.step({"a": 4}))
    engine.start("a", [0, 1], hit_end=4)  # a continuation, not a new request
    saved = engine.step({"a": 4})
    out = engine.materialize(saved)
    assert out.hidden_states["a"].shape[0] == 4
    assert manager.stats().hit_requests == 0


def test_same_step_hit_reads_the_producer(make: Make) -> None:
    """A hit on blocks another request computes in the same step returns that request's rows (HIT-5)."""
    manager = make()
    engine = Engine(manager)
    engine.start("z", [0, 1])
    old = engine.step({"z": 8})
    engine.materialize(old)
    engine.finish("z")
    engine.start("a", [0, 1])
    engine.start("b", [0, 1, 2], hit_end=8)
    before = manager.stats().hit_rows["THIS_STEP"]
    saved = engine.step({"a": 8, "b": 1})
    out = engine.materialize(saved)
    assert_rows(out.hidden_states["b"][:8], saved.rows[HIDDEN_KEY][:8], "prefix from a")
    assert not torch.equal(out.hidden_states["b"][:8], old.rows[HIDDEN_KEY])
    assert_rows(out.mm_outputs[DEF]["b"][:8], saved.rows[DEF][:8], "deferred prefix from a")
    assert manager.stats().hit_rows["THIS_STEP"] - before == 3 * 8


def test_hit_on_unwritten_blocks_raises(make: Make) -> None:
    """A hidden hit on never-written blocks raises at materialize and holds no page (HIT-4)."""
    manager = make()
    engine = Engine(manager)
    engine.start("a", [0])
    engine.materialize(engine.step({"a": 4}))
    engine.start("b", [0, 5, 6], hit_end=8)  # block 5 was never written
    saved = engine.step({"b": 2})
    assert saved.unreadable == {"b"}
    with pytest.raises(HitUnreadableError) as caught:
        manager.materialize(saved.step_id, ["b"])
    assert caught.value.req_id == "b"
    assert settle(manager).pages_in_use == 0
    with pytest.raises(StepAlreadyConsumedError):
        manager.materialize(saved.step_id, ["b"])


def test_unaligned_hit_and_hit_without_blocks_raise(make: Make) -> None:
    """An unaligned hit or a hit without block ids raises at step start; nothing changes (HIT-1)."""
    manager = make()
    with pytest.raises(BadInputError) as caught:
        manager.new_step_starts(started("a", hit_end=3, blocks=(0,)))
    assert "'a'" in str(caught.value)
    assert "hit_end=3" in str(caught.value)
    assert f"block_size={BLOCK}" in str(caught.value)
    with pytest.raises(BadInputError) as caught:
        manager.new_step_starts(started("a", hit_end=4))
    assert "block ids" in str(caught.value)
    engine = Engine(manager)
    engine.start("a", [0])
    engine.materialize(engine.step({"a": 2}))
    assert manager.stats().hit_requests == 0


def test_id_finished_and_started_in_one_step_is_new(make: Make) -> None:
    """An id finished and started again in one step is a new request whose hit opens (HIT-2)."""
    manager = make()
    engine = Engine(manager)
    engine.start("a", [0, 1])
    first = engine.step({"a": 8})
    engine.materialize(first)
    engine.finish("a")
    engine.start("a", [0, 2], hit_end=4)
    saved = engine.step({"a": 2})
    out = engine.materialize(saved)
    assert_rows(out.hidden_states["a"][:4], first.rows[HIDDEN_KEY][:4], "prefix of the new a")
    assert manager.stats().hit_requests == 1


def test_key_first_seen_after_prefix_reads_zeros(make: Make) -> None:
    """A per-token key first emitted after the prefix was written reads zeros there (HIT-3)."""
    engine = Engine(make())
    engine.start("a", [0, 1])
    engine.materialize(engine.step({"a": 8}, emit=()))  # no mm key exists yet
    engine.finish("a")
    engine.start("b", [0, 2], hit_end=4)
    saved = engine.step({"b": 2})
    out = engine.materialize(saved)
    for key in (MM, DEF):
        assert not out.mm_outputs[key]["b"][:4].any()
        assert_rows(out.mm_outputs[key]["b"][4:], saved.rows[key], f"{key} rows of b")


def test_mm_keys_merge_like_hidden(make: Make) -> None:
    """Immediate and deferred per-token mm keys merge hit prefix and step rows like hidden (HIT-3)."""
    engine = Engine(make())
    engine.start("a", [0, 1])
    first = engine.step({"a": 7})
    engine.materialize(first)
    engine.finish("a")
    engine.start("b", [0, 2], hit_end=4)
    saved = engine.step({"b": 3})
    out = engine.materialize(saved)
    for key in (MM, DEF):
        expected = torch.cat((first.rows[key][:4], saved.rows[key]))
        assert_rows(out.mm_outputs[key]["b"], expected, key)


def test_unpadded_mm_on_padded_step_is_cached(make: Make) -> None:
    """A per-token mm tensor of ``n`` rows on a padded step is cached and served on a hit (OUT-2)."""
    manager = make()
    engine = Engine(manager)
    engine.start("a", [0, 1])
    # Hidden and DEF carry 8 padded rows; MM carries exactly the 6 real rows.
    first = engine.step({"a": 6}, padded=8, pad=(DEF,))
    out = engine.materialize(first)
    assert out.mm_outputs[MM]["a"].shape[0] == 6
    engine.finish("a")
    engine.start("b", [0, 2], hit_end=4)
    saved = engine.step({"b": 1}, padded=4, pad=(MM,))
    out = engine.materialize(saved)
    assert_rows(out.mm_outputs[MM]["b"][:4], first.rows[MM][:4], "unpadded key prefix")
    assert_rows(out.mm_outputs[DEF]["b"][:4], first.rows[DEF][:4], "padded key prefix")


def test_leftover_shapes_are_preserved(make: Make) -> None:
    """Uncached values: other-length tensors whole, n-row tensors sliced, lists whole, dicts recursed (OUT-4, OUT-5)."""
    engine = Engine(make())
    engine.start("a", [0])
    engine.start("b", [1])
    ref = torch.arange(6.0).reshape(3, 2)  # a reference-codes tensor, not per token
    tok = torch.arange(6) * 10  # 1-D, one value per token: sliced per request
    padded_meta = torch.arange(8) * 100  # 1-D with the padded length
    extra = {
        "codes.ref": ref,
        "meta.tok": tok,
        "meta.pad": padded_meta,
        "lst": [1, 2, 3],
        "nested": {"t": tok.clone(), "l": ["x"]},
        "scalar": 5,
    }
    saved = engine.step({"a": 4, "b": 2}, extra=extra, padded=8)
    out = engine.materialize(saved, leftover=extra)
    mm = out.mm_outputs
    for req, (start, end) in (("a", (0, 4)), ("b", (4, 6))):
        assert_rows(mm["codes.ref"][req], ref, f"codes.ref of {req}")
        assert_rows(mm["meta.tok"][req], tok[start:end], f"meta.tok of {req}")
        assert_rows(mm["meta.pad"][req], padded_meta[start:end], f"meta.pad of {req}")
        assert mm["lst"][req] == [1, 2, 3]
        assert set(mm["nested"][req]) == {"t", "l"}
        assert_rows(mm["nested"][req]["t"], tok[start:end], f"nested.t of {req}")
        assert mm["nested"][req]["l"] == ["x"]
        assert mm["scalar"][req] == 5


# ---------------------------------------------------------------------------------------------
# Deferred writes and the budget.


def test_deferred_rows_readable_before_and_after_finish(make: Make) -> None:
    """Deferred rows are served from the write task before finish and from the pool after (HIT-3, TASK-4)."""
    manager = make()
    engine = Engine(manager)
    engine.start("a", [0, 1, 2])
    first = engine.step({"a": 8})
    engine.materialize(first)
    engine.start("b", [0, 1, 3], hit_end=8)
    task_rows = manager.stats().hit_rows["TASK"]
    out = engine.materialize(engine.step({"b": 1}))
    assert_rows(out.mm_outputs[DEF]["b"][:8], first.rows[DEF], "deferred prefix from the task")
    assert manager.stats().hit_rows["TASK"] - task_rows == 8
    assert manager.stats().rows_written.get(DEF, 0) == 0  # nothing deferred reached the pool
    engine.finish("a")
    engine.finish("b")
    engine.materialize(engine.step({}))
    assert settle(manager).rows_written[DEF] == 9  # a's 8 rows and b's 1
    engine.start("c", [0, 1, 4], hit_end=8)
    pool_rows = manager.stats().hit_rows["POOL"]
    out = engine.materialize(engine.step({"c": 2}))
    assert_rows(out.mm_outputs[DEF]["c"][:8], first.rows[DEF], "deferred prefix from the pool")
    assert manager.stats().hit_rows["POOL"] - pool_rows == 3 * 8


def test_budget_forces_oldest_deferred_write_out(make: Make) -> None:
    """A save over the GPU-byte budget flushes the oldest deferred write; hits stay exact (BUDGET-2)."""
    row_bytes = 4 * 8  # one DEF row: 2 x 2 int64
    manager = make(gpu_staging_bytes=6 * row_bytes)
    engine = Engine(manager)
    engine.start("a", [0, 1, 2])
    steps = [engine.step({"a": 4}) for _ in range(3)]
    for saved in steps:
        engine.materialize(saved)
    stats = settle(manager)
    assert stats.budget_flushes >= 2
    assert stats.budget_bytes_in_use <= 6 * row_bytes
    engine.start("b", [0, 1, 2, 3], hit_end=12)
    saved = engine.step({"b": 1})
    out = engine.materialize(saved)
    expected = torch.cat([s.rows[DEF] for s in steps] + [saved.rows[DEF]])
    assert_rows(out.mm_outputs[DEF]["b"], expected, "deferred rows across flushed writes")


# ---------------------------------------------------------------------------------------------
# Tenants, sparse keys, delayed reads.


def _slow_writes(manager: OmniPrefixCacheManager) -> None:
    """Make every pool write take a little while, so writes overlap the next steps."""
    manager._inject_write_fault(lambda job: time.sleep(0.02))


def test_newest_tenant_wins(make: Make) -> None:
    """A recycled block serves its newest tenant's rows, deferred keys included (SLOT-2, SLOT-3)."""
    manager = make()
    _slow_writes(manager)
    engine = Engine(manager)
    engine.start("a", [0])
    old = engine.step({"a": 4})
    engine.finish("a")  # a's deferred write is escalated and may still be in flight
    engine.start("b", [0])
    new = engine.step({"b": 4})
    engine.finish("b")
    engine.start("c", [0, 1], hit_end=4)
    saved = engine.step({"c": 1})
    out = engine.materialize(saved)
    for key in (HIDDEN_KEY, MM, DEF):
        got = out.hidden_states["c"] if key == HIDDEN_KEY else out.mm_outputs[key]["c"]
        assert_rows(got[:4], new.rows[key], f"{key} of the newest tenant")
    engine.materialize(old)
    engine.materialize(new)
    engine.finish("c")
    engine.materialize(engine.step({}))
    settle(manager)
    engine.start("d", [0, 2], hit_end=4)
    pool_rows = manager.stats().hit_rows["POOL"]
    out = engine.materialize(engine.step({"d": 1}))
    assert_rows(out.mm_outputs[DEF]["d"][:4], new.rows[DEF], "deferred rows once written")
    assert manager.stats().hit_rows["POOL"] - pool_rows == 3 * 4


def test_reacquired_slot_is_written_by_a_new_task(make: Make) -> None:
    """A request that lost its block and writes it again gets its rows into the pool (SLOT-5)."""
    manager = make()
    engine = Engine(manager)
    engine.start("a", [0])
    engine.materialize(engine.step({"a": 4}))  # a's open deferred write owns block 0
    engine.start("b", [0])  # a is preempted; b takes block 0 and tombstones a's write there
    engine.materialize(engine.step({"b": 4}))
    engine.finish("b")
    engine.rewind("a", 0)  # a resumes on block 0 and recomputes it
    resumed = engine.step({"a": 4})
    engine.materialize(resumed)
    engine.finish("a")
    engine.materialize(engine.step({}))
    settle(manager)  # every deferred write is in the pool: the hit reads it from there
    engine.start("c", [0, 1], hit_end=4)
    out = engine.materialize(engine.step({"c": 1}))
    assert_rows(out.mm_outputs[DEF]["c"][:4], resumed.rows[DEF], "deferred rows of the resume")
    assert_rows(out.hidden_states["c"][:4], resumed.rows[HIDDEN_KEY], "hidden of the resume")


def test_last_chunk_wins_in_one_deferred_write(make: Make) -> None:
    """A request recomputing its own block gets its last rows into the pool, wide rows too (TASK-5)."""
    manager = make(cache_policy=ModelCachePolicy(deferred_keys={DEF, WIDE}))
    engine = Engine(manager)
    # Three rounds, each one write: an unordered indexed copy gets a round right only by luck.
    for round_ in range(3):
        writer, reader = f"a{round_}", f"c{round_}"
        engine.start(writer, [0, 1, 2, 3])
        for _ in range(2):  # nobody took the blocks: every chunk joins the same open write
            engine.materialize(engine.step({writer: 16}, emit=(DEF, WIDE)))
            engine.rewind(writer, 0)
        last = engine.step({writer: 16}, emit=(DEF, WIDE))
        engine.materialize(last)
        engine.finish(writer)
        engine.materialize(engine.step({}))
        settle(manager)
        engine.start(reader, [0, 1, 2, 3, 4], hit_end=16)
        out = engine.materialize(engine.step({reader: 1}, emit=(DEF, WIDE)))
        assert_rows(out.mm_outputs[WIDE][reader][:16], last.rows[WIDE], f"round {round_}")
        engine.finish(reader)


def test_dropped_hit_reads_leave_no_records(make: Make) -> None:
    """Hit reads a save drops (keys it does not emit) or never plans keep no records (OUT-6, D4)."""
    manager = make()
    engine = Engine(manager)
    engine.start("a", [0, 1, 2, 3])
    engine.materialize(engine.step({"a": 8}))
    engine.materialize(engine.step({"a": 1}))
    engine.start("b", [0, 1, 4], hit_end=8)
    engine.materialize(engine.step({"a": 1, "b": 1}, emit=()))  # the mm reads are dropped
    engine.start("d", [0, 6], hit_end=4)
    engine.begin({"d": 1})  # a start never followed by a save: d's hit is lost (D10)
    engine.finish("d", abort=True)
    engine.begin({"a": 1})
    engine.materialize(engine.save())
    assert manager._state.reads == {}


def test_a_request_that_lost_its_hit_cannot_be_saved(make: Make) -> None:
    """A request whose hit start no save followed raises at its next save until it ends (D10)."""
    manager = make()
    engine = Engine(manager)
    engine.start("a", [0, 1, 2])
    engine.materialize(engine.step({"a": 8}))
    engine.start("b", [0, 6], hit_end=4)
    engine.begin({"b": 1})  # the forward failed: no save
    engine.begin({"a": 1, "b": 1})
    with pytest.raises(BadInputError, match="lost their hit"):
        engine.save()
    assert settle(manager).pages_in_use == 0
    engine.finish("b", abort=True)
    engine.begin({"a": 1})
    engine.materialize(engine.save())


def test_sparse_key_reads_zeros(make: Make) -> None:
    """A key a step did not emit on its slots reads zeros on a later hit, never older rows (SLOT-4)."""
    manager = make()
    _slow_writes(manager)
    engine = Engine(manager)
    engine.start("a", [0])
    engine.materialize(engine.step({"a": 4}))
    engine.finish("a")
    engine.start("b", [0])
    engine.materialize(engine.step({"b": 4}, emit=()))  # b emits neither MM nor DEF
    engine.finish("b")
    engine.start("c", [0, 1], hit_end=4)
    saved = engine.step({"c": 1})
    out = engine.materialize(saved)
    assert not out.mm_outputs[MM]["c"][:4].any()
    assert not out.mm_outputs[DEF]["c"][:4].any()
    assert_rows(out.mm_outputs[MM]["c"][4:], saved.rows[MM], "c's own rows")


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "no-prefetch"])
def test_delayed_materialize_keeps_old_tenant(make: Make, prefetch: bool) -> None:
    """A materialize one step late returns the rows of its time after the blocks were recycled (HIT-6)."""
    manager = make(prefetch=prefetch)
    engine = Engine(manager)
    engine.start("a", [0, 1, 2])
    first = engine.step({"a": 8})
    engine.materialize(first)
    engine.materialize(engine.step({"a": 1}))
    engine.finish("a")
    engine.start("b", [0, 1, 3], hit_end=8)
    hit = engine.step({"b": 1})
    engine.finish("b", abort=True)
    engine.start("c", [1, 0])  # blocks 0 and 1 get a new tenant before b's step is read
    recycled = engine.step({"c": 8})
    out = engine.materialize(hit)
    assert_rows(out.hidden_states["b"][:8], first.rows[HIDDEN_KEY], "old tenant's rows")
    engine.materialize(recycled)


def test_steps_consumed_exactly_once_in_any_order(make: Make) -> None:
    """Step ids are consumed once each by id in any order; a second or unknown consume raises (STEP-1, STEP-2)."""
    manager = make()
    engine = Engine(manager)
    engine.start("a", [0, 1])
    first, second, third = (engine.step({"a": 1}) for _ in range(3))
    manager.discard_step(third.step_id)
    manager.discard_step(first.step_id)
    engine.materialize(second)  # the discarded first step's position is passed over (DLV-4)
    fourth = engine.step({"a": 1})
    with pytest.raises(StepAlreadyConsumedError) as caught:
        manager.materialize(first.step_id, ["a"])
    assert caught.value.step_id == first.step_id
    assert caught.value.open_step_ids == (fourth.step_id,)
    with pytest.raises(StepAlreadyConsumedError):
        manager.discard_step(third.step_id)
    with pytest.raises(UnknownStepError) as unknown:
        manager.discard_step(99)
    assert isinstance(unknown.value, OmniPrefixCacheUnmatchError)
    assert not isinstance(unknown.value, StepAlreadyConsumedError)
    engine.materialize(fourth)  # nothing else changed
    stats = manager.stats()
    assert (stats.steps_saved, stats.steps_consumed, stats.steps_discarded) == (4, 2, 2)


# ---------------------------------------------------------------------------------------------
# Pages.


def test_page_timeout_with_depth_exhausted(make: Make) -> None:
    """A save with every page held waits the bound, raises PageTimeoutError and leaves no trace (PAGE-4, STEP-5)."""
    manager = make(staging_depth=2, staging_claim_timeout_s=0.2)
    engine = Engine(manager)
    engine.start("a", [0, 1])
    first, second = engine.step({"a": 1}), engine.step({"a": 1})
    settle(manager)  # only the page claim waits, not the barrier
    engine.begin({"a": 1})
    began = time.monotonic()
    with pytest.raises(PageTimeoutError) as caught:
        engine.save()
    assert 0.15 <= time.monotonic() - began < 3.0
    assert isinstance(caught.value, OmniPrefixCacheStagingTimeoutError)
    assert caught.value.open_step_ids == (first.step_id, second.step_id)
    assert manager.stats().timeouts == 1
    manager.discard_step(first.step_id)
    third = engine.save()
    assert third.step_id == second.step_id + 1
    engine.materialize(second)
    engine.materialize(third)


def test_zero_timeout_fails_at_once(make: Make) -> None:
    """With a zero claim timeout a save on a full page pool fails without waiting (PAGE-4)."""
    manager = make(staging_depth=1, staging_claim_timeout_s=0)
    engine = Engine(manager)
    engine.start("a", [0, 1])
    first = engine.step({"a": 1})
    settle(manager)  # a zero bound applies to the barrier too: let the first write land
    engine.begin({"a": 1})
    began = time.monotonic()
    with pytest.raises(PageTimeoutError):
        engine.save()
    assert time.monotonic() - began < 1.0
    engine.materialize(first)


def test_blocked_save_unblocked_by_discard(make: Make) -> None:
    """A save waiting for a page proceeds once another thread discards a step (PAGE-3, CONC-3)."""
    manager = make(staging_depth=1, staging_claim_timeout_s=10)
    engine = Engine(manager)
    engine.start("a", [0, 1])
    first = engine.step({"a": 4})
    timer = threading.Timer(0.2, manager.discard_step, [first.step_id])
    engine.begin({"a": 1})
    timer.start()
    began = time.monotonic()
    second = engine.save()
    waited = time.monotonic() - began
    timer.join()
    assert 0.15 <= waited < 5.0
    assert manager.stats().page_waits == 1
    engine.materialize(second)


def test_oversize_step_raises(make: Make) -> None:
    """A step with more rows than a page raises OversizeStepError and changes nothing (PAGE-5)."""
    manager = make(staging_capacity_tokens=8)
    engine = Engine(manager)
    engine.start("a", [0, 1, 2])
    engine.begin({"a": 9})
    with pytest.raises(OversizeStepError) as caught:
        engine.save()
    assert isinstance(caught.value, OmniPrefixCacheUnmatchError)
    assert (caught.value.rows, caught.value.capacity) == (9, 8)
    stats = manager.stats()
    assert (stats.steps_saved, stats.pages_in_use, stats.budget_bytes_in_use) == (0, 0, 0)
    engine.materialize(engine.step({"a": 8}))


# ---------------------------------------------------------------------------------------------
# Bad input.


def test_slot_count_not_matching_rows_raises(make: Make) -> None:
    """A layout whose slot count differs from the step's rows raises BadInputError (OUT-3)."""
    manager = make()
    engine = Engine(manager)
    engine.start("a", [0, 1])
    engine.begin({"a": 6})
    hidden = encode(HIDDEN_KEY, torch.arange(6), 1)
    for slots in (torch.arange(5), torch.arange(7)):
        layout = PrefixCacheWriteLayout([PrefixCacheWrite("a", 0, 6)], slots)
        with pytest.raises(BadInputError):
            manager.save_outputs(hidden, {}, num_tokens_unpadded=6, write_layout=layout)
    layout = PrefixCacheWriteLayout([PrefixCacheWrite("a", 0, 5)], torch.arange(5))
    with pytest.raises(BadInputError):
        manager.save_outputs(hidden, {}, num_tokens_unpadded=6, write_layout=layout)
    engine.materialize(engine.save())


def test_hidden_with_fewer_rows_than_tokens_raises(make: Make) -> None:
    """Hidden with fewer rows than ``n``, ``ndim < 2`` or missing raises BadInputError (OUT-3)."""
    manager = make()
    engine = Engine(manager)
    engine.start("a", [0, 1])
    engine.begin({"a": 4})
    layout, slots = engine.layout()
    short = encode(HIDDEN_KEY, slots[:3], 1)
    for hidden in (short, torch.zeros(4), None):
        with pytest.raises(BadInputError):
            manager.save_outputs(hidden, {}, num_tokens_unpadded=4, write_layout=layout)
    engine.materialize(engine.save())


def test_width_or_dtype_change_raises(make: Make) -> None:
    """A cached key whose row width or dtype changes raises BadInputError; the cache stays usable (FAIL-5)."""
    manager = make()
    engine = Engine(manager)
    engine.start("a", [0, 1])
    engine.materialize(engine.step({"a": 4}))
    engine.begin({"a": 1})
    layout, slots = engine.layout()
    hidden = encode(HIDDEN_KEY, slots, 9)
    with pytest.raises(BadInputError) as caught:
        manager.save_outputs(torch.zeros(1, 5), {}, num_tokens_unpadded=1, write_layout=layout)
    assert HIDDEN_KEY in str(caught.value)
    wrong_dtype = {MM: torch.zeros(1, 3, dtype=torch.float64)}
    with pytest.raises(BadInputError) as caught:
        manager.save_outputs(hidden, wrong_dtype, num_tokens_unpadded=1, write_layout=layout)
    assert MM in str(caught.value)
    wrong_width = {DEF: torch.zeros(1, 2, 3, dtype=torch.int64)}
    with pytest.raises(BadInputError):
        manager.save_outputs(hidden, wrong_width, num_tokens_unpadded=1, write_layout=layout)
    assert settle(manager).pages_in_use == 0
    engine.materialize(engine.save())


def test_request_ids_outside_layout_raise_and_consume(make: Make) -> None:
    """Materializing a request outside the step raises and still consumes the step (STEP-4)."""
    manager = make()
    engine = Engine(manager)
    engine.start("a", [0, 1])
    saved = engine.step({"a": 4})
    with pytest.raises(BadInputError) as caught:
        manager.materialize(saved.step_id, ["a", "zzz"])
    assert "zzz" in str(caught.value)
    with pytest.raises(StepAlreadyConsumedError):
        manager.materialize(saved.step_id, ["a"])
    assert settle(manager).pages_in_use == 0
    engine.materialize(engine.step({"a": 1}))


def test_failed_save_leaves_no_trace(make: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save failing after its page claim issues no id and leaves no page, budget or claim (STEP-5)."""
    manager = make()
    engine = Engine(manager)
    engine.start("a", [0, 1])
    first = engine.step({"a": 4})
    engine.materialize(first)
    before = settle(manager)

    def broken_copy(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("copy into the page failed")

    monkeypatch.setattr(manager._save, "stage", broken_copy)
    engine.begin({"a": 4})
    with pytest.raises(RuntimeError, match="copy into the page failed"):
        engine.save()
    monkeypatch.undo()
    after = settle(manager)
    assert after.pages_in_use == 0
    assert after.budget_bytes_in_use == before.budget_bytes_in_use
    assert after.steps_saved == before.steps_saved
    # The failed save claimed no slot: a hit on block 1 finds it never written (HIT-4).
    engine.finish("a", abort=True)
    engine.start("b", [0, 1, 2], hit_end=8)
    saved = engine.step({"b": 1})
    assert saved.step_id == first.step_id + 1
    assert saved.unreadable == {"b"}
    with pytest.raises(HitUnreadableError):
        manager.materialize(saved.step_id, ["b"])
    engine.start("c", [0, 3], hit_end=4)
    engine.materialize(engine.step({"c": 1}))


# ---------------------------------------------------------------------------------------------
# Failures and shutdown.


def test_injected_write_failure_is_sticky(make: Make) -> None:
    """A failed pool write makes every later call raise WriteFailedError (FAIL-1)."""
    manager = make()
    engine = Engine(manager)
    engine.start("a", [0, 1, 2])
    first = engine.step({"a": 4})
    engine.materialize(first)

    def broken_write(job: Any) -> None:
        raise RuntimeError("pool write failed")

    manager._inject_write_fault(broken_write)
    # Inline the failing write runs in its own save; threaded the next save's barrier sees it.
    with pytest.raises(WriteFailedError) as caught:
        engine.step({"a": 1})
        engine.step({"a": 1})
    assert "pool write failed" in str(caught.value)
    layout = PrefixCacheWriteLayout([], torch.zeros(0, dtype=torch.int64))
    calls: list[Callable[[], Any]] = [
        lambda: manager.new_step_starts(empty_step()),
        lambda: manager.save_outputs(None, {}, num_tokens_unpadded=0, write_layout=layout),
        lambda: manager.materialize(first.step_id + 1, ["a"]),
        lambda: manager.discard_step(first.step_id + 1),
        lambda: manager.register_policy(policy()),
    ]
    for call in calls:
        with pytest.raises(WriteFailedError):
            call()
    assert manager.stats().writes_failed == 1


def test_shutdown_wakes_blocked_save(make: Make) -> None:
    """Shutdown wakes a save waiting for a page with ShutDownError within a bound (FAIL-4)."""
    manager = make(staging_depth=1, staging_claim_timeout_s=30)
    engine = Engine(manager)
    engine.start("a", [0, 1])
    engine.step({"a": 1})
    engine.begin({"a": 1})
    timer = threading.Timer(0.2, manager.shutdown)
    timer.start()
    began = time.monotonic()
    with pytest.raises(ShutDownError):
        engine.save()
    assert time.monotonic() - began < 5.0
    timer.join()


def test_calls_after_shutdown_raise(threaded: bool) -> None:
    """After shutdown (idempotent, also by the context manager) every call raises ShutDownError (FAIL-4)."""
    with make_manager(threaded) as manager:
        engine = Engine(manager)
        engine.start("a", [0])
        saved = engine.step({"a": 2})
    manager.shutdown()
    layout, _ = engine.layout()
    calls: list[Callable[[], Any]] = [
        lambda: manager.new_step_starts(empty_step()),
        lambda: manager.save_outputs(
            encode(HIDDEN_KEY, torch.arange(2), 2), {}, num_tokens_unpadded=2, write_layout=layout
        ),
        lambda: manager.materialize(saved.step_id, ["a"]),
        lambda: manager.discard_step(saved.step_id),
        lambda: manager.register_policy(policy()),
    ]
    for call in calls:
        with pytest.raises(ShutDownError):
            call()


# ---------------------------------------------------------------------------------------------
# What materialize returns.


def test_live_buffers_overwritten_after_save(make: Make) -> None:
    """Overwriting the step's tensors after save changes nothing materialize returns (STEP-3)."""
    engine = Engine(make())
    engine.start("a", [0, 1, 2])
    first = engine.step({"a": 8})
    engine.materialize(first)
    engine.start("b", [0, 1, 3], hit_end=8)
    kept: dict[str, torch.Tensor] = {}
    tok = torch.arange(3.0)
    saved = engine.step({"b": 3}, extra={"meta.tok": tok}, keep=kept)
    for tensor in kept.values():
        tensor.fill_(-1)
    out = engine.materialize(saved, leftover=["meta.tok"])
    assert_rows(out.mm_outputs["meta.tok"]["b"], torch.arange(3.0), "leftover snapshot")


def test_policy_opt_out_returns_no_hidden(make: Make) -> None:
    """A policy that does not cache hidden returns ``hidden_states=None`` and still mm (OUT-7)."""
    manager = make(cache_policy=policy(hidden=False))
    engine = Engine(manager)
    engine.start("a", [0, 1, 2])
    first = engine.step({"a": 8})
    out = engine.materialize(first)
    assert out.hidden_states is None
    engine.finish("a")
    engine.start("b", [0, 1, 3], hit_end=8)
    engine.begin({"b": 2})
    layout, slots = engine.layout()
    mm = {MM: encode(MM, slots, 50), DEF: encode(DEF, slots, 50)}
    step_id = manager.save_outputs(None, mm, num_tokens_unpadded=2, write_layout=layout)
    out = manager.materialize(step_id, ["b"])
    assert out.hidden_states is None
    assert_rows(out.mm_outputs[MM]["b"], torch.cat((first.rows[MM], mm[MM])), "mm of b")
    assert_rows(out.mm_outputs[DEF]["b"], torch.cat((first.rows[DEF], mm[DEF])), "def of b")
    assert HIDDEN_KEY not in manager.stats().rows_written


def test_cached_key_not_emitted_gives_no_output(make: Make) -> None:
    """A cached mm key a step does not emit has no output on that step, hit or not (OUT-6)."""
    engine = Engine(make())
    engine.start("a", [0, 1, 2])
    engine.materialize(engine.step({"a": 4}))
    out = engine.materialize(engine.step({"a": 1}, emit=(DEF,)))
    assert MM not in out.mm_outputs
    engine.start("b", [0, 3], hit_end=4)
    out = engine.materialize(engine.step({"a": 1, "b": 1}, emit=()))
    assert out.mm_outputs == {}
    assert out.hidden_states["b"].shape[0] == 5


def test_prefetch_on_and_off_agree(threaded: bool) -> None:
    """A scripted workload returns identical outputs with prefetch on and off (HIT-7)."""
    runs = []
    for prefetch in (True, False):
        with make_manager(threaded, prefetch=prefetch, num_blocks=20) as manager:
            workload = Workload(Engine(manager), seed=7, builder=False)
            for _ in range(80):
                workload.step()
            workload.close()
            assert not workload.errors, workload.errors[:3]
            assert workload.counts.hit_requests > 5
            runs.append(workload.outputs)
    assert runs[0] == runs[1]


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "no-prefetch"])
def test_inline_and_threaded_agree(prefetch: bool) -> None:
    """The same scripted workload returns identical outputs inline and threaded (SPEC section 2)."""
    runs = []
    for threaded in (False, True):
        with make_manager(threaded, prefetch=prefetch, num_blocks=20) as manager:
            workload = Workload(Engine(manager), seed=11, builder=threaded)
            for _ in range(80):
                workload.step()
            workload.close()
            assert not workload.errors, workload.errors[:3]
            runs.append(workload.outputs)
    assert runs[0] == runs[1]
    assert len(runs[0]) > 50


def test_layout_from_block_tables(make: Make) -> None:
    """The layout helper maps positions to slots, accepts 0-token requests and rejects overruns."""
    layout = PrefixCacheWriteLayout.from_block_tables(
        ["a", "b", "c"],
        {"a": 3, "b": 0, "c": 20},
        {"a": 2, "c": 3},  # a 0-token request needs no entries
        {"a": [7, 3], "c": [9, 2, 4, 5, 6, 8]},
        BLOCK,
    )
    tables = {"a": (2, 3, [7, 3]), "c": (3, 20, [9, 2, 4, 5, 6, 8])}
    expected = [
        blocks[p // BLOCK] * BLOCK + p % BLOCK
        for computed, count, blocks in tables.values()
        for p in range(computed, computed + count)
    ]
    assert layout.slots_cpu.tolist() == expected
    assert layout.slots_cpu.tolist()[:3] == [30, 31, 12]
    assert layout.writes == (
        PrefixCacheWrite("a", 0, 3),
        PrefixCacheWrite("b", 3, 3),
        PrefixCacheWrite("c", 3, 23),
    )
    with pytest.raises(BadInputError):  # position 8 needs a third block
        PrefixCacheWriteLayout.from_block_tables(["a"], {"a": 7}, {"a": 2}, {"a": [7, 3]}, BLOCK)
    with pytest.raises(BadInputError):
        PrefixCacheWriteLayout.from_block_tables(["a"], {}, {"a": 0}, {"a": [1]}, BLOCK)
    # A 0-token request in a real step gets empty rows.
    engine = Engine(make())
    engine.start("a", [7, 3])
    engine.start("b", [1])
    out = engine.materialize(engine.step({"a": 3, "b": 0}))
    assert out.hidden_states["b"].shape == (0, 4)


def test_oracle_detects_a_stale_row(make: Make) -> None:
    """A pool row overwritten behind the cache's back fails the check: the oracle can fail."""
    manager = make()
    engine = Engine(manager)
    engine.start("a", [0, 1, 2])
    engine.materialize(engine.step({"a": 8}))
    engine.materialize(engine.step({"a": 1}, emit=()))
    manager._state.pool.tensors[HIDDEN_KEY][5] += 1  # corrupt one committed row
    engine.finish("a")
    engine.start("b", [0, 1, 3], hit_end=8)
    saved = engine.step({"b": 1})
    with pytest.raises(AssertionError, match="hidden of b"):
        engine.materialize(saved)


@pytest.mark.parametrize(
    ("rows", "width", "max_bytes"),
    [(10, 4, 24), (7, 8, 16), (3, 64, 8), (5, 4, 10**6), (0, 4, 16)],
    ids=["3-rows-a-piece", "1-row-a-piece", "row-wider-than-limit", "one-piece", "empty"],
)
def test_budget_3_deferred_rows_are_copied_in_pieces_of_at_most_copy_chunk_bytes(
    rows: int, width: int, max_bytes: int
) -> None:
    """BUDGET-3: the deferred copy goes in row ranges of at most `copy_chunk_bytes`, as few as
    that allows, tiling the rows; a row wider than the limit goes alone. (The CUDA path uses
    this helper; the GPU suite checks it end to end with a small `copy_chunk_bytes`.)"""
    src = torch.arange(rows * width, dtype=torch.int16).reshape(rows, width)
    dst = torch.zeros_like(src)
    pieces = copy_in_pieces(dst, src, max_bytes)
    assert torch.equal(dst, src)
    row_nbytes = width * 2
    per_piece = max(1, max_bytes // row_nbytes)
    assert pieces == [(a, min(a + per_piece, rows)) for a in range(0, rows, per_piece)]
    assert all((b - a) * row_nbytes <= max_bytes or b - a == 1 for a, b in pieces)


def test_hit_7_only_reads_of_the_prefetch_threshold_and_more_are_prefetched(
    make: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hit read of fewer bytes than `PREFETCH_MIN_BYTES` is left to the consume's gather
    (D34); one of at least that many goes to the prefetch worker; the consume hands out the
    oracle's rows for both (HIT-7)."""
    # b's hit is 8 rows: 128 bytes of hidden states (4 float32 a row), 96 of MM (3 a row).
    monkeypatch.setattr(effects_module, "PREFETCH_MIN_BYTES", 100)
    manager = make()
    assert manager._state.prefetcher is not None
    submitted: list[str] = []
    submit = manager._state.prefetcher.submit

    def spy(fn: Callable[..., Any], read: Any, *args: Any) -> Any:
        submitted.append(read.key)
        return submit(fn, read, *args)

    monkeypatch.setattr(manager._state.prefetcher, "submit", spy)
    out = _serve_an_8_row_hit(manager)
    assert submitted == [HIDDEN_KEY]
    assert out.hidden_states["b"].shape[0] == 9 and out.mm_outputs[MM]["b"].shape[0] == 9


def _serve_an_8_row_hit(manager: OmniPrefixCacheManager) -> Any:
    """Request a writes 8 rows and ends; b starts on them and computes one: b's outputs,
    each row checked against the oracle's."""
    engine = Engine(manager)
    engine.start("a", [0, 1, 2])
    engine.materialize(engine.step({"a": 4}, emit=(MM,)))
    engine.materialize(engine.step({"a": 4}, emit=(MM,)))
    engine.finish("a")
    settle(manager)
    engine.start("b", [0, 1, 3], hit_end=8)
    return engine.materialize(engine.step({"b": 1}, emit=(MM,)))


@pytest.mark.parametrize("prefetch", [None, True, False])
def test_hit_7_a_cpu_manager_prefetches_only_when_told(
    prefetch: bool | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the CPU the prefetch is off unless asked for (D38): no worker, and the consume
    gathers every hit itself; asked for, the worker gathers them (HIT-7). The rows handed out
    are the oracle's either way."""
    monkeypatch.setattr(manager_module, "PREFETCH_ON_CPU", False)  # the library's default
    kwargs = {} if prefetch is None else {"prefetch": prefetch}
    with OmniPrefixCacheManager(config(), policy=policy(), device="cpu", **kwargs) as manager:
        prefetcher = manager._state.prefetcher
        assert (prefetcher is not None) is bool(prefetch)
        submitted: list[str] = []
        if prefetcher is not None:
            submit = prefetcher.submit

            def spy(fn: Callable[..., Any], read: Any, *args: Any) -> Any:
                submitted.append(read.key)
                return submit(fn, read, *args)

            monkeypatch.setattr(prefetcher, "submit", spy)
        out = _serve_an_8_row_hit(manager)
        # Every hit read is prefetched when the prefetch is on (the tests' threshold is 0).
        assert sorted(submitted) == ([HIDDEN_KEY, MM] if prefetch else [])
        assert out.hidden_states["b"].shape[0] == 9
