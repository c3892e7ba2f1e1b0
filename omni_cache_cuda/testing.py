"""Test support: run the core's stateful machine against the real adapter, with real tensors.

`TensorDriver` implements the driver interface of `omni_cache_core.testing` (`CacheDriver`) over
an `OmniPrefixCacheManager`, on the CPU or, with ``device="cuda"``, on a GPU, so the same
`CacheMachine` and `ReferenceModel` that check the pure core check the adapter too (the way
``zarr.testing.stateful`` ships one machine for every store). It needs hypothesis (the ``test``
extra); ``import omni_cache_cuda`` never imports it.

Rows
----
The machine gives every saved row an integer *write identity* (`row_value`). The driver turns
it into tensor rows whose every element equals that identity, one width and dtype per key
(`ROW_SHAPES`), and turns `materialize` results back into integers. A row whose elements differ
(torn, mixed from two writes, stale in part) raises `DriverError`; zeros read back as ``0``.
A materialize also reports each request's delivered positions, `StageCacheOutputs.positions`
(DLV-7), which the machine compares with the model's, as it does the rows the adapter cut below
each request's delivery cursor (DLV-2).
Steps are padded now and then as under CUDA graphs (OUT-2): padding rows carry `PAD_VALUE`,
which the model never expects. The step tensors and the slot ids are views of buffers the
driver reuses for every save and overwrites right after it, as an engine's static buffers are
(STEP-3). A policy without hidden states still gets a hidden tensor of junk rows (OUT-7).

Committer and clock
-------------------
Inline (``threaded=False``): writes run in the caller, so nothing is ever in flight; `land` and
`fail` are never called (`in_flight` is empty) and write failures are not injected.

Threaded: the write-fault hook (`OmniPrefixCacheManager._inject_write_fault`) parks the
committer before each pool write, after the copy stage (with ``park_early`` a write with an even
tid parks earlier, at the first of its fault points: a piece of its deferred copy or its
host-ready wait, D19). Parked and queued writes are in flight;
`land(tid)` lets the committer run until that write's rows are in the pool, `fail(tid)` until
that write fails (FAIL-1): at its pool write, or at an earlier fault point it has yet to reach
(`fail(tid, at=...)`: its host-ready wait or a piece of its deferred copy). The committer works
one job at a time in queue order, so landing a write lands every write ahead of it. Whenever the adapter waits for writes (save
barrier, budget flush, hit join) the driver lets the committer run until the awaited writes are
through, unless the save is stalled (then the wait runs out). Between calls the driver waits
until the committer is parked or idle, so the state the machine snapshots holds still.

Saves with ``on_page_wait`` run on a second thread (the engine thread); when that save waits
for a page, the caller's thread runs the callback (a consume, CONC-3) and the save claims the
page it frees.

The adapter reads the real clock; the clock-driven rules are not simulated. The driver
replaces ``staging_claim_timeout_s`` by a small ``wait_s`` and makes every wait that something
will end (writes the gate let go, the consume beside a page wait) end on that event instead of
on the clock, so a busy machine cannot turn it into a timeout. Only waits nothing will end (a
page claim with every page held, a stalled save) run the real clock down to their timeout
error. `advance_clock` only counts: the machine's "time passes" rule changes nothing.

The driver watches the adapter through instance attributes of its own manager (the core's
entry points and the manager's wait, wrapped to observe) and its private tables (read-only,
under the state lock or while the committer is parked); it changes no behaviour but the waits'
wake-up and the committer's pace.
"""

from __future__ import annotations

import collections
import functools
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
import numpy as np
import torch

from omni_cache_core import (
    HIDDEN_KEY,
    AwaitPage,
    AwaitTasks,
    EscalateTasks,
    ModelCachePolicy,
    PrefixCacheConfig,
    PrefixCacheRequestEvent,
    PrefixCacheStep,
    ReqId,
    StepId,
    TensorName,
    Tid,
)
from omni_cache_core.testing import (
    DEFERRED_KEY,
    MM_KEY,
    Delivered,
    DriverError,
    Rows,
    SaveSpec,
)
from omni_cache_cuda._committer import JobStage, WriteJob
from omni_cache_cuda._layout import PrefixCacheWrite, PrefixCacheWriteLayout
from omni_cache_cuda._manager import OmniPrefixCacheManager
from omni_cache_cuda._outputs import StageCacheOutputs

__all__ = ["PAD_VALUE", "ROW_SHAPES", "TensorDriver"]

#: Row shape and dtype of each key the machine emits: a different width and dtype per key, a
#: 2-D row for the deferred key. Any other key gets one int64 element per row.
ROW_SHAPES: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    HIDDEN_KEY: ((4,), torch.float64),
    MM_KEY: ((3,), torch.int32),
    DEFERRED_KEY: ((2, 2), torch.int64),
}
_OTHER_SHAPE: tuple[tuple[int, ...], torch.dtype] = ((1,), torch.int64)

#: Padding rows past the step's tokens (OUT-2): never cached, so never read back.
PAD_VALUE = -7
#: Written over the live buffers after every save: a later read of them shows up (STEP-3).
_SCRIBBLE = -3
#: Hidden rows handed to a policy that does not cache hidden states (OUT-7).
_JUNK = -9

#: The longest the driver waits for the committer thread to settle; past it, a hang is a bug.
_SETTLE_S = 10.0


class _InjectedFault(RuntimeError):
    """The failure the driver injects into one pool write (FAIL-1)."""


class _Gate:
    """The fault hooks that park the committer: before each pool write, or earlier.

    The hooks run on the committer thread with no lock of the adapter held. A job stops once,
    at its pool write (after the copy stage); with ``park_early``, a job with an even tid stops
    at the first fault point it reaches instead (a piece of its deferred copy, its host-ready
    wait, else its pool write), so parked writes of both stages occur. It goes on when the
    driver lets it (`release`), or when the gate is open (shutdown); a doomed job fails at the
    fault point it was doomed at (D19), or at its pool write at the latest.
    """

    #: The committer's fault points in the order a job meets them.
    ORDER = ("deferred_piece", "host_ready", "pool_write")

    def __init__(self, *, park_early: bool = False) -> None:
        self._cv = threading.Condition(threading.Lock())
        self.park_early = park_early
        #: The job parked in a hook, if any, and the fault point it is parked at.
        self.parked: WriteJob | None = None
        self.parked_at = "pool_write"
        #: Tids the committer must get through; it runs every job until all of them passed.
        self._until: set[Tid] = set()
        #: Doomed tids and the fault point each fails at.
        self._target: dict[Tid, str] = {}
        #: Tids that went through their stop (released, or failed).
        self.through: set[Tid] = set()
        #: Jobs that went through and may still be finishing.
        self.finishing: list[WriteJob] = []
        #: Where doomed writes failed, by fault point.
        self.failed_at: collections.Counter[str] = collections.Counter()
        self._open = False

    def __call__(self, job: WriteJob) -> None:
        """The pool-write hook."""
        self._hook("pool_write", job)

    def early(self, point: str, detail: Any) -> None:
        """The ``host_ready`` and ``deferred_piece`` hooks (D19)."""
        self._hook(point, detail[0] if isinstance(detail, tuple) else detail)

    def _hook(self, point: str, job: WriteJob) -> None:
        tid = job.tid
        with self._cv:
            if not self._fails_here(tid, point):
                if tid in self.through or tid in self._target:
                    return  # released, or doomed at a later point: go on
                if point != "pool_write" and (tid % 2 or not self.park_early):
                    return  # this job stops at its pool write
                self.parked = job
                self.parked_at = point
                self._cv.notify_all()
                while not (self._open or self._until or tid in self._target):
                    self._cv.wait()
                self.parked = None
                if not self._fails_here(tid, point):
                    self._until.discard(tid)
                    self.through.add(tid)
                    self.finishing.append(job)
                    self._cv.notify_all()
                    return
            del self._target[tid]
            self._until.discard(tid)
            self.through.add(tid)
            self.finishing.append(job)
            self.failed_at[point] += 1
            self._cv.notify_all()
        raise _InjectedFault(f"injected failure of write {tid} at {point}")

    def _fails_here(self, tid: Tid, point: str) -> bool:
        target = self._target.get(tid)
        return target is not None and (target == point or point == "pool_write")

    def release(self, tids: Iterable[Tid], *, doom: bool = False, at: str = "pool_write") -> None:
        """Let the committer run until these writes went through, or failed (``doom``) at the
        fault point ``at`` (their pool write at the latest)."""
        with self._cv:
            todo = {tid for tid in tids if tid not in self.through}
            self._until |= todo
            if doom:
                self._target.update(dict.fromkeys(todo, at))
            self._cv.notify_all()

    def hold(self) -> None:
        """Stop letting writes through (the next job parks)."""
        with self._cv:
            self._until.clear()

    def open(self) -> None:
        """Let every write through from now on (shutdown)."""
        with self._cv:
            self._open = True
            self._cv.notify_all()

    def wait_done(self, tids: Iterable[Tid], timeout_s: float) -> bool:
        """Wait until these writes went through and finished (reports out); False on timeout."""
        deadline = time.monotonic() + timeout_s
        for tid in tids:
            if not self.wait_through(tid, deadline - time.monotonic()):
                return False
        with self._cv:
            jobs = [job for job in self.finishing if job.tid in set(tids)]
        while any(job.stage is not JobStage.DONE for job in jobs):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.0002)
        return True

    def wait_through(self, tid: Tid, timeout_s: float) -> bool:
        """Wait until ``tid`` went through the hook; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while tid not in self.through:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True


class _Relief:
    """A save on an engine thread, and the consume the caller runs while it waits for a page."""

    def __init__(self, engine: threading.Thread) -> None:
        self.engine = engine
        #: Set when the save waits for a page (or ends without waiting).
        self.asked = threading.Event()
        #: Set when the consume is done.
        self.done = threading.Event()


def _shape_of(key: str) -> tuple[tuple[int, ...], torch.dtype]:
    return ROW_SHAPES.get(key, _OTHER_SHAPE)


def _decode(key: str, rows: Any) -> tuple[int, ...]:
    """Turn one request's returned rows back into write identities; refuse a torn row."""
    if not isinstance(rows, torch.Tensor):
        raise DriverError(f"{key}: got {type(rows).__name__}, not a tensor")
    if not len(rows):
        return ()  # no rows: for a key never seen yet there is no row shape to follow
    features, dtype = _shape_of(key)
    if rows.dtype != dtype or tuple(rows.shape[1:]) != features:
        raise DriverError(
            f"{key}: rows of shape {tuple(rows.shape[1:])} and dtype {rows.dtype}, "
            f"expected {features} and {dtype}"
        )
    flat = rows.detach().reshape(len(rows), -1).cpu()
    if not torch.equal(flat, flat[:, :1].expand_as(flat)):
        torn = (flat != flat[:, :1]).any(dim=1).nonzero().flatten().tolist()
        raise DriverError(f"{key}: rows {torn} mix several writes: {flat[torn].tolist()}")
    out = []
    for value in flat[:, 0].tolist():
        if value != int(value):
            raise DriverError(f"{key}: {value} is no write identity")
        out.append(int(value))
    return tuple(out)


class TensorDriver:
    """The driver interface of `omni_cache_core.testing` over a real `OmniPrefixCacheManager`.

    See the module docstring for how rows, the committer and the clock are handled.

    Args:
        config: Cache sizes as the machine draws them; the wait bound is replaced by
            ``wait_s`` and the budget is scaled by ``budget_scale``.
        policy: What the model caches.
        prefetch: Start hit gathers at the step start (HIT-7).
        threaded: A committer thread (True) or inline writes (False); None: the manager's
            default (threaded on CUDA, inline on the CPU).
        device: Where the step tensors live ("cpu" or "cuda").
        wait_s: ``staging_claim_timeout_s`` of the manager: how long a page claim with no page
            or a stalled save waits before its timeout error.
        budget_scale: Bytes per budget unit: the machine's budgets count rows, the adapter's
            count bytes (a deferred row here is 32 bytes).
        park_early: Writes with an even tid park at their first fault point rather than at
            their pool write (threaded), so `fail` can make them fail there (D19).
    """

    def __init__(
        self,
        config: PrefixCacheConfig,
        policy: ModelCachePolicy | None = None,
        *,
        prefetch: bool = True,
        threaded: bool | None = None,
        device: str | torch.device = "cpu",
        wait_s: float = 0.05,
        budget_scale: int = 32,
        park_early: bool = False,
    ) -> None:
        config = attrs.evolve(
            config,
            staging_claim_timeout_s=wait_s,
            gpu_staging_bytes=config.gpu_staging_bytes * budget_scale,
        )
        self.config = config
        self.manager = OmniPrefixCacheManager(
            config, policy=policy, device=device, threaded=threaded, prefetch=prefetch
        )
        self.device = self.manager.device
        self.threaded = self.manager.threaded
        self.now_ns = 0
        self.save_touched = False
        self.saves = 0
        self._stalled = False
        self._relief: _Relief | None = None
        #: Per thread: the writes the adapter's next wait is for, once the gate let them go.
        self._awaited = threading.local()
        self._reports_seen = 0
        self._escalated = False
        #: The engine's static buffers, reused by every save (STEP-3).
        self._buffers: dict[str, torch.Tensor] = {}
        self._slot_buffer = torch.zeros(0, dtype=torch.int64)
        self._gate: _Gate | None = None
        if self.threaded:
            self._gate = _Gate(park_early=park_early)
            self.manager._inject_write_fault(self._gate)
            for point in ("host_ready", "deferred_piece"):
                self.manager._inject_fault(point, functools.partial(self._gate.early, point))
        self._observe(self.manager._state.core)
        self._observe_waits()

    # -----------------------------------------------------------------------------------------
    # What the driver sees of the core's inputs (the adapter is not changed, only watched).

    def _observe(self, core: Any) -> None:
        """Wrap the core's entry points on this instance to see waits, escalations, reports."""
        save_proceed, consume_begin, report = core.save_proceed, core.consume_begin, core.report

        def watched_save_proceed(inp: Any) -> Any:
            effect = save_proceed(inp)
            if isinstance(effect, EscalateTasks):
                self._escalated = True
            elif isinstance(effect, AwaitTasks) and not self._stalled:
                self._let_through(tid for tid, _ in effect.waits)
            elif isinstance(effect, AwaitPage):
                relief = self._relief
                if relief is not None and threading.current_thread() is relief.engine:
                    relief.asked.set()
            return effect

        def watched_consume_begin(inp: Any) -> Any:
            effect = consume_begin(inp)
            if isinstance(effect, AwaitTasks):
                self._let_through(tid for tid, _ in effect.waits)
            return effect

        def counted_report(inp: Any) -> None:
            self._reports_seen += 1
            report(inp)

        core.save_proceed = watched_save_proceed
        core.consume_begin = watched_consume_begin
        core.report = counted_report

    def _observe_waits(self) -> None:
        """Make the adapter's waits end on the awaited event, not on the clock.

        A wait for writes the gate let go ends once they are through; a save's page wait ends
        once the consume beside it is done. Either way the adapter then asks the core again
        and finds the write landed or the page free, however long a busy machine took. Only a
        wait nothing will end (a stalled save, a page claim with every page held) runs on the
        real clock to its timeout.
        """
        wait = self.manager._state.wait_for_signal

        def event_wait(seen: int, deadline_ns: int) -> None:
            tids = getattr(self._awaited, "tids", None)
            self._awaited.tids = None
            if tids and self._gate is not None and self._gate.wait_done(tids, _SETTLE_S):
                return
            relief = self._relief
            if (
                relief is not None
                and threading.current_thread() is relief.engine
                and relief.asked.is_set()
                and not relief.done.is_set()
            ):
                relief.done.wait(_SETTLE_S)
                return
            wait(seen, deadline_ns)

        self.manager._state.wait_for_signal = event_wait  # type: ignore[method-assign]

    def _let_through(self, tids: Iterable[Tid]) -> None:
        if self._gate is not None:
            tids = tuple(tids)
            self._gate.release(tids)
            self._awaited.tids = tids

    # -----------------------------------------------------------------------------------------
    # Queries.

    @property
    def open_step_ids(self) -> tuple[StepId, ...]:
        """Step ids saved and not consumed, as the core reports them."""
        with self.manager._state.lock:
            return self.manager._state.core.open_step_ids

    def snapshot(self) -> Any:
        """The core's canonical state."""
        with self.manager._state.lock:
            return self.manager._state.core.snapshot()

    def sync(self) -> None:
        """Let the committer settle, then feed its reports to the core (D8)."""
        self._settle()
        with self.manager._state.lock:
            self.manager._state.drain(raise_fatal=False)

    def in_flight(self) -> tuple[Tid, ...]:
        """Writes the committer holds and has not finished: parked or queued (threaded only)."""
        if self._gate is None:
            return ()
        through = self._gate.through
        return tuple(
            sorted(
                tid
                for tid, job in list(self.manager._state.jobs.items())
                if job.stage in (JobStage.QUEUED, JobStage.RUNNING) and tid not in through
            )
        )

    def check_invariants(self) -> None:
        """Check the core's invariants and that no committed pool row is torn."""
        with self.manager._state.lock:
            self.manager._state.core.check_invariants()
        self.committed_rows()

    def committed_rows(self) -> dict[TensorName, dict[int, int]]:
        """The pool's row of every COMMITTED (slot, key), as write identities.

        Raises:
            DriverError: A committed row is torn (its elements differ).
        """
        out: dict[TensorName, dict[int, int]] = {}
        with self.manager._state.lock:
            core = self.manager._state.core
            for key in core.installed_keys:
                pool = self.manager._state.pool.tensors.get(key)
                owners = core.slot_owners(key)
                assert owners is not None  # an installed key has its table
                committed = np.flatnonzero(owners == 0)
                if pool is None or not len(committed):
                    continue
                rows = pool[torch.from_numpy(committed)]
                if not torch.equal(rows, rows[:, :1].expand_as(rows)):
                    raise DriverError(f"torn committed pool rows of {key}: {rows.tolist()}")
                out[key] = dict(zip(committed.tolist(), map(int, rows[:, 0].tolist()), strict=True))
        return out

    # -----------------------------------------------------------------------------------------
    # Engine calls.

    def register_policy(self, policy: ModelCachePolicy) -> None:
        """Set the policy (only before the first step)."""
        self.manager.register_policy(policy)

    def start(self, events: Sequence[PrefixCacheRequestEvent]) -> None:
        """One `new_step_starts` with these lifecycle records."""
        try:
            self.manager.new_step_starts(PrefixCacheStep(events=tuple(events)))
        finally:
            self._settle()

    def save(
        self,
        spec: SaveSpec,
        *,
        stall: bool = False,
        on_page_wait: Callable[[], None] | None = None,
    ) -> StepId:
        """One `save_outputs` of the spec's rows; see the module docstring for waits."""
        self.saves += 1
        self._reports_seen = 0
        self._escalated = False
        self._stalled = stall
        hidden, mm, n, padded, layout = self._tensors(spec)
        try:

            def call() -> StepId:
                return self.manager.save_outputs(
                    hidden,
                    mm,
                    num_tokens_unpadded=n,
                    num_tokens_padded=padded,
                    write_layout=layout,
                )

            if on_page_wait is None:
                return call()
            return self._save_beside(call, on_page_wait)
        finally:
            self._stalled = False
            self._scribble()
            self._settle()
            # Committer progress fed in, or writes escalated by a budget flush: a failed save
            # then leaves a trace that is not its own (STEP-5 still holds for the save itself).
            self.save_touched = self._reports_seen > 0 or self._escalated

    def _save_beside(self, call: Callable[[], StepId], on_page_wait: Callable[[], None]) -> StepId:
        """Run the save on an engine thread; run ``on_page_wait`` here if it waits for a page."""
        result: list[Any] = []
        finished = threading.Event()

        def engine() -> None:
            try:
                result.append(call())
            except BaseException as exc:  # handed to the caller's thread below
                result.append(exc)
            finally:
                finished.set()
                relief.asked.set()

        thread = threading.Thread(target=engine, name="tensor-driver-engine", daemon=True)
        relief = _Relief(thread)
        self._relief = relief
        try:
            thread.start()
            relief.asked.wait()
            if not finished.is_set():
                try:
                    on_page_wait()  # CONC-3: a consume on another thread frees the page
                finally:
                    relief.done.set()
            if not finished.wait(_SETTLE_S + self.config.staging_claim_timeout_s):
                raise DriverError("a save that waited for a page never returned")
        finally:
            self._relief = None
        if isinstance(result[0], BaseException):
            raise result[0]
        return StepId(result[0])

    def materialize(self, step_id: StepId, req_ids: Sequence[ReqId]) -> Delivered:
        """`materialize` the step; decode every returned row and take its positions (DLV-7)."""
        try:
            out = self.manager.materialize(step_id, tuple(req_ids))
        finally:
            self._settle()
        positions = {ReqId(req): (int(s), int(e)) for req, (s, e) in out.positions.items()}
        return Delivered(self._rows(out), positions)

    def discard(self, step_id: StepId) -> None:
        """`discard_step` the step."""
        try:
            self.manager.discard_step(step_id)
        finally:
            self._settle()

    def shutdown(self) -> None:
        """Shut the manager down (FAIL-4); writes still parked go through first."""
        if self._gate is not None:
            self._gate.open()
        self.manager.shutdown()
        self._settle()

    def close(self) -> None:
        """Stop the manager's threads for good, whatever state the run left it in."""
        self.shutdown()

    def advance_clock(self, ns: int) -> None:
        """Count time only: the adapter reads the real clock."""
        self.now_ns += ns

    # -----------------------------------------------------------------------------------------
    # The committer, under the test's control (threaded only).

    def land(self, tid: Tid) -> None:
        """Run the committer until ``tid``'s rows are in the pool (and every write before it)."""
        self._through(tid, doom=False)

    def fail(self, tid: Tid, at: str | None = None) -> None:
        """Run the committer until ``tid`` fails (FAIL-1): at the fault point ``at`` if the
        write has yet to reach it (a piece of its deferred copy, its host-ready wait: D19), else
        at its pool write."""
        job = self.manager._state.jobs.get(tid)
        gate = self._gate
        order = list(_Gate.ORDER if job is not None and job.deferred else _Gate.ORDER[1:])
        if gate is not None and gate.parked is not None and gate.parked.tid == tid:
            allowed = order[order.index(gate.parked_at) :]  # where it stopped, or later
        elif job is not None and job.stage is JobStage.QUEUED:
            allowed = order
        else:
            allowed = ["pool_write"]
        self._through(tid, doom=True, at=at if at in allowed else "pool_write")

    @property
    def failed_at(self) -> collections.Counter[str]:
        """Where `fail` made writes fail, by fault point."""
        return self._gate.failed_at if self._gate is not None else collections.Counter()

    def early_failures(self) -> tuple[Tid, ...]:
        """In-flight writes that can fail before their pool write (D19): those the committer has
        not started, and the one parked at its host-ready wait or a piece of its deferred copy."""
        gate = self._gate
        parked = gate.parked if gate is not None and gate.parked_at != "pool_write" else None
        return tuple(
            tid
            for tid in self.in_flight()
            if (job := self.manager._state.jobs.get(tid)) is not None
            and (job.stage is JobStage.QUEUED or job is parked)
        )

    def _through(self, tid: Tid, *, doom: bool, at: str = "pool_write") -> None:
        gate = self._gate
        if gate is None or tid not in self.in_flight():
            raise DriverError(f"write {tid} is not in flight")
        gate.release((tid,), doom=doom, at=at)
        if not gate.wait_through(tid, _SETTLE_S):
            raise DriverError(f"write {tid} never reached the pool write")
        gate.hold()
        self._settle()

    def _settle(self) -> None:
        """Wait until the committer is parked in the hook or has nothing left to run."""
        gate = self._gate
        if gate is None:
            return
        gate.hold()  # writes the call awaited are through; the rest wait for land()
        committer = self.manager._state.committer
        deadline = time.monotonic() + _SETTLE_S
        while True:
            with committer._cv:
                queued = bool(committer._queue)
                parked = gate.parked
                jobs = [*self.manager._state.jobs.values(), *gate.finishing]
                running = [j for j in jobs if j.stage is JobStage.RUNNING and j is not parked]
                if not running and (parked is not None or not queued):
                    gate.finishing = [j for j in gate.finishing if j.stage is not JobStage.DONE]
                    return
            if time.monotonic() > deadline:
                raise DriverError(f"the committer did not settle: running {running}")
            time.sleep(0.0002)

    # -----------------------------------------------------------------------------------------
    # Tensors in, integers out.

    def _buffer(self, key: str, rows: int) -> torch.Tensor:
        features, dtype = _shape_of(key)
        buf = self._buffers.get(key)
        if buf is None or len(buf) < rows:
            buf = torch.zeros((max(rows, 16), *features), dtype=dtype, device=self.device)
            self._buffers[key] = buf
        return buf[:rows]

    def _rows_of(self, key: str, values: Sequence[int], rows: int) -> torch.Tensor:
        """A view of the key's static buffer: ``values`` then padding rows."""
        view = self._buffer(key, rows)
        filled = list(values) + [PAD_VALUE] * (rows - len(values))
        column = torch.tensor(filled, dtype=torch.float64).to(view.dtype)
        view.copy_(column.reshape(rows, *([1] * (view.ndim - 1))).expand_as(view))
        return view

    def _tensors(
        self, spec: SaveSpec
    ) -> tuple[Any, dict[str, Any], int, int, PrefixCacheWriteLayout]:
        """The save's arguments as an engine passes them, from the machine's spec."""
        n = spec.num_tokens
        values = spec.value_map()
        # OUT-2: a padded step now and then; mm keys sometimes keep only the unpadded rows.
        padded = n + (self.saves % 3 if n else 0)
        mm_rows = padded if self.saves % 2 else n
        policy = self.manager.policy
        takes_hidden = policy.needs_full_hidden_states and n > 0
        hidden: Any
        if HIDDEN_KEY in values and not takes_hidden:
            # The core refuses hidden rows for a policy without them; the adapter ignores any
            # hidden tensor there (OUT-7), so the nearest bad input it refuses is a wrong type.
            hidden = list(values[HIDDEN_KEY])
        elif HIDDEN_KEY in values:
            hidden = self._rows_of(HIDDEN_KEY, values[HIDDEN_KEY], padded)
        elif takes_hidden:
            hidden = None  # OUT-3: hidden states missing
        else:
            hidden = self._rows_of(HIDDEN_KEY, [], padded).fill_(_JUNK)
        mm: dict[str, Any] = {}
        for key, vals in values.items():
            if key == HIDDEN_KEY:
                continue
            if not n:
                raise DriverError(f"a spec with no rows emits {key}: no engine does that")
            mm[key] = self._rows_of(key, vals, mm_rows)
        if len(self._slot_buffer) < n:
            self._slot_buffer = torch.zeros(max(n, 16), dtype=torch.int64)
        slots = self._slot_buffer[:n]
        slots.copy_(torch.tensor(spec.flat_slots, dtype=torch.int64))
        writes = []
        row = 0
        for req_id, run in zip(spec.req_ids, spec.slots, strict=True):
            writes.append(PrefixCacheWrite(req_id, row, row + len(run)))
            row += len(run)
        return hidden, mm, n, padded, PrefixCacheWriteLayout(writes, slots)

    def _scribble(self) -> None:
        """Overwrite the live buffers after a save, as the next forward would (STEP-3)."""
        for buf in self._buffers.values():
            buf.fill_(_SCRIBBLE)
        # Slot ids stay in range, so a write that read the live ids would land somewhere wrong.
        self._slot_buffer.copy_(torch.arange(len(self._slot_buffer)) % self.config.num_slots)

    def _rows(self, out: StageCacheOutputs) -> Rows:
        rows: Rows = {}
        if out.hidden_states is not None:
            rows[HIDDEN_KEY] = {
                ReqId(req): _decode(HIDDEN_KEY, t) for req, t in out.hidden_states.items()
            }
        for name, per in out.mm_outputs.items():
            rows[TensorName(name)] = {ReqId(req): _decode(name, t) for req, t in per.items()}
        return rows
