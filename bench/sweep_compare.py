"""Compare sweep points with an earlier revision's, round by round in one run.

`sweep.py` prints one run of each point; a change of 20 % at a point cannot be told from the
machine's swing between two such runs. This script extracts the packages of a git revision
and runs the chosen points of `sweep.py` (this tree's copy) alternately against that revision
and this tree, one round each in a fresh process, the order of the two flipped every round
(`adapter_compare.interleaved`). It prints each round's cycle and copy figures per version and
the median of the per-round ratios of the cycles (this tree / revision).

Points are ``KIND:REQUESTS:WIDTH`` (`prefill` or `decode`, as in `sweep.py`); `--threaded` runs
them on threaded managers instead of `sweep.py`'s inline ones (threaded mode's steps under
2 MiB go through a staging page), `--no-prefetch` on managers without the hit prefetch (as a
CPU manager runs by default since DESIGN D38; without it both trees prefetch), `--lag` with each
step materialized after the next step's save (`sweep.Mode.lag`).

Run from the repository root: python bench/sweep_compare.py REV [--points P,..] [--rounds R]
[--steps N] [--threaded] [--no-prefetch] [--lag]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from adapter_compare import ROOT, interleaved, print_rounds, run_json

#: One round in a fresh process: the points' medians, as JSON on the last line.
_ROUND = """
import json, sys
sys.path.insert(0, {bench!r})
import torch
import sweep

torch.set_num_threads(1)
out = {{}}
for kind, requests, width in {points!r}:
    mode = sweep.Mode(threaded={threaded!r}, prefetch={prefetch!r}, lag={lag!r})
    point = getattr(sweep, kind)(requests, width, {steps!r}, 3, mode)
    out[f"{{kind}} {{requests}} x {{width}}"] = (point.cycle_ms, point.copy_ms)
print(json.dumps(out))
"""


def _run(
    tree: Path,
    points: list[tuple[str, int, int]],
    steps: int,
    threaded: bool,
    prefetch: bool,
    lag: bool,
) -> dict[str, tuple[float, float]]:
    code = _ROUND.format(
        bench=str(ROOT / "bench"),
        threaded=threaded,
        prefetch=prefetch,
        lag=lag,
        points=points,
        steps=steps,
    )
    return run_json(tree, code)  # type: ignore[no-any-return]


def _points(text: str) -> list[tuple[str, int, int]]:
    points = []
    for item in text.split(","):
        kind, requests, width = item.split(":")
        if kind not in ("prefill", "decode"):
            raise SystemExit(f"a point's kind is prefill or decode, not {kind!r}")
        points.append((kind, int(requests), int(width)))
    return points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rev", help="git revision to compare against")
    parser.add_argument("--points", default="prefill:16:2048,prefill:256:1024")
    parser.add_argument("--rounds", type=int, default=4, help="rounds per version")
    parser.add_argument("--steps", type=int, default=15, help="steps per point and round")
    parser.add_argument("--threaded", action="store_true", help="threaded managers")
    parser.add_argument("--no-prefetch", action="store_true", help="managers without prefetch")
    parser.add_argument(
        "--lag", action="store_true", help="each step materialized after the next one's save"
    )
    args = parser.parse_args()
    points = _points(args.points)
    results = interleaved(
        args.rev,
        args.rounds,
        lambda tree: _run(tree, points, args.steps, args.threaded, not args.no_prefetch, args.lag),
    )
    mode = ("threaded" if args.threaded else "inline") + (" without prefetch" * args.no_prefetch)
    mode += ", each step materialized after the next one's save" * args.lag
    print(f"sweep points, {mode} managers, {args.rounds} rounds of {args.steps} steps per version")
    print(f"{'point':26} {'version':>10}  cycle ms per round / copy ms per round")
    for point in results["tree"][0]:
        print_rounds(point, results, width=26, number="7.3f")
        ratio = statistics.median(
            new[point][0] / old[point][0]
            for new, old in zip(results["tree"], results[args.rev], strict=True)
        )
        print(f"{point:26} {'ratio':>10}  cycle {ratio:.2f} (tree / {args.rev}, median of rounds)")


if __name__ == "__main__":
    main()
