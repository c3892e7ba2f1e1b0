"""Where an inline prefill cycle's time goes beside its one-copy baseline, and what the
materialize's gathers cost into fresh buffers and into a reused one.

`adapter_step.py` prints the prefill cycle (16 requests x 512 tokens, 8 of them starting with a
256-token hit; hidden width 2048 bf16 plus one mm key of width 16) as one figure against the
copies of the one-copy path (`copy1`: the pool write, then one gather of the step's rows and one
of the hit rows per key, into output buffers allocated once). This script runs the same cycles
(inline, the hit prefetch off, so that every copy runs on this thread) and prints the medians of
their parts, each this thread's CPU time:

- `start`, `save`, `materialize`: the manager's three calls; inside them `pool write` (the
  save's one copy, `SavePath._write_now`) and `build` (the consume's gathers and outputs,
  `ConsumePath._build`);
- `core`: the core's calls inside them, summed (`CacheCore.start_step`, `save_begin`,
  `save_proceed`, `save_commit`, `consume_begin`, `consume_end` and the write's reports);
- `copy1 write` and `copy1 gather`: the one-copy baseline's two halves, on the same step.

Then four probes, run on each cycle's own plan right before its build (in rotating order, so
no probe always meets the pool rows cold), each doing only the hidden key's gathers:

- `same gathers, fresh buffers`: the build's gathers (one for the requests without a hit, a
  prefix and an own-rows gather per hit request) into buffers allocated as the build allocates
  them (`empty_rows`), no bookkeeping;
- `same gathers, reused buffer`: the same gathers into views of one buffer allocated once;
- `one gather, reused buffer`: every row of the step, hits included, in one gather into it;
- `one gather, one fresh buffer`: the same into one buffer allocated for it (`empty_rows`), as
  a consume that hands out every request's rows as views of one buffer per key would.

Read together: the build against `same gathers, fresh buffers` is its bookkeeping; fresh
against reused is what writing into new memory costs (outputs are new memory each step: the
caller keeps them); the two reused probes show what the number of gathers costs; the last probe
what one large new buffer costs instead of several smaller ones. The baseline writes into
buffers it reuses, so `copy1 gather` is the reused case.

`--width 16` runs the same cycles with hidden states of width 16 instead of 2048, as
`decode_floor.py`'s narrow row does: the same calls on the same requests, with copies of a few
kilobytes, so the cycle less its copies is the step's fixed cost, which the 1.05 x target of
`adapter_step.py` has to fit in 5 % of the copies at width 2048.

Run: python bench/prefill_floor.py [--steps N] [--rounds R] [--width W]
"""

from __future__ import annotations

import argparse
import collections
import functools
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import adapter_step
from adapter_step import CAPACITY, DTYPE, WIDTH, CopyBaseline, bench_prefill

from omni_cache_core import HIDDEN_KEY, _core
from omni_cache_cuda import _consume_path, _manager, _save_path
from omni_cache_cuda._storage import alloc_host, empty_rows

_TIMED = (
    (_manager.OmniPrefixCacheManager, "new_step_starts", "start"),
    (_manager.OmniPrefixCacheManager, "save_outputs", "save"),
    (_manager.OmniPrefixCacheManager, "materialize", "materialize"),
    (_save_path.SavePath, "_write_now", "pool write"),
    (_consume_path.ConsumePath, "_build", "build"),
    *(
        (_core.CacheCore, name, "core")
        for name in (
            "start_step",
            "save_begin",
            "save_proceed",
            "save_commit",
            "consume_begin",
            "consume_end",
            "report",
        )
    ),
)
PROBES = (
    "same gathers, fresh buffers",
    "same gathers, reused buffer",
    "one gather, reused buffer",
    "one gather, one fresh buffer",
)
COLUMNS = (
    "start",
    "save",
    "pool write",
    "materialize",
    "build",
    "core",
    "copy1 write",
    "copy1 gather",
    *PROBES,
)


class Probes:
    """The hidden key's gathers of one consume, done four ways outside the cache."""

    def __init__(self, samples: dict[str, list[int]], width: int) -> None:
        self.samples = samples
        self.reused = alloc_host((2 * CAPACITY, width), DTYPE, pin=False)
        self.turn = 0

    def run(self, consume: Any, plan: Any, ctx: Any, wanted: tuple[str, ...]) -> None:
        pool = consume._pool.tensors[HIDDEN_KEY]
        hits = {r.req_id: r.slots for r in plan.reads if r.key == HIDDEN_KEY}
        plain = [req for req in wanted if req not in hits]
        # The build's gathers, as (pool slots, rows) in the order it makes them.
        pieces = [np.concatenate([ctx.slots[slice(*ctx.req_rows[req])] for req in plain])]
        for req in wanted:
            if req in hits:
                pieces += [hits[req], ctx.slots[slice(*ctx.req_rows[req])]]
        index = [torch.from_numpy(p.astype(np.int64)) for p in pieces]
        ways: tuple[Callable[[], object], ...] = (
            functools.partial(self._fresh, pool, index),
            functools.partial(self._reused, pool, index),
            functools.partial(self._reused, pool, [torch.cat(index)]),
            functools.partial(self._one_fresh, pool, torch.cat(index)),
        )
        self.turn += 1
        for k in range(len(ways)):
            at = (self.turn + k) % len(ways)
            t0 = time.thread_time_ns()
            kept = ways[at]()
            self.samples[PROBES[at]].append(time.thread_time_ns() - t0)
            del kept

    @staticmethod
    def _fresh(pool: torch.Tensor, index: list[torch.Tensor]) -> object:
        # One buffer for the requests without a hit, one per hit request (prefix and own rows).
        width = pool.shape[1]
        outs = [empty_rows((len(index[0]), width), DTYPE)]
        torch.index_select(pool, 0, index[0], out=outs[0])
        for prefix, own in zip(index[1::2], index[2::2], strict=True):
            out = empty_rows((len(prefix) + len(own), width), DTYPE)
            torch.index_select(pool, 0, prefix, out=out[: len(prefix)])
            torch.index_select(pool, 0, own, out=out[len(prefix) :])
            outs.append(out)
        return outs

    @staticmethod
    def _one_fresh(pool: torch.Tensor, index: torch.Tensor) -> object:
        out = empty_rows((len(index), pool.shape[1]), DTYPE)
        torch.index_select(pool, 0, index, out=out)
        return out

    def _reused(self, pool: torch.Tensor, index: list[torch.Tensor]) -> object:
        at = 0
        for part in index:
            torch.index_select(pool, 0, part, out=self.reused[at : at + len(part)])
            at += len(part)
        return None


@contextmanager
def instrumented(samples: dict[str, list[int]], width: int) -> Iterator[None]:
    """Time the parts of every cycle; probe each consume's gathers; split the baseline."""
    step: collections.Counter[str] = collections.Counter()
    probes = Probes(samples, width)
    run = CopyBaseline.run
    originals: list[tuple[Any, str, Any]] = [(CopyBaseline, "run", run)]

    def wrapper(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if name == "build":
                consume, plan, ctx, _, wanted = args
                p0 = time.thread_time_ns()
                probes.run(consume, plan, ctx, wanted)
                step["probes"] += time.thread_time_ns() - p0  # not the materialize's
            t0 = time.thread_time_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                step[name] += time.thread_time_ns() - t0

        return call

    def baseline(self: CopyBaseline, rows: Any, slots: Any, hit_slots: Any) -> Any:
        # The cycle is over when its baseline runs: close its parts, then split the one-copy
        # path's halves on the same step (the whole baseline runs after, for the cycle's figure).
        step["materialize"] -= step.pop("probes")
        for name, value in step.items():
            samples[name].append(value)
        step.clear()
        t0 = time.thread_time_ns()
        self.write_one_copy(rows, slots.numpy())
        t1 = time.thread_time_ns()
        self.gather_one_copy(slots, hit_slots)
        t2 = time.thread_time_ns()
        samples["copy1 write"].append(t1 - t0)
        samples["copy1 gather"].append(t2 - t1)
        return run(self, rows, slots, hit_slots)

    for owner, attr, name in _TIMED:
        fn = owner.__dict__[attr]
        originals.append((owner, attr, fn))
        setattr(owner, attr, wrapper(fn, name))
    CopyBaseline.run = baseline  # type: ignore[method-assign]
    try:
        yield
    finally:
        for owner, attr, fn in originals:
            setattr(owner, attr, fn)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--steps", type=int, default=30, help="prefill cycles per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--width", type=int, default=WIDTH, help="hidden width (16: the cycle's fixed cost)"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    baseline = CopyBaseline(args.width)
    rounds: list[dict[str, list[int]]] = []
    for _ in range(args.rounds):
        samples: dict[str, list[int]] = collections.defaultdict(list)
        with instrumented(samples, args.width):
            bench_prefill(False, args.steps, 4, baseline, prefetch=False, width=args.width)
        warm = {name: values[4:] for name, values in samples.items()}  # the warm-up's cycles
        rounds.append(warm)
    print(
        f"torch {torch.__version__}, CPU, one intra-op thread; {adapter_step.__name__}'s inline "
        f"prefill (16 x 512, 8 hits), hidden width {args.width}, hit prefetch off; ms per cycle, "
        f"this thread's CPU, median "
        f"of the round with the least materialize ({args.rounds} rounds of {args.steps} cycles)"
    )
    best = min(rounds, key=lambda r: statistics.median(r["materialize"]))
    for name in COLUMNS:
        spread = ", ".join(f"{statistics.median(r[name]) / 1e6:.3f}" for r in rounds)
        print(f"{name:<30}{statistics.median(best[name]) / 1e6:8.3f}   rounds: {spread}")
    m = {name: statistics.median(best[name]) / 1e6 for name in COLUMNS}
    cycle = m["start"] + m["save"] + m["materialize"]
    copy1 = m["copy1 write"] + m["copy1 gather"]
    print(
        f"cycle (start + save + materialize) {cycle:.3f} ms, copy1 {copy1:.3f} ms, cycle less "
        f"copy1 {cycle - copy1:.3f} ms (of it the core {m['core']:.3f} ms, the rest "
        f"{cycle - copy1 - m['core']:.3f} ms); build less the same gathers into "
        f"fresh buffers {m['build'] - m[PROBES[0]]:.2f} ms; fresh less reused "
        f"{m[PROBES[0]] - m[PROBES[1]]:.2f} ms; one gather less the same gathers "
        f"{m[PROBES[2]] - m[PROBES[1]]:.2f} ms; one fresh buffer less the build's "
        f"{m[PROBES[3]] - m[PROBES[0]]:.2f} ms"
    )


if __name__ == "__main__":
    main()
