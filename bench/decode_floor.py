"""Where a decode step's engine-thread time goes, through the vLLM glue, and what is left without
the committer hand-off.

`vllm_glue.py` times `step_begin` + `save` of a decode step (256 x 1, hidden width 2048 bf16 plus
one mm key of width 16) as one figure. This script splits the same cycle into its parts, each
the engine thread's CPU time (`time.thread_time_ns`) measured by a wrapper around one function,
medians per step:

- `glue begin`: `VllmPrefixCache.step_begin` less the manager's `new_step_starts` in it;
- `manager start`: `new_step_starts`;
- `glue save`: `VllmPrefixCache.save` less `save_outputs` (the decode layout and its checks);
- `manager save`: `save_outputs`, and inside it:
  - `landing copy`: the step's rows into the landing page (`SavePath._copy_into_pages`, before
    the barrier since PAGE-7, and the rest of `SavePath._copy_step`);
  - `hand-off`: queueing the step's write for the committer thread (`Committer.submit`); its
    wall time is printed beside it;
  - `pool write`: the step's write run on the engine thread (`SavePath._write_now`: inline
    mode's one copy into the pool, with its checks and reports);
  - `barrier wait`: waiting for the previous step's write (TASK-3) or a page, summed over the
    steps that wait, divided by all steps (and how many waited);
  - `core`: `CacheCore.save_begin`, `save_proceed` and `save_commit`;
  - `rest`: the adapter's own checks, contexts and bookkeeping (the difference).

Eight variants run in alternating rounds (each a fresh manager, order of rows kept from step to
step as vLLM's input batch keeps it; materialize right after each save on the same thread, timed
apart, as in `vllm_glue.py`). The engine thread is pinned to the first CPU in every variant, and
the threads the manager starts inherit that or are moved, so where each thread runs is fixed:

- `threaded, two vCPUs`: `vllm_glue.py`'s threaded configuration, the committer thread pinned
  to a second CPU: the write runs beside the engine thread (left out on a single CPU);
- `threaded, one vCPU`: the same, with the committer on the engine thread's CPU. The scheduler
  picks either placement on its own from run to run, and the engine thread's CPU time differs
  by up to 1.7 x between them: here the committer's work does not show in the engine thread's
  CPU time but takes its CPU, so its wall time grows instead;
- `inline`: the pool write on the engine thread (D27's direct write, no page copy, no thread);
- `no hand-off (diagnostic)`: threaded, but the step's write job runs on the engine thread with
  its pool write skipped: no wake-up of the committer, no concurrent writer, no barrier wait.
  Not a configuration (the pool never gets the rows); it shows the engine thread's own work, so
  the difference to `threaded, two vCPUs` is what handing the write to another thread costs on
  this machine. Its `hand-off` column is the write job run here without its pool write (its
  reports);
- `no hand-off, narrow rows (diagnostic)`: the same with hidden states of width 16 instead of
  2048 (16 KiB a step instead of 1 MiB): the same calls, the same Python and the same arrays
  of 256 requests, but rows too small to evict the caches the Python runs from. The
  difference to the row above, less its landing copy, is what a step's own rows passing
  through the caches (the landing copy here, the materialize's copy out before it) costs the
  rest of the engine thread's work;
- `one vCPU, 2 ms pauses (diagnostic)`: `threaded, one vCPU` with the engine thread asleep for
  2 ms after each step, as it would wait for a forward pass: the same calls on the same data,
  so what it adds to the parts is what the thread pays for having slept (its caches and its
  CPU's state are lost meanwhile on a shared virtual machine). The committer's write is done in
  the pause, so nothing waits for it;
- `two vCPUs, no pool write (diagnostic)`: `threaded, two vCPUs` with the committer thread's
  pool write skipped. Not a configuration either: the thread still wakes, takes the GIL, runs
  the job and reports, but it is done within microseconds of the hand-off instead of a hundred
  or more. The difference to `threaded, two vCPUs` is what the write costs the engine thread
  by lasting into its next step: the writer takes the GIL back at the engine thread's next
  release of it (its landing copy, mostly) and the engine thread then waits for it there;
- `two vCPUs, hash, no write (diagnostic)`: the same, but in place of its pool write
  the committer hashes a 256 KiB buffer that stays in its caches (`hashlib`, which gives the GIL
  up while it works, as numpy does while it copies): about as long as the write, with no memory
  traffic. Between the row above and `threaded, two vCPUs`, it splits what the write costs the
  engine thread into what any work of that length on the other vCPU costs it and what the
  write's stores into cold memory add.

Beside the parts, three whole-step figures: `wall` of `step_begin` + `save` (what the engine
waits for), `blocks`, the engine thread's voluntary context switches in `step_begin` + `save`
per step (the times it went to sleep: a barrier, a page or the GIL held by the committer), and
`process` CPU per step (`time.process_time` over `step_begin`, `save` and
`materialize`: every thread's work for the step, the committer's included). Under the threaded
variants, the committer thread's CPU and wall time per step write (`Committer.run` on that
thread, medians): wall beyond CPU is time the write waited, for the GIL above all, which numpy
gives up while it copies the wide hidden rows and the writer must take back from the engine
thread.

The wrappers add about a microsecond per wrapped call; the `total` column is measured around
`step_begin` + `save` without them being subtracted, so compare totals with each other, not with
`vllm_glue.py`'s figure to the microsecond.

Linux only (thread placement by `os.sched_setaffinity`).

Run: python bench/decode_floor.py [--steps N] [--rounds R]
"""

from __future__ import annotations

import argparse
import collections
import functools
import hashlib
import os
import random
import resource
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from adapter_step import BLOCK_SIZE, CAPACITY, DTYPE, MM_KEY, MM_WIDTH, WIDTH, make_manager
from vllm_glue import Step, decode_steps

from omni_cache_core import _core
from omni_cache_cuda import _committer, _manager, _save_path, _state
from omni_cache_cuda.vllm import VllmPrefixCache
from omni_cache_cuda.vllm import _glue as glue_module

TWO_VCPUS = "threaded, two vCPUs"
ONE_VCPU = "threaded, one vCPU"
INLINE = "inline"
NO_HAND_OFF = "no hand-off (diagnostic)"
NO_POOL_WRITE = "two vCPUs, no pool write (diagnostic)"
NARROW = "no hand-off, narrow rows (diagnostic)"
NARROW_WIDTH = 16
PAUSED = "one vCPU, 2 ms pauses (diagnostic)"
PAUSE_S = 2e-3
COMPUTE = "two vCPUs, hash, no write (diagnostic)"

#: (owner, attribute, part name): the functions timed; a part's figure is its inclusive time.
_TIMED: tuple[tuple[Any, str, str], ...] = (
    (glue_module.VllmPrefixCache, "step_begin", "glue begin+"),
    (glue_module.VllmPrefixCache, "save", "glue save+"),
    (_save_path.SavePath, "save", "manager save"),
    (_save_path.SavePath, "_copy_step", "landing copy"),
    (_save_path.SavePath, "_copy_into_pages", "landing copy"),
    (_committer.Committer, "submit", "hand-off"),
    (_save_path.SavePath, "_write_now", "pool write"),
    (_state.AdapterState, "wait_for_signal", "barrier wait"),
    (_manager.OmniPrefixCacheManager, "new_step_starts", "manager start"),
    (_core.CacheCore, "save_begin", "core"),
    (_core.CacheCore, "save_proceed", "core"),
    (_core.CacheCore, "save_commit", "core"),
)


class Parts:
    """Per-step sums of each part's thread CPU time (and the hand-off's wall time)."""

    def __init__(self) -> None:
        self.step: collections.Counter[str] = collections.Counter()
        self.samples: dict[str, list[int]] = collections.defaultdict(list)
        self.waits = 0
        #: Per step write run by the committer thread: its CPU time and wall time (ns).
        self.jobs: list[tuple[int, int]] = []

    def close_step(self) -> None:
        for name in self.samples.keys() | self.step.keys():
            self.samples[name].append(self.step.get(name, 0))
        if self.step.get("barrier wait"):
            self.waits += 1
        self.step.clear()

    def median_us(self, name: str) -> float:
        values = self.samples.get(name)
        return statistics.median(values) / 1e3 if values else 0.0

    def mean_us(self, name: str) -> float:
        values = self.samples.get(name)
        return sum(values) / len(values) / 1e3 if values else 0.0


def _median_us(pairs: list[tuple[int, int]], index: int) -> float:
    return statistics.median(p[index] for p in pairs) / 1e3 if pairs else 0.0


@contextmanager
def timed(parts: Parts) -> Iterator[None]:
    """Wrap the functions of `_TIMED` so each call adds its thread CPU time to ``parts``."""
    originals = []
    clock = time.thread_time_ns
    wall = time.perf_counter_ns

    def wrapper(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            t0, w0 = clock(), wall()
            try:
                return fn(*args, **kwargs)
            finally:
                parts.step[name] += clock() - t0
                if name == "hand-off":
                    parts.step["hand-off wall"] += wall() - w0

        return call

    def job(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def run(committer: _committer.Committer, job: _committer.WriteJob) -> None:
            t0, w0 = clock(), wall()
            fn(committer, job)
            if threading.current_thread() is committer._thread:
                parts.jobs.append((clock() - t0, wall() - w0))

        return run

    for owner, attr, name in _TIMED:
        fn = owner.__dict__[attr]
        originals.append((owner, attr, fn))
        setattr(owner, attr, wrapper(fn, name))
    run = _committer.Committer.__dict__["run"]
    originals.append((_committer.Committer, "run", run))
    _committer.Committer.run = job(run)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for owner, attr, fn in originals:
            setattr(owner, attr, fn)


@contextmanager
def _pool_write_replaced(
    replacement: Callable[[_committer.Committer, _committer.WriteJob], None],
) -> Iterator[None]:
    """Run ``replacement`` wherever a job's pool write would run, for the diagnostics."""
    write_pool = _committer.Committer._write_pool
    _committer.Committer._write_pool = replacement  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        _committer.Committer._write_pool = write_pool  # type: ignore[method-assign]


def no_pool_write() -> AbstractContextManager[None]:
    """The diagnostic variant: the committer thread runs each job with its pool write skipped."""
    return _pool_write_replaced(lambda self, job: None)


def compute_for_pool_write() -> AbstractContextManager[None]:
    """The diagnostic variant: the committer hashes cache-resident bytes instead of its write."""
    return _pool_write_replaced(_hash_instead)


def _hash_instead(committer: _committer.Committer, job: _committer.WriteJob) -> None:
    hashlib.sha256(_COMPUTE)


#: What `compute_for_pool_write` hashes: about as long as a step's write (the script prints it).
_COMPUTE = bytes(range(256)) * 1024


def _compute_us() -> float:
    """The median time of one `compute_for_pool_write` hash on this thread, in us."""
    times = []
    for _ in range(50):
        t0 = time.thread_time_ns()
        hashlib.sha256(_COMPUTE)
        times.append(time.thread_time_ns() - t0)
    return statistics.median(times) / 1e3


@contextmanager
def no_hand_off() -> Iterator[None]:
    """The diagnostic variant: a step's write job runs at once on this thread, pool write skipped."""
    submit = _committer.Committer.submit
    _committer.Committer.submit = _committer.Committer.run_now  # type: ignore[method-assign]
    try:
        with no_pool_write():
            yield
    finally:
        _committer.Committer.submit = submit  # type: ignore[method-assign]


def run_round(setup: list[Step], steps: list[Step], warmup: int, variant: str) -> Parts:
    """One fresh manager through the glue; the parts of every step after the warm-up."""
    width = NARROW_WIDTH if variant == NARROW else WIDTH
    hidden = torch.randn(CAPACITY, width).to(DTYPE)
    mm = torch.randn(CAPACITY, MM_WIDTH).to(DTYPE)
    parts = Parts()
    threaded = variant != INLINE
    with (
        on_first_cpu() as cpus,
        VllmPrefixCache(make_manager(threaded), block_size=BLOCK_SIZE) as glue,
    ):
        committer = glue.manager._state.committer._thread
        if variant in (TWO_VCPUS, NO_POOL_WRITE, COMPUTE) and committer is not None:
            to_second_cpu(committer, cpus)
        _steps(glue, parts, setup, steps, warmup, variant, hidden, mm)
    return parts


@contextmanager
def on_first_cpu() -> Iterator[list[int]]:
    """Pin this thread, and the threads it starts meanwhile, to its first CPU; yield its CPUs."""
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, cpus[:1])
    try:
        yield cpus
    finally:
        os.sched_setaffinity(0, cpus)


def blocks_so_far() -> int:
    """This thread's voluntary context switches so far: the times it went to sleep."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw


def to_second_cpu(thread: threading.Thread, cpus: list[int]) -> None:
    """Move a started thread to the second of ``cpus``."""
    assert thread.native_id is not None
    os.sched_setaffinity(thread.native_id, cpus[1:2])


def _steps(
    glue: VllmPrefixCache,
    parts: Parts,
    setup: list[Step],
    steps: list[Step],
    warmup: int,
    variant: str,
    hidden: torch.Tensor,
    mm: torch.Tensor,
) -> None:
    """Run the setup and the timed steps of one round, adding each step's parts to ``parts``."""
    hand_off = {
        NO_HAND_OFF: no_hand_off,
        NARROW: no_hand_off,
        NO_POOL_WRITE: no_pool_write,
        COMPUTE: compute_for_pool_write,
    }
    with hand_off.get(variant, nullcontext)(), timed(parts):
        for i, step in enumerate(setup + steps):
            n = step.rows
            b0 = blocks_so_far()
            p0, w0 = time.process_time_ns(), time.perf_counter_ns()
            t0 = time.thread_time_ns()
            glue.step_begin(step.so)
            sid = glue.save(hidden[:n], {MM_KEY: mm[:n]}, req_ids=step.order, num_tokens_unpadded=n)
            total = time.thread_time_ns() - t0
            wall = time.perf_counter_ns() - w0
            blocks = blocks_so_far() - b0
            if i < len(setup):
                glue.discard_step(sid)
                parts.step.clear()
                continue
            step_parts = dict(parts.step, total=total, wall=wall, blocks=blocks)
            glue.materialize(sid, step.order)
            if variant == PAUSED:
                time.sleep(PAUSE_S)  # not timed: the thread only sleeps
            # The consume's own core and wait calls are not the step's parts.
            parts.step.clear()
            if i >= len(setup) + warmup:
                parts.step.update(step_parts, process=time.process_time_ns() - p0)
                parts.close_step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warmup = 5
    setup, steps = decode_steps(args.steps + warmup, random.Random(0), shuffle=False)
    two = len(os.sched_getaffinity(0)) >= 2
    variants = (
        *((TWO_VCPUS,) if two else ()),
        ONE_VCPU,
        PAUSED,
        INLINE,
        NO_HAND_OFF,
        NARROW,
        *((NO_POOL_WRITE, COMPUTE) if two else ()),
    )
    rounds: dict[str, list[Parts]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for variant in variants:
            rounds[variant].append(run_round(setup, steps, warmup, variant))
    print(
        f"torch {torch.__version__}, CPU, one intra-op thread; decode 256 x 1 through the glue, "
        f"order kept; us per step (engine-thread CPU, but for wall and process), median of the "
        f"round with the least total ({args.rounds} rounds of {args.steps} steps per variant, "
        f"alternating)"
    )
    columns = (
        "total",
        "wall",
        "blocks",
        "process",
        "glue begin",
        "manager start",
        "glue save",
        "manager save",
        "landing copy",
        "hand-off",
        "pool write",
        "barrier wait",
        "core",
        "rest",
    )
    print(f"{'variant':<38}" + "".join(f"{c:>14}" for c in columns) + "   rounds (total)")
    print(
        f"{'':<38}"
        + "".join(f"{c:>14}" for c in ("engine CPU", "engine wall", "a step", "all threads"))
    )
    for variant in variants:
        best = min(rounds[variant], key=lambda p: p.median_us("total"))
        m = best.median_us
        figures = {
            "total": m("total"),
            "wall": m("wall"),
            "blocks": statistics.fmean(best.samples["blocks"]),
            "process": m("process"),
            "glue begin": m("glue begin+") - m("manager start"),
            "manager start": m("manager start"),
            "glue save": m("glue save+") - m("manager save"),
            "manager save": m("manager save"),
            "landing copy": m("landing copy"),
            "hand-off": m("hand-off"),
            "pool write": m("pool write"),
            "barrier wait": best.mean_us("barrier wait"),
            "core": m("core"),
        }
        figures["rest"] = figures["manager save"] - sum(
            figures[k] for k in ("landing copy", "hand-off", "pool write", "barrier wait", "core")
        )
        spread = ", ".join(f"{p.median_us('total'):.0f}" for p in rounds[variant])
        print(f"{variant:<38}" + "".join(f"{figures[c]:>14.1f}" for c in columns) + f"   {spread}")
        if variant == COMPUTE:
            print(f"{'':<38}its hash in place of the write: {_compute_us():.1f} us of CPU")
        if variant in (TWO_VCPUS, ONE_VCPU, PAUSED, NO_POOL_WRITE, COMPUTE):
            print(
                f"{'':<38}hand-off wall {m('hand-off wall'):.1f} us; barrier waits in "
                f"{best.waits} of {len(best.samples['total'])} steps; the committer's write "
                f"of a step: CPU {_median_us(best.jobs, 0):.1f} us, wall "
                f"{_median_us(best.jobs, 1):.1f} us"
            )


if __name__ == "__main__":
    main()
