"""What the NVTX flag costs on the CPU: adapter cycles with OMNI_CACHE_NVTX unset, set, and forced.

Three variants of `adapter_step.py`'s decode (256 x 1) and prefill (16 x 512, 8 hits) cycles, run
alternately round by round in one process so each round's variants see the same machine state:

- `unset`: the default, no ``OMNI_CACHE_NVTX`` in the environment;
- `set`: ``OMNI_CACHE_NVTX=1``; on the CPU the flag is accepted and no range is emitted (the
  claim under test: within noise of `unset`);
- `forced`: the ranges switched on as on CUDA, with ``torch.cuda.nvtx.range_push/range_pop``
  replaced by empty functions: the Python cost of the range hooks themselves when they are on
  (on CUDA the NVTX library adds its own, well under a microsecond per range).

Each round prints the median per-cycle CPU time of the engine thread (decode: what a step costs
the engine) and of the process (prefill: all the work); the summary gives, per variant, the median
of the rounds and the median of the per-round ratios to `unset`.

Run from the repository root: python bench/nvtx_cost.py [--rounds R] [--steps N] [--modes inline,threaded]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import adapter_step

from omni_cache_cuda import _manager, _nvtx

VARIANTS = ("unset", "set", "forced")


@contextlib.contextmanager
def variant(name: str) -> Iterator[None]:
    """Set the environment (and for `forced`, the range function) of one variant."""
    saved_env = os.environ.pop(_nvtx.ENV_VAR, None)
    # Patched where the manager looks it up; _manager imports it without re-exporting it.
    saved_ranges = _manager.ranges_for  # type: ignore[attr-defined]
    saved_push, saved_pop = torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop
    try:
        if name in ("set", "forced"):
            os.environ[_nvtx.ENV_VAR] = "1"
        if name == "forced":
            _manager.ranges_for = lambda device: _nvtx.nvtx_ranges  # type: ignore[attr-defined]
            torch.cuda.nvtx.range_push = lambda msg: 0
            torch.cuda.nvtx.range_pop = lambda: 0
        yield
    finally:
        _manager.ranges_for = saved_ranges  # type: ignore[attr-defined]
        torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop = saved_push, saved_pop
        os.environ.pop(_nvtx.ENV_VAR, None)
        if saved_env is not None:
            os.environ[_nvtx.ENV_VAR] = saved_env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds of every variant")
    parser.add_argument("--steps", type=int, default=200, help="decode cycles per run")
    parser.add_argument(
        "--modes", default="inline,threaded", help="committer modes, comma-separated"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    baseline = adapter_step.CopyBaseline()
    prefill_steps = max(8, args.steps // 8)
    rows = []
    for mode in args.modes.split(","):
        threaded = mode == "threaded"
        rows.append((f"decode 256x1 {mode}", adapter_step.bench_decode, args.steps, 20, threaded))
        rows.append(
            (f"prefill 16x512 {mode}", adapter_step.bench_prefill, prefill_steps, 4, threaded)
        )
    print(
        f"torch {torch.__version__}, 1 intra-op thread; {args.rounds} rounds; per-cycle medians "
        "in ms: engine-thread CPU for decode, process CPU for prefill"
    )
    results: dict[str, dict[str, list[float]]] = {}
    for name, bench, steps, warmup, threaded in rows:
        per = results.setdefault(name, {v: [] for v in VARIANTS})
        for r in range(args.rounds):
            # Rotate the order so no variant always runs first (after the previous row's memory
            # was freed) or last.
            order = VARIANTS[r % 3 :] + VARIANTS[: r % 3]
            figures = {}
            for v in order:
                with variant(v):
                    samples = bench(threaded, steps, warmup, baseline)
                cpu = samples.engine if bench is adapter_step.bench_decode else samples.cpu
                figures[v] = statistics.median(cpu) * 1e3
                per[v].append(figures[v])
            print(
                f"  {name:24} round {r + 1}: "
                + "  ".join(f"{v} {figures[v]:7.3f}" for v in VARIANTS)
            )
    print()
    print(
        f"{'cycle':24} {'unset ms':>9} {'set ms':>8} {'forced ms':>9} {'set/unset':>10} {'forced/unset':>13}"
    )
    for name, per in results.items():
        ratios = {
            v: statistics.median(a / b for a, b in zip(per[v], per["unset"], strict=True))
            for v in VARIANTS
        }
        print(
            f"{name:24} {statistics.median(per['unset']):9.3f} {statistics.median(per['set']):8.3f} "
            f"{statistics.median(per['forced']):9.3f} {ratios['set']:10.3f} {ratios['forced']:13.3f}"
        )


if __name__ == "__main__":
    main()
