"""Compare whole adapter cycles with an earlier revision's, round by round in one run.

`adapter_step.py` measures this tree's adapter; on a machine whose speed swings by up to 2x,
two such runs minutes apart cannot tell a 20 % change from the swing. This script extracts the
packages of a git revision into a temporary folder and runs `adapter_step.py` (this tree's copy;
it uses only the public API) alternately against that revision and this tree, one round each in
a fresh process, the order flipped every round, so neighbouring rounds see the same machine
state. It prints each round's figures per version and the median ratio (this tree / revision)
of the engine thread's CPU time and of the process's CPU time per cycle, per row.

Run from the repository root: python bench/adapter_compare.py REV [--rounds R] [--steps N]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")
STEP_SCRIPT = ROOT / "bench" / "adapter_step.py"
#: A result row of adapter_step.py: name, wall, p90, engine, cpu, copy3, x copy3, copy1, ...
#: (ms). The revision's run is this tree's script, so the columns are the same for both. The
#: diagnostic row (`inline, no prefetch`) does not match: the four configurations are compared.
ROW = re.compile(
    r"^(?P<name>(?:decode|prefill).*?(?:inline|threaded))\s+(?P<wall>[\d.]+)\s+[\d.]+\s+"
    r"(?P<engine>[\d.]+)\s+(?P<cpu>[\d.]+)\s+(?P<copy>[\d.]+)\s+[\d.]+\s+(?P<copy1>[\d.]+)",
    re.MULTILINE,
)


def interleaved(rev: str, rounds: int, run: Callable[[Path], T]) -> dict[str, list[T]]:
    """``run`` against the packages of git revision ``rev`` and against this tree's, one call
    each per round, the order flipped every round; results per version (``rev``, ``"tree"``)."""
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(
            ["git", "archive", rev, "omni_cache_core", "omni_cache_cuda"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        order = [(rev, Path(tmp)), ("tree", ROOT)]
        results: dict[str, list[T]] = {name: [] for name, _ in order}
        for r in range(rounds):
            for name, tree in order if r % 2 == 0 else reversed(order):
                results[name].append(run(tree))
    return results


def run_json(tree: Path, code: str) -> Any:
    """Run ``code`` in a fresh interpreter that imports the packages in ``tree``; return the
    JSON value its output ends with."""
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=dict(os.environ, PYTHONPATH=str(tree)),
        capture_output=True,
        text=True,
        check=True,
        cwd=tempfile.gettempdir(),  # so the working tree's packages are not found by accident
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def print_rounds(
    row: str,
    results: Mapping[str, Sequence[Mapping[str, Sequence[float]]]],
    *,
    width: int,
    number: str,
) -> None:
    """Print a row's first two figures of every round, one line per version: ``a a / b b``."""
    for name, rounds in results.items():
        first = " ".join(f"{r[row][0]:{number}}" for r in rounds)
        second = " ".join(f"{r[row][1]:{number}}" for r in rounds)
        print(f"{row:{width}} {name:>10}  {first}  /  {second}")


def _run(tree: Path, steps: int) -> dict[str, tuple[float, float, float, float]]:
    """One round of adapter_step.py against the packages in `tree`.

    Returns name -> (engine, cpu, three-copy copies, one-copy copies), in ms per cycle.
    """
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run(
        [sys.executable, str(STEP_SCRIPT), "--rounds", "1", "--steps", str(steps)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=tempfile.gettempdir(),  # so the working tree's packages are not found by accident
    ).stdout
    rows = {
        m["name"].strip(): (
            float(m["engine"]),
            float(m["cpu"]),
            float(m["copy"]),
            float(m["copy1"]),
        )
        for m in ROW.finditer(out)
    }
    if len(rows) != 4:
        raise SystemExit(f"could not read adapter_step.py's output:\n{out}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rev", help="git revision to compare against")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per version")
    parser.add_argument("--steps", type=int, default=200, help="decode cycles per round")
    args = parser.parse_args()
    results = interleaved(args.rev, args.rounds, lambda tree: _run(tree, args.steps))
    versions = (args.rev, "tree")
    print(f"adapter cycles, {args.rounds} rounds of {args.steps} decode steps per version")
    print(f"{'cycle':31} {'version':>10}  engine ms per round / cpu ms per round")
    for row in results["tree"][0]:
        print_rounds(row, results, width=31, number="6.3f")
        ratios = [
            (new[row][0] / old_[row][0], new[row][1] / old_[row][1])
            for new, old_ in zip(results["tree"], results[args.rev], strict=True)
        ]
        engine_ratio = statistics.median(r[0] for r in ratios)
        cpu_ratio = statistics.median(r[1] for r in ratios)
        print(
            f"{row:31} {'ratio':>10}  engine {engine_ratio:.2f}, cpu {cpu_ratio:.2f} "
            f"(tree / {args.rev}, median of rounds)"
        )
        for name in versions:
            # The cycle against each round's own copies, both baselines (median of rounds).
            x3 = statistics.median(r[row][1] / r[row][2] for r in results[name])
            x1 = statistics.median(r[row][1] / r[row][3] for r in results[name])
            print(f"{row:31} {name:>10}  cpu / copy3 {x3:.2f}, cpu / copy1 {x1:.2f}")


if __name__ == "__main__":
    main()
