"""Compare the core's step cycle with an earlier revision's, in one process.

The shared machine this project is measured on changes speed by up to 2x from minute to minute,
so two runs of `core_step.py` minutes apart cannot tell a 20 % change from the machine's swing.
This script loads `omni_cache_core` from a git revision under another package name beside the
working tree's, and runs the two versions' decode (same and shuffled row order) and prefill cycles (from `core_step.py`)
interleaved round by round, so both see the same machine state. It prints each round's median
per version and the median ratio (this tree / revision).

Run from the repository root: python bench/core_compare.py REV [--rounds R]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OLD = "omni_cache_core_old"


def _load(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _renamed(text: str) -> str:
    return text.replace("omni_cache_core", OLD)


def _export_old(rev: str, into: Path) -> None:
    """Write the revision's core package into `into` as `omni_cache_core_old`."""
    names = subprocess.run(
        ["git", "ls-tree", "--name-only", rev, "omni_cache_core/"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    package = into / OLD
    package.mkdir()
    for name in names:
        if name.endswith(".py"):
            text = subprocess.run(
                ["git", "show", f"{rev}:{name}"],
                cwd=ROOT,
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            (package / Path(name).name).write_text(_renamed(text))
    # The benchmark's own code is this tree's, pointed at the old package.
    (into / "core_step_old.py").write_text(_renamed((ROOT / "bench" / "core_step.py").read_text()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rev", help="git revision to compare with, e.g. HEAD~1")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    with tempfile.TemporaryDirectory() as tmp:
        _export_old(args.rev, Path(tmp))
        sys.path.insert(0, tmp)
        versions = {
            args.rev: _load("core_step_old", Path(tmp) / "core_step_old.py"),
            "tree": _load("core_step_new", ROOT / "bench" / "core_step.py"),
        }
        medians: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.rounds):
            for name, bench in versions.items():
                decode = bench.bench_decode(120)[20:]
                shuffled = bench.bench_decode_shuffled(120)[20:]
                prefill = bench.bench_prefill(40)[0][5:]
                medians.setdefault((name, "decode"), []).append(statistics.median(decode) * 1e6)
                medians.setdefault((name, "shuffled"), []).append(statistics.median(shuffled) * 1e6)
                medians.setdefault((name, "prefill"), []).append(statistics.median(prefill) * 1e6)
    print(f"{'step':8} {'version':12} rounds' medians (us)")
    for step in ("decode", "shuffled", "prefill"):
        for name in versions:
            print(f"{step:8} {name:12} " + " ".join(f"{m:.0f}" for m in medians[(name, step)]))
        ratios = [
            new / old
            for old, new in zip(medians[(args.rev, step)], medians[("tree", step)], strict=True)
        ]
        print(f"{step:8} {'tree/' + args.rev:12} median ratio {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
