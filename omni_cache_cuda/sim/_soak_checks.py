"""The soak's checks: the rows a position must hold, and an output builder that checks them.

Every row is a pure function of the token prefix it ends (`_oracle`), so a hit on another
request's blocks, a resume and a recompute must all give the same value. Per admission (LIFE-1)
the builder keeps which positions were delivered (`StageCacheOutputs.positions`) and which were
carried by steps that delivered nothing to it (discarded, left out, failed): every position must
be delivered at most once, with the right rows for every cached key, in position order, and by
the time the admission's last step is consumed every computed position must be delivered or
excused that way (DLV-2, DLV-4, DLV-6).

The builder thread consumes every step one to a few steps late, sometimes out of order (a step
that would skip positions an earlier one carries raises `DeliveryOrderError` and is retried after
it), discards some and leaves requests out of others. `Report` collects what both threads saw;
`Watch` names the calls in progress for the hang watchdog.
"""

from __future__ import annotations

import array
import collections
import contextlib
import queue
import random
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from omni_cache_core import HIDDEN_KEY, DeliveryOrderError, StepId, WriteFailedError
from omni_cache_cuda._faults import FAULT_ERRORS
from omni_cache_cuda._manager import OmniPrefixCacheManager

from ._oracle import float_rows, int_rows, prefix_hashes

__all__ = [
    "DEF",
    "HANG_S",
    "MM",
    "SHAPES",
    "Admission",
    "Builder",
    "Report",
    "Saved",
    "Watch",
    "expected_rows",
]

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

#: A call that has not returned after this many seconds is a hang.
HANG_S = 120.0


def expected_rows(key: str, hashes: np.ndarray) -> torch.Tensor:
    """The rows of ``key`` at positions whose prefix hashes are ``hashes`` (exact values)."""
    if key == HIDDEN_KEY:
        return float_rows(hashes, HIDDEN_WIDTH)
    if key == MM:
        return float_rows(hashes, MM_WIDTH, first_lane=HIDDEN_WIDTH)
    return int_rows(hashes)


class Admission:
    """One admission of a request (LIFE-1): its tokens' prefix hashes and what it received."""

    __slots__ = (
        "delivered",
        "ended",
        "excused",
        "hashes",
        "max_hi",
        "outstanding",
        "req_id",
        "total",
    )

    def __init__(self, req_id: str, tokens: Sequence[int]) -> None:
        self.req_id = req_id
        self.hashes = np.asarray(prefix_hashes(tokens), dtype=np.uint64)
        self.total = len(tokens)
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
        step_id: StepId,
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
                want = expected_rows(key, expected)
                if tuple(rows.shape) != tuple(want.shape) or not torch.equal(rows.cpu(), want):
                    self.report.wrong_row(
                        f"{what}: {key} rows of positions [{start}, {end}) differ "
                        f"(shape {tuple(rows.shape)}, expected {tuple(want.shape)})"
                    )
                    continue
                checked[key] += count
        with self.report.lock:
            self.report.rows_checked.update(checked)
