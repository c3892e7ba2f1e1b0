"""The least a prefill cycle can cost on the CPU against its one-copy baseline, beside the
library's.

`adapter_step.py` sets the prefill cycle's target at 1.05 x the copies of the one-copy path
(`copy1`: the step's rows written into the pool at their slots, then every returned row gathered
out of the pool once, into output buffers allocated once). This script measures how much above
`copy1` any prefix cache must be on this machine, whatever its design: `LeastPrefill` serves the
same cycles (`adapter_step.prefill_cycles`: 16 requests x 512 tokens, 8 of them starting with a
256-token hit; hidden width 2048 bf16 plus one mm key of width 16) doing only what serving them
needs, and nothing that decides an error.

What `LeastPrefill` does per cycle, all on the calling thread:

- start: reads the step's events; per request that starts with a hit, its hit's slots from its
  block ids (one array operation); per request that ends, forgets its hit;
- save: the layout's slots; the rows of both keys into the pools at those slots (the pool write
  of the library and of `copy1`: one assignment of whole KV blocks through byte views, the blocks
  found once for both keys); one mark of the slots per key in an owner table (a later read must
  know whose rows a slot holds);
- materialize: per key, the rows of the requests without a hit in one gather into one
  buffer, and each hit request's prefix and own rows next to each other in one gather into one
  more buffer; every request's rows handed out as a view of those buffers. The buffers come
  from the library's `OutputMemory` (D40), as the library's do: one the caller let go of is
  handed out again, so neither cache faults in new memory every cycle.

So its copies are the library's, and its outputs are the caller's, as the library's are: a
buffer is used again only once nothing else refers to it (`copy1` gathers into buffers it
owns). What it leaves out, all of which the library does: every check of its input, the slots'
private copy (STEP-3), the request records and their lifecycle (DLV), the core's save and
consume transactions, the hit plans and their protection (HIT-4, HIT-6), the state lock, the
write's reports, stats and metrics. So its figure is a floor: a correct cache does at least
this.

Both run the same cycles, in alternating rounds of fresh caches, inline (every copy on the one
thread; the library with its hit prefetch off, as a CPU manager runs by default, and on).
Per cycle they are timed as `adapter_step.py` times them (process CPU), each of the three calls
on its own too, and the copy baseline runs on the same step right after
(`adapter_step.CopyBaseline`). The script prints, per cache, the medians of its quietest round:
the cycle, `copy1`, their ratio, the cycle less `copy1`, and each call (at `--width 16` the
calls are the caches' fixed work on warm caches, so the two caches' columns say where the
library's extra work is).
Before the rounds it checks once that the least cache hands back the rows the library does.

Run: python bench/prefill_least.py [--steps N] [--rounds R] [--width W]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
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
    PREFILL_ROWS,
    PREFILL_TARGET_RATIO,
    WIDTH,
    CopyBaseline,
    PrefillCycle,
    make_manager,
    prefill_cycles,
    prefill_rows,
    prefill_warm_cycle,
)

from omni_cache_cuda import (
    HIDDEN_KEY,
    OmniPrefixCacheManager,
    PrefixCacheEventKind,
    StageCacheOutputs,
    StepId,
)
from omni_cache_cuda._storage import (
    OutputMemory,
    alloc_host,
    row_bytes,
    scatter_rows,
    write_blocks,
)

FINISHED = PrefixCacheEventKind.FINISHED
#: Cycles run before the timed ones in every round.
WARMUP = 4
_BLOCK_OFFSETS = np.arange(BLOCK_SIZE, dtype=np.int64)


class LeastPrefill:
    """A prefill cycle's least work (module docstring); serves nothing but these cycles."""

    def __init__(self, width: int) -> None:
        slots = NUM_BLOCKS * BLOCK_SIZE
        self.widths = {HIDDEN_KEY: width, MM_KEY: MM_WIDTH}
        self.pool = {k: alloc_host((slots, w), DTYPE, pin=False) for k, w in self.widths.items()}
        self.pool_bytes = {k: row_bytes(v) for k, v in self.pool.items()}
        self.owner = {k: np.full(slots, -1, dtype=np.int32) for k in self.widths}
        self.hits: dict[str, np.ndarray] = {}  # request -> its hit's slots
        self.tid = 0
        self.slots = np.zeros(0, dtype=np.int64)
        self.bounds: dict[str, tuple[int, int]] = {}
        # The library's output buffers are bounded by its landing pages' bytes: the same bound.
        pages = CAPACITY * (width + MM_WIDTH) * DTYPE.itemsize
        self.outputs = OutputMemory(lambda: pages)

    def start(self, step: Any) -> None:
        """The step's events: hits of the requests that start, none of those that end."""
        for event in step.events:
            if event.kind is FINISHED:
                self.hits.pop(event.req_id, None)
            elif event.hit_end:
                blocks = np.asarray(event.block_ids[: event.hit_end // BLOCK_SIZE], np.int64)
                self.hits[event.req_id] = (blocks[:, None] * BLOCK_SIZE + _BLOCK_OFFSETS).ravel()

    def save(self, rows: dict[str, torch.Tensor], n: int, layout: Any) -> None:
        """The step's rows into the pools at the layout's slots, the slots marked per key."""
        slots = layout.slots_cpu.numpy()
        blocks = write_blocks(slots, BLOCK_SIZE)
        self.tid += 1
        for key, target in self.pool_bytes.items():
            scatter_rows(target, slots, row_bytes(rows[key][:n]), BLOCK_SIZE, blocks)
            self.owner[key][slots] = self.tid
        self.slots = slots
        bounds = layout.bounds
        self.bounds = {r: (bounds[i], bounds[i + 1]) for i, r in enumerate(layout.req_ids)}

    def materialize(self, req_ids: list[str]) -> dict[str, dict[str, torch.Tensor]]:
        """Every request's rows of each key, its hit's first, as views of a few buffers."""
        slots, bounds, hits = self.slots, self.bounds, self.hits
        plain = [r for r in req_ids if r not in hits]
        hit = [r for r in req_ids if r in hits]
        groups = [
            (
                names,
                np.concatenate([part for r in names for part in parts(r)]),
                [sum(len(part) for part in parts(r)) for r in names],
            )
            for names, parts in (
                (plain, lambda r: (slots[slice(*bounds[r])],)),
                (hit, lambda r: (hits[r], slots[slice(*bounds[r])])),
            )
            if names
        ]
        out: dict[str, dict[str, torch.Tensor]] = {}
        for key, width in self.widths.items():
            views: dict[str, torch.Tensor] = {}
            for names, index, sizes in groups:
                buffer = self.outputs.rows((len(index), width), DTYPE)
                torch.index_select(self.pool[key], 0, torch.from_numpy(index), out=buffer)
                views.update(zip(names, torch.split(buffer, sizes), strict=True))
            out[key] = views
        return out


class LibraryPrefill:
    """The library's manager behind `LeastPrefill`'s three calls, so one loop times both."""

    def __init__(self, manager: OmniPrefixCacheManager) -> None:
        self.manager = manager
        self.step_id: StepId | None = None

    def start(self, step: Any) -> None:
        self.manager.new_step_starts(step)

    def save(self, rows: dict[str, torch.Tensor], n: int, layout: Any) -> None:
        self.step_id = self.manager.save_outputs(
            rows[HIDDEN_KEY], {MM_KEY: rows[MM_KEY]}, num_tokens_unpadded=n, write_layout=layout
        )

    def materialize(self, req_ids: list[str]) -> StageCacheOutputs:
        assert self.step_id is not None
        step_id, self.step_id = self.step_id, None
        return self.manager.materialize(step_id, req_ids)


#: A round's samples: per timed cycle, the process CPU of each call and of copy1, in seconds.
Round = dict[str, list[float]]
#: The three calls of a cycle, timed one by one.
CALLS = ("start", "save", "materialize")


def timed_round(
    cache: LeastPrefill | LibraryPrefill, steps: int, width: int, baseline: CopyBaseline
) -> Round:
    """One round of a cache: each call's process CPU per timed cycle, and copy1's."""
    rows, warm_rows = prefill_rows(width)
    warm = prefill_warm_cycle()
    cache.start(warm.step)
    cache.save({HIDDEN_KEY: warm_rows[0], MM_KEY: warm_rows[1]}, 256, warm.layout)
    cache.materialize(warm.req_ids)
    keyed = {HIDDEN_KEY: rows[0], MM_KEY: rows[1]}
    samples: Round = {name: [] for name in (*CALLS, "cycle", "copy1")}
    for s, cycle in enumerate(prefill_cycles(WARMUP + steps)):
        p0 = time.process_time()
        cache.start(cycle.step)
        p1 = time.process_time()
        cache.save(keyed, PREFILL_ROWS, cycle.layout)
        p2 = time.process_time()
        out = cache.materialize(cycle.req_ids)
        p3 = time.process_time()
        del out
        _, copy1 = baseline.run(rows, cycle.layout.slots_cpu, cycle.hit_slots)
        if s >= WARMUP:
            for name, spent in zip(
                (*CALLS, "cycle", "copy1"), (p1 - p0, p2 - p1, p3 - p2, p3 - p0, copy1), strict=True
            ):
                samples[name].append(spent)
    return samples


def check_least(width: int) -> None:
    """Check that the least cache hands back the rows the library does, every request and key.

    Raises:
        AssertionError: It does not, so its figure would not be a prefill cycle's work.
    """
    rows, warm_rows = prefill_rows(width)
    cache = LeastPrefill(width)
    with make_manager(False, prefetch=False) as m:
        library = LibraryPrefill(m)
        warm = prefill_warm_cycle()
        cycles: list[PrefillCycle] = [warm, *prefill_cycles(3)]
        for i, cycle in enumerate(cycles):
            n, saved = (256, warm_rows) if i == 0 else (PREFILL_ROWS, rows)
            keyed = {HIDDEN_KEY: saved[0], MM_KEY: saved[1]}
            library.start(cycle.step)
            library.save(keyed, n, cycle.layout)
            theirs = library.materialize(cycle.req_ids)
            cache.start(cycle.step)
            cache.save(keyed, n, cycle.layout)
            ours = cache.materialize(cycle.req_ids)
            assert theirs.hidden_states is not None
            for req in cycle.req_ids:
                assert torch.equal(ours[HIDDEN_KEY][req], theirs.hidden_states[req]), req
                assert torch.equal(ours[MM_KEY][req], theirs.mm_outputs[MM_KEY][req]), req


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--steps", type=int, default=25, help="timed cycles per round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--width", type=int, default=WIDTH, help="hidden width")
    args = parser.parse_args()
    torch.set_num_threads(1)
    check_least(args.width)
    baseline = CopyBaseline(args.width)
    caches = ("least", "library, prefetch off", "library, prefetch on")
    # Per cache and round, the medians of its samples.
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in caches}
    for r in range(args.rounds):
        order = caches if r % 2 == 0 else caches[::-1]
        for name in order:
            if name == "least":
                samples = timed_round(LeastPrefill(args.width), args.steps, args.width, baseline)
            else:
                with make_manager(False, prefetch=name.endswith("on")) as manager:
                    samples = timed_round(LibraryPrefill(manager), args.steps, args.width, baseline)
                    assert manager.stats().writes_failed == 0
            rounds[name].append({k: statistics.median(v) for k, v in samples.items()})
    print(
        f"torch {torch.__version__}, CPU, one intra-op thread; prefill 16 x 512, 8 hits, hidden "
        f"width {args.width}, inline; process CPU per cycle, ms, median of the quietest of "
        f"{args.rounds} alternating rounds of {args.steps} cycles; the calls' columns are their "
        "own medians in that round"
    )
    print(
        f"{'cache':24} {'cycle':>7} {'copy1':>7} {'x copy1':>8} {'less copy1':>10} "
        f"{'start':>7} {'save':>7} {'materialize':>11}   rounds (x copy1)"
    )
    for name in caches:
        quietest = min(rounds[name], key=lambda m: (m["cycle"], m["copy1"]))
        cycle, copy1 = quietest["cycle"], quietest["copy1"]
        spread = ", ".join(f"{m['cycle'] / m['copy1']:.2f}" for m in rounds[name])
        calls = " ".join(
            f"{quietest[call] * 1e3:{w}.3f}" for call, w in zip(CALLS, (7, 7, 11), strict=True)
        )
        print(
            f"{name:24} {cycle * 1e3:7.3f} {copy1 * 1e3:7.3f} {cycle / copy1:8.2f} "
            f"{(cycle - copy1) * 1e3:10.3f} {calls}   {spread}"
        )
    print(f"target: <= {PREFILL_TARGET_RATIO:.2f} x copy1")


if __name__ == "__main__":
    main()
