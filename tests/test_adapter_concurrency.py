"""A long randomized run of the CPU adapter with an async output builder consuming late.

The `Workload` of `tests.adapter_helpers` plays a scheduler with prefix caching over a small
block pool, so blocks are recycled often while earlier steps are still being read on the builder
thread (CONC-3, HIT-6). Requests are preempted and resumed with new hits, end while preempted,
and their ids come back. Every row `materialize` returns is checked against the oracle of what
the engine wrote and against the value a full recompute gives at its position; every delivered
range against the engine's own model of delivery; and at the end every admission's whole life:
each computed position delivered exactly once, in order, unless only discarded or left-out steps
carried it. Every 50 steps the pool rows of all COMMITTED slots are compared with the oracle too.
"""

from __future__ import annotations

import collections
import random
import threading
import time
from collections import Counter
from typing import Any

import pytest
import torch

from omni_cache_core import (
    HIDDEN_KEY,
    CopyLanded,
    CopyStarted,
    TensorName,
    Tid,
    WriteFailed,
    WriteLanded,
)
from omni_cache_cuda import (
    OmniPrefixCacheManager,
    StepAlreadyConsumedError,
    WaitTimeoutError,
    WriteFailedError,
)
from omni_cache_cuda._committer import Chunk, Committer, Signal, WriteJob
from omni_cache_cuda._faults import FAULT_ERRORS
from omni_cache_cuda._storage import HostPool, KeyShape, StagingPages
from tests.adapter_helpers import Engine, Workload, make_manager, settle, wait_for
from tests.reliability_helpers import OneShot, assert_sticky, bounded, library_threads

#: Engine steps per run: enough for hundreds of hits, recycled blocks and budget flushes.
STEPS = 2000
#: Steps are consumed one to this many steps late (staging_depth leaves room for it).
MAX_LAG = 3
#: Preemption: running requests are preempted now and then (four times as often at a block
#: boundary, where vLLM preempts), come back with the longest cached prefix of the tokens they
#: know as their hit, a random shorter one, or one at the builder's cursor, and some end while
#: preempted. Decodes run up to 10 tokens, so generated blocks fill and a resume can hit them.
PREEMPTING: dict[str, Any] = {
    "preempt_p": 0.02,
    "resume_p": 0.6,
    "end_preempted_p": 0.05,
    "cut_hit_p": 0.25,
    "aim_hit_p": 0.3,
    "max_decode": 10,
}
#: A small cache the workload recycles fast: 24 blocks, room for MAX_LAG open steps, and a
#: budget of a few steps of deferred rows (32 bytes each), so saves force flushes (BUDGET-2).
BUSY_CACHE: dict[str, Any] = {
    "num_blocks": 24,
    "staging_depth": MAX_LAG + 3,
    "staging_capacity_tokens": 32,
    "staging_claim_timeout_s": 30.0,
    "gpu_staging_bytes": 40 * 32,
}


def _run(workload: Workload, steps: int) -> Any:
    """Run the workload's steps, stop at its first error, close it; return the settled stats."""
    for _ in range(steps):
        workload.step()
        if workload.errors:
            break
    workload.close()
    assert not workload.errors, workload.errors[:5]
    return settle(workload.engine.m)


def _count_internal_paths(
    manager: OmniPrefixCacheManager, monkeypatch: pytest.MonkeyPatch
) -> Counter[str]:
    """Count copy-on-write preserves and tombstones, leaving their behaviour unchanged."""
    seen: Counter[str] = Counter()
    preserve = manager._effects.preserve_rows
    add_tombstone = WriteJob.add_tombstone

    def counted_preserve(record: Any, effect: Any) -> None:
        seen["preserve"] += 1
        preserve(record, effect)

    def counted_tombstone(job: WriteJob, key: str, slots: Any) -> None:
        seen["tombstone"] += 1
        add_tombstone(job, key, slots)

    monkeypatch.setattr(manager._effects, "preserve_rows", counted_preserve)
    monkeypatch.setattr(WriteJob, "add_tombstone", counted_tombstone)
    return seen


@pytest.mark.parametrize("threaded", [True, False], ids=["threaded", "inline"])
def test_builder_thread_consumes_late(threaded: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Random hits, finishes, aborts, preemptions and resumes, ends while preempted, id reuse,
    discards and block reuse, read back on a late builder thread: every computed position of
    every admission is delivered exactly once, in order, with the recomputed value, except
    positions only discarded or left-out steps carried; every refusal is predicted and the step
    consumed later (CONC-3, LIFE-1, LIFE-2, LIFE-3, LIFE-4, DLV-1, DLV-2, DLV-3, DLV-4, DLV-5,
    DLV-6, DLV-7)."""
    began = time.monotonic()
    manager = make_manager(threaded, **BUSY_CACHE)
    seen = _count_internal_paths(manager, monkeypatch)
    if threaded:
        # Some pool writes take a while, so writes overlap the next steps and their claims.
        delays = random.Random(3)
        manager._inject_write_fault(lambda job: time.sleep(0.002 * (delays.random() < 0.3)))
    with manager:
        engine = Engine(manager)
        workload = Workload(
            engine,
            seed=20240601 + threaded,
            max_lag=MAX_LAG,
            check_pool_every=50,
            builder=True,
            **PREEMPTING,
        )
        stats = _run(workload, STEPS)
    counts, delivery = workload.counts, engine.delivery
    lost, recovered = engine.lost_and_recovered()
    # Every step id was consumed exactly once, and nothing is left held or recorded.
    assert stats.steps_saved == STEPS
    assert (stats.steps_consumed, stats.steps_discarded) == (counts.materialized, counts.discarded)
    assert stats.steps_consumed + stats.steps_discarded == STEPS
    assert stats.pages_in_use == 0
    assert stats.writes_failed == 0
    assert manager._state.reads == {}
    # Every delivered row was compared with the recomputed value at its position (DLV-6), and
    # `_run` found no admission with a position delivered twice, out of order, or never
    # delivered though a materialized step carried it (DLV-2, DLV-4).
    assert delivery.recomputed_checked == delivery.delivered > 5 * STEPS, delivery
    assert delivery.external == 0, delivery
    # The run covered what it is meant to cover.
    assert counts.hit_requests >= 300, counts
    assert counts.same_step_hits >= 10, counts
    assert counts.recycled_blocks >= 1000, counts
    assert counts.finishes >= 300 and counts.aborts >= 50, counts
    assert counts.id_reuses >= 10 and counts.sparse_steps >= 200, counts
    assert counts.reuses_with_open_steps >= 10, counts  # LIFE-1
    assert counts.checked_rows > 15 * STEPS, counts
    assert counts.preemptions >= 100 and counts.resumes >= 100, counts
    assert counts.same_step_resumes >= 5, counts  # LIFE-2
    assert counts.preempted_finishes >= 3 and counts.preempted_aborts >= 3, counts
    # Resume hits of every kind against the cursor the cache had (DLV-3, LIFE-4).
    assert counts.resume_zero >= 10 and counts.resume_below >= 10, counts
    assert counts.resume_equal >= 3 and counts.resume_above >= 5, counts
    assert counts.resume_beyond_prompt >= 5, counts
    assert counts.refusals == delivery.refused >= 100, (counts, delivery)  # DLV-5
    assert delivery.cut >= 100, delivery  # recomputed rows not handed out again (DLV-2)
    assert delivery.passed_over > 0 and recovered > 0, (delivery, recovered)  # DLV-4
    assert delivery.left_out > 0 and delivery.empty > 0, delivery
    assert stats.budget_flushes >= 20, stats
    for source in ("POOL", "THIS_STEP", "TASK", "ZEROS"):
        assert stats.hit_rows[source] > 0, stats
    assert seen["preserve"] >= 20, seen
    if threaded:
        # Hits are planned at commit, after the barrier landed every earlier step write, so
        # AFTER_WRITE does not occur; in-flight deferred writes do lose slots.
        assert seen["tombstone"] > 0, seen
    mode = "threaded" if threaded else "inline"
    print(
        f"\n{mode}: {counts} {delivery} lost={lost} recovered={recovered} {dict(seen)} "
        f"in {time.monotonic() - began:.1f}s"
    )


def test_save_barrier_timeout_leaves_no_trace() -> None:
    """A save whose barrier outwaits a slow write raises WaitTimeoutError and leaves no trace (FAIL-3, STEP-5)."""
    with make_manager(True, staging_claim_timeout_s=0.1) as manager:
        engine = Engine(manager)
        engine.start("a", [0, 1, 2])
        engine.materialize(engine.step({"a": 4}))
        settle(manager)  # the slow fault must catch the next write, not this one
        release = threading.Event()
        manager._inject_write_fault(lambda job: release.wait(10))
        slow = engine.step({"a": 1})
        before = manager.stats()
        engine.begin({"a": 1})
        began = time.monotonic()
        with pytest.raises(WaitTimeoutError) as caught:
            engine.save()
        assert 0.09 <= time.monotonic() - began < 3.0
        assert caught.value.what == "save barrier"
        after = manager.stats()
        assert (after.steps_saved, after.pages_in_use) == (before.steps_saved, before.pages_in_use)
        assert after.budget_bytes_in_use == before.budget_bytes_in_use
        release.set()
        retried = engine.save()
        assert retried.step_id == slow.step_id + 1
        engine.materialize(slow)
        engine.materialize(retried)


def test_page_7_the_rows_are_in_the_page_before_the_save_waits_at_the_barrier(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """PAGE-7: a CPU save copies its rows into the page it will claim before it waits at the
    save barrier for the previous step's write, and claims that page; the step reads them back."""
    with make_manager(True) as manager:
        state = manager._state
        engine = Engine(manager)
        engine.start("a", [0, 1, 2])
        engine.materialize(engine.step({"a": 4}))
        settle(manager)  # the held write must be the next one, and the keys have their pages
        release = threading.Event()
        manager._inject_write_fault(lambda job: release.wait(10))
        late = engine.step({"a": 1})
        late_page = state.steps[late.step_id].page
        engine.materialize(late)  # its page is held by its write alone, until it is released
        waiting = threading.Event()
        seen: dict[str, Any] = {}
        wait_for_signal = state.wait_for_signal

        def at_the_barrier(seen_generation: int, deadline_ns: int) -> None:
            if not waiting.is_set():
                page = seen["page"] = state.core.save_page
                seen["rows"] = state.pages.rows(HIDDEN_KEY, page, 1).clone()
                waiting.set()
            wait_for_signal(seen_generation, deadline_ns)

        monkeypatch.setattr(state, "wait_for_signal", at_the_barrier)
        engine.begin({"a": 1})
        saver = threading.Thread(target=lambda: seen.setdefault("saved", engine.save()))
        saver.start()
        try:
            assert waiting.wait(10), "the save did not wait at the barrier"
        finally:
            release.set()
            saver.join(10)
        assert not saver.is_alive()
        saved = seen["saved"]
        assert seen["page"] is not None and seen["page"] != late_page
        assert state.steps[saved.step_id].page == seen["page"], "the save claimed another page"
        assert torch.equal(seen["rows"], saved.rows[HIDDEN_KEY]), "the page missed the rows"
        engine.materialize(saved)


def test_racing_consumers_consume_once() -> None:
    """Two threads consuming one id concurrently: exactly one succeeds (STEP-1, CONC-3)."""
    with make_manager(True) as manager:
        engine = Engine(manager)
        engine.start("a", [0])
        for _ in range(100):
            saved = engine.step({"a": 0})
            results: list[str] = []

            def consume(
                discard: bool, step_id: int = saved.step_id, results: list[str] = results
            ) -> None:
                try:
                    if discard:
                        manager.discard_step(step_id)
                    else:
                        manager.materialize(step_id, ["a"])
                    results.append("consumed")
                except StepAlreadyConsumedError:
                    results.append("refused")

            threads = [threading.Thread(target=consume, args=(d,)) for d in (False, True)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert sorted(results) == ["consumed", "refused"]
        stats = settle(manager)
        assert stats.steps_consumed + stats.steps_discarded == 100
        assert stats.pages_in_use == 0


class _RecordingLock:
    """A lock that records the name of every thread that takes it, and who holds it now."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.takers: Counter[str] = Counter()
        self.holder: str | None = None

    def __enter__(self) -> bool:
        self._lock.acquire()
        self.holder = threading.current_thread().name
        self.takers[self.holder] += 1
        return True

    def __exit__(self, *exc: object) -> None:
        self.holder = None
        self._lock.release()


@pytest.mark.parametrize("threaded", [True, False], ids=["threaded", "inline"])
def test_committer_never_takes_the_state_lock_and_the_pool_has_one_writer(
    threaded: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CONC-2: only caller threads take the state lock. CONC-4: every pool write runs on one
    thread, the committer's (threaded) or the engine's (inline), escalations and flushes too.
    CONC-1: no thread writes the pool while it holds the state lock (inline writes run outside)."""
    manager = make_manager(threaded, **BUSY_CACHE)
    lock = _RecordingLock()
    monkeypatch.setattr(manager._state, "lock", lock)
    writers: Counter[str] = Counter()
    under_lock: list[int] = []
    committer = manager._state.committer
    write_pool = committer._write_pool

    def recorded_write_pool(job: WriteJob) -> None:
        writers[threading.current_thread().name] += 1
        if lock.holder == threading.current_thread().name:
            under_lock.append(job.tid)  # this thread writes the pool inside the state lock
        write_pool(job)

    monkeypatch.setattr(committer, "_write_pool", recorded_write_pool)
    engine_thread = threading.current_thread().name
    with manager:
        # No builder thread: the engine thread consumes, so the lock's takers are the engine,
        # the prefetch worker and (if it broke CONC-2) the committer.
        workload = Workload(Engine(manager), seed=7 + threaded, max_lag=MAX_LAG, builder=False)
        stats = _run(workload, 300)
    assert stats.budget_flushes > 0 and workload.counts.finishes > 0, (stats, workload.counts)
    assert sum(writers.values()) > 300, writers
    if threaded:
        assert committer._thread is not None
        committer_thread = committer._thread.name
        assert committer_thread != engine_thread
        assert set(writers) == {committer_thread}, writers  # CONC-4
        assert committer_thread not in lock.takers, lock.takers  # CONC-2
    else:
        assert set(writers) == {engine_thread}, writers  # CONC-4: the caller writes inline
    assert lock.takers[engine_thread] > 0, lock.takers
    assert not under_lock, f"pool writes while the state lock was held (CONC-1): {under_lock[:5]}"


@pytest.mark.parametrize("failure", ["raised", "bad rows"])
def test_committer_thread_goes_on_after_a_failed_write(failure: str) -> None:
    """FAIL-2: a write that fails is reported FAILED, and the committer thread lives on to run
    the writes queued behind it, in order ("raised": the write raises on its way to the pool;
    "bad rows": its rows do not fit the pool)."""
    pool, reports, committer = _bare_committer()
    key = CODES
    if failure == "raised":
        committer.faults.set("pool_write", lambda job: _raise_if(job.tid == 1))
    jobs = []
    for tid in (1, 2, 3):
        width = 3 if (tid == 1 and failure == "bad rows") else 2
        rows = torch.full((2, width), 10 * tid, dtype=torch.int64)
        job = WriteJob(Tid(tid), (key,))
        job.chunks.append(Chunk(torch.tensor([2 * tid - 2, 2 * tid - 1]), {key: rows}))
        jobs.append(job)
    committer.escalate(jobs)
    assert wait_for(lambda: sum(isinstance(r, WriteLanded) for r in reports) == 2), list(reports)
    committer.shutdown(5.0)
    failed = [r.tid for r in reports if isinstance(r, WriteFailed)]
    landed = [r.tid for r in reports if isinstance(r, WriteLanded)]
    assert (failed, landed) == ([1], [2, 3]), list(reports)
    assert committer._thread is not None and not committer._thread.is_alive()
    assert pool.tensors[key][2:6].flatten().tolist() == [20, 20, 20, 20, 30, 30, 30, 30]


def test_committer_skips_the_slots_a_write_lost() -> None:
    """SLOT-2, the committer's part: a tombstoned slot keeps the newer tenant's row; the rows
    around it are written, and a slot the write claimed twice gets its last row (TASK-5)."""
    pool, reports, committer = _bare_committer()
    pool.tensors[CODES][:] = -1  # what newer writes left there
    job = WriteJob(Tid(1), (CODES,))
    rows = torch.arange(12, dtype=torch.int64).reshape(6, 2)
    job.chunks.append(Chunk(torch.tensor([0, 1, 2]), {CODES: rows[:3]}))
    job.chunks.append(Chunk(torch.tensor([3, 2, 4]), {CODES: rows[3:]}))
    job.add_tombstone(CODES, torch.tensor([1, 4]))
    committer.escalate([job])
    assert wait_for(lambda: any(isinstance(r, WriteLanded) for r in reports)), list(reports)
    committer.shutdown(5.0)
    got = pool.tensors[CODES][:6, 0].tolist()
    assert got == [0, -1, 8, 6, -1, -1], got


@pytest.mark.parametrize("deferred", [False, True])
def test_a_cpu_step_write_wakes_its_waiters_once(deferred: bool) -> None:
    """TASK-6: every stage is published before the waiters are woken. A CPU step write has no
    copy stage, so its waiters are woken once, when it is written; a deferred write wakes them
    after its copy stage too (the save barrier awaits an escalated one at HOST_READY)."""
    pool, reports, committer = _bare_committer(threaded=False)
    rows = torch.arange(6, dtype=torch.int64).reshape(3, 2) + 10
    slots = torch.tensor([5, 1, 6])
    if deferred:
        job = WriteJob(Tid(7), (CODES,))
        job.chunks.append(Chunk(slots, {CODES: rows}))
        committer.escalate([job])
    else:
        job = WriteJob(Tid(7), (CODES,), page=0, slots=slots)
        committer.pages.rows(CODES, 0, 3).copy_(rows)
        committer.submit(job)
    assert [type(r) for r in reports] == [CopyStarted, CopyLanded, WriteLanded]
    assert committer.signal.generation == (2 if deferred else 1)
    assert pool.tensors[CODES][[5, 1, 6]].tolist() == rows.tolist()


CODES = TensorName("codes.audio")


def _bare_committer(*, threaded: bool = True) -> tuple[HostPool, collections.deque[Any], Committer]:
    """A committer over a pool of 8 slots and one page of 4 rows, with one key (two int64 per
    row)."""
    pool = HostPool(8, pin=False)
    pages = StagingPages(1, 4, pin=False)
    shape = KeyShape(features=(2,), dtype=torch.int64)
    pool.install(CODES, shape, pool.allocate(shape))
    pages.install(CODES, pages.allocate(shape, CODES))
    reports: collections.deque[Any] = collections.deque()
    committer = Committer(pool, pages, reports, Signal(), threaded=threaded, copy_chunk_bytes=64)
    return pool, reports, committer


def _raise_if(condition: bool) -> None:
    if condition:
        raise RuntimeError("injected pool write failure")


@pytest.mark.parametrize("point", sorted(FAULT_ERRORS))
def test_a_fault_at_each_point_under_the_busy_workload(point: str) -> None:
    """One fault at each point of the adapter's work, in the preempting workload with a late
    builder thread, ends in its typed error: the committer's fail the write for good (FAIL-1),
    the others fail only their call (D19). Every row served before and after is exact, no call
    hangs, and no page or thread is left behind (FAIL-3, FAIL-4)."""
    error = FAULT_ERRORS[point]
    sticky = error is WriteFailedError
    manager = make_manager(True, **BUSY_CACHE)
    engine = Engine(manager)
    # A gather fault must reach a materialize: no step is discarded or read in part.
    reads_all = point in ("prefetch", "gather")
    workload = Workload(
        engine,
        seed=20240611,
        max_lag=MAX_LAG,
        check_pool_every=25,
        discard_p=0.0 if reads_all else 0.08,
        subset_p=0.0 if reads_all else 0.15,
        **PREEMPTING,
    )
    hook = OneShot()
    pinning = point == "pin"  # a CPU build cannot pin: the hook refuses first

    def arm(on: bool) -> None:
        manager._state.pool.pin = manager._state.pages.pin = on and pinning
        manager._inject_fault(point, hook if on else None)

    # Storage is allocated at a key's first save; every other point is hit mid-run.
    arm_at = 0 if point in ("alloc", "pin") else 60
    failed: list[BaseException] = []
    steps = 0
    while steps < 400:
        if steps == arm_at:
            arm(True)
        try:
            bounded(workload.step, "a step")
        except WriteFailedError as exc:
            failed.append(exc)
            break
        steps += 1
        if workload.failed_saves:
            arm(False)
        expected = workload.failed_saves or [e for e in workload.errors if error.__name__ in e]
        if hook.fired and (expected or failed) and steps >= arm_at + 60:
            break
    arm(False)
    assert hook.fired == 1, f"the {point} fault never fired"
    if sticky:
        if not failed:  # the builder saw it first; the engine's next call raises it too
            with pytest.raises(WriteFailedError) as caught:
                bounded(workload.step, "a step")
            failed.append(caught.value)
        assert_sticky(manager, failed[0].tids)  # type: ignore[attr-defined]
        workload.stop()
        late = [e for e in workload.errors if "WriteFailedError" not in e]
        assert not late, late[:3]  # before the failure: every row exact
    else:
        workload.close()
        if workload.failed_saves:
            assert all(isinstance(e, error) for e in workload.failed_saves), workload.failed_saves
        others = [e for e in workload.errors if not (error.__name__ in e and "Injected" in e)]
        assert not others, others[:3]
        assert workload.failed_saves or len(workload.errors) == 1, workload.errors
        stats = settle(manager)
        assert stats.pages_in_use == 0 and stats.writes_failed == 0
        with manager._state.lock:
            manager._state.core.check_invariants()
        assert workload.counts.materialized > 50
    manager.shutdown()
    assert not library_threads(), library_threads()
    assert not manager._state.pool.tensors and not manager._state.jobs and not manager._state.steps
