"""Compare the decode step through the vLLM glue with an earlier revision's, round by round.

`decode_least.py` times `step_begin` + `save` of `vllm_glue.py`'s decode step (256 x 1, order
kept, threaded manager) in two thread placements; two runs minutes apart cannot tell a 10 %
change from the machine's swing. This script extracts the packages of a git revision and runs
that timing (`decode_least.library_round`, this tree's copy) alternately against the revision
and this tree, one round each in a fresh process, the order of the two flipped every round
(`adapter_compare.interleaved`). It prints each round's engine-thread CPU per step, per
placement and version, and the median of the per-round ratios (this tree / revision).

Linux only (thread placement). Run from the repository root:
python bench/glue_compare.py REV [--rounds R] [--steps N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from adapter_compare import ROOT, interleaved, run_json

#: One round in a fresh process: each placement's median, as JSON on the last line.
_ROUND = """
import json, sys
sys.path.insert(0, {bench!r})
import torch
import decode_least as dl

torch.set_num_threads(1)
setup, steps, tensors = dl.inputs({steps!r})
out = {{
    p: dl.library_round(setup, steps, dl.WARMUP, p, tensors)["total"] for p in dl.placements()
}}
print(json.dumps(out))
"""


def _run(tree: Path, steps: int) -> dict[str, float]:
    return run_json(tree, _ROUND.format(bench=str(ROOT / "bench"), steps=steps))  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rev", help="git revision to compare against")
    parser.add_argument("--rounds", type=int, default=6, help="rounds per version")
    parser.add_argument("--steps", type=int, default=150, help="decode steps per round")
    args = parser.parse_args()
    results = interleaved(args.rev, args.rounds, lambda tree: _run(tree, args.steps))
    print(
        f"decode 256 x 1 through the glue, threaded, order kept: engine-thread CPU us per step "
        f"(step_begin + save), {args.rounds} rounds of {args.steps} steps per version"
    )
    for placement in results["tree"][0]:
        for name, rounds in results.items():
            figures = " ".join(f"{r[placement]:6.1f}" for r in rounds)
            print(f"{placement:10} {name:>10}  {figures}")
        ratio = statistics.median(
            new[placement] / old[placement]
            for new, old in zip(results["tree"], results[args.rev], strict=True)
        )
        print(f"{placement:10} {'ratio':>10}  {ratio:.3f} (tree / {args.rev}, median of rounds)")


if __name__ == "__main__":
    main()
