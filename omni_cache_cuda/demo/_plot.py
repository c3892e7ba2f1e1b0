"""The demo's chart: per-step time with and without prefix caching, and the hit rate over the run.

Needs matplotlib (the ``demo`` extra); `require_matplotlib` says so before a run starts. Drawn
with the Agg backend, so it works without a display.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._engine import RunReport

__all__ = ["MISSING_MATPLOTLIB", "require_matplotlib", "write_plot"]

MISSING_MATPLOTLIB = (
    "--plot needs matplotlib, which is not installed: pip install 'omni-cache[demo]' "
    "(or pip install matplotlib)"
)

#: Steps in the moving average of the step time and of the windowed hit rate.
WINDOW = 9

_REF_COLOR = "#7a7a7a"
_CACHED_COLOR = "#d95f02"
_HIT_COLOR = "#1b9e77"


def require_matplotlib() -> None:
    """Raise ImportError with `MISSING_MATPLOTLIB` when matplotlib cannot be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ImportError(MISSING_MATPLOTLIB) from exc


def _moving_average(values: Sequence[float], window: int) -> list[float]:
    """Centered moving average; the ends average over the part of the window that exists."""
    half = window // 2
    out = []
    for i in range(len(values)):
        part = values[max(0, i - half) : i + half + 1]
        out.append(sum(part) / len(part))
    return out


def _windowed_rate(hits: Sequence[int], totals: Sequence[int], window: int) -> list[float]:
    """Hit tokens over prompt tokens admitted in the last ``window`` steps, in percent."""
    out = []
    for i in range(len(hits)):
        lo = max(0, i - window + 1)
        total = sum(totals[lo : i + 1])
        out.append(100.0 * sum(hits[lo : i + 1]) / total if total else float("nan"))
    return out


def _cumulative_rate(hits: Sequence[int], totals: Sequence[int]) -> list[float]:
    out = []
    hit = total = 0
    for h, t in zip(hits, totals, strict=True):
        hit += h
        total += t
        out.append(100.0 * hit / total if total else float("nan"))
    return out


def _ends(report: RunReport) -> list[float]:
    """Seconds since the run started at the end of each step."""
    out, t = [], 0.0
    for s in report.step_s:
        t += s
        out.append(t)
    return out


def write_plot(path: str | Path, reference: RunReport, cached: RunReport, title: str) -> None:
    """Draw the chart of both runs into ``path`` (PNG, SVG or PDF, by the suffix).

    Three panels over the seconds since each run started: requests done, the time of each
    engine step, and the prefix hit rate of the run with prefix caching.

    Args:
        path: Where to write the image.
        reference: The run without prefix caching.
        cached: The run with KV prefix caching and the omni prefix cache.
        title: The first line of the title (the workload).
    """
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, (ax_done, ax_time, ax_hit) = plt.subplots(
        3,
        1,
        figsize=(11, 10),
        sharex=True,
        gridspec_kw={"height_ratios": [2, 3, 2]},
        constrained_layout=True,
    )
    speedup = cached.tokens_per_s / reference.tokens_per_s
    fig.suptitle(
        f"{title}\nwith prefix caching {cached.wall_s:.1f} s ({cached.tokens_per_s:,.0f} tok/s), "
        f"without {reference.wall_s:.1f} s ({reference.tokens_per_s:,.0f} tok/s): "
        f"throughput x{speedup:.2f}",
        fontsize=13,
    )
    # Each run with when each of its steps ended (seconds into the run: every panel's x axis).
    runs: list[tuple[RunReport, list[float], str, str]] = [
        (reference, _ends(reference), _REF_COLOR, "without prefix caching (full recompute)"),
        (cached, _ends(cached), _CACHED_COLOR, "with prefix caching + omni cache"),
    ]

    total = max(reference.step_done[-1:] + cached.step_done[-1:] + (1,))
    for report, ends, color, label in runs:
        ax_done.plot(
            [0.0, *ends],
            [0, *report.step_done],
            color=color,
            linewidth=2.2,
            label=f"{label}: done in {report.wall_s:.1f} s",
        )
        if ends:
            ax_done.axvline(ends[-1], color=color, linestyle=":", linewidth=1.2)
    ax_done.set_ylabel("requests done")
    ax_done.set_ylim(0, total * 1.05)
    ax_done.grid(True, alpha=0.3)
    ax_done.legend(loc="lower right", fontsize=10, framealpha=0.9)
    ax_done.set_title("progress: requests finished or aborted", fontsize=10, loc="left")

    for report, ends, color, label in runs:
        ms = [s * 1e3 for s in report.step_s]
        ax_time.plot(ends, ms, color=color, alpha=0.25, linewidth=0.8)
        ax_time.plot(
            ends,
            _moving_average(ms, WINDOW),
            color=color,
            linewidth=2.2,
            label=f"{label}: {len(ms)} steps, mean {sum(ms) / max(len(ms), 1):.0f} ms",
        )
    ax_time.set_ylabel("time per engine step (ms)")
    ax_time.set_ylim(bottom=0)
    ax_time.grid(True, alpha=0.3)
    ax_time.legend(loc="lower left", fontsize=10, framealpha=0.9)
    ax_time.set_title(
        f"time per step (thin: each step, thick: {WINDOW}-step average); a step fills the "
        "token budget: with hits it serves more requests, so fewer steps",
        fontsize=10,
        loc="left",
    )

    ends = runs[1][1]
    hits, totals = cached.step_hit_tokens, cached.step_prompt_tokens
    admitted = [i for i, t in enumerate(totals) if t]
    ax_hit.scatter(
        [ends[i] for i in admitted],
        [100.0 * hits[i] / totals[i] for i in admitted],
        s=14,
        color=_HIT_COLOR,
        alpha=0.45,
        label="requests admitted in one step",
    )
    ax_hit.plot(
        ends,
        _windowed_rate(hits, totals, WINDOW),
        color=_HIT_COLOR,
        linewidth=1.6,
        label=f"over the last {WINDOW} steps",
    )
    ax_hit.plot(
        ends,
        _cumulative_rate(hits, totals),
        color="black",
        linewidth=2.2,
        label=f"since the start (whole run {cached.hit_rate:.1%})",
    )
    ax_hit.set_ylim(0, 100)
    ax_hit.set_ylabel("hit rate (% of prompt tokens)")
    ax_hit.set_xlabel("seconds since the run started")
    ax_hit.grid(True, alpha=0.3)
    ax_hit.legend(loc="lower right", fontsize=10, framealpha=0.9)
    ax_hit.set_title(
        "prefix hit rate of the run with prefix caching: prompt tokens served from the KV "
        "cache, their hidden states from the omni cache",
        fontsize=10,
        loc="left",
    )
    ax_hit.set_xlim(0, max(reference.wall_s, cached.wall_s) * 1.02)

    kwargs: dict[str, Any] = {"dpi": 110} if str(path).lower().endswith(".png") else {}
    fig.savefig(path, **kwargs)
    plt.close(fig)
