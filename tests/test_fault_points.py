"""Every fault point of the adapter ends in its typed error, with nothing leaked (D19).

A test hook (`OmniPrefixCacheManager._inject_fault`, not public API) makes one piece of the
adapter's own work fail: the copy of a step's rows into its page, the wait for a write's copy to
land on the host, a piece of a deferred write's copy, the pool write, a hit's gather (prefetched
or on demand), and the allocation or pinning of a key's host storage. Each test checks the error
SPEC and D19 name (sticky where FAIL-1 says so), that no call hangs (`bounded`), that no page,
budget charge, storage or thread is left behind, and that every row served before and after is
exact (`tests.adapter_helpers.Engine` checks each one; `usable` proves the cache still serves).
Each runs inline and with a committer thread.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from omni_cache_cuda import (
    HIDDEN_KEY,
    HitUnreadableError,
    HostAllocationError,
    OmniPrefixCacheManager,
    StagingCopyError,
    StepAlreadyConsumedError,
    WriteFailedError,
)
from omni_cache_cuda._faults import FAULT_POINTS
from tests.adapter_helpers import DEF, MM, Engine, make_manager, settle
from tests.reliability_helpers import OneShot, assert_sticky, bounded, library_threads, usable

Make = Callable[..., OmniPrefixCacheManager]


@pytest.fixture
def make(threaded: bool) -> Iterator[Make]:
    """Build CPU managers; at the end shut them down and require their threads gone."""
    made: list[OmniPrefixCacheManager] = []

    def build(**kwargs: Any) -> OmniPrefixCacheManager:
        manager = make_manager(threaded, **kwargs)
        made.append(manager)
        return manager

    yield build
    for manager in made:
        manager.shutdown()
        assert not manager._state.pool.tensors and not manager._state.pages.buffers, "storage kept"
    assert not library_threads(), library_threads()


def _warm(manager: OmniPrefixCacheManager, emit: tuple[str, ...] = (MM,)) -> Engine:
    """An engine whose request "a" (blocks 0-2) saved and materialized one step."""
    engine = Engine(manager)
    engine.start("a", [0, 1, 2])
    engine.materialize(bounded(lambda: engine.step({"a": 4}, emit=emit)))
    settle(manager)
    return engine


def test_every_fault_point_is_named() -> None:
    """The hook knows the eight points and refuses any other name."""
    assert set(FAULT_POINTS) == {
        "alloc",
        "pin",
        "page_copy",
        "prefetch",
        "host_ready",
        "deferred_piece",
        "pool_write",
        "gather",
    }
    with make_manager(False) as manager, pytest.raises(ValueError, match="unknown fault point"):
        manager._inject_fault("pool", lambda detail: None)


# ---------------------------------------------------------------------------------------------
# The save's copy into its page: part of the save transaction (STEP-5, D19).


def test_page_copy_fault_fails_the_save_with_no_trace(make: Make) -> None:
    """A failed copy into the page raises StagingCopyError; the save leaves no trace."""
    manager = make()
    engine = _warm(manager)
    before = manager.stats()
    hook = OneShot(skip=1)  # the second key's copy fails, after the first key's rows landed
    manager._inject_fault("page_copy", hook)
    engine.begin({"a": 4})
    with pytest.raises(StagingCopyError) as caught:
        bounded(lambda: engine.save(emit=(MM,)))
    assert hook.calls == [HIDDEN_KEY, MM]
    assert caught.value.key == MM
    assert "InjectedFault" in caught.value.reason
    after = settle(manager)
    assert after.steps_saved == before.steps_saved
    assert after.pages_in_use == 0
    assert after.budget_bytes_in_use == before.budget_bytes_in_use
    assert after.writes_failed == 0
    # Not sticky: the same step saved again gets the next id and its rows are exact.
    saved = bounded(lambda: engine.step({"a": 4}, emit=(MM,)))
    assert saved.step_id == 2
    engine.materialize(saved)
    usable(manager)


# ---------------------------------------------------------------------------------------------
# The committer's work: a failed write, sticky (FAIL-1).


@pytest.mark.parametrize(
    ("point", "target"),
    [
        ("host_ready", "step"),
        ("host_ready", "deferred"),
        ("pool_write", "step"),
        ("pool_write", "deferred"),
        ("deferred_piece", "deferred"),
    ],
)
def test_committer_fault_fails_the_write_for_good(make: Make, point: str, target: str) -> None:
    """A fault in the committer fails that write: WriteFailedError, sticky, nothing leaked."""
    manager = make(copy_chunk_bytes=64)  # a deferred row is 32 bytes: two rows a piece
    engine = _warm(manager, emit=(MM, DEF))
    assert manager.stats().budget_bytes_in_use > 0  # request a's deferred clone is charged
    fired: list[Any] = []

    def hook(detail: Any) -> None:
        job = detail[0] if isinstance(detail, tuple) else detail
        if job.deferred == (target == "deferred") and not fired:
            fired.append(detail)
            raise RuntimeError(f"injected {point} fault")

    manager._inject_fault(point, hook)
    with pytest.raises(WriteFailedError) as caught:
        # A step write fails at the next save; a deferred one at a's finish (TASK-4).
        bounded(lambda: engine.step({"a": 2}, emit=(MM, DEF)))
        engine.finish("a")
        for _ in range(3):  # threaded: a later call sees the failure (D8)
            bounded(lambda: engine.step({}))
    job = fired[0][0] if isinstance(fired[0], tuple) else fired[0]
    assert caught.value.tids == (job.tid,)
    assert f"injected {point} fault" in caught.value.reason
    if point == "deferred_piece":
        _, key, start, stop = fired[0]
        assert key == DEF and stop - start == 2  # BUDGET-3: pieces of copy_chunk_bytes
    assert_sticky(manager, caught.value.tids)
    if target == "deferred":
        # BUDGET-1: the failed write's clone is uncharged; a had no other write open.
        assert manager.stats().budget_bytes_in_use == 0
    manager.shutdown()
    assert not library_threads()


def test_deferred_pieces_tile_the_copy(make: Make) -> None:
    """The deferred copy goes in pieces of at most copy_chunk_bytes (BUDGET-3), also on CPU."""
    manager = make(copy_chunk_bytes=96)  # three 32-byte rows a piece
    engine = _warm(manager, emit=(MM, DEF))
    pieces: list[tuple[int, int]] = []
    manager._inject_fault("deferred_piece", lambda detail: pieces.append(detail[2:]))
    engine.materialize(bounded(lambda: engine.step({"a": 4}, emit=(MM, DEF))))
    engine.finish("a")
    manager.discard_step(bounded(lambda: engine.step({})).step_id)
    settle(manager)
    assert pieces == [(0, 3), (3, 6), (6, 8)]  # a's 8 rows in one write, 3 + 3 + 2
    usable(manager)


# ---------------------------------------------------------------------------------------------
# Hit gathers: the materialize that reads them fails, the cache goes on (D19).


def _hit_step(manager: OmniPrefixCacheManager) -> tuple[Engine, Any]:
    """Request b hits the two blocks request a wrote (committed, so prefetched)."""
    engine = _warm(manager)
    engine.materialize(bounded(lambda: engine.step({"a": 4}, emit=(MM,))))
    engine.finish("a")
    settle(manager)
    engine.start("b", [0, 1, 3], hit_end=8)
    return engine, bounded(lambda: engine.step({"b": 1}, emit=(MM,)))


@pytest.mark.parametrize("point", ["prefetch", "gather"])
def test_gather_fault_fails_that_materialize_only(make: Make, point: str) -> None:
    """A failed hit gather raises HitUnreadableError; the step is consumed; not sticky."""
    manager = make()
    hook = OneShot()
    manager._inject_fault(point, hook)
    engine, saved = _hit_step(manager)
    with pytest.raises(HitUnreadableError) as caught:
        bounded(lambda: engine.materialize(saved))
    assert hook.fired == 1
    assert caught.value.req_id == "b"
    assert "InjectedFault" in caught.value.reason
    with pytest.raises(StepAlreadyConsumedError):
        manager.materialize(saved.step_id, ["b"])
    stats = settle(manager)
    assert stats.pages_in_use == 0
    assert stats.writes_failed == 0
    assert not manager._state.reads, "read records of the failed materialize kept"
    # Nothing was delivered (D19): b's cursor is back at 0, so a resume hit serves its prefix.
    engine.preempt("b")
    manager.discard_step(bounded(lambda: engine.step({}, emit=(MM,))).step_id)
    engine.resume("b", [0, 1, 3], hit_end=8)
    out = engine.materialize(bounded(lambda: engine.step({"b": 1}, emit=(MM,))))
    assert out.positions["b"] == (0, 9)
    usable(manager)


def test_prefetch_fault_of_a_discarded_step_raises_nothing(make: Make) -> None:
    """Rows nobody reads cannot be wrong: a discarded step's failed prefetch goes unseen."""
    manager = make()
    hook = OneShot()
    manager._inject_fault("prefetch", hook)
    _, saved = _hit_step(manager)
    manager.discard_step(saved.step_id)
    assert settle(manager).pages_in_use == 0
    usable(manager)


def test_no_prefetch_no_prefetch_fault(make: Make) -> None:
    """With prefetch off the prefetch point never runs and the hit is served on demand."""
    manager = make(prefetch=False)
    hook = OneShot()
    manager._inject_fault("prefetch", hook)
    engine, saved = _hit_step(manager)
    engine.materialize(saved)
    assert hook.calls == []


# ---------------------------------------------------------------------------------------------
# Host storage: a failed allocation or a refused pin (D19, D20).


def _tracked(manager: OmniPrefixCacheManager) -> list[weakref.ref[torch.Tensor]]:
    """Weak references to every host buffer the manager allocates from now on."""
    refs: list[weakref.ref[torch.Tensor]] = []
    for storage in (manager._state.pool, manager._state.pages):
        allocate = storage.allocate

        def tracking(*args: Any, _allocate: Any = allocate) -> torch.Tensor:
            tensor = _allocate(*args)
            refs.append(weakref.ref(tensor))
            return tensor

        storage.allocate = tracking  # type: ignore[method-assign]
    return refs


@pytest.mark.parametrize("skip", [0, 1, 3])
def test_alloc_fault_at_first_save_keeps_nothing(make: Make, skip: int) -> None:
    """A failed allocation at a key's first save: HostAllocationError, nothing kept, no trace."""
    manager = make()
    refs = _tracked(manager)
    hook = OneShot(skip=skip)
    manager._inject_fault("alloc", hook)
    engine = Engine(manager)
    engine.start("a", [0, 1, 2])
    engine.begin({"a": 4})
    with pytest.raises(HostAllocationError) as caught:
        bounded(lambda: engine.save(emit=(MM,)))
    part, key = hook.calls[skip]
    assert (caught.value.part, caught.value.key) == (part, key)
    assert not caught.value.pinned
    assert "InjectedFault" in caught.value.reason
    assert len(refs) == skip  # the allocations before the failing one happened...
    assert all(ref() is None for ref in refs)  # ...and none is kept
    stats = settle(manager)
    assert (stats.pool_bytes, stats.staging_bytes, stats.steps_saved, stats.pages_in_use) == (
        0,
        0,
        0,
        0,
    )
    manager._inject_fault("alloc", None)
    # The engine treats the failed save as a failed forward and tries the step again.
    engine.begin({"a": 4})
    saved = bounded(lambda: engine.save(emit=(MM,)))
    assert saved.step_id == 1  # STEP-5: the failed save issued no id
    engine.materialize(saved)
    usable(manager)


def test_alloc_fault_at_reserve_keeps_the_keys_the_cache_had(make: Make) -> None:
    """A failed reserve keeps nothing it allocated; the keys reserved before stay in use."""
    manager = make()
    manager.reserve({HIDDEN_KEY: (4, torch.float32)})
    hidden_pool = manager._state.pool.tensors[HIDDEN_KEY]
    refs = _tracked(manager)
    manager._inject_fault("alloc", OneShot(skip=2))
    with pytest.raises(HostAllocationError) as caught:
        manager.reserve({MM: (3, torch.float32), DEF: ((2, 2), torch.int64)})
    assert caught.value.key in (MM, DEF)
    assert len(refs) == 2 and all(ref() is None for ref in refs)
    assert set(manager._state.pool.tensors) == set(manager._state.pages.buffers) == {HIDDEN_KEY}
    assert manager._state.pool.tensors[HIDDEN_KEY] is hidden_pool
    with manager._state.lock:
        assert manager._state.core.installed_keys == ()
        manager._state.core.check_invariants()
    manager._inject_fault("alloc", None)
    engine = Engine(manager)
    engine.start("a", [0, 1, 2])
    engine.materialize(bounded(lambda: engine.step({"a": 4})))  # MM and DEF allocated here
    assert manager._state.pool.tensors[HIDDEN_KEY] is hidden_pool
    usable(manager)


@pytest.mark.parametrize("at", ["reserve", "save"])
def test_refused_pin_keeps_nothing(make: Make, at: str) -> None:
    """A refused pin raises HostAllocationError (pinned=True) where it happened; nothing kept.

    On a CPU machine the storage is never pinned; the test marks it for pinning as on CUDA, and
    the hook refuses before any pinning is tried.
    """
    manager = make()
    refs = _tracked(manager)
    manager._state.pool.pin = manager._state.pages.pin = True
    hook = OneShot()
    manager._inject_fault("pin", hook)
    engine = Engine(manager)
    engine.start("a", [0, 1, 2])
    with pytest.raises(HostAllocationError) as caught:
        if at == "reserve":
            manager.reserve({HIDDEN_KEY: (4, torch.float32), MM: (3, torch.float32)})
        else:
            engine.begin({"a": 4})
            bounded(lambda: engine.save(emit=(MM,)))
    assert caught.value.pinned
    assert hook.calls == [("pool", HIDDEN_KEY)]
    assert all(ref() is None for ref in refs)
    stats = manager.stats()
    assert stats.pool_bytes == stats.staging_bytes == stats.host_pinned_bytes == 0
    manager._state.pool.pin = manager._state.pages.pin = False
    manager._inject_fault("pin", None)
    if at == "save":
        engine.begin({"a": 4})
        engine.materialize(bounded(lambda: engine.save(emit=(MM,))))
    usable(manager)
