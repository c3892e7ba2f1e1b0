"""Soak: a long run of a busy engine against the cache, every delivered row checked.

``python -m omni_cache_cuda.soak --minutes M --seed S`` (or ``--steps N``) runs two phases.

The clean phase keeps one manager for its whole length. An engine thread (this one) plays a
vLLM-style scheduler with prefix caching over a small paged KV cache: requests over a few shared
prompt families, hits on the longest registered prefix (also on blocks computed in the same
step), chunked prefill, decode, finishes, aborts, preemptions (the request's blocks go back to
the free list) and resumes (a hit on whatever of its blocks is still registered), request ids
used again, blocks recycled least or most recently freed first. Staging pages and the GPU-byte
budget are small, so saves wait for pages and deferred writes are flushed early. An output
builder thread consumes every step one to a few steps late, sometimes out of order (a step that
would skip positions an earlier one carries raises `DeliveryOrderError` and is retried after it),
discards some and leaves requests out of others.

The fault phase runs short episodes, each with a fresh manager and one fault injected at one of
the adapter's fault points (`omni_cache_cuda._faults`). Each must end in its typed error (D19):
a sticky `WriteFailedError` for the committer's points (every later call raises it too, then the
manager is shut down and rebuilt), a `StagingCopyError` or `HostAllocationError` from the save or
`reserve` that hit it (the engine aborts that step's requests, as after a failed forward), or a
`HitUnreadableError` from the materialize whose gather failed. Every episode ends with no page,
budget charge or thread of the library left.

The oracle: every row is a pure function of the token prefix it ends (a hash of the tokens up to
and including its position), so a hit on another request's blocks, a resume and a recompute must
all give the same value. Per admission (LIFE-1) the soak keeps which positions were delivered
(`StageCacheOutputs.positions`) and which were carried by steps that delivered nothing to it
(discarded, left out, failed): every position must be delivered at most once, with the right rows
for every cached key, in position order, and by the time the admission's last step is consumed
every computed position must be delivered or excused that way (DLV-2, DLV-4, DLV-6).

It prints rows checked, wrong rows, faults by kind, hangs, step time percentiles, and resident
and pinned bytes and thread counts over time, and exits 1 on a wrong row, an unexpected error, a
fault that did not end in its error, or memory or threads that grow past the stated bound after
warm-up; 2 on a hang (a call that did not return within the hang bound; the stacks are printed).
"""

from __future__ import annotations

import argparse
import array
import collections
import contextlib
import faulthandler
import logging
import os
import queue
import random
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from omni_cache_core import (
    HIDDEN_KEY,
    DeliveryOrderError,
    HostAllocationError,
    ModelCachePolicy,
    PrefixCacheConfig,
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
    PrefixCacheStep,
    StagingCopyError,
    WriteFailedError,
)
from omni_cache_cuda._faults import FAULT_ERRORS, OneShot
from omni_cache_cuda._layout import PrefixCacheWriteLayout
from omni_cache_cuda._manager import OmniPrefixCacheManager
from omni_cache_cuda._probes import library_threads, os_threads, resident_bytes
from omni_cache_cuda._storage import registered_pinned_bytes

__all__ = ["main"]

MM = "talker.h"
DEF = "codes.audio"
HIDDEN_WIDTH = 32
MM_WIDTH = 8
#: Key -> (row shape, dtype) of the soak's model.
SHAPES: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    HIDDEN_KEY: ((HIDDEN_WIDTH,), torch.float32),
    MM: ((MM_WIDTH,), torch.float32),
    DEF: ((2,), torch.int64),
}
_MOD = (1 << 61) - 1

_STICKY = {kind for kind, error in FAULT_ERRORS.items() if error is WriteFailedError}

#: Resident memory may grow this much after warm-up (allocator and interpreter noise).
RSS_BOUND_BYTES = 64 * 2**20
#: A call that has not returned after this many seconds is a hang.
HANG_S = 120.0
#: The wait bound of the soak's managers.
TIMEOUT_S = 20.0


def _rows(key: str, hashes: np.ndarray) -> torch.Tensor:
    """The rows of ``key`` at positions whose prefix hashes are ``hashes`` (exact in float32)."""
    h = torch.from_numpy(hashes)
    if key == HIDDEN_KEY:
        base = (h & 0x3FFFFF).to(torch.float32)
        return base[:, None] + torch.arange(HIDDEN_WIDTH, dtype=torch.float32)[None, :]
    if key == MM:
        base = ((h >> 22) & 0x3FFFFF).to(torch.float32)
        return base[:, None] + 3 * torch.arange(MM_WIDTH, dtype=torch.float32)[None, :]
    return torch.stack((h, h ^ 0x2545F491), dim=1)


def _prefix_hashes(tokens: list[int]) -> np.ndarray:
    out = np.empty(len(tokens), dtype=np.int64)
    h = 0
    for i, token in enumerate(tokens):
        h = (h * 1_000_003 + token + 1) % _MOD
        out[i] = h
    return out


class Admission:
    """One admission of a request (LIFE-1): its tokens' prefix hashes and what it received."""

    __slots__ = (
        "delivered",
        "ended",
        "excused",
        "hashes",
        "max_hi",
        "outstanding",
        "prompt_len",
        "req_id",
        "total",
    )

    def __init__(self, req_id: str, tokens: list[int], prompt_len: int) -> None:
        self.req_id = req_id
        self.hashes = _prefix_hashes(tokens)
        self.total = len(tokens)
        self.prompt_len = prompt_len
        self.delivered = np.zeros(self.total, dtype=np.bool_)
        self.excused = np.zeros(self.total, dtype=np.bool_)
        self.outstanding = 0  # saved steps that carry it and are not consumed yet
        self.ended = False
        self.max_hi = 0


class Saved:
    """A saved step as the builder sees it."""

    __slots__ = ("adms", "carried", "n", "order", "plain", "step_id")

    def __init__(
        self,
        step_id: int,
        order: list[str],
        adms: dict[str, Admission],
        carried: dict[str, tuple[int, int]],
        n: int,
    ) -> None:
        self.step_id = step_id
        self.order = order
        self.adms = adms
        self.carried = carried
        self.n = n
        #: Consume it whole (no discard, no subset): fault episodes that must see their error.
        self.plain = False


class Report:
    """What a run saw; shared by the threads under `lock`."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rows_checked: collections.Counter[str] = collections.Counter()
        self.positions_delivered = 0
        self.positions_excused = 0
        self.wrong: list[str] = []
        self.unexpected: list[str] = []
        self.counts: collections.Counter[str] = collections.Counter()
        self.faults: dict[str, collections.Counter[str]] = {
            kind: collections.Counter() for kind in FAULT_ERRORS
        }
        self.step_ms = array.array("d")
        self.hangs = 0

    def wrong_row(self, text: str) -> None:
        with self.lock:
            self.wrong.append(text)

    def error(self, text: str) -> None:
        with self.lock:
            self.unexpected.append(text)

    def count(self, what: str, by: int = 1) -> None:
        with self.lock:
            self.counts[what] += by


class Watch:
    """Calls in progress per thread, for the hang watchdog."""

    def __init__(self) -> None:
        self.calls: dict[str, tuple[str, float]] = {}

    @contextlib.contextmanager
    def __call__(self, what: str) -> Iterator[None]:
        name = threading.current_thread().name
        self.calls[name] = (what, time.monotonic())
        try:
            yield
        finally:
            self.calls.pop(name, None)

    def longest(self) -> tuple[str, str, float] | None:
        now = time.monotonic()
        worst = None
        for name, (what, since) in list(self.calls.items()):
            if worst is None or now - since > worst[2]:
                worst = (name, what, now - since)
        return worst


class Builder(threading.Thread):
    """The output builder: consumes saved steps late, sometimes out of order, and checks them."""

    def __init__(
        self,
        manager: OmniPrefixCacheManager,
        report: Report,
        watch: Watch,
        rng: random.Random,
        *,
        discard_p: float,
        subset_p: float,
        shuffle_p: float,
        oracle_lock: threading.Lock,
    ) -> None:
        super().__init__(name="soak-builder", daemon=True)
        self.m = manager
        self.report = report
        self.watch = watch
        self.rng = rng
        self.discard_p = discard_p
        self.subset_p = subset_p
        self.shuffle_p = shuffle_p
        self.oracle_lock = oracle_lock
        self.inbox: queue.Queue[list[Saved] | None] = queue.Queue()
        #: Steps handed over and not consumed yet.
        self.pending = 0
        self._pending_lock = threading.Lock()
        #: Set by the fault phase: which error a failed materialize may end in.
        self.expect: type[BaseException] | None = None
        self.seen: list[BaseException] = []
        self.sticky = False

    def hand(self, items: list[Saved]) -> None:
        if items:
            with self._pending_lock:
                self.pending += len(items)
            self.inbox.put(items)

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until every step handed over is consumed; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self.pending:
            if time.monotonic() > deadline or not self.is_alive():
                return False
            time.sleep(0.005)
        return True

    def stop(self) -> None:
        """Consume what is held, then end the thread."""
        self.inbox.put(None)
        self.join(HANG_S)

    def run(self) -> None:
        held: list[Saved] = []
        stopping = False
        while not stopping:
            items = self.inbox.get()
            while True:
                if items is None:
                    stopping = True
                    break
                held.extend(items)
                try:  # take every step handed over so far: they may go out of order
                    items = self.inbox.get_nowait()
                except queue.Empty:
                    break
            while held:
                pick = 0
                if len(held) > 1 and self.rng.random() < self.shuffle_p:
                    pick = self.rng.randrange(1, len(held))
                item = held.pop(pick)
                try:
                    self._consume(item)
                except DeliveryOrderError as exc:
                    # DLV-5: the earlier step comes first; hand-off is in save order, so it is
                    # one of the steps held here.
                    self.report.count("delivery order refusals")
                    at = [i for i, s in enumerate(held) if s.step_id == exc.earlier_step_id]
                    if not at:
                        self.report.error(f"{exc!r} names a step the builder does not hold")
                        self._settle(item)
                        with self._pending_lock:
                            self.pending -= 1
                        continue
                    held.insert(0, item)
                    held.insert(0, held.pop(at[0] + 1))
                    continue
                except BaseException as exc:  # a bug of the soak itself: report, go on
                    self.report.error(f"builder, step {item.step_id}: {exc!r}")
                with self._pending_lock:
                    self.pending -= 1

    def _consume(self, item: Saved) -> None:
        rng = self.rng
        plain = item.plain or self.sticky
        if not plain and rng.random() < self.discard_p:
            try:
                with self.watch("discard_step"):
                    self.m.discard_step(item.step_id)
            except BaseException as exc:
                self._failed(item, exc)
                return
            self.report.count("steps discarded")
            self._settle(item, excuse=item.order)
            return
        reqs = list(item.order)
        if not plain and reqs and rng.random() < self.subset_p:
            reqs = rng.sample(reqs, rng.randint(0, len(reqs)))
        try:
            with self.watch("materialize"):
                out = self.m.materialize(item.step_id, reqs)
        except DeliveryOrderError:
            raise
        except BaseException as exc:
            self._failed(item, exc)
            return
        self.report.count("steps materialized")
        asked = set(reqs)
        left_out = [r for r in item.order if r not in asked]
        self._check(item, reqs, out)
        self._settle(item, excuse=left_out)

    def _failed(self, item: Saved, exc: BaseException) -> None:
        if isinstance(exc, WriteFailedError) and self.expect is WriteFailedError:
            self.sticky = True
            self.seen.append(exc)
        elif self.expect is not None and isinstance(exc, self.expect) and "injected" in str(exc):
            self.seen.append(exc)
        else:
            self.report.error(f"consume of step {item.step_id}: {exc!r}")
        self._settle(item, excuse=item.order)

    def _settle(self, item: Saved, excuse: Any = ()) -> None:
        """The step is consumed: excuse what it carried for ``excuse``; finish admissions."""
        with self.oracle_lock:
            for req in excuse:
                lo, hi = item.carried[req]
                adm = item.adms[req]
                adm.excused[lo:hi] = True
            for req in item.order:
                adm = item.adms[req]
                adm.outstanding -= 1
                if adm.ended and adm.outstanding == 0:
                    self._finish(adm)

    def _finish(self, adm: Admission) -> None:
        """Every computed position of an ended admission was delivered or excused (DLV-2)."""
        if self.sticky:
            return  # a failed cache delivers nothing more; what it delivered was checked
        top = adm.max_hi
        missing = np.flatnonzero(~(adm.delivered[:top] | adm.excused[:top]))
        if len(missing):
            self.report.wrong_row(
                f"request {adm.req_id}: positions {missing[:8].tolist()} of [0, {top}) never "
                "delivered, though no step that carried them was discarded or left out"
            )
        with self.report.lock:
            self.report.positions_delivered += int(adm.delivered[:top].sum())
            self.report.positions_excused += int((adm.excused[:top] & ~adm.delivered[:top]).sum())
            self.report.counts["admissions checked"] += 1

    def _check(self, item: Saved, reqs: list[str], out: Any) -> None:
        positions = out.positions
        if set(positions) != set(reqs):
            self.report.wrong_row(f"step {item.step_id}: positions for {sorted(positions)}")
            return
        checked: collections.Counter[str] = collections.Counter()
        for req in reqs:
            adm = item.adms[req]
            start, end = positions[req]
            count = max(0, end - start)
            what = f"step {item.step_id} request {req}"
            if count and (start < 0 or end > adm.total):
                self.report.wrong_row(f"{what}: positions [{start}, {end}) out of range")
                continue
            with self.oracle_lock:
                if count and adm.delivered[start:end].any():
                    again = np.flatnonzero(adm.delivered[start:end])[:8] + start
                    self.report.wrong_row(f"{what}: positions {again.tolist()} delivered again")
                    continue
                below = np.flatnonzero(adm.delivered)
                if count and len(below) and below[-1] >= start:
                    self.report.wrong_row(f"{what}: [{start}, {end}) after position {below[-1]}")
                    continue
                cursor = int(below[-1]) + 1 if len(below) else 0
                gap = np.flatnonzero(~adm.excused[cursor:start]) + cursor
                if count and len(gap):
                    self.report.wrong_row(
                        f"{what}: positions {gap[:8].tolist()} passed over, though no step "
                        "that carried them was discarded or left out"
                    )
                    continue
                adm.delivered[start:end] = True
            expected = adm.hashes[start:end] if count else adm.hashes[:0]
            got = {HIDDEN_KEY: out.hidden_states, MM: out.mm_outputs.get(MM)}
            if item.n:
                got[DEF] = out.mm_outputs.get(DEF)
            for key, per_req in got.items():
                rows = None if per_req is None else per_req.get(req)
                if rows is None:
                    if count:
                        self.report.wrong_row(f"{what}: no {key} rows")
                    continue
                want = _rows(key, expected)
                if tuple(rows.shape) != tuple(want.shape) or not torch.equal(rows.cpu(), want):
                    self.report.wrong_row(
                        f"{what}: {key} rows of positions [{start}, {end}) differ "
                        f"(shape {tuple(rows.shape)}, expected {tuple(want.shape)})"
                    )
                    continue
                checked[key] += count
        with self.report.lock:
            self.report.rows_checked.update(checked)


class Req:
    """The engine's side of a live request."""

    __slots__ = ("adm", "blocks", "computed", "fresh", "reached")

    def __init__(self, adm: Admission, blocks: list[int], computed: int) -> None:
        self.adm = adm
        self.blocks = blocks
        self.computed = computed
        self.reached = computed  # the furthest position computed in this admission
        self.fresh = True  # started or resumed in the current step


class Engine:
    """A vLLM-style scheduler with prefix caching over a small paged KV cache (module doc)."""

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
        abort_p: float = 0.015,
        preempt_p: float = 0.03,
        resume_p: float = 0.35,
        reuse_p: float = 0.1,
        idle_p: float = 0.04,
        mru_p: float = 0.3,
        max_running: int = 6,
        max_chunk: int = 8,
    ) -> None:
        self.m = manager
        self.report = report
        self.watch = watch
        self.rng = rng
        self.bs = manager.config.block_size
        self.lag = lag
        self.abort_p = abort_p
        self.preempt_p = preempt_p
        self.resume_p = resume_p
        self.reuse_p = reuse_p
        self.idle_p = idle_p
        self.mru_p = mru_p
        self.max_running = max_running
        self.max_chunk = max_chunk
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
        num_blocks = manager.config.num_blocks
        self.free: collections.deque[int] = collections.deque(range(num_blocks))
        self.ref = [0] * num_blocks
        self.table: dict[int, int] = {}  # prefix hash at a block's last position -> block
        self.block_hash: dict[int, int] = {}
        self.families = [[rng.randrange(1, 1 << 30) for _ in range(6 * self.bs)] for _ in range(4)]
        self.running: dict[str, Req] = {}
        self.preempted: dict[str, Req] = {}
        self.events: list[PrefixCacheRequestEvent] = []
        self.late: collections.deque[tuple[int, Saved]] = collections.deque()
        self.steps = 0
        self.next_req = 0
        self.next_token = 1 << 31
        #: Set by the fault phase: hand steps to the builder whole (no discard, no subset).
        self.plain = False

    # Blocks -----------------------------------------------------------------------------------

    def _alloc(self) -> int:
        block = self.free.pop() if self.rng.random() < self.mru_p else self.free.popleft()
        old = self.block_hash.pop(block, None)
        if old is not None and self.table.get(old) == block:
            del self.table[old]
        self.ref[block] = 1
        self.report.count("blocks allocated")
        return block

    def _release(self, blocks: list[int]) -> None:
        for block in blocks:
            self.ref[block] -= 1
            if self.ref[block] == 0:
                self.free.append(block)

    def _hit(self, adm: Admission, known: int) -> list[int]:
        hit: list[int] = []
        for i in range((min(known, adm.total) - 1) // self.bs):
            block = self.table.get(int(adm.hashes[(i + 1) * self.bs - 1]))
            if block is None:
                break
            hit.append(block)
        return hit

    def _take_blocks(self, adm: Admission, hit: list[int]) -> list[int] | None:
        needed = -(-adm.total // self.bs) - len(hit)
        if needed > len(self.free) - sum(1 for b in hit if self.ref[b] == 0):
            return None
        for block in hit:
            if self.ref[block] == 0:
                self.free.remove(block)
            self.ref[block] += 1
        return hit + [self._alloc() for _ in range(needed)]

    # Lifecycle --------------------------------------------------------------------------------

    def _end(self, req_id: str, req: Req, kind: PrefixCacheEventKind) -> None:
        self.events.append(PrefixCacheRequestEvent(req_id=req_id, kind=kind))
        if req_id in self.running:
            self._release(req.blocks)  # a preempted request gave its blocks back already
        self.running.pop(req_id, None)
        self.preempted.pop(req_id, None)
        with self.oracle_lock:
            adm = req.adm
            adm.ended = True
            if adm.outstanding == 0:
                self.builder._finish(adm)
        self.report.count("finished" if kind is PrefixCacheEventKind.FINISHED else "aborted")

    def _admit(self, req_id: str, schedule: dict[str, int]) -> bool:
        rng = self.rng
        family = self.families[rng.randrange(len(self.families))]
        shared = rng.randrange(0, len(family) // self.bs + 1) * self.bs
        tail = rng.randint(1, 2 * self.bs + 1)
        decode = rng.randint(0, 16)
        tokens = family[:shared] + list(range(self.next_token, self.next_token + tail + decode))
        adm = Admission(req_id, tokens, shared + tail)
        hit = self._hit(adm, adm.prompt_len)
        blocks = self._take_blocks(adm, hit)
        if blocks is None:
            return False
        self.next_token += tail + decode
        hit_end = len(hit) * self.bs
        req = Req(adm, blocks, hit_end)
        self.running[req_id] = req
        count = self._count(req)
        schedule[req_id] = count
        self.events.append(
            PrefixCacheRequestEvent(
                req_id=req_id,
                kind=PrefixCacheEventKind.STARTED,
                hit_end=hit_end,
                block_ids=tuple(blocks),
                scheduled_tokens=count,
            )
        )
        self.report.count("admissions")
        if hit_end:
            self.report.count("admissions with a hit")
        return True

    def _resume(self, req_id: str, req: Req, schedule: dict[str, int]) -> bool:
        known = max(req.adm.prompt_len, req.reached + 1)
        hit = self._hit(req.adm, known)
        blocks = self._take_blocks(req.adm, hit)
        if blocks is None:
            return False
        del self.preempted[req_id]
        req.blocks = blocks
        req.computed = len(hit) * self.bs
        req.fresh = True
        self.running[req_id] = req
        count = self._count(req)
        schedule[req_id] = count
        self.events.append(
            PrefixCacheRequestEvent(
                req_id=req_id,
                kind=PrefixCacheEventKind.RESUMED,
                hit_end=req.computed,
                block_ids=tuple(blocks),
                scheduled_tokens=count,
            )
        )
        self.report.count("resumes")
        if req.computed:
            self.report.count("resumes with a hit")
        return True

    def _count(self, req: Req) -> int:
        """Tokens to schedule: a prefill (or recompute) chunk, one decode token, or none."""
        limit = max(req.adm.prompt_len, req.reached)
        if not req.fresh and self.rng.random() < self.idle_p:
            return 0
        if req.computed < limit:
            return min(self.rng.randint(1, self.max_chunk), limit - req.computed)
        return 1

    def _register(self, req: Req, count: int, registered: list[int]) -> None:
        """Publish the full blocks this step computes (vLLM caches them at schedule time)."""
        bs = self.bs
        for i in range(req.computed // bs, (req.computed + count) // bs):
            key = int(req.adm.hashes[(i + 1) * bs - 1])
            block = req.blocks[i]
            if key not in self.table and block not in self.block_hash:
                self.table[key] = block
                self.block_hash[block] = key
                registered.append(block)

    # One step ---------------------------------------------------------------------------------

    def step(self) -> BaseException | None:
        """Run one engine step; return the typed error a save raised (a fault), if any."""
        rng = self.rng
        self.steps += 1
        ended: list[str] = []
        for req_id, req in list(self.running.items()):
            req.fresh = False
            if req.computed >= req.adm.total:
                self._end(req_id, req, PrefixCacheEventKind.FINISHED)
                ended.append(req_id)
            elif rng.random() < self.abort_p:
                self._end(req_id, req, PrefixCacheEventKind.ABORTED)
                ended.append(req_id)
            elif rng.random() < self.preempt_p:
                self.events.append(
                    PrefixCacheRequestEvent(req_id=req_id, kind=PrefixCacheEventKind.PREEMPTED)
                )
                self._release(req.blocks)
                del self.running[req_id]
                self.preempted[req_id] = req
                self.report.count("preemptions")
        resume = []
        for req_id, req in list(self.preempted.items()):
            if any(e.req_id == req_id for e in self.events):
                continue  # preempted in this very step
            if rng.random() < self.abort_p:
                self._end(req_id, req, PrefixCacheEventKind.ABORTED)
                ended.append(req_id)
            elif rng.random() < self.resume_p:
                resume.append(req_id)
        registered: list[int] = []
        schedule: dict[str, int] = {}
        for req_id, req in self.running.items():
            schedule[req_id] = self._count(req)
            self._register(req, schedule[req_id], registered)
        for req_id in resume:
            req = self.preempted[req_id]
            if len(self.running) < self.max_running and self._resume(req_id, req, schedule):
                self._register(req, schedule[req_id], registered)
        while len(self.running) < self.max_running and rng.random() < 0.6:
            if ended and rng.random() < self.reuse_p:
                req_id = ended.pop()  # HIT-2: ended and admitted again in one step
                self.report.count("ids used again")
            else:
                req_id = f"r{self.next_req}"
                self.next_req += 1
            if req_id in self.running or req_id in self.preempted:
                continue
            if not self._admit(req_id, schedule):
                break
            self._register(self.running[req_id], schedule[req_id], registered)
        return self._save(schedule, registered)

    def _save(self, schedule: dict[str, int], registered: list[int]) -> BaseException | None:
        order = list(schedule)
        step = PrefixCacheStep(events=self.events, scheduled_tokens=dict(schedule))
        self.events = []
        began = time.perf_counter()
        with self.watch("new_step_starts"):
            self.m.new_step_starts(step)
        hit_now = {
            e.req_id for e in step.events if e.hit_end and e.req_id in schedule
        }  # STARTED or RESUMED with a hit, registered in this step
        layout = PrefixCacheWriteLayout.from_block_tables(
            order,
            schedule,
            {r: self.running[r].computed for r in order},
            {r: self.running[r].blocks for r in order},
            self.bs,
        )
        n = layout.num_rows
        hidden = None
        mm: dict[str, torch.Tensor] = {}
        if n:
            pieces = []
            for req_id in order:
                req = self.running[req_id]
                pieces.append(req.adm.hashes[req.computed : req.computed + schedule[req_id]])
            hashes = np.concatenate(pieces)
            hidden = _rows(HIDDEN_KEY, hashes)
            mm = {key: _rows(key, hashes) for key in (MM, DEF)}
        try:
            with self.watch("save_outputs"):
                step_id = self.m.save_outputs(
                    hidden, mm, num_tokens_unpadded=n, write_layout=layout
                )
        except (StagingCopyError, HostAllocationError) as exc:
            # As after a failed forward: publish none of the step's blocks, drop its requests.
            for block in registered:
                key = self.block_hash.pop(block)
                del self.table[key]
            for req_id in order:
                req = self.running[req_id]
                self._end(req_id, req, PrefixCacheEventKind.ABORTED)
            return exc
        with self.report.lock:
            self.report.step_ms.append((time.perf_counter() - began) * 1e3)
        carried: dict[str, tuple[int, int]] = {}
        adms: dict[str, Admission] = {}
        with self.oracle_lock:
            for req_id in order:
                req = self.running[req_id]
                lo = 0 if req_id in hit_now else req.computed
                req.computed += schedule[req_id]
                req.reached = max(req.reached, req.computed)
                adm = req.adm
                adm.max_hi = max(adm.max_hi, req.computed)
                adm.outstanding += 1
                carried[req_id] = (lo, req.computed)
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

    # Ending -----------------------------------------------------------------------------------

    def drain(self) -> None:
        """End every request, hand every step over and wait until the builder consumed them."""
        for req_id, req in list(self.running.items()) + list(self.preempted.items()):
            self._end(req_id, req, PrefixCacheEventKind.FINISHED)
        if self.events:
            self._save({}, [])
        self.builder.hand([saved for _, saved in self.late])
        self.late.clear()
        if not self.builder.wait_idle(HANG_S):
            self.report.error("the builder did not finish the last steps")
        self.builder.stop()


# ---------------------------------------------------------------------------------------------
# Resources.


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


def _manager(args: argparse.Namespace) -> OmniPrefixCacheManager:
    return OmniPrefixCacheManager(
        _config(), policy=_policy(), device=args.device, threaded=not args.inline
    )


def clean_phase(
    args: argparse.Namespace,
    report: Report,
    watch: Watch,
    rng: random.Random,
    until: Callable[[int], bool],
) -> dict[str, Any]:
    """One manager for the whole phase, its keys reserved up front, no faults."""
    manager = _manager(args)
    manager.reserve(SHAPES)
    engine = Engine(manager, report, watch, rng)
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
    args: argparse.Namespace, report: Report, watch: Watch, rng: random.Random, kind: str
) -> int:
    """One fresh manager, one fault of ``kind``; returns the steps run."""
    tally = report.faults[kind]
    tally["episodes"] += 1
    expected = FAULT_ERRORS[kind]
    manager = _manager(args)
    hook = OneShot(0 if kind == "pin" else rng.randint(0, 1))
    pinning = kind == "pin" and not manager._cuda
    seen: list[BaseException] = []

    def arm() -> None:
        if pinning:
            # A CPU build cannot pin: the hook refuses before any pinning is tried.
            manager._pool.pin = manager._pages.pin = True
        manager._inject_fault(kind, hook)
        tally["armed"] += 1

    def disarm() -> None:
        manager._inject_fault(kind, None)
        if pinning:
            manager._pool.pin = manager._pages.pin = False

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
        with manager._lock:
            manager._core.check_invariants()
        if rng.random() < 0.5:
            manager.reserve(SHAPES)
    engine = Engine(manager, report, watch, rng, lag=1)
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
        with manager._lock:
            manager._core.check_invariants()
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
    manager: OmniPrefixCacheManager, engine: Engine, report: Report, kind: str
) -> None:
    """FAIL-1: once a write failed, every public call raises WriteFailedError."""
    layout = PrefixCacheWriteLayout([], torch.zeros(0, dtype=torch.int64))
    calls: dict[str, Callable[[], Any]] = {
        "new_step_starts": lambda: manager.new_step_starts(PrefixCacheStep()),
        "save_outputs": lambda: manager.save_outputs(
            None, {}, num_tokens_unpadded=0, write_layout=layout
        ),
        "materialize": lambda: manager.materialize(1, []),
        "discard_step": lambda: manager.discard_step(1),
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


# ---------------------------------------------------------------------------------------------
# Main.


def _percentile(values: array.array[float], q: float) -> float:
    if not values:
        return 0.0
    return float(np.percentile(np.frombuffer(values, dtype=np.float64), q))


def main(argv: list[str] | None = None) -> int:
    """Run the soak; return the exit status (0 pass, 1 failure, 2 hang)."""
    parser = argparse.ArgumentParser(
        prog="python -m omni_cache_cuda.soak", description=__doc__.split("\n\n")[0]
    )
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--minutes", type=float, help="run this long (default 1)")
    length.add_argument("--steps", type=int, help="run this many engine steps instead")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="where step tensors live (cpu or cuda)")
    parser.add_argument("--inline", action="store_true", help="inline writes, no committer")
    parser.add_argument(
        "--fault-share", type=float, default=0.3, help="share of the run for the fault phase"
    )
    parser.add_argument("--samples", type=int, default=12, help="memory rows to print")
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="show the library's log lines (the fault phase's failed writes log an error each)",
    )
    args = parser.parse_args(argv)
    if not args.verbose:
        logging.getLogger("omni_cache").setLevel(logging.CRITICAL)
    minutes = args.minutes if args.minutes is not None else (None if args.steps else 1.0)
    rng = random.Random(args.seed)
    report = Report()
    watch = Watch()
    torch.manual_seed(args.seed)
    began = time.monotonic()
    total_s = None if minutes is None else minutes * 60.0
    clean_s = None if total_s is None else total_s * (1 - args.fault_share)
    clean_steps = None if args.steps is None else int(args.steps * (1 - args.fault_share))
    # Warm-up: the first tenth of the clean phase, at least a few hundred steps.
    warm: dict[str, Any] = {}
    samples: list[tuple[float, str, int, int, int, int, int]] = []
    phase = ["clean"]
    counter = {"steps": 0}
    stop = threading.Event()

    def sample() -> None:
        stats_pinned = registered_pinned_bytes()
        samples.append(
            (
                time.monotonic() - began,
                phase[0],
                counter["steps"],
                resident_bytes(),
                stats_pinned,
                threading.active_count(),
                os_threads(),
            )
        )

    def progress() -> None:
        with report.lock:
            rows = sum(report.rows_checked.values())
            wrong, errors = len(report.wrong), len(report.unexpected)
        print(
            f"  {time.monotonic() - began:7.0f}s {phase[0]:<7} steps {counter['steps']:>8} "
            f"rows checked {rows:>10} wrong {wrong} errors {errors} "
            f"resident {resident_bytes() / 2**20:.1f} MiB threads {threading.active_count()}",
            flush=True,
        )

    def watchdog() -> None:
        period = max(1.0, (total_s or 60.0) / 120)
        next_sample = time.monotonic()
        next_line = time.monotonic() + 60.0
        while not stop.wait(0.5):
            if time.monotonic() >= next_line:
                progress()
                next_line += 60.0
            worst = watch.longest()
            if worst is not None and worst[2] > HANG_S:
                report.hangs += 1
                print(
                    f"HANG: thread {worst[0]} in {worst[1]} for {worst[2]:.0f}s; stacks follow",
                    flush=True,
                )
                faulthandler.dump_traceback(all_threads=True)
                _print_report(report, samples, warm, began, args)
                os._exit(2)
            if time.monotonic() >= next_sample:
                sample()
                next_sample += period

    dog = threading.Thread(target=watchdog, name="soak-watchdog", daemon=True)
    sample()
    dog.start()

    def clean_until(steps: int) -> bool:
        counter["steps"] = steps
        if clean_steps is not None:
            warmed = steps >= min(max(300, clean_steps // 10), clean_steps // 2)
        else:
            assert clean_s is not None
            warmed = steps >= 300 and time.monotonic() - began >= clean_s / 10
            warmed = warmed or time.monotonic() - began >= clean_s / 2
        if not warm and warmed:
            sample()
            warm.update(index=len(samples) - 1, rss=samples[-1][3], steps=steps)
        if clean_steps is not None:
            return steps >= clean_steps
        assert clean_s is not None
        return time.monotonic() - began >= clean_s

    clean = clean_phase(args, report, watch, rng, clean_until)
    if not warm:
        sample()
        warm.update(index=len(samples) - 1, rss=samples[-1][3], steps=clean["steps"])
    phase[0] = "faults"
    fault_steps = 0
    kinds = list(FAULT_ERRORS)
    order: list[str] = []
    episodes = 0
    while True:
        if args.steps is not None:
            if fault_steps >= args.steps - clean["steps"] and episodes >= len(kinds):
                break
        elif time.monotonic() - began >= (total_s or 0) and episodes >= len(kinds):
            break
        if not order:
            order = kinds[:]
            rng.shuffle(order)
        fault_steps += fault_episode(args, report, watch, rng, order.pop())
        episodes += 1
        counter["steps"] = clean["steps"] + fault_steps
    sample()
    stop.set()
    dog.join(5)
    report.counts["clean steps"] = clean["steps"]
    report.counts["fault steps"] = fault_steps
    report.counts["fault episodes"] = episodes
    return _print_report(report, samples, warm, began, args, clean["stats"])


def _print_report(
    report: Report,
    samples: list[tuple[float, str, int, int, int, int, int]],
    warm: dict[str, Any],
    began: float,
    args: argparse.Namespace,
    stats: Any = None,
) -> int:
    mib = 2**20
    counts = report.counts
    elapsed = time.monotonic() - began
    print(
        f"omni-cache soak: seed {args.seed}, {elapsed / 60:.1f} min, device {args.device}, "
        f"{'inline writes' if args.inline else 'committer thread'}, {os.cpu_count()} CPUs"
    )
    print(
        f"steps: {counts['clean steps']} clean, {counts['fault steps']} in "
        f"{counts['fault episodes']} fault episodes"
    )
    lifecycle = ", ".join(
        f"{counts[k]} {k}"
        for k in (
            "admissions",
            "admissions with a hit",
            "finished",
            "aborted",
            "preemptions",
            "resumes",
            "resumes with a hit",
            "ids used again",
            "blocks allocated",
        )
    )
    print(f"requests: {lifecycle}")
    print(
        f"consumes: {counts['steps materialized']} materialized, {counts['steps discarded']} "
        f"discarded, {counts['delivery order refusals']} refused for order and retried (DLV-5)"
    )
    if stats is not None:
        hits = ", ".join(f"{k} {v}" for k, v in stats.hit_rows.items() if v)
        print(
            f"clean phase cache: page waits {stats.page_waits}, budget flushes "
            f"{stats.budget_flushes}, timeouts {stats.timeouts}, hit rows by source: {hits}"
        )
    rows = sum(report.rows_checked.values())
    by_key = ", ".join(f"{k} {v}" for k, v in sorted(report.rows_checked.items()))
    print(
        f"rows checked: {rows} ({by_key}); positions delivered exactly once: "
        f"{report.positions_delivered}, passed over after a discard or a left-out request: "
        f"{report.positions_excused}; admissions checked whole: {counts['admissions checked']}"
    )
    print(f"wrong rows: {len(report.wrong)}")
    for text in report.wrong[:10]:
        print(f"  WRONG {text}")
    print(f"unexpected errors: {len(report.unexpected)}")
    for text in report.unexpected[:10]:
        print(f"  ERROR {text}")
    print("faults injected, by kind: episodes / fired / ended in their typed error / rebuilds")
    for kind, tally in report.faults.items():
        print(
            f"  {kind:<15} {FAULT_ERRORS[kind].__name__:<20} {tally['episodes']:>5} "
            f"{tally['fired']:>6} {tally['raised']:>6} {tally['rebuilds']:>6}"
        )
    print(f"hangs: {report.hangs} (a call running over {HANG_S:.0f}s)")
    print(
        f"step time (new_step_starts + save_outputs, clean and fault steps): "
        f"p50 {_percentile(report.step_ms, 50):.2f} ms, p99 {_percentile(report.step_ms, 99):.2f} ms"
    )
    print(
        "memory and threads over time: seconds, phase, steps, resident MiB, pinned MiB, "
        "Python threads, OS threads"
    )
    shown = samples
    if len(samples) > args.samples:
        picks = np.linspace(0, len(samples) - 1, args.samples).round().astype(int)
        shown = [samples[i] for i in sorted(set(picks.tolist()) | {warm.get("index", 0)})]
    warm_sample = samples[warm["index"]] if warm else None
    for row in shown:
        t, ph, steps, rss, pinned, py, ost = row
        mark = "  <- warm-up ends" if row is warm_sample else ""
        print(
            f"  {t:8.1f} {ph:<7} {steps:>8} {rss / mib:9.1f} {pinned / mib:8.1f} {py:4d} "
            f"{ost:4d}{mark}"
        )
    verdicts: list[str] = []
    if warm and samples:
        after = samples[warm["index"] :]
        base = samples[warm["index"]]
        growth = max(s[3] for s in after) - base[3]
        py_growth = max(s[5] for s in after) - base[5]
        os_growth = max(s[6] for s in after) - base[6]
        pinned_growth = max(s[4] for s in after) - base[4]
        print(
            f"after warm-up ({warm['steps']} steps): resident grew {growth / mib:.1f} MiB "
            f"(bound {RSS_BOUND_BYTES / mib:.0f} MiB), pinned {pinned_growth / mib:.1f} MiB "
            f"(bound 0), threads {py_growth:+d} Python / {os_growth:+d} OS (bound 0)"
        )
        if growth > RSS_BOUND_BYTES:
            verdicts.append("resident memory grew past its bound")
        if pinned_growth > 0:
            verdicts.append("pinned memory grew")
        if py_growth > 0 or os_growth > 0:
            verdicts.append("threads grew")
    if report.wrong:
        verdicts.append("wrong rows")
    if report.unexpected:
        verdicts.append("unexpected errors")
    if report.hangs:
        verdicts.append("hangs")
    if rows == 0:
        verdicts.append("no rows checked")
    status = 2 if report.hangs else (1 if verdicts else 0)
    print(f"verdict: {'PASS' if not verdicts else 'FAIL: ' + ', '.join(verdicts)}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
