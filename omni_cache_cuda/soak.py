"""Soak: a long run of a busy engine against the cache, every delivered row checked.

``python -m omni_cache_cuda.soak --minutes M --seed S`` (or ``--steps N``) runs two phases; the
run itself is `omni_cache_cuda.sim._soak.run` (the simulated scheduler, the output builder and
the checks live in `omni_cache_cuda.sim`), this command parses the flags and prints the report.

The clean phase keeps one manager for its whole length. An engine thread (this one) plays a
vLLM-style scheduler with prefix caching over a small paged KV cache: requests over a few shared
prompt families, hits on the longest registered prefix (also on blocks computed in the same
step), chunked prefill, decode, finishes, aborts, preemptions (the request's blocks go back to
the free list) and resumes (a hit on whatever of its blocks is still registered), request ids
used again, blocks recycled least or most recently freed first. Staging pages and the GPU-byte
budget are small, so saves wait for pages and deferred writes are flushed early. An output
builder thread consumes every step one to a few steps late, sometimes out of order (a step that
would skip positions an earlier one carries raises `DeliveryOrderError` and is retried after it),
discards some and leaves requests out of others.

The fault phase runs short episodes, each with a fresh manager and one fault injected at one of
the adapter's fault points (`omni_cache_cuda._faults`). Each must end in its typed error (D19):
a sticky `WriteFailedError` for the committer's points (every later call raises it too, then the
manager is shut down and rebuilt), a `StagingCopyError` or `HostAllocationError` from the save or
`reserve` that hit it (the engine aborts that step's requests, as after a failed forward), or a
`HitUnreadableError` from the materialize whose gather failed. Every episode ends with no page,
budget charge or thread of the library left.

The oracle: every row is a pure function of the token prefix it ends (a hash of the tokens up to
and including its position), so a hit on another request's blocks, a resume and a recompute must
all give the same value. Per admission (LIFE-1) the soak keeps which positions were delivered
(`StageCacheOutputs.positions`) and which were carried by steps that delivered nothing to it
(discarded, left out, failed): every position must be delivered at most once, with the right rows
for every cached key, in position order, and by the time the admission's last step is consumed
every computed position must be delivered or excused that way (DLV-2, DLV-4, DLV-6).

It prints rows checked, wrong rows, faults by kind, hangs, step time percentiles, and resident
and pinned bytes and thread counts over time, and exits 1 on a wrong row, an unexpected error, a
fault that did not end in its error, or memory or threads that grow past the stated bound after
warm-up; 2 on a hang (a call that did not return within the hang bound; the stacks are printed).
"""

from __future__ import annotations

import argparse
import array
import logging
import os
import sys
import time

import attrs
import numpy as np

from omni_cache_cuda._faults import FAULT_ERRORS
from omni_cache_cuda.sim._soak import RSS_BOUND_BYTES, SoakOptions, SoakRun, run
from omni_cache_cuda.sim._soak_checks import HANG_S

__all__ = ["main"]


def _percentile(values: array.array[float], q: float) -> float:
    if not values:
        return 0.0
    return float(np.percentile(np.frombuffer(values, dtype=np.float64), q))


def main(argv: list[str] | None = None) -> int:
    """Run the soak; return the exit status (0 pass, 1 failure, 2 hang)."""
    parser = argparse.ArgumentParser(
        prog="python -m omni_cache_cuda.soak", description=__doc__.split("\n\n")[0]
    )
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--minutes", type=float, help="run this long (default 1)")
    length.add_argument("--steps", type=int, help="run this many engine steps instead")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="where step tensors live (cpu or cuda)")
    parser.add_argument("--inline", action="store_true", help="inline writes, no committer")
    parser.add_argument(
        "--fault-share", type=float, default=0.3, help="share of the run for the fault phase"
    )
    parser.add_argument("--samples", type=int, default=12, help="memory rows to print")
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="show the library's log lines (the fault phase's failed writes log an error each)",
    )
    args = parser.parse_args(argv)
    if not args.verbose:
        logging.getLogger("omni_cache").setLevel(logging.CRITICAL)
    options = SoakOptions(
        minutes=args.minutes,
        steps=args.steps,
        seed=args.seed,
        device=args.device,
        inline=args.inline,
        fault_share=args.fault_share,
    )
    return _print_report(run(options, lambda soak: _print_report(soak, args)), args)


def _print_report(soak: SoakRun, args: argparse.Namespace) -> int:
    """Print what the run saw; return the exit status (0 pass, 1 failure, 2 hang)."""
    report, samples, warm, stats = soak.report, soak.samples, soak.warm, soak.stats
    mib = 2**20
    counts = report.counts
    elapsed = time.monotonic() - soak.began
    print(
        f"omni-cache soak: seed {args.seed}, {elapsed / 60:.1f} min, device {args.device}, "
        f"{'inline writes' if args.inline else 'committer thread'}, {os.cpu_count()} CPUs"
    )
    print(
        f"steps: {counts['clean steps']} clean, {counts['fault steps']} in "
        f"{counts['fault episodes']} fault episodes"
    )
    lifecycle = ", ".join(
        f"{counts[k]} {k}"
        for k in (
            "admissions",
            "admissions with a hit",
            "finished",
            "aborted",
            "preemptions",
            "resumes",
            "resumes with a hit",
            "ids used again",
            "blocks allocated",
        )
    )
    print(f"requests: {lifecycle}")
    print(
        f"consumes: {counts['steps materialized']} materialized, {counts['steps discarded']} "
        f"discarded, {counts['delivery order refusals']} refused for order and retried (DLV-5)"
    )
    if stats is not None:
        hits = ", ".join(f"{k} {v}" for k, v in stats.hit_rows.items() if v)
        print(
            f"clean phase cache: page waits {stats.page_waits}, budget flushes "
            f"{stats.budget_flushes}, timeouts {stats.timeouts}, hit rows by source: {hits}"
        )
    rows = sum(report.rows_checked.values())
    by_key = ", ".join(f"{k} {v}" for k, v in sorted(report.rows_checked.items()))
    print(
        f"rows checked: {rows} ({by_key}); positions delivered exactly once: "
        f"{report.positions_delivered}, passed over after a discard or a left-out request: "
        f"{report.positions_excused}; admissions checked whole: {counts['admissions checked']}"
    )
    print(f"wrong rows: {len(report.wrong)}")
    for text in report.wrong[:10]:
        print(f"  WRONG {text}")
    print(f"unexpected errors: {len(report.unexpected)}")
    for text in report.unexpected[:10]:
        print(f"  ERROR {text}")
    print("faults injected, by kind: episodes / fired / ended in their typed error / rebuilds")
    for kind, tally in report.faults.items():
        print(
            f"  {kind:<15} {FAULT_ERRORS[kind].__name__:<20} {tally['episodes']:>5} "
            f"{tally['fired']:>6} {tally['raised']:>6} {tally['rebuilds']:>6}"
        )
    print(f"hangs: {report.hangs} (a call running over {HANG_S:.0f}s)")
    print(
        f"step time (new_step_starts + save_outputs, clean and fault steps): "
        f"p50 {_percentile(report.step_ms, 50):.2f} ms, p99 {_percentile(report.step_ms, 99):.2f} ms"
    )
    print(
        "memory and threads over time: seconds, phase, steps, resident MiB, pinned MiB, "
        "Python threads, OS threads"
    )
    shown = samples
    if len(samples) > args.samples:
        picks = np.linspace(0, len(samples) - 1, args.samples).round().astype(int)
        shown = [samples[i] for i in sorted(set(picks.tolist()) | {warm.get("index", 0)})]
    warm_sample = samples[warm["index"]] if warm else None
    for row in shown:
        t, ph, steps, rss, pinned, py, ost = attrs.astuple(row)
        mark = "  <- warm-up ends" if row is warm_sample else ""
        print(
            f"  {t:8.1f} {ph:<7} {steps:>8} {rss / mib:9.1f} {pinned / mib:8.1f} {py:4d} "
            f"{ost:4d}{mark}"
        )
    verdicts: list[str] = []
    if warm and samples:
        after = samples[warm["index"] :]
        base = samples[warm["index"]]
        growth = max(s.resident for s in after) - base.resident
        py_growth = max(s.python_threads for s in after) - base.python_threads
        os_growth = max(s.os_threads for s in after) - base.os_threads
        pinned_growth = max(s.pinned for s in after) - base.pinned
        print(
            f"after warm-up ({warm['steps']} steps): resident grew {growth / mib:.1f} MiB "
            f"(bound {RSS_BOUND_BYTES / mib:.0f} MiB), pinned {pinned_growth / mib:.1f} MiB "
            f"(bound 0), threads {py_growth:+d} Python / {os_growth:+d} OS (bound 0)"
        )
        if growth > RSS_BOUND_BYTES:
            verdicts.append("resident memory grew past its bound")
        if pinned_growth > 0:
            verdicts.append("pinned memory grew")
        if py_growth > 0 or os_growth > 0:
            verdicts.append("threads grew")
    if report.wrong:
        verdicts.append("wrong rows")
    if report.unexpected:
        verdicts.append("unexpected errors")
    if report.hangs:
        verdicts.append("hangs")
    if rows == 0:
        verdicts.append("no rows checked")
    status = 2 if report.hangs else (1 if verdicts else 0)
    print(f"verdict: {'PASS' if not verdicts else 'FAIL: ' + ', '.join(verdicts)}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
