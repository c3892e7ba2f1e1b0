"""The vLLM glue's own cost per step, next to the manager's step cycle, on the CPU.

`VllmPrefixCache` adds two things to every step: `step_begin` (reading the scheduler output,
building the step's records, tracking block ids and computed counts) and, in `save`, the write
layout (`PrefixCacheWriteLayout.from_block_tables` in the runner's row order). This script
times exactly that, with the wrapped manager replaced by a stand-in that does nothing, and
times the manager's own step cycle (`new_step_starts`, `save_outputs`, `materialize`) on the
same steps with the records and layouts built beforehand. The ratio of the two is the figure
the target is set on: the glue under 20 % of the manager's decode step.

Scheduler outputs are plain stand-ins shaped like vLLM 0.33's `SchedulerOutput` (the fields the
glue reads), so the script runs without vLLM.

Sizes as in `adapter_step.py`: num_blocks=16384, block_size=16, hidden states of width 2048 in
bf16 and one immediate mm key of width 16; staging_capacity_tokens=8192; inline writes.
- decode: 256 running requests x 1 token, at positions 100 to 1500, in a shuffled row order,
  each gaining a block every 16 steps (about 16 of them per step);
- prefill: 16 new requests x 512 tokens, half of them starting on a 256-token hit, the previous
  step's 16 finishing.

Times are the engine thread's CPU time (`time.thread_time`), medians over `--steps` steps after
a warm-up; glue and manager run in alternating rounds (`--rounds`, default 5). Printed: the
quietest round of each, their ratio, and the median of the rounds' own ratios (a glue round and
the manager round right after it see the same machine state; the shared machine's speed swings).

Then the whole decode cycle through the glue over a real manager (threaded and inline), with the
row order shuffled every step (the worst case: every per-request lookup starts over) and with
one order kept from step to step (what vLLM's input batch does while no request joins or
leaves; each step's list is still a fresh one): the
engine thread's CPU time for `step_begin` + `save` (records, layout, core, the copy into the
landing buffer; target <= 250 us) and the CPU time of `materialize` of the same step (target
<= 300 us), timed apart on the same thread; `+ read` adds reading every request's hidden and mm
rows once (what an output builder such as the export does; `materialize` makes per-request views
only when they are read). Medians per round; the quietest round is printed, then every round.
Beside them, from the round whose engine figure is printed: `step_begin` + `save` in wall time
(`wall us`, what the engine waits for) and the step's CPU time in every thread (`process us`:
the committer's and the prefetch worker's included). Threaded, the engine thread's CPU time
depends on where the scheduler puts the committer: on the engine thread's own vCPU its work
does not show in that figure, but takes the engine's CPU and shows in the wall time; on the
other vCPU each wake-up costs the engine thread tens of microseconds. Each round prints
begin+save / materialize / + read / wall. `decode_floor.py` fixes the placement and splits the
decode cycle's figure into its parts.

Run: python bench/vllm_glue.py [--steps N] [--rounds R]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

# The same sizes as the adapter's step benchmark, so the two tables read side by side.
from adapter_step import (
    BLOCK_SIZE,
    CAPACITY,
    DTYPE,
    MM_KEY,
    MM_WIDTH,
    NUM_BLOCKS,
    WIDTH,
    make_manager,
)

from omni_cache_cuda import (
    PrefixCacheStep,
    PrefixCacheWriteLayout,
)
from omni_cache_cuda.vllm import VllmPrefixCache

TARGET = 0.20
#: Targets of the decode cycle through the glue: engine thread's step_begin + save, materialize.
ENGINE_TARGET_US = 250.0
MATERIALIZE_TARGET_US = 300.0


# ---------------------------------------------------------------------------------------------
# Stand-in scheduler outputs.


def output(
    sched: dict[str, int],
    new: list[SimpleNamespace],
    cached: tuple[list[str], list[Any], list[int]],
    finished: set[str],
) -> SimpleNamespace:
    req_ids, new_block_ids, computed = cached
    return SimpleNamespace(
        num_scheduled_tokens=sched,
        scheduled_new_reqs=new,
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=req_ids,
            new_block_ids=new_block_ids,
            num_computed_tokens=computed,
            resumed_req_ids=set(),
        ),
        finished_req_ids=finished,
        preempted_req_ids=set(),
        scheduled_spec_decode_tokens={},
        kv_cache_block_copies=None,
    )


def new_req(req_id: str, blocks: list[int], computed: int) -> SimpleNamespace:
    return SimpleNamespace(req_id=req_id, block_ids=(blocks,), num_computed_tokens=computed)


class Step:
    """One step: its scheduler output, the runner's row order, its rows."""

    def __init__(self, so: SimpleNamespace, order: list[str], rows: int) -> None:
        self.so = so
        self.order = order
        self.rows = rows


def decode_steps(
    n: int, rng: random.Random, *, shuffle: bool = True
) -> tuple[list[Step], list[Step]]:
    """Setup steps that start 256 requests (discarded), then n decode steps.

    The runner's row order is shuffled anew every step, or with ``shuffle=False`` shuffled
    once and kept (a fresh list of the same order each step), as vLLM's input batch keeps its
    rows in place while no request joins or leaves.
    """
    ids = [f"chatcmpl-{i:04d}-{rng.randrange(16**8):08x}" for i in range(256)]
    computed = {r: rng.randrange(100, 1500) for r in ids}
    next_block = iter(range(NUM_BLOCKS))
    blocks = {r: [next(next_block) for _ in range(computed[r] // BLOCK_SIZE + 1)] for r in ids}
    setup = []
    for i in range(0, 256, 16):
        group = ids[i : i + 16]
        news = [new_req(r, list(blocks[r]), computed[r] // BLOCK_SIZE * BLOCK_SIZE) for r in group]
        sched = {r: computed[r] - computed[r] // BLOCK_SIZE * BLOCK_SIZE + 1 for r in group}
        for r in group:
            computed[r] += 1
        setup.append(Step(output(sched, news, ([], [], []), set()), group, sum(sched.values())))
    steps = []
    kept = list(ids)
    rng.shuffle(kept)
    for _ in range(n):
        order = list(ids if shuffle else kept)
        if shuffle:
            rng.shuffle(order)
        new_block_ids: list[Any] = []
        for r in ids:
            if computed[r] // BLOCK_SIZE >= len(blocks[r]):
                added = [next(next_block)]
                blocks[r].extend(added)
                new_block_ids.append((added,))
            else:
                new_block_ids.append(None)
        so = output(
            dict.fromkeys(ids, 1), [], (list(ids), new_block_ids, [computed[r] for r in ids]), set()
        )
        for r in ids:
            computed[r] += 1
        steps.append(Step(so, order, 256))
    return setup, steps


def prefill_steps(n: int, rng: random.Random) -> tuple[list[Step], list[Step]]:
    """A setup step writing the shared 256-token prefix, then n prefill steps."""
    prefix = list(range(16))  # 16 blocks = 256 tokens
    setup = [
        Step(
            output({"prefix": 256}, [new_req("prefix", list(prefix), 0)], ([], [], []), set()),
            ["prefix"],
            256,
        ),
    ]
    steps = []
    pool = list(range(16, NUM_BLOCKS))
    previous: set[str] = {"prefix"}
    for s in range(n):
        news, sched = [], {}
        free = rng.sample(pool, 16 * 32)
        for i in range(16):
            rid = f"p{s}-{i}"
            own = free[i * 32 : (i + 1) * 32]
            if i % 2:
                news.append(new_req(rid, prefix + own[16:], 256))
                sched[rid] = 256
            else:
                news.append(new_req(rid, own, 0))
                sched[rid] = 512
        order = list(sched)
        rng.shuffle(order)
        so = output(sched, news, ([], [], []), previous)
        steps.append(Step(so, order, sum(sched.values())))
        previous = set(sched)
    return setup, steps


# ---------------------------------------------------------------------------------------------
# Timed runs.


class _NoCache:
    """Stands in for the manager: the glue's own cost is what is left."""

    def __init__(self) -> None:
        self.ids = 0

    def new_step_starts(self, step: PrefixCacheStep) -> None:
        pass

    def save_outputs(self, *args: Any, **kwargs: Any) -> int:
        self.ids += 1
        return self.ids

    def shutdown(self) -> None:
        pass


def stub_glue(stub: _NoCache) -> VllmPrefixCache:
    """A glue over `stub` instead of a manager (the real one only configures it)."""
    glue = VllmPrefixCache(make_manager(False), block_size=BLOCK_SIZE)
    glue.manager.shutdown()
    glue.manager = stub  # type: ignore[assignment]
    return glue


def glue_round(setup: list[Step], steps: list[Step], warmup: int) -> list[float]:
    """The glue's step_begin + save (layout included) per step, manager stubbed out."""
    glue = stub_glue(_NoCache())
    hidden = torch.zeros(CAPACITY, 1)
    samples = []
    for i, step in enumerate(setup + steps):
        t0 = time.thread_time()
        glue.step_begin(step.so)
        glue.save(hidden, None, req_ids=step.order, num_tokens_unpadded=step.rows)
        t1 = time.thread_time()
        if i >= len(setup) + warmup:
            samples.append(t1 - t0)
    return samples


def recorded(setup: list[Step], steps: list[Step]) -> list[tuple[PrefixCacheStep, Any]]:
    """The records and layouts the glue builds for each step, kept for the manager's run."""
    seen: list[tuple[PrefixCacheStep, Any]] = []

    class Recorder(_NoCache):
        def new_step_starts(self, step: PrefixCacheStep) -> None:
            seen.append((step, None))

        def save_outputs(self, *args: Any, write_layout: PrefixCacheWriteLayout, **kw: Any) -> int:
            seen[-1] = (seen[-1][0], write_layout)
            return super().save_outputs()

    glue = stub_glue(Recorder())
    hidden = torch.zeros(CAPACITY, 1)
    for step in setup + steps:
        glue.step_begin(step.so)
        glue.save(hidden, None, req_ids=step.order, num_tokens_unpadded=step.rows)
    return seen


def manager_round(
    records: list[tuple[PrefixCacheStep, Any]], setup: int, warmup: int
) -> list[float]:
    """The manager's cycle per step: new_step_starts, save_outputs, materialize."""
    hidden = torch.randn(CAPACITY, WIDTH).to(DTYPE)
    mm = torch.randn(CAPACITY, MM_WIDTH).to(DTYPE)
    samples = []
    with make_manager(False) as manager:
        for i, (step, layout) in enumerate(records):
            n = layout.num_rows
            t0 = time.thread_time()
            manager.new_step_starts(step)
            sid = manager.save_outputs(
                hidden[:n], {MM_KEY: mm[:n]}, num_tokens_unpadded=n, write_layout=layout
            )
            if i < setup:
                manager.discard_step(sid)
            else:
                manager.materialize(sid, layout.req_ids)
            t1 = time.thread_time()
            if i >= setup + warmup:
                samples.append(t1 - t0)
    return samples


def cycle_round(
    setup: list[Step], steps: list[Step], warmup: int, threaded: bool
) -> tuple[float, float, float, float, float]:
    """Medians over a real manager, in microseconds: the glue's step_begin + save, materialize,
    and materialize plus one read of every returned row (thread CPU time); step_begin + save in
    wall time; and the step's CPU time in every thread (step_begin, save and materialize)."""
    hidden = torch.randn(CAPACITY, WIDTH).to(DTYPE)
    mm = torch.randn(CAPACITY, MM_WIDTH).to(DTYPE)
    engine, consume, read, wall, process = [], [], [], [], []
    with VllmPrefixCache(make_manager(threaded), block_size=BLOCK_SIZE) as glue:
        for i, step in enumerate(setup + steps):
            n = step.rows
            p0, w0 = time.process_time(), time.perf_counter()
            t0 = time.thread_time()
            glue.step_begin(step.so)
            sid = glue.save(hidden[:n], {MM_KEY: mm[:n]}, req_ids=step.order, num_tokens_unpadded=n)
            t1 = time.thread_time()
            w1 = time.perf_counter()
            if i < len(setup):
                glue.discard_step(sid)
                continue
            out = glue.materialize(sid, step.order)
            t2 = time.thread_time()
            p2 = time.process_time()
            rows = out.hidden_states
            assert rows is not None
            keyed = out.mm_outputs[MM_KEY]
            for req in step.order:
                rows[req]
                keyed[req]
            t3 = time.thread_time()
            if i >= len(setup) + warmup:
                engine.append(t1 - t0)
                consume.append(t2 - t1)
                read.append(t3 - t1)
                wall.append(w1 - w0)
                process.append(p2 - p0)
    return tuple(statistics.median(x) * 1e6 for x in (engine, consume, read, wall, process))  # type: ignore[return-value]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warmup = 5
    rng = random.Random(0)
    print(f"torch {torch.__version__}, CPU, one intra-op thread; engine-thread CPU time")
    print(
        f"{'step':<34} {'glue us':>9} {'manager us':>11} {'glue/manager':>13} "
        f"{'per round':>10} {'target':>8}  rounds (glue/manager us)"
    )
    for name, build in (
        ("decode 256 x 1", decode_steps),
        ("prefill 16 x 512 (8 with a hit)", prefill_steps),
    ):
        setup, steps = build(args.steps + warmup, rng)
        records = recorded(setup, steps)
        glue_medians, manager_medians = [], []
        for _ in range(args.rounds):
            glue_medians.append(statistics.median(glue_round(setup, steps, warmup)) * 1e6)
            manager_medians.append(
                statistics.median(manager_round(records, len(setup), warmup)) * 1e6
            )
        glue_us, manager_us = min(glue_medians), min(manager_medians)
        ratio = glue_us / manager_us
        per_round = statistics.median(
            g / m for g, m in zip(glue_medians, manager_medians, strict=True)
        )
        target = f"< {TARGET:.0%}" if name.startswith("decode") else "-"
        worst = max(ratio, per_round)
        verdict = ("met" if worst < TARGET else "MISSED") if name.startswith("decode") else ""
        spread = ", ".join(
            f"{g:.0f}/{m:.0f}" for g, m in zip(glue_medians, manager_medians, strict=True)
        )
        print(
            f"{name:<34} {glue_us:>9.0f} {manager_us:>11.0f} {ratio:>13.1%} "
            f"{per_round:>10.1%} {target:>8} {verdict}  {spread}"
        )
    shuffled = decode_steps(args.steps + warmup, rng)
    kept = decode_steps(args.steps + warmup, rng, shuffle=False)
    print()
    print(
        f"{'decode 256 x 1 through the glue':<34} {'begin+save us':>13} {'materialize us':>15} "
        f"{'+ read us':>10} {'wall us':>8} {'process us':>11}  targets <= "
        f"{ENGINE_TARGET_US:.0f} / {MATERIALIZE_TARGET_US:.0f}"
    )
    for threaded, order in (
        (True, "shuffled"),
        (False, "shuffled"),
        (True, "kept"),
        (False, "kept"),
    ):
        setup, steps = shuffled if order == "shuffled" else kept
        cycles = [cycle_round(setup, steps, warmup, threaded) for _ in range(args.rounds)]
        engine_us, consume_us, read_us = (min(c[k] for c in cycles) for k in range(3))
        # The wall and process figures of the round whose engine time is printed.
        wall_us, process_us = min(cycles)[3:]
        verdict = (
            "met"
            if engine_us <= ENGINE_TARGET_US and consume_us <= MATERIALIZE_TARGET_US
            else "MISSED"
        )
        spread = ", ".join(f"{c[0]:.0f}/{c[1]:.0f}/{c[2]:.0f}/{c[3]:.0f}" for c in cycles)
        name = f"{'threaded' if threaded else 'inline'}, order {order}"
        print(
            f"{name:<34} {engine_us:>13.0f} {consume_us:>15.0f} "
            f"{read_us:>10.0f} {wall_us:>8.0f} {process_us:>11.0f}  {verdict}  rounds {spread}"
        )


if __name__ == "__main__":
    main()
