"""The soak's run: a busy simulated engine and a late output builder against one cache.

The clean phase keeps one manager for its whole length. The engine thread (the caller's) runs the
randomized `Scheduler` over a small paged KV cache: requests over a few shared prompt families,
hits on the longest registered prefix (also on blocks computed in the same step), chunked
prefill, decode, finishes, aborts, preemptions (the request's blocks go back to the free list)
and resumes (a hit on whatever of its blocks is still registered), request ids used again,
blocks recycled least or most recently freed first. Staging pages and the GPU-byte budget are
small, so saves wait for pages and deferred writes are flushed early. Each step's rows are the
oracle's (`_soak_checks.expected_rows`); the `Builder` thread consumes and checks them.

The fault phase runs short episodes, each with a fresh manager and one fault injected at one of
the adapter's fault points (`omni_cache_cuda._faults`). Each must end in its typed error (D19):
a sticky `WriteFailedError` for the committer's points (every later call raises it too, then the
manager is shut down and rebuilt), a `StagingCopyError` or `HostAllocationError` from the save or
`reserve` that hit it (the engine aborts that step's requests, as after a failed forward), or a
`HitUnreadableError` from the materialize whose gather failed. Every episode ends with no page,
budget charge or thread of the library left.

`run` drives both phases, samples resident and pinned bytes and thread counts (`_probes`) and
watches for hangs; `omni_cache_cuda.soak` prints what it returns.
"""

from __future__ import annotations

import collections
import faulthandler
import os
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from attrs import define, field, frozen

from omni_cache_core import (
    HIDDEN_KEY,
    HostAllocationError,
    ModelCachePolicy,
    PrefixCacheConfig,
    PrefixCacheStep,
    StagingCopyError,
    StepId,
    WriteFailedError,
)
from omni_cache_cuda._faults import FAULT_ERRORS, OneShot
from omni_cache_cuda._layout import PrefixCacheWriteLayout
from omni_cache_cuda._manager import OmniPrefixCacheManager
from omni_cache_cuda._probes import library_threads, os_threads, resident_bytes
from omni_cache_cuda._storage import registered_pinned_bytes

from ._records import RecordQueue
from ._scheduler import Knobs, Scheduler, SchedulerCounts
from ._soak_checks import (
    DEF,
    HANG_S,
    MM,
    SHAPES,
    Admission,
    Builder,
    Report,
    Saved,
    Watch,
    expected_rows,
)

__all__ = ["RSS_BOUND_BYTES", "Sample", "SoakEngine", "SoakOptions", "SoakRun", "run"]

_STICKY = {kind for kind, error in FAULT_ERRORS.items() if error is WriteFailedError}

#: Resident memory may grow this much after warm-up (allocator and interpreter noise).
RSS_BOUND_BYTES = 64 * 2**20
#: The wait bound of the soak's managers.
TIMEOUT_S = 20.0

#: The soak's scheduler: busier than the tests' (more running requests, longer decodes).
SOAK_KNOBS = Knobs(
    max_running=6,
    max_chunk=8,
    max_decode=16,
    families=4,
    family_blocks=6,
    admit_p=0.6,
    abort_p=0.015,
    reuse_p=0.1,
    idle_p=0.04,
    idle_fresh=False,
    preempt_p=0.03,
    resume_p=0.35,
    same_step_resume_p=0.0,
    end_preempted_p=0.03,
    mru_p=0.3,
)

#: Scheduler counts -> the names the soak's report prints them under.
_COUNT_NAMES = {
    "admissions": "admissions",
    "hit_requests": "admissions with a hit",
    "finishes": "finished",
    "preempted_finishes": "finished",
    "aborts": "aborted",
    "preempted_aborts": "aborted",
    "preemptions": "preemptions",
    "resumes": "resumes",
    "resumes_with_hit": "resumes with a hit",
    "id_reuses": "ids used again",
    "blocks_allocated": "blocks allocated",
}


class _Records(RecordQueue):
    """The scheduler's lifecycle records as the step's events, and the admissions they open."""

    def __init__(self, builder: Builder, oracle_lock: threading.Lock) -> None:
        super().__init__()
        self.builder = builder
        self.oracle_lock = oracle_lock
        self.admissions: dict[str, Admission] = {}

    def start(
        self,
        req: str,
        blocks: Sequence[int],
        *,
        hit_end: int = 0,
        tokens: Sequence[int] | None = None,
    ) -> None:
        assert tokens is not None, req
        self.admissions[req] = Admission(req, tokens)
        super().start(req, blocks, hit_end=hit_end)

    def finish(self, req: str, *, abort: bool = False) -> None:
        super().finish(req, abort=abort)
        adm = self.admissions.pop(req)
        with self.oracle_lock:
            adm.ended = True
            if adm.outstanding == 0:
                self.builder._finish(adm)


class SoakEngine:
    """The simulated scheduler feeding one manager, its steps handed to a late `Builder`."""

    def __init__(
        self,
        manager: OmniPrefixCacheManager,
        report: Report,
        watch: Watch,
        rng: random.Random,
        *,
        lag: int = 2,
        discard_p: float = 0.06,
        subset_p: float = 0.1,
        shuffle_p: float = 0.3,
        knobs: Knobs = SOAK_KNOBS,
    ) -> None:
        self.m = manager
        self.report = report
        self.watch = watch
        self.rng = rng
        self.bs = manager.config.block_size
        self.lag = lag
        self.oracle_lock = threading.Lock()
        self.builder = Builder(
            manager,
            report,
            watch,
            random.Random(rng.random()),
            discard_p=discard_p,
            subset_p=subset_p,
            shuffle_p=shuffle_p,
            oracle_lock=self.oracle_lock,
        )
        self.builder.start()
        self.records = _Records(self.builder, self.oracle_lock)
        self.counts = SchedulerCounts()
        self.scheduler = Scheduler(
            manager.config.num_blocks,
            self.bs,
            self.records,
            rng=rng,
            knobs=knobs,
            counts=self.counts,
        )
        self.late: collections.deque[tuple[int, Saved]] = collections.deque()
        self.steps = 0
        #: Set by the fault phase: hand steps to the builder whole (no discard, no subset).
        self.plain = False

    def step(self) -> BaseException | None:
        """Run one engine step; return the typed error a save raised (a fault), if any."""
        self.steps += 1
        return self._save(self.scheduler.plan().schedule)

    def _save(self, schedule: dict[str, int]) -> BaseException | None:
        order = list(schedule)
        live = self.scheduler.live
        records = self.records
        step = PrefixCacheStep(events=records.events, scheduled_tokens=dict(schedule))
        records.events = []
        began = time.perf_counter()
        with self.watch("new_step_starts"):
            self.m.new_step_starts(step)
        hit_now = {
            e.req_id for e in step.events if e.hit_end and e.req_id in schedule
        }  # STARTED or RESUMED with a hit, registered in this step
        layout = PrefixCacheWriteLayout.from_block_tables(
            order,
            schedule,
            {r: live[r].computed for r in order},
            {r: live[r].blocks for r in order},
            self.bs,
        )
        n = layout.num_rows
        hidden = None
        mm: dict[str, torch.Tensor] = {}
        if n:
            pieces = []
            for req_id in order:
                at = live[req_id].computed
                pieces.append(records.admissions[req_id].hashes[at : at + schedule[req_id]])
            hashes = np.concatenate(pieces)
            hidden = expected_rows(HIDDEN_KEY, hashes)
            mm = {key: expected_rows(key, hashes) for key in (MM, DEF)}
        try:
            with self.watch("save_outputs"):
                step_id = self.m.save_outputs(
                    hidden, mm, num_tokens_unpadded=n, write_layout=layout
                )
        except (StagingCopyError, HostAllocationError) as exc:
            # As after a failed forward: publish none of the step's blocks, drop its requests.
            self.scheduler.fail(schedule)
            return exc
        with self.report.lock:
            self.report.step_ms.append((time.perf_counter() - began) * 1e3)
        carried: dict[str, tuple[int, int]] = {}
        adms: dict[str, Admission] = {}
        self.scheduler.commit(schedule)
        with self.oracle_lock:
            for req_id in order:
                computed = live[req_id].computed
                lo = 0 if req_id in hit_now else computed - schedule[req_id]
                adm = records.admissions[req_id]
                adm.max_hi = max(adm.max_hi, computed)
                adm.outstanding += 1
                carried[req_id] = (lo, computed)
                adms[req_id] = adm
        saved = Saved(step_id, order, adms, carried, n)
        saved.plain = self.plain
        due = self.steps + self.rng.randint(0, self.lag)
        if self.late:
            due = max(due, self.late[-1][0])  # hand-off stays in save order
        self.late.append((due, saved))
        items = []
        while self.late and self.late[0][0] <= self.steps:
            items.append(self.late.popleft()[1])
        self.builder.hand(items)
        return None

    def fold_counts(self) -> None:
        """Add what the scheduler exercised to the report (once, when the engine is done)."""
        for name, label in _COUNT_NAMES.items():
            self.report.count(label, getattr(self.counts, name))

    def drain(self) -> None:
        """End every request, hand every step over and wait until the builder consumed them."""
        self.scheduler.drain()
        if self.records.events:
            self._save({})
        self.builder.hand([saved for _, saved in self.late])
        self.late.clear()
        if not self.builder.wait_idle(HANG_S):
            self.report.error("the builder did not finish the last steps")
        self.builder.stop()
        self.fold_counts()


def _settle(manager: OmniPrefixCacheManager, report: Report, what: str) -> None:
    """No page or budget charge is left once everything is consumed and written."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        stats = manager.stats()
        if stats.pages_in_use == 0 and stats.budget_bytes_in_use == 0:
            return
        if time.monotonic() > deadline:
            report.error(
                f"{what}: {stats.pages_in_use} pages and {stats.budget_bytes_in_use} budget "
                "bytes still held after every step was consumed and every request ended"
            )
            return
        time.sleep(0.005)


def _closed_clean(manager: OmniPrefixCacheManager, report: Report, what: str) -> None:
    """After shutdown no thread of the library is alive and no host storage is held."""
    manager.shutdown()
    left = library_threads()
    if left:
        report.error(f"{what}: threads still alive after shutdown: {left}")
    stats = manager.stats()
    if stats.pool_bytes or stats.staging_bytes:
        report.error(f"{what}: host storage held after shutdown: {stats}")


# ---------------------------------------------------------------------------------------------
# Phases.


def _config() -> PrefixCacheConfig:
    return PrefixCacheConfig(
        num_blocks=96,
        block_size=4,
        staging_depth=5,
        staging_capacity_tokens=64,
        staging_claim_timeout_s=TIMEOUT_S,
        gpu_staging_bytes=2048,
        copy_chunk_bytes=64,
    )


def _policy() -> ModelCachePolicy:
    return ModelCachePolicy(deferred_keys={DEF})


def _manager(options: SoakOptions) -> OmniPrefixCacheManager:
    manager = OmniPrefixCacheManager(
        _config(),
        policy=_policy(),
        device=options.device,
        threaded=not options.inline,
        prefetch=True,
    )
    # The soak's rows are a few bytes wide: every hit is prefetched, on the CPU too, so that
    # the prefetch's paths and its fault point are exercised (HIT-7, D34, D38).
    manager._effects.prefetch_min_bytes = 0
    # And every returned buffer is kept for reuse, so that rows a consumer still holds meet
    # later steps' buffers (OUT-8, D40).
    manager._state.outputs.min_bytes = 1
    return manager


def clean_phase(
    options: SoakOptions,
    report: Report,
    watch: Watch,
    rng: random.Random,
    until: Callable[[int], bool],
) -> dict[str, Any]:
    """One manager for the whole phase, its keys reserved up front, no faults."""
    manager = _manager(options)
    manager.reserve(SHAPES)
    engine = SoakEngine(manager, report, watch, rng)
    while not until(engine.steps):
        error = engine.step()
        if error is not None:
            report.error(f"clean phase step {engine.steps}: {error!r}")
    engine.drain()
    _settle(manager, report, "clean phase")
    stats = manager.stats()
    _closed_clean(manager, report, "clean phase")
    return {"steps": engine.steps, "stats": stats}


def fault_episode(
    options: SoakOptions, report: Report, watch: Watch, rng: random.Random, kind: str
) -> int:
    """One fresh manager, one fault of ``kind``; returns the steps run."""
    tally = report.faults[kind]
    tally["episodes"] += 1
    expected = FAULT_ERRORS[kind]
    manager = _manager(options)
    # The manager's shared state: the storage's pin flags, the state lock and the core.
    state = manager._state
    hook = OneShot(0 if kind == "pin" else rng.randint(0, 1))
    pinning = kind == "pin" and not state.cuda
    seen: list[BaseException] = []

    def arm() -> None:
        if pinning:
            # A CPU build cannot pin: the hook refuses before any pinning is tried.
            state.pool.pin = state.pages.pin = True
        manager._inject_fault(kind, hook)
        tally["armed"] += 1

    def disarm() -> None:
        manager._inject_fault(kind, None)
        if pinning:
            state.pool.pin = state.pages.pin = False

    at_reserve = kind in ("alloc", "pin") and rng.random() < 0.5
    if at_reserve:
        arm()
        try:
            manager.reserve(SHAPES)
        except HostAllocationError as exc:
            seen.append(exc)
            stats = manager.stats()
            if stats.pool_bytes or stats.staging_bytes:
                report.error(f"{kind} at reserve: storage kept after the failure: {stats}")
        disarm()
        with state.lock:
            state.core.check_invariants()
        if rng.random() < 0.5:
            manager.reserve(SHAPES)
    engine = SoakEngine(manager, report, watch, rng, lag=1)
    engine.plain = kind in ("prefetch", "gather")
    engine.builder.expect = expected
    arm_at = 0 if kind in ("alloc", "pin") else rng.randint(2, 12)
    steps_after = rng.randint(5, 15)
    sticky_at: int | None = None
    done_at: int | None = None
    max_steps = 400
    while engine.steps < max_steps:
        if engine.steps == arm_at and not at_reserve:
            arm()
        try:
            error = engine.step()
        except WriteFailedError as exc:
            if kind not in _STICKY:
                report.error(f"{kind} episode: {exc!r}")
                break
            seen.append(exc)
            sticky_at = engine.steps
            break
        if error is not None:
            if isinstance(error, expected) and "injected" in str(error):
                seen.append(error)
                disarm()  # a CPU build must not try to pin for real
            else:
                report.error(f"{kind} episode, step {engine.steps}: {error!r}")
        if engine.builder.sticky:
            sticky_at = engine.steps
            break
        if hook.fired and done_at is None and (seen or engine.builder.seen):
            done_at = engine.steps
        if done_at is not None and engine.steps >= done_at + steps_after:
            break
    disarm()
    if sticky_at is not None:
        _check_sticky(manager, engine, report, kind)
    else:
        engine.drain()
        _settle(manager, report, f"{kind} episode")
        with state.lock:
            state.core.check_invariants()
    seen.extend(engine.builder.seen)
    tally["fired"] += hook.fired
    typed = [e for e in seen if isinstance(e, expected)]
    tally["raised"] += min(len(typed), hook.fired) if kind not in _STICKY else int(bool(typed))
    if hook.fired and not typed:
        report.error(f"{kind}: the injected fault fired but no {expected.__name__} was seen")
    if typed and not hook.fired:
        report.error(f"{kind}: {expected.__name__} raised with no fault injected: {typed[0]!r}")
    if kind in _STICKY and typed:
        tally["rebuilds"] += 1
    _closed_clean(manager, report, f"{kind} episode")
    return engine.steps


def _check_sticky(
    manager: OmniPrefixCacheManager, engine: SoakEngine, report: Report, kind: str
) -> None:
    """FAIL-1: once a write failed, every public call raises WriteFailedError."""
    layout = PrefixCacheWriteLayout([], torch.zeros(0, dtype=torch.int64))
    calls: dict[str, Callable[[], Any]] = {
        "new_step_starts": lambda: manager.new_step_starts(PrefixCacheStep()),
        "save_outputs": lambda: manager.save_outputs(
            None, {}, num_tokens_unpadded=0, write_layout=layout
        ),
        "materialize": lambda: manager.materialize(StepId(1), []),
        "discard_step": lambda: manager.discard_step(StepId(1)),
        "reserve": lambda: manager.reserve(SHAPES),
    }
    for name, call in calls.items():
        try:
            call()
        except WriteFailedError:
            continue
        except BaseException as exc:
            report.error(f"{kind}: {name} after a failed write raised {exc!r}")
            continue
        report.error(f"{kind}: {name} after a failed write did not raise (FAIL-1)")
    engine.builder.sticky = True
    engine.builder.hand([saved for _, saved in engine.late])
    engine.late.clear()
    engine.builder.stop()
    if engine.builder.is_alive():
        report.error(f"{kind}: the builder did not stop")
    engine.fold_counts()


# ---------------------------------------------------------------------------------------------
# The run.


@frozen(kw_only=True)
class SoakOptions:
    """How long and how the soak runs (the command's flags).

    Attributes:
        minutes: Run this long (None with ``steps``).
        steps: Run this many engine steps instead.
        seed: Seeds every random choice.
        device: Where step tensors live (``cpu`` or ``cuda``).
        inline: Inline writes, no committer thread.
        fault_share: Share of the run for the fault phase.
    """

    minutes: float | None = None
    steps: int | None = None
    seed: int = 0
    device: str = "cpu"
    inline: bool = False
    fault_share: float = 0.3


@frozen
class Sample:
    """Memory and threads at one moment: seconds, phase, steps, resident and pinned bytes,
    Python threads, OS threads."""

    seconds: float
    phase: str
    steps: int
    resident: int
    pinned: int
    python_threads: int
    os_threads: int


@define
class SoakRun:
    """What a run saw so far: its report, samples, where warm-up ended, the clean phase's stats."""

    report: Report = field(factory=Report)
    watch: Watch = field(factory=Watch)
    samples: list[Sample] = field(factory=list)
    #: ``index`` (of the sample that ends warm-up), ``rss``, ``steps``; empty until then.
    warm: dict[str, Any] = field(factory=dict)
    began: float = field(factory=time.monotonic)
    stats: Any = None
    phase: str = "clean"
    steps: int = 0

    def sample(self) -> None:
        """Take one memory and threads sample."""
        self.samples.append(
            Sample(
                time.monotonic() - self.began,
                self.phase,
                self.steps,
                resident_bytes(),
                registered_pinned_bytes(),
                threading.active_count(),
                os_threads(),
            )
        )

    def progress(self) -> None:
        """Print one progress line."""
        report = self.report
        with report.lock:
            rows = sum(report.rows_checked.values())
            wrong, errors = len(report.wrong), len(report.unexpected)
        print(
            f"  {time.monotonic() - self.began:7.0f}s {self.phase:<7} steps {self.steps:>8} "
            f"rows checked {rows:>10} wrong {wrong} errors {errors} "
            f"resident {resident_bytes() / 2**20:.1f} MiB threads {threading.active_count()}",
            flush=True,
        )


def run(options: SoakOptions, on_hang: Callable[[SoakRun], object]) -> SoakRun:
    """Run the clean phase, then fault episodes of every kind; return what was seen.

    A call that does not return within `HANG_S` prints the stacks, calls ``on_hang`` and exits
    the process with status 2.
    """
    minutes = options.minutes if options.minutes is not None else (None if options.steps else 1.0)
    rng = random.Random(options.seed)
    soak = SoakRun()
    report = soak.report
    torch.manual_seed(options.seed)
    total_s = None if minutes is None else minutes * 60.0
    clean_s = None if total_s is None else total_s * (1 - options.fault_share)
    clean_steps = None if options.steps is None else int(options.steps * (1 - options.fault_share))
    stop = threading.Event()

    def watchdog() -> None:
        period = max(1.0, (total_s or 60.0) / 120)
        next_sample = time.monotonic()
        next_line = time.monotonic() + 60.0
        while not stop.wait(0.5):
            if time.monotonic() >= next_line:
                soak.progress()
                next_line += 60.0
            worst = soak.watch.longest()
            if worst is not None and worst[2] > HANG_S:
                report.hangs += 1
                print(
                    f"HANG: thread {worst[0]} in {worst[1]} for {worst[2]:.0f}s; stacks follow",
                    flush=True,
                )
                faulthandler.dump_traceback(all_threads=True)
                on_hang(soak)
                os._exit(2)
            if time.monotonic() >= next_sample:
                soak.sample()
                next_sample += period

    dog = threading.Thread(target=watchdog, name="soak-watchdog", daemon=True)
    soak.sample()
    dog.start()

    def mark_warm(steps: int) -> None:
        soak.sample()
        soak.warm.update(index=len(soak.samples) - 1, rss=soak.samples[-1].resident, steps=steps)

    def clean_until(steps: int) -> bool:
        soak.steps = steps
        # Warm-up: the first tenth of the clean phase, at least a few hundred steps.
        if clean_steps is not None:
            warmed = steps >= min(max(300, clean_steps // 10), clean_steps // 2)
        else:
            assert clean_s is not None
            warmed = steps >= 300 and time.monotonic() - soak.began >= clean_s / 10
            warmed = warmed or time.monotonic() - soak.began >= clean_s / 2
        if not soak.warm and warmed:
            mark_warm(steps)
        if clean_steps is not None:
            return steps >= clean_steps
        assert clean_s is not None
        return time.monotonic() - soak.began >= clean_s

    clean = clean_phase(options, report, soak.watch, rng, clean_until)
    soak.stats = clean["stats"]
    if not soak.warm:
        mark_warm(clean["steps"])
    soak.phase = "faults"
    fault_steps = 0
    kinds = list(FAULT_ERRORS)
    order: list[str] = []
    episodes = 0
    while True:
        if options.steps is not None:
            if fault_steps >= options.steps - clean["steps"] and episodes >= len(kinds):
                break
        elif time.monotonic() - soak.began >= (total_s or 0) and episodes >= len(kinds):
            break
        if not order:
            order = kinds[:]
            rng.shuffle(order)
        fault_steps += fault_episode(options, report, soak.watch, rng, order.pop())
        episodes += 1
        soak.steps = clean["steps"] + fault_steps
    soak.sample()
    stop.set()
    dog.join(5)
    for kind, tally in report.faults.items():
        if tally["episodes"] and not tally["fired"]:
            # A fault point no episode reached is a path the soak no longer exercises.
            report.error(f"{kind}: no episode reached its fault point ({tally['episodes']} run)")
    report.counts["clean steps"] = clean["steps"]
    report.counts["fault steps"] = fault_steps
    report.counts["fault episodes"] = episodes
    return soak
