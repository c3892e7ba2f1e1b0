"""The least engine-thread work a decode step can cost on the CPU, beside the library's.

`vllm_glue.py` sets a decode step's target at 250 us of engine-thread CPU for `step_begin` +
`save` (256 requests x 1 token, hidden states of width 2048 in bf16 plus one mm key of width
16, threaded). This script measures how much of that any prefix cache must spend on this
machine, whatever its design: `LeastCache` serves the same steady decode steps doing only what
serving them needs, and nothing that decides an error.

What `LeastCache` does per step, on the engine thread:

- begin: reads the scheduler output's fields (finished, preempted, new and cached requests,
  drafts, block copies) and takes its one path only when the step is a plain decode step (the
  one test it makes); looks the cached requests' rows of its block table up once per id list,
  kept while the next step's list is equal (as the glue's memo does); appends each added block
  to its row; reads the starts as an array;
- save: the runner's order's table rows, looked up the same way; the slots from the block
  table and the starts (array operations); one mark of the slots per key in an owner table (a
  later read must know whose rows a slot holds); the lowest free landing page; the copy of both
  keys' rows into it; the hand-off of the page's write to a writer thread (a deque and a
  condition, as the committer's).

What it leaves out, all of which the library does: every check of its input (types, counts,
request ids, positions, slot ranges, page sizes, key shapes), the request records and their
lifecycle, the core's save transaction and its step, the state lock, the page holders, the
preservation of rows older reads planned on (HIT-6), the write's reports and waiters, stats
and metrics. So its figure is a floor: a correct cache does at least this.

It also leaves out the save barrier (TASK-3): its next save does not wait for the previous
step's write to be in the pool, which the library's must (a reused slot must not leave a
pending pool write behind). `least + barrier` is the same cache with that wait, after its
landing copy as in the library's save (PAGE-7), a floor for a cache under this spec: with the
writer on another vCPU the wait puts the engine thread to sleep whenever the write is late, and
the thread pays for each sleep in wake-ups and cold caches.
Beside each figure the script prints the engine thread's blocks per step: its voluntary context
switches (waits for the barrier, a page or the GIL), counted by `getrusage` over the timed steps.

The rest of the step is the library's: the writer thread scatters the page's rows into a pool
of the same size (16384 blocks of 16 slots, byte views, as the committer), and the consume
(right after the save, on the same thread, as `vllm_glue.py` runs it; not timed) copies the
step's rows out of its page into one fresh tensor per key. So the memory traffic that decides
how cold the engine thread's caches are when the next step begins is the same.

Both run the same scheduler outputs (`vllm_glue.decode_steps`, the runner's order kept) and the
same tensors, in alternating rounds, in two thread placements (Linux only; see
`decode_floor.py`): `one vCPU` (the writer or committer thread on the engine thread's CPU) and
`two vCPUs` (on the other one, left out on a single CPU). Per placement it prints the medians of
the quietest round of each (engine-thread CPU for begin + save, and the least's parts: its
landing copy, its hand-off, its barrier wait, the rest), the library's ratio to the least and
how much of the target the least leaves for everything it leaves out, for the least without
and with the barrier. Before the rounds it checks once that
the least cache marks and writes the slots of the glue's own layouts for every step and hands
back the rows saved (`check_least`).

`--pause-ms P` puts the engine thread to sleep for P ms after every step of both, as an engine
waits for its forward pass between steps. On a shared virtual machine a thread that slept
finds its caches, and its CPU's state, lost: the same work then costs more, and the writer's
work is done in the pause, so nothing waits for it.

Run: python bench/decode_least.py [--steps N] [--rounds R] [--pause-ms P]
"""

from __future__ import annotations

import argparse
import collections
import operator
import os
import random
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from adapter_step import (
    BLOCK_SIZE,
    CAPACITY,
    DTYPE,
    MM_KEY,
    MM_WIDTH,
    NUM_BLOCKS,
    WIDTH,
    make_manager,
)
from decode_floor import blocks_so_far, on_first_cpu, to_second_cpu
from vllm_glue import ENGINE_TARGET_US, Step, decode_steps, recorded

from omni_cache_cuda._storage import alloc_host
from omni_cache_cuda.vllm import VllmPrefixCache

ONE_VCPU = "one vCPU"
TWO_VCPUS = "two vCPUs"
#: Landing pages, as the library's default staging depth.
PAGES = 4
#: Steps run before the timed ones in every round.
WARMUP = 5


def inputs(steps: int) -> tuple[list[Step], list[Step], tuple[torch.Tensor, torch.Tensor]]:
    """The setup steps, ``steps`` decode steps after `WARMUP` more (the runner's order kept),
    and the hidden and mm rows they save: what every round of this script and of
    `glue_compare.py` runs."""
    setup, decode = decode_steps(steps + WARMUP, random.Random(0), shuffle=False)
    tensors = (
        torch.randn(CAPACITY, WIDTH).to(DTYPE),
        torch.randn(CAPACITY, MM_WIDTH).to(DTYPE),
    )
    return setup, decode, tensors


def placements() -> tuple[str, ...]:
    """The thread placements this machine has CPUs for."""
    return (ONE_VCPU, TWO_VCPUS) if len(os.sched_getaffinity(0)) >= 2 else (ONE_VCPU,)


class LeastCache:
    """A decode step's least work (module docstring); serves nothing but plain decode steps.

    ``barrier``: a save first waits until the previous steps' writes are in the pool (TASK-3).
    """

    def __init__(self, *, barrier: bool = False) -> None:
        self.barrier = barrier
        slots = NUM_BLOCKS * BLOCK_SIZE
        widths = {"hidden": WIDTH, MM_KEY: MM_WIDTH}
        self.pool = {k: alloc_host((slots, w), DTYPE, pin=False) for k, w in widths.items()}
        self.pages = [
            {k: alloc_host((CAPACITY, w), DTYPE, pin=False) for k, w in widths.items()}
            for _ in range(PAGES)
        ]
        self.owner = {k: np.full(slots, -1, dtype=np.int32) for k in widths}
        self.table = np.full((512, 256), -1, dtype=np.int32)
        self.lens = np.zeros(512, dtype=np.int64)
        self.row_of: dict[str, int] = {}
        self.ids: list[str] | None = None  # the last cached-request list and its rows
        self.rows = np.zeros(0, dtype=np.int64)
        self.order: list[str] | None = None  # the last runner order and its rows
        self.order_rows = np.zeros(0, dtype=np.int64)
        self.row_start = np.zeros(512, dtype=np.int64)
        self.busy = [False] * PAGES  # a page is busy from its copy until its write is done
        self.tid = 0
        self.written = 0  # steps whose write is in the pool
        self.write_delay_s = 0.0  # `check_least` makes the writer late on purpose
        self.queue: collections.deque[tuple[int, np.ndarray, int] | None] = collections.deque()
        self.cv = threading.Condition()
        self.writer = threading.Thread(target=self._write_loop, daemon=True)
        self.writer.start()
        # The current step's barrier wait, landing copy and hand-off, thread CPU time.
        self.wait_ns = 0
        self.copy_ns = 0
        self.hand_off_ns = 0

    def start(self, steps: Sequence[Step]) -> None:
        """Take the setup steps' new requests and their blocks (not timed)."""
        for step in steps:
            for new in step.so.scheduled_new_reqs:
                row = self.row_of[new.req_id] = len(self.row_of)
                blocks = new.block_ids[0]
                self.table[row, : len(blocks)] = blocks
                self.lens[row] = len(blocks)

    def begin(self, so: Any) -> None:
        """A decode step's scheduler output: blocks added, starts read."""
        cached = so.scheduled_cached_reqs
        if (
            so.finished_req_ids
            or so.preempted_req_ids
            or so.scheduled_new_reqs
            or so.scheduled_spec_decode_tokens
            or so.kv_cache_block_copies
            or cached.resumed_req_ids
        ):
            raise NotImplementedError("the least cache serves plain decode steps only")
        ids = cached.req_ids
        if ids != self.ids:
            self.rows = np.array(operator.itemgetter(*ids)(self.row_of), dtype=np.int64)
            self.ids = list(ids)
        added = cached.new_block_ids
        if any(added):
            table, lens, row_of = self.table, self.lens, self.row_of
            for req_id, blocks in zip(ids, added, strict=True):
                if blocks:
                    row = row_of[req_id]
                    table[row, lens[row]] = blocks[0][0]
                    lens[row] += 1
        starts = np.fromiter(cached.num_computed_tokens, dtype=np.int64, count=len(ids))
        self.row_start[self.rows] = starts

    def save(self, hidden: torch.Tensor, mm: torch.Tensor, order: list[str]) -> int:
        """The step's rows into a landing page, its write handed to the writer; its page.

        The order of the library's save (PAGE-7): the rows into a free page, then the barrier,
        then the slots and their marks, then the hand-off.
        """
        with self.cv:
            while all(self.busy):
                self.cv.wait()
            page = self.busy.index(False)
            self.busy[page] = True
        t0 = time.thread_time_ns()
        n = len(order)
        landing = self.pages[page]
        landing["hidden"][:n].copy_(hidden)
        landing[MM_KEY][:n].copy_(mm)
        t1 = time.thread_time_ns()
        if self.barrier:
            with self.cv:
                while self.written < self.tid:
                    self.cv.wait()
        t2 = time.thread_time_ns()
        if order != self.order:
            self.order_rows = np.array(operator.itemgetter(*order)(self.row_of), dtype=np.int64)
            self.order = list(order)
        rows = self.order_rows
        starts = self.row_start[rows]
        slots = self.table[rows, starts // BLOCK_SIZE].astype(np.int64) * BLOCK_SIZE
        slots += starts % BLOCK_SIZE
        tid = self.tid = self.tid + 1
        for owner in self.owner.values():
            owner[slots] = tid
        t3 = time.thread_time_ns()
        with self.cv:
            self.queue.append((page, slots, n))
            self.cv.notify()
        self.copy_ns, self.hand_off_ns = t1 - t0, time.thread_time_ns() - t3
        self.wait_ns = t2 - t1 if self.barrier else 0
        return page

    def consume(self, page: int, n: int) -> dict[str, torch.Tensor]:
        """The step's rows out of its page, one fresh tensor per key."""
        return {k: v[:n].clone() for k, v in self.pages[page].items()}

    def close(self) -> None:
        with self.cv:
            self.queue.append(None)
            self.cv.notify()
        self.writer.join()

    def _write_loop(self) -> None:
        pool = {k: v.view(torch.uint8).numpy() for k, v in self.pool.items()}
        pages = [{k: v.view(torch.uint8).numpy() for k, v in p.items()} for p in self.pages]
        while True:
            with self.cv:
                while not self.queue:
                    self.cv.wait()
                job = self.queue.popleft()
            if job is None:
                return
            page, slots, n = job
            if self.write_delay_s:
                time.sleep(self.write_delay_s)
            for key, target in pool.items():
                target[slots] = pages[page][key][:n]
            with self.cv:
                self.busy[page] = False
                self.written += 1
                self.cv.notify()


def check_least(setup: list[Step], steps: list[Step], tensors: Any, *, barrier: bool) -> None:
    """Check that the least cache writes the slots of the glue's own layouts, and the rows.

    With ``barrier``, also that every save finds the previous step's rows in the pool, with the
    writer made a millisecond late for every write so that a save without the wait would not.

    Raises:
        AssertionError: It does not, so its figure would not be a decode step's work.
    """
    hidden, mm = tensors
    layouts = [layout for _, layout in recorded(setup, steps)[len(setup) :]]
    cache = LeastCache(barrier=barrier)
    cache.write_delay_s = 1e-3 if barrier else 0.0
    previous: Any = None
    try:
        cache.start(setup)
        for step, layout in zip(steps, layouts, strict=True):
            n = step.rows
            cache.begin(step.so)
            page = cache.save(hidden[:n], mm[:n], step.order)
            if barrier and previous is not None:
                rows = cache.pool["hidden"][previous.slots_cpu]
                assert torch.equal(rows, hidden[: previous.num_rows]), "a save passed a late write"
            assert list(layout.req_ids) == step.order
            slots = layout.slots_cpu.numpy()
            assert (cache.owner["hidden"][slots] == cache.tid).all(), "slots differ"
            assert torch.equal(cache.consume(page, n)["hidden"], hidden[:n]), "rows differ"
            previous = layout
    finally:
        cache.close()
    assert torch.equal(cache.pool["hidden"][layout.slots_cpu], hidden[:n]), "pool rows differ"


def least_round(
    setup: list[Step],
    steps: list[Step],
    warmup: int,
    placement: str,
    tensors: Any,
    *,
    barrier: bool = False,
    pause_s: float = 0.0,
) -> dict[str, float]:
    """Medians (us) of the least cache's begin + save and its parts; its blocks per step."""
    hidden, mm = tensors
    parts: dict[str, list[int]] = {"total": [], "wait": [], "copy": [], "hand-off": []}
    blocks = 0
    with on_first_cpu() as cpus:
        cache = LeastCache(barrier=barrier)
        try:
            if placement == TWO_VCPUS:
                to_second_cpu(cache.writer, cpus)
            cache.start(setup)
            for i, step in enumerate(steps):
                n = step.rows
                b0 = blocks_so_far()
                t0 = time.thread_time_ns()
                cache.begin(step.so)
                page = cache.save(hidden[:n], mm[:n], step.order)
                t1 = time.thread_time_ns()
                b1 = blocks_so_far()
                cache.consume(page, n)
                if pause_s:
                    time.sleep(pause_s)
                if i >= warmup:
                    parts["total"].append(t1 - t0)
                    parts["wait"].append(cache.wait_ns)
                    parts["copy"].append(cache.copy_ns)
                    parts["hand-off"].append(cache.hand_off_ns)
                    blocks += b1 - b0
        finally:
            cache.close()
    figures = {k: statistics.median(v) / 1e3 for k, v in parts.items()}
    figures["blocks"] = blocks / (len(steps) - warmup)
    return figures


def library_round(
    setup: list[Step],
    steps: list[Step],
    warmup: int,
    placement: str,
    tensors: Any,
    *,
    pause_s: float = 0.0,
) -> dict[str, float]:
    """Median (us) of the glue's step_begin + save over a threaded manager; blocks per step."""
    hidden, mm = tensors
    total = []
    blocks = 0
    with on_first_cpu() as cpus, VllmPrefixCache(make_manager(True), block_size=BLOCK_SIZE) as glue:
        committer = glue.manager._state.committer._thread
        if placement == TWO_VCPUS and committer is not None:
            to_second_cpu(committer, cpus)
        for step in setup:
            n = step.rows
            glue.step_begin(step.so)
            sid = glue.save(hidden[:n], {MM_KEY: mm[:n]}, req_ids=step.order, num_tokens_unpadded=n)
            glue.discard_step(sid)
        for i, step in enumerate(steps):
            n = step.rows
            b0 = blocks_so_far()
            t0 = time.thread_time_ns()
            glue.step_begin(step.so)
            sid = glue.save(hidden[:n], {MM_KEY: mm[:n]}, req_ids=step.order, num_tokens_unpadded=n)
            t1 = time.thread_time_ns()
            b1 = blocks_so_far()
            glue.materialize(sid, step.order)
            if pause_s:
                time.sleep(pause_s)
            if i >= warmup:
                total.append(t1 - t0)
                blocks += b1 - b0
    return {"total": statistics.median(total) / 1e3, "blocks": blocks / (len(steps) - warmup)}


#: The least caches measured: without and with the save barrier.
LEAST_KINDS = {"least": False, "least + barrier": True}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument(
        "--pause-ms",
        type=float,
        default=0.0,
        help="sleep this long after every step, as an engine waits for its forward pass",
    )
    args = parser.parse_args()
    pause_s = args.pause_ms / 1e3
    torch.set_num_threads(1)
    setup, steps, tensors = inputs(args.steps)
    for barrier in LEAST_KINDS.values():
        check_least(setup, steps, tensors, barrier=barrier)
    where = placements()
    least: dict[tuple[str, str], list[dict[str, float]]] = {
        (p, k): [] for p in where for k in LEAST_KINDS
    }
    library: dict[str, list[dict[str, float]]] = {p: [] for p in where}
    for _ in range(args.rounds):
        for placement in where:
            for kind, barrier in LEAST_KINDS.items():
                least[placement, kind].append(
                    least_round(
                        setup, steps, WARMUP, placement, tensors, barrier=barrier, pause_s=pause_s
                    )
                )
            library[placement].append(
                library_round(setup, steps, WARMUP, placement, tensors, pause_s=pause_s)
            )
    print(
        f"torch {torch.__version__}, CPU, one intra-op thread; decode 256 x 1, order kept; "
        f"engine-thread CPU us per step for begin + save, medians, quietest of {args.rounds} "
        f"alternating rounds of {args.steps} steps, {args.pause_ms:g} ms pauses between "
        f"steps; blocks: the engine thread's voluntary context switches a step in begin + save"
    )
    header = (
        "least",
        "wait",
        "copy",
        "hand-off",
        "rest",
        "blocks",
        "library",
        "blocks",
        "library/least",
        "target - least",
    )
    print(
        f"{'placement':<12}{'cache':<17}"
        + "".join(f"{h:>15}" for h in header)
        + "   rounds (least/library)"
    )
    for placement in where:
        lib = min(library[placement], key=lambda r: r["total"])
        for kind in LEAST_KINDS:
            rounds = least[placement, kind]
            low = min(rounds, key=lambda r: r["total"])
            rest = low["total"] - low["wait"] - low["copy"] - low["hand-off"]
            figures = (
                low["total"],
                low["wait"],
                low["copy"],
                low["hand-off"],
                rest,
                low["blocks"],
                lib["total"],
                lib["blocks"],
                lib["total"] / low["total"],
                ENGINE_TARGET_US - low["total"],
            )
            spread = ", ".join(
                f"{a['total']:.0f}/{b['total']:.0f}"
                for a, b in zip(rounds, library[placement], strict=True)
            )
            print(
                f"{placement:<12}{kind:<17}"
                + "".join(f"{f:>15.2f}" for f in figures)
                + f"   {spread}"
            )


if __name__ == "__main__":
    main()
