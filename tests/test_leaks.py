"""Nothing outlives the cache: threads, host storage, device clones, pages and budget (FAIL-4).

After `shutdown()`, and after the context manager exits on an exception, no thread of the
library is alive and nothing the cache allocated is reachable (its pool and pages, the steps'
clones and snapshots, the write jobs). A run whose steps are all consumed and whose requests all
ended holds no page and no budget charge. A thousand create/use/shutdown cycles keep resident
memory and the thread count flat.
"""

from __future__ import annotations

import gc
import threading
import weakref
from typing import Any

import pytest

from omni_cache_cuda import OmniPrefixCacheManager, ShutDownError
from omni_cache_cuda._probes import os_threads, resident_bytes
from tests.adapter_helpers import DEF, MM, Engine, make_manager, settle, wait_for
from tests.reliability_helpers import library_threads

#: Resident memory may grow this much over the cycles after warm-up (allocator noise).
RSS_BOUND = 32 * 2**20


def _busy(manager: OmniPrefixCacheManager) -> tuple[Engine, list[weakref.ref[Any]]]:
    """Leave the cache busy: open steps, an open deferred write, a hit; weakly track its memory."""
    engine = Engine(manager)
    engine.start("a", [0, 1, 2])
    engine.materialize(engine.step({"a": 8}))
    engine.finish("a")
    engine.start("b", [0, 1, 3], hit_end=8)
    engine.start("c", [4, 5])
    engine.step({"b": 1, "c": 3})  # left open: its page, its clones, b's hit read
    engine.step({"b": 1, "c": 1})  # left open too
    refs: list[weakref.ref[Any]] = []
    refs.extend(weakref.ref(t) for t in manager._state.pool.tensors.values())
    refs.extend(weakref.ref(t) for t in manager._state.pages.buffers.values())
    for ctx in manager._state.steps.values():
        refs.extend(weakref.ref(t) for t in ctx.deferred_rows.values())
    for job in manager._state.jobs.values():
        if job.slots is not None:
            refs.append(weakref.ref(job.slots))
        for chunk in job.chunks:
            refs.extend(weakref.ref(t) for t in (chunk.device or chunk.host or {}).values())
    assert len(refs) >= 7 and manager._state.jobs, "the cache is not busy enough to show a leak"
    return engine, refs


def _released(manager: OmniPrefixCacheManager, refs: list[weakref.ref[Any]]) -> None:
    gc.collect()
    assert not library_threads(), library_threads()
    alive = [ref() for ref in refs if ref() is not None]
    assert not alive, f"{len(alive)} buffers or jobs still reachable: {alive[:3]}"
    assert not manager._state.jobs and not manager._state.steps and not manager._state.reads
    assert not manager._state.committer._queue
    stats = manager.stats()
    assert stats.pool_bytes == stats.staging_bytes == 0
    assert stats.host_pinned_bytes == stats.host_unpinned_bytes == 0


@pytest.mark.parametrize("threaded", [False, True], ids=["inline", "threaded"])
def test_shutdown_releases_threads_storage_and_jobs(threaded: bool) -> None:
    """After shutdown no library thread is alive and no buffer or job is reachable (FAIL-4)."""
    manager = make_manager(threaded)
    _, refs = _busy(manager)
    manager.shutdown()
    _released(manager, refs)
    with pytest.raises(ShutDownError):
        manager.discard_step(3)


@pytest.mark.parametrize("threaded", [False, True], ids=["inline", "threaded"])
def test_context_manager_exit_on_an_exception_releases_everything(threaded: bool) -> None:
    """An engine that fails inside ``with`` leaves no thread, buffer or job behind."""
    refs: list[weakref.ref[Any]] = []
    with (
        pytest.raises(RuntimeError, match="the forward failed"),
        make_manager(threaded) as manager,
    ):
        _, refs = _busy(manager)
        raise RuntimeError("the forward failed")
    _released(manager, refs)


@pytest.mark.parametrize("threaded", [False, True], ids=["inline", "threaded"])
def test_a_finished_run_holds_no_page_and_no_budget(threaded: bool) -> None:
    """Every step consumed and every request ended: no page and no budget charge is held."""
    manager = make_manager(threaded, gpu_staging_bytes=4 * 32)  # saves flush (BUDGET-2)
    engine = Engine(manager)
    engine.start("a", [0, 1, 2])
    engine.start("c", [4, 5])
    first = engine.step({"a": 8, "c": 3})
    assert manager.stats().budget_bytes_in_use > 0
    engine.materialize(first)
    engine.finish("a")
    engine.start("b", [0, 1, 3], hit_end=8)
    second = engine.step({"b": 1, "c": 1})
    engine.finish("b")
    engine.finish("c")
    third = engine.step({})
    manager.discard_step(third.step_id)
    engine.materialize(second)
    stats = settle(manager)
    assert stats.pages_in_use == 0
    assert stats.budget_bytes_in_use == 0
    with manager._state.lock:
        core = manager._state.core
        assert not core.task_states() and not core.unended_step_ids()
        manager._state.core.check_invariants()
    assert not manager._state.jobs and not manager._state.steps and not manager._state.reads
    manager.shutdown()


def test_a_dropped_manager_stops_its_threads() -> None:
    """A manager dropped without shutdown still stops its threads once collected."""
    manager = make_manager(True)
    _busy(manager)
    assert library_threads()
    del manager
    gc.collect()
    assert wait_for(lambda: not library_threads(), 10.0), library_threads()


def _cycle(threaded: bool) -> None:
    with make_manager(threaded) as manager:
        engine = Engine(manager)
        engine.start("a", [0, 1, 2])
        engine.materialize(engine.step({"a": 8}, emit=(MM, DEF)))
        engine.finish("a")
        engine.start("b", [0, 1, 3], hit_end=8)
        engine.materialize(engine.step({"b": 2}, emit=(MM, DEF)))
        engine.step({"b": 1})  # left open: shutdown must release it


def test_a_thousand_cycles_keep_memory_and_threads_flat() -> None:
    """1000 create/use/shutdown cycles, inline and threaded: resident memory and threads flat."""
    for i in range(100):  # warm-up: allocator pools, torch's own threads, caches
        _cycle(i % 2 == 1)
    gc.collect()
    assert wait_for(lambda: not library_threads(), 10.0)  # earlier tests' dropped managers
    base = resident_bytes()
    threads = threading.active_count()
    native = os_threads()
    peak = base
    for i in range(900):
        _cycle(i % 2 == 1)
        if i % 100 == 99:
            gc.collect()
            peak = max(peak, resident_bytes())
            assert not library_threads()
            assert threading.active_count() <= threads, threading.enumerate()
            assert os_threads() <= native
    assert not library_threads()
    grew = peak - base
    assert grew < RSS_BOUND, f"resident memory grew {grew / 2**20:.1f} MiB over 900 cycles"
