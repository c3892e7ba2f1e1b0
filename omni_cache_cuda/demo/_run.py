"""Command line of the demo: run the workload twice and check the talker saw the same rows.

Run 1 (the reference) serves the workload without prefix caching: every prompt token is computed
and the talker gets the forward's rows directly. Run 2 serves it with hash-based KV prefix caching
and the omni prefix cache: hit prefixes are skipped by the model, and the talker gets the rows
``materialize`` merges (hit prefix from the host mirror, then the computed rows), one step late on
an output-builder thread. The two must agree to float rounding.

Figures go to stdout as text, and with ``--json PATH`` to a JSON file; ``--plot PATH`` draws
per-step time of both runs and the hit rate over the run (matplotlib). The progress bar is tqdm's
when tqdm is installed (the ``demo`` extra), else a plain one.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TextIO

import attrs
import torch
from attrs import frozen

from omni_cache_cuda import (
    HIDDEN_KEY,
    CacheStats,
    ModelCachePolicy,
    OmniPrefixCacheManager,
    PrefixCacheConfig,
)

from ._engine import Engine, EngineConfig, RunReport
from ._model import ModelConfig, TinyCausalLM
from ._plot import require_matplotlib, write_plot
from ._stages import TALKER_KEY, DirectSink, OmniSink, Talker
from ._workload import RequestSpec, WorkloadConfig, make_workload

__all__ = ["Comparison", "compare_runs", "main"]

#: Largest relative difference (max |a - b| over max |b|, per request) accepted as rounding.
DEFAULT_TOLERANCE = 1e-4


@frozen(kw_only=True)
class Comparison:
    """How far the talker's inputs in the cached run are from those of the full recompute.

    Attributes:
        requests: Requests compared.
        rows: Rows compared.
        max_abs_hidden: Largest absolute difference of a hidden-state element.
        max_rel_hidden: Largest per-request ``max |a - b| / max |ref|`` of the hidden states.
        max_abs_talker: Largest absolute difference of a ``talker.h`` element.
        max_rel_talker: Same as ``max_rel_hidden`` for ``talker.h``.
        max_abs_voice: Largest absolute difference of the talker's full-prompt summary.
        token_mismatches: Requests whose generated tokens differ (rows compared up to the first).
        incomplete: Requests whose talker rows have gaps or the wrong length.
    """

    requests: int
    rows: int
    max_abs_hidden: float
    max_rel_hidden: float
    max_abs_talker: float
    max_rel_talker: float
    max_abs_voice: float
    token_mismatches: int
    incomplete: tuple[str, ...]

    def ok(self, tolerance: float) -> bool:
        """Return True if every row arrived and every difference is at rounding level."""
        return (
            not self.incomplete
            and self.max_rel_hidden <= tolerance
            and self.max_rel_talker <= tolerance
            and self.max_abs_voice <= tolerance
        )


def _rel(diff: float, ref: torch.Tensor) -> float:
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    return diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)


def compare_runs(
    specs: Sequence[RequestSpec],
    reference: tuple[RunReport, Talker],
    candidate: tuple[RunReport, Talker],
) -> Comparison:
    """Compare what the talker received in two runs of the same workload.

    Args:
        specs: The workload.
        reference: Report and talker of the run without prefix caching.
        candidate: Report and talker of the run under test.

    Returns:
        The largest differences found, and the requests whose rows are incomplete.
    """
    ref_report, ref_talker = reference
    got_report, got_talker = candidate
    abs_h = rel_h = abs_t = rel_t = abs_v = 0.0
    rows = mismatches = 0
    incomplete = []
    for spec in specs:
        r = spec.req_id
        ref_out, got_out = ref_report.outputs[r], got_report.outputs[r]
        common = 0
        while common < min(len(ref_out), len(got_out)) and ref_out[common] == got_out[common]:
            common += 1
        if ref_out != got_out:
            mismatches += 1
        try:
            ref_h, ref_t = ref_talker.rows(r)
            got_h, got_t = got_talker.rows(r)
        except ValueError:
            incomplete.append(r)
            continue
        # Rows exist for every token fed to the model: the prompt and all outputs but the last.
        if got_h.shape[0] != len(spec.prompt) + len(got_out) - 1 or r not in got_talker.voices:
            incomplete.append(r)
            continue
        k = len(spec.prompt) + min(common, len(got_out) - 1)
        dh = float((got_h[:k] - ref_h[:k]).abs().max())
        dt = float((got_t[:k] - ref_t[:k]).abs().max())
        abs_h, rel_h = max(abs_h, dh), max(rel_h, _rel(dh, ref_h[:k]))
        abs_t, rel_t = max(abs_t, dt), max(rel_t, _rel(dt, ref_t[:k]))
        abs_v = max(abs_v, float((got_talker.voices[r] - ref_talker.voices[r]).abs().max()))
        rows += k
    return Comparison(
        requests=len(specs),
        rows=rows,
        max_abs_hidden=abs_h,
        max_rel_hidden=rel_h,
        max_abs_talker=abs_t,
        max_rel_talker=rel_t,
        max_abs_voice=abs_v,
        token_mismatches=mismatches,
        incomplete=tuple(incomplete),
    )


class Progress(Protocol):
    """What a run reports its progress to: called after each step, closed at the end."""

    def __call__(self, done: int, total: int) -> None:
        """Requests ended so far, of ``total``."""

    def close(self) -> None:
        """End the bar's line."""


class _TqdmProgress:
    """tqdm's bar, shown once a run has lasted a few seconds."""

    def __init__(self, label: str, stream: TextIO, *, enabled: bool, delay_s: float = 2.0) -> None:
        from tqdm import tqdm

        self.bar = tqdm(
            desc=f"  {label}",
            unit="req",
            file=stream,
            disable=not enabled,
            delay=delay_s,
            leave=True,
            dynamic_ncols=True,
        )

    def __call__(self, done: int, total: int) -> None:
        if self.bar.total != total:
            self.bar.total = total
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        self.bar.close()


def make_progress(label: str, stream: TextIO, *, enabled: bool, delay_s: float = 2.0) -> Progress:
    """tqdm's progress bar when tqdm is installed, else the plain one."""
    try:
        return _TqdmProgress(label, stream, enabled=enabled, delay_s=delay_s)
    except ImportError:
        return _Progress(label, stream, enabled=enabled, delay_s=delay_s)


class _Progress:
    """A one-line text progress bar that appears only once a run has lasted a few seconds.

    The fallback when tqdm is not installed.
    """

    def __init__(self, label: str, stream: TextIO, *, enabled: bool, delay_s: float = 2.0) -> None:
        self.label = label
        self.stream = stream
        self.enabled = enabled
        self.delay_s = delay_s
        self.start_s = time.perf_counter()
        self.last_s = 0.0
        self.shown = False

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if not self.enabled or now - self.start_s < self.delay_s:
            return
        if now - self.last_s < 0.2 and done < total:
            return
        self.last_s = now
        width = 30
        filled = width * done // max(total, 1)
        bar = "#" * filled + "." * (width - filled)
        self.stream.write(
            f"\r  {self.label:<24} [{bar}] {done}/{total} requests {now - self.start_s:5.1f}s"
        )
        self.stream.flush()
        self.shown = True

    def close(self) -> None:
        if self.shown:
            self.stream.write("\n")
            self.stream.flush()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="omni-cache demo",
        description=(
            "Serve a shared-prefix workload with a small transformer twice, with and without "
            "KV prefix caching, and check that the second stage receives the same full-prompt "
            "hidden states through the omni prefix cache."
        ),
    )
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default=None,
        help="where the model, KV cache and outputs live (default: cuda if available)",
    )
    p.add_argument("--requests", type=int, default=None, help="number of requests (default 200)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload and the weights")
    p.add_argument("--max-batched-tokens", type=int, default=256, help="token budget per step")
    p.add_argument("--max-num-seqs", type=int, default=32, help="most requests running at once")
    p.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="KV blocks (default 320, 128 with --quick: small enough that cached blocks get recycled)",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--threaded",
        dest="threaded",
        action="store_const",
        const=True,
        default=None,
        help="cache writes on a committer thread",
    )
    mode.add_argument(
        "--inline",
        dest="threaded",
        action="store_const",
        const=False,
        help="cache writes inline on the saving thread",
    )
    p.add_argument(
        "--defer-mm",
        action="store_true",
        help=f"cache {TALKER_KEY} as a deferred key (written when its request ends)",
    )
    p.add_argument(
        "--gpu-staging-bytes",
        type=int,
        default=None,
        help="device clone budget of the cache (small values force budget flushes)",
    )
    p.add_argument(
        "--staging-depth",
        type=int,
        default=None,
        help="staging pages of the cache (2 makes the one-step-late builder cause page waits)",
    )
    p.add_argument("--quick", action="store_true", help="a short run (48 requests)")
    p.add_argument(
        "--tolerance",
        type=float,
        default=DEFAULT_TOLERANCE,
        help="largest relative difference accepted (default 1e-4)",
    )
    p.add_argument("--no-progress", action="store_true", help="never draw the progress bar")
    p.add_argument(
        "--json", metavar="PATH", type=Path, help="also write the figures to PATH as JSON"
    )
    p.add_argument(
        "--plot",
        metavar="PATH",
        type=Path,
        help="draw per-step time with and without prefix caching and the hit rate over the run "
        "into PATH (.png, .svg or .pdf; needs matplotlib)",
    )
    p.add_argument(
        "--verbose",
        action="store_true",
        help="print the cache's log lines (logger 'omni_cache', INFO) to stderr",
    )
    return p


def _sources(stats: CacheStats) -> str:
    served = {name.lower(): count for name, count in stats.hit_rows.items() if count}
    others = [name.lower() for name, count in stats.hit_rows.items() if not count]
    text = ", ".join(f"{name} {count}" for name, count in served.items()) or "none"
    return f"{text}; none from {', '.join(others)}" if others else text


def _run_reference(
    model: TinyCausalLM,
    config: EngineConfig,
    specs: Sequence[RequestSpec],
    device: str,
    progress: Progress,
) -> tuple[RunReport, Talker]:
    talker = Talker({s.req_id: len(s.prompt) for s in specs}, d_model=model.config.d_model)
    engine = Engine(model, attrs.evolve(config, enable_prefix_caching=False), device=device)
    try:
        return engine.run(specs, DirectSink(talker), progress=progress), talker
    finally:
        progress.close()


def _run_cached(
    model: TinyCausalLM,
    config: EngineConfig,
    specs: Sequence[RequestSpec],
    device: str,
    args: argparse.Namespace,
    progress: Progress,
) -> tuple[RunReport, Talker, CacheStats]:
    talker = Talker({s.req_id: len(s.prompt) for s in specs}, d_model=model.config.d_model)
    engine = Engine(model, config, device=device)
    sizing: dict[str, int] = {}
    if args.gpu_staging_bytes is not None:
        sizing["gpu_staging_bytes"] = args.gpu_staging_bytes
    if args.staging_depth is not None:
        sizing["staging_depth"] = args.staging_depth
    cache_config = PrefixCacheConfig(
        num_blocks=config.num_blocks,
        block_size=config.block_size,
        # One staging page holds one whole step (PAGE-1), so it is sized by the step budget.
        staging_capacity_tokens=config.max_batched_tokens,
        **sizing,
    )
    policy = ModelCachePolicy(deferred_keys=frozenset({TALKER_KEY} if args.defer_mm else ()))
    with OmniPrefixCacheManager(
        cache_config, policy=policy, device=device, threaded=args.threaded
    ) as mgr:
        sink = OmniSink(mgr, talker, block_size=config.block_size)
        try:
            report = engine.run(specs, sink, progress=progress)
        finally:
            sink.close()
            progress.close()
        return report, talker, mgr.stats()


def _warm_up(model: TinyCausalLM, config: EngineConfig, device: str) -> None:
    # The first forwards pay for kernel selection and allocator growth; keep that out of both
    # timed runs so the throughput ratio compares like with like.
    specs = make_workload(WorkloadConfig(num_requests=4, seed=99, arrivals_per_step=100.0))
    engine = Engine(model, attrs.evolve(config, enable_prefix_caching=False), device=device)
    talker = Talker({s.req_id: len(s.prompt) for s in specs}, d_model=model.config.d_model)
    engine.run(specs, DirectSink(talker))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo and return the process exit status (0: the outputs matched).

    Args:
        argv: Command-line arguments without the program name; a leading ``demo`` subcommand
            (as the ``omni-cache`` console script passes it) is accepted and ignored. None reads
            ``sys.argv``.

    Returns:
        0 if the talker received the full recompute's rows to rounding level, 1 otherwise.
    """
    args_in = list(sys.argv[1:] if argv is None else argv)
    if args_in[:1] == ["demo"]:
        args_in = args_in[1:]
    parser = _parser()
    args = parser.parse_args(args_in)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    if args.staging_depth is not None and args.staging_depth < 2:
        # The engine holds step k's id until step k+1 is saved (the builder runs one step late),
        # so a single page could never be freed in time.
        parser.error("--staging-depth must be at least 2 for a one-step-late output builder")
    num_requests = args.requests if args.requests is not None else (48 if args.quick else 200)
    if num_requests <= 0:
        parser.error("--requests must be positive")
    if args.plot is not None:
        try:
            require_matplotlib()
        except ImportError as exc:
            parser.error(str(exc))
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path is not None and not path.parent.is_dir():
            parser.error(f"{flag} {path}: the folder {path.parent} does not exist")
    out = sys.stdout
    specs = make_workload(WorkloadConfig(num_requests=num_requests, seed=args.seed))
    model = TinyCausalLM(ModelConfig(seed=args.seed))
    try:
        config = EngineConfig(
            num_blocks=args.num_blocks or (128 if args.quick else 320),
            block_size=args.block_size,
            max_batched_tokens=args.max_batched_tokens,
            max_num_seqs=args.max_num_seqs,
        )
        Engine.check_workload(specs, config, model.config)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    # The model's ops are tiny: on a small shared CPU, intra-op threads spin against each other
    # (and against the output builder and committer threads) and cost more than they bring.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    logger = logging.getLogger("omni_cache")
    level = logger.level
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("  [%(name)s %(levelname)s] %(message)s"))
    if args.verbose:
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    try:
        return _demo(args, specs, model, config, device, out)
    finally:
        torch.set_num_threads(threads)
        if args.verbose:
            logger.removeHandler(handler)
            logger.setLevel(level)


def _run_figures(report: RunReport) -> dict[str, Any]:
    return {
        "steps": report.steps,
        "wall_s": report.wall_s,
        "tokens_per_s": report.tokens_per_s,
        "prompt_tokens": report.prompt_tokens,
        "hit_tokens": report.hit_tokens,
        "hit_rate": report.hit_rate,
        "computed_tokens": report.computed_tokens,
        "total_tokens": report.total_tokens,
        "evictions": report.evictions,
        "block_reuses": report.block_reuses,
        "aborted": len(report.aborted),
        "per_step": {
            "seconds": list(report.step_s),
            "tokens": list(report.step_tokens),
            "admitted_prompt_tokens": list(report.step_prompt_tokens),
            "hit_tokens": list(report.step_hit_tokens),
            "requests_done": list(report.step_done),
        },
    }


def _figures(
    args: argparse.Namespace,
    specs: Sequence[RequestSpec],
    config: EngineConfig,
    device: str,
    ref: RunReport,
    got: RunReport,
    stats: CacheStats,
    cmp: Comparison,
    ok: bool,
) -> dict[str, Any]:
    """Everything the text report says, as plain JSON values."""
    return {
        "ok": ok,
        "tolerance": args.tolerance,
        "workload": {"requests": len(specs), "seed": args.seed},
        "engine": {**attrs.asdict(config), "device": device},
        "full_recompute": _run_figures(ref),
        "prefix_cache": _run_figures(got),
        "throughput_ratio": got.tokens_per_s / ref.tokens_per_s,
        "comparison": {
            k: list(v) if isinstance(v, tuple) else v for k, v in attrs.asdict(cmp).items()
        },
        "cache_stats": {
            k: dict(v) if isinstance(v, Mapping) else v
            for k, v in attrs.asdict(stats, recurse=False).items()
        },
    }


def _demo(
    args: argparse.Namespace,
    specs: Sequence[RequestSpec],
    model: TinyCausalLM,
    config: EngineConfig,
    device: str,
    out: TextIO,
) -> int:
    mode = {None: "default", True: "threaded", False: "inline"}[args.threaded]
    out.write(
        f"omni-cache demo: {len(specs)} requests, device {device}, block_size "
        f"{config.block_size}, num_blocks {config.num_blocks}, max_batched_tokens "
        f"{config.max_batched_tokens}, cache writes {mode}\n"
    )
    show = not args.no_progress and sys.stderr.isatty()
    _warm_up(model, config, device)
    ref = _run_reference(
        model, config, specs, device, make_progress("full recompute", sys.stderr, enabled=show)
    )
    got_report, got_talker, stats = _run_cached(
        model,
        config,
        specs,
        device,
        args,
        make_progress("prefix cache + omni cache", sys.stderr, enabled=show),
    )
    cmp = compare_runs(specs, ref, (got_report, got_talker))
    ref_report = ref[0]
    ok = cmp.ok(args.tolerance)
    lines = [
        f"prefix hit rate         {got_report.hit_rate:6.1%}  ({got_report.hit_tokens} of "
        f"{got_report.prompt_tokens} prompt tokens; {got_report.evictions} cached blocks "
        f"evicted, {got_report.block_reuses} blocks recycled)",
        f"rows served from cache  {_sources(stats)} (rows of {HIDDEN_KEY} and {TALKER_KEY})",
        f"hidden vs recompute     max abs {cmp.max_abs_hidden:.2e}, max rel "
        f"{cmp.max_rel_hidden:.2e} over {cmp.rows} rows of {cmp.requests} requests",
        f"talker.h vs recompute   max abs {cmp.max_abs_talker:.2e}, max rel "
        f"{cmp.max_rel_talker:.2e}; talker summary max abs {cmp.max_abs_voice:.2e}",
        f"generated tokens        {cmp.requests - cmp.token_mismatches}/{cmp.requests} "
        f"requests identical, {len(got_report.aborted)} aborted",
        f"throughput              {got_report.tokens_per_s:,.0f} tok/s with prefix caching "
        f"({got_report.steps} steps, {got_report.wall_s:.2f}s), "
        f"{ref_report.tokens_per_s:,.0f} tok/s without ({ref_report.steps} steps, "
        f"{ref_report.wall_s:.2f}s): x{got_report.tokens_per_s / ref_report.tokens_per_s:.2f}",
        f"page waits              {stats.page_waits} ({stats.page_wait_s * 1e3:.1f} ms waiting; "
        f"{stats.steps_saved} steps saved, {stats.steps_consumed} materialized)",
        f"budget flushes          {stats.budget_flushes}",
    ]
    for line in lines:
        out.write(f"  {line}\n")
    if args.json is not None:
        figures = _figures(args, specs, config, device, ref_report, got_report, stats, cmp, ok)
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
        out.write(f"  figures written to {args.json}\n")
    if args.plot is not None:
        title = (
            f"omni-cache demo: {len(specs)} requests over shared system prompts, device {device}"
        )
        write_plot(args.plot, ref_report, got_report, title)
        out.write(f"  plot written to {args.plot}\n")
    if ok:
        out.write(f"OK: differences within {args.tolerance:g} relative\n")
        return 0
    why = (
        f"{len(cmp.incomplete)} requests with incomplete rows"
        if cmp.incomplete
        else (f"difference above {args.tolerance:g} relative")
    )
    out.write(f"FAILED: {why}\n")
    return 1
