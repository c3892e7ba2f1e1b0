"""How a step's cost grows: decode and prefill cycles over batch sizes and hidden widths.

One inline manager per point (the pool write runs on the engine thread, so the engine thread's
CPU time is the cycle's whole work), block_size=16, hidden states in bf16 at widths 1024, 4096
and 8192 plus one immediate mm key (width 16). Per point:
- decode: R running requests x 1 token (R in 16, 64, 256, 1024), each gaining a block every
  16 steps;
- prefill: R new requests x 32 tokens, every other one starting on a 16-token hit of a shared
  block (the step before's requests finishing), so half the returned rows come from the pool.

Printed per point, medians over the steps after a warm-up, the quietest of `--rounds` runs:
`cycle ms` the engine thread's CPU time for `new_step_starts` + `save_outputs` + `materialize`
(layout built beforehand, reported apart as `layout ms`), `copy ms` the copies such a cycle
cannot avoid (the step's rows into the pool at its slots, and every returned row copied out
once: `scatter_rows` through byte views into the pool, as the cache's own pool write, and
`copy_` / `index_select` out, on buffers of the same sizes), their ratio,
and `fixed ms` = cycle - copy, the bookkeeping. Read across a row for what grows with bytes
(the copies), down a column for what grows with requests (the bookkeeping); a constant
bookkeeping across widths and a ratio falling to 1 with width is the healthy shape.

`--plot PATH` writes a figure of both (matplotlib): bookkeeping against requests, and the
cycle's ratio to its copies against bytes per step. `decode` and `prefill` take a `Mode`: a
threaded manager, or one without the hit prefetch (`sweep_compare.py --threaded`,
`--no-prefetch`).

`--gc off` (or `frozen`, after `gc.freeze()`) runs the points without Python's cyclic collector
(or with the objects made before them frozen), to show what its collections cost a step that
makes many tracked objects.

`--lag` materializes each step after the next step's save (`Mode.lag`): what a step costs
while the one before it is still unconsumed, as under an engine that builds a step's outputs
while its next step runs.

Run: python bench/sweep.py [--steps N] [--rounds R] [--widths 1024,4096,8192]
     [--batches 16,64,256,1024] [--kinds decode,prefill] [--gc on|off|frozen] [--lag]
     [--plot docs/sweep.png]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from adapter_step import prefill_records, scatter_rows

from omni_cache_cuda import (
    OmniPrefixCacheManager,
    PrefixCacheConfig,
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
    PrefixCacheStep,
    PrefixCacheWriteLayout,
    StepId,
)
from omni_cache_cuda._storage import alloc_host, row_bytes

BLOCK_SIZE = 16
MM_KEY = "talker.h"
MM_WIDTH = 16
DTYPE = torch.bfloat16
PREFILL_TOKENS = 32
HIT_TOKENS = 16

STARTED = PrefixCacheEventKind.STARTED
FINISHED = PrefixCacheEventKind.FINISHED


@dataclass
class Point:
    kind: str
    requests: int
    width: int
    cycle_ms: float
    copy_ms: float
    layout_ms: float
    step_bytes: int

    @property
    def fixed_ms(self) -> float:
        return self.cycle_ms - self.copy_ms


class Buffers:
    """Plain tensors of the cache's sizes, for the copies a cycle cannot avoid: host memory of
    the cache's own kind (`alloc_host`, huge pages where Linux offers them)."""

    def __init__(self, slots: int, width: int, rows_out: int) -> None:
        self.pools = (
            alloc_host((slots, width), DTYPE, pin=False),
            alloc_host((slots, MM_WIDTH), DTYPE, pin=False),
        )
        self.outs = (
            alloc_host((rows_out, width), DTYPE, pin=False),
            alloc_host((rows_out, MM_WIDTH), DTYPE, pin=False),
        )
        self.pool_bytes = tuple(row_bytes(pool) for pool in self.pools)

    def copies(
        self, rows: tuple[torch.Tensor, torch.Tensor], slots: torch.Tensor, hits: torch.Tensor
    ) -> float:
        """Engine-thread CPU seconds of one step's unavoidable copies."""
        n, h = len(slots), len(hits)
        index = slots.numpy()
        t0 = time.thread_time()
        for src, pool, pool_bytes, out in zip(
            rows, self.pools, self.pool_bytes, self.outs, strict=True
        ):
            scatter_rows(pool_bytes, index, row_bytes(src[:n]), BLOCK_SIZE)
            out[:n].copy_(src[:n])
            if h:
                torch.index_select(pool, 0, hits, out=out[n : n + h])
        return time.thread_time() - t0


@dataclass(frozen=True)
class Mode:
    """How the manager of a point runs: `sweep.py` uses inline managers with the CPU's default,
    no hit prefetch (DESIGN D38); `sweep_compare.py` can ask for threaded ones, and sets the
    prefetch on or off (older trees prefetch by default).

    ``lag``: each step is materialized after the next step's save instead of right after its own,
    as an engine that builds a step's outputs while its next step runs does (a builder thread,
    or asynchronous scheduling). A cycle is then a step's start and save and the previous step's
    materialize, and one step is always unconsumed while the next one starts and saves.
    """

    threaded: bool = False
    prefetch: bool | None = None
    lag: bool = False


INLINE = Mode()


def _manager(num_blocks: int, step_rows: int, mode: Mode) -> OmniPrefixCacheManager:
    capacity = max(1024, step_rows)
    config = PrefixCacheConfig(
        num_blocks=num_blocks, block_size=BLOCK_SIZE, staging_capacity_tokens=capacity
    )
    return OmniPrefixCacheManager(
        config, device="cpu", threaded=mode.threaded, prefetch=mode.prefetch
    )


class Cycles:
    """Runs a point's cycles on a manager: each step's start and save, then its materialize, or
    the previous step's with `Mode.lag` (the last one is materialized, untimed, by `close`)."""

    def __init__(self, m: OmniPrefixCacheManager, mode: Mode) -> None:
        self.m = m
        self.lag = mode.lag
        self.pending: tuple[StepId, list[str]] | None = None

    def run(
        self,
        step: PrefixCacheStep,
        rows: tuple[torch.Tensor, torch.Tensor],
        n: int,
        layout: PrefixCacheWriteLayout,
        reqs: list[str],
    ) -> float:
        """One cycle; the engine thread's CPU seconds."""
        m = self.m
        t0 = time.thread_time()
        m.new_step_starts(step)
        step_id = m.save_outputs(
            rows[0], {MM_KEY: rows[1]}, num_tokens_unpadded=n, write_layout=layout
        )
        if not self.lag:
            m.materialize(step_id, reqs)
        else:
            if self.pending is not None:
                m.materialize(*self.pending)
            self.pending = (step_id, reqs)
        return time.thread_time() - t0

    def close(self) -> None:
        if self.pending is not None:
            self.m.materialize(*self.pending)
            self.pending = None


def decode(requests: int, width: int, steps: int, warmup: int, mode: Mode = INLINE) -> Point:
    blocks_per_req = 8
    num_blocks = requests * blocks_per_req
    reqs = [f"d{i}" for i in range(requests)]
    blocks = {
        r: list(range(i * blocks_per_req, (i + 1) * blocks_per_req)) for i, r in enumerate(reqs)
    }
    rows = (torch.randn(requests, width).to(DTYPE), torch.randn(requests, MM_WIDTH).to(DTYPE))
    ones = dict.fromkeys(reqs, 1)
    starts = [
        PrefixCacheRequestEvent(req_id=r, kind=STARTED, block_ids=blocks[r], scheduled_tokens=1)
        for r in reqs
    ]
    buffers = Buffers(num_blocks * BLOCK_SIZE, width, requests)
    no_hits = torch.zeros(0, dtype=torch.int64)
    cycle, copy, layout_s = [], [], []
    with _manager(num_blocks, requests, mode) as m:
        cycles = Cycles(m, mode)
        for pos in range(warmup + steps):
            step = PrefixCacheStep(events=starts if pos == 0 else (), scheduled_tokens=ones)
            t0 = time.thread_time()
            layout = PrefixCacheWriteLayout.from_block_tables(
                reqs,
                ones,
                dict.fromkeys(reqs, pos % (blocks_per_req * BLOCK_SIZE)),
                blocks,
                BLOCK_SIZE,
            )
            lay = time.thread_time() - t0
            c = cycles.run(step, rows, requests, layout, reqs)
            k = buffers.copies(rows, layout.slots_cpu, no_hits)
            if pos >= warmup:
                cycle.append(c)
                copy.append(k)
                layout_s.append(lay)
        cycles.close()
    return _point("decode", requests, width, cycle, copy, layout_s, requests)


def prefill(requests: int, width: int, steps: int, warmup: int, mode: Mode = INLINE) -> Point:
    blocks_per_req = PREFILL_TOKENS // BLOCK_SIZE
    shared = [0]
    num_blocks = 1 + 2 * requests * blocks_per_req  # this step's and the step before's
    computed_rows = requests // 2 * PREFILL_TOKENS + requests // 2 * (PREFILL_TOKENS - HIT_TOKENS)
    rows = (
        torch.randn(computed_rows, width).to(DTYPE),
        torch.randn(computed_rows, MM_WIDTH).to(DTYPE),
    )
    buffers = Buffers(num_blocks * BLOCK_SIZE, width, requests * PREFILL_TOKENS)
    cycle, copy, layout_s = [], [], []
    with _manager(num_blocks, computed_rows, mode) as m:
        cycles = Cycles(m, mode)
        # The shared block, written once by a request that stays live.
        warm = PrefixCacheWriteLayout.from_block_tables(
            ["warm"], {"warm": HIT_TOKENS}, {"warm": 0}, {"warm": shared}, BLOCK_SIZE
        )
        start = PrefixCacheRequestEvent(
            req_id="warm", kind=STARTED, block_ids=shared, scheduled_tokens=HIT_TOKENS
        )
        cycles.run(
            PrefixCacheStep(events=[start], scheduled_tokens={"warm": HIT_TOKENS}),
            (rows[0][:HIT_TOKENS], rows[1][:HIT_TOKENS]),
            HIT_TOKENS,
            warm,
            ["warm"],
        )
        prev: list[str] = []
        for s in range(warmup + steps):
            reqs = [f"p{s}_{i}" for i in range(requests)]
            base = 1 + (s % 2) * requests * blocks_per_req
            own_blocks = [
                list(range(base + i * blocks_per_req, base + (i + 1) * blocks_per_req))
                for i in range(requests)
            ]
            records = prefill_records(prev, reqs, own_blocks, shared, PREFILL_TOKENS, HIT_TOKENS)
            scheduled, hit_slots = records.scheduled, records.hit_slots
            t0 = time.thread_time()
            layout = PrefixCacheWriteLayout.from_block_tables(
                reqs, scheduled, records.computed, records.block_ids, BLOCK_SIZE
            )
            lay = time.thread_time() - t0
            step = PrefixCacheStep(events=records.events, scheduled_tokens=scheduled)
            c = cycles.run(step, rows, computed_rows, layout, reqs)
            k = buffers.copies(rows, layout.slots_cpu, torch.tensor(hit_slots, dtype=torch.int64))
            if s >= warmup:
                cycle.append(c)
                copy.append(k)
                layout_s.append(lay)
            prev = reqs
        cycles.close()
    return _point("prefill", requests, width, cycle, copy, layout_s, computed_rows)


def _point(
    kind: str,
    requests: int,
    width: int,
    cycle: list[float],
    copy: list[float],
    layout: list[float],
    rows: int,
) -> Point:
    return Point(
        kind=kind,
        requests=requests,
        width=width,
        cycle_ms=statistics.median(cycle) * 1e3,
        copy_ms=statistics.median(copy) * 1e3,
        layout_ms=statistics.median(layout) * 1e3,
        step_bytes=rows * (width + MM_WIDTH) * DTYPE.itemsize,
    )


def plot(points: list[Point], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for kind, marker in (("decode", "o"), ("prefill", "s")):
        for width in sorted({p.width for p in points}):
            run = sorted(
                (p for p in points if p.kind == kind and p.width == width), key=lambda p: p.requests
            )
            if not run:
                continue
            label = f"{kind}, width {width}"
            left.plot(
                [p.requests for p in run], [p.fixed_ms for p in run], marker=marker, label=label
            )
            right.plot(
                [p.step_bytes / 2**20 for p in run],
                [p.cycle_ms / p.copy_ms for p in run],
                marker=marker,
                label=label,
            )
    left.set(
        xscale="log",
        yscale="log",
        xlabel="requests per step",
        ylabel="bookkeeping ms (cycle - copies)",
    )
    left.set_title("What grows with requests")
    right.set(xscale="log", xlabel="MiB of rows per step", ylabel="cycle / unavoidable copies")
    right.set_title("What grows with bytes")
    right.axhline(1.0, color="grey", linewidth=0.8)
    for ax in (left, right):
        ax.grid(True, which="both", linewidth=0.3)
    left.legend(fontsize=7)
    fig.suptitle("omni-cache step cycle on the CPU (inline, engine-thread CPU time, bf16)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--widths", default="1024,4096,8192")
    parser.add_argument("--batches", default="16,64,256,1024")
    parser.add_argument("--plot", default=None, help="write the figure to this path")
    parser.add_argument(
        "--kinds", default="decode,prefill", help="the cycles to run: decode, prefill or both"
    )
    parser.add_argument(
        "--gc",
        choices=("on", "off", "frozen"),
        default="on",
        help="Python's cyclic collector during the points: on, off, or on after gc.freeze()",
    )
    parser.add_argument(
        "--lag",
        action="store_true",
        help="materialize each step after the next step's save (`Mode.lag`)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    mode = Mode(lag=args.lag)
    if args.gc == "off":
        gc.disable()
    elif args.gc == "frozen":
        gc.collect()
        gc.freeze()  # what an engine that freezes its startup objects runs with
    widths = [int(w) for w in args.widths.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    print(
        f"torch {torch.__version__}, 1 intra-op thread; {args.steps} steps a point, quietest of "
        f"{args.rounds}; cyclic collector {args.gc}"
        + ("; each step materialized after the next step's save" if args.lag else "")
    )
    print(
        f"{'cycle':8} {'requests':>8} {'width':>6} {'MiB':>7} {'cycle ms':>9} {'copy ms':>8} {'x copy':>7} {'fixed ms':>9} {'layout ms':>9}"
    )
    points: list[Point] = []
    kinds = args.kinds.split(",")
    for kind, bench in (("decode", decode), ("prefill", prefill)):
        if kind not in kinds:
            continue
        for requests in batches:
            for width in widths:
                steps = args.steps if kind == "decode" else max(6, args.steps // 4)
                point = min(
                    (bench(requests, width, steps, 5, mode) for _ in range(args.rounds)),
                    key=lambda p: p.cycle_ms,
                )
                points.append(point)
                print(
                    f"{kind:8} {requests:8d} {width:6d} {point.step_bytes / 2**20:7.2f} "
                    f"{point.cycle_ms:9.3f} {point.copy_ms:8.3f} "
                    f"{point.cycle_ms / point.copy_ms:7.2f} {point.fixed_ms:9.3f} {point.layout_ms:9.3f}",
                    flush=True,
                )
    if args.plot:
        plot(points, args.plot)


if __name__ == "__main__":
    main()
