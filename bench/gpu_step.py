"""Device-to-host cost of the step copy on CUDA, and the engine thread's time in save_outputs.

For a step of 1024, 8192 and 16384 rows of bf16 hidden states of width 2048 (4, 32 and 64 MiB),
with a threaded committer:
- `step ms` / `GB/s`: from the start of save_outputs until the step's rows are in the pinned
  page (HOST_READY: the manager's copy stream synchronized), which includes the save's
  on-device clone (DEV-1) and its host bookkeeping;
- `raw ms` / `raw GB/s`: a plain `copy_(non_blocking=True)` of the same bytes into pinned host
  memory, then a device synchronize; `x raw` = raw time / step time (1.0: the step copy costs
  no more than the bare transfer);
- `save ms` / `save cpu`: wall and thread CPU time of the engine thread inside save_outputs
  (it only enqueues work: DEV-3);
- `mat ms`: materialize of the step's own rows; `pool ms`: from the save until the committer
  has written the rows to the pool (the next save waits for that: TASK-3).
Then the pinned host bytes (`registered_pinned_bytes`) against the configured pool + pages.

Before each timed save the previous step's pool write has landed and the device is idle, so the
save waits on nothing. Medians after a warm-up (time.perf_counter, time.thread_time).

Then the copies launched per step, by phase, for two steps of two keys (hidden states of width
2048 and `talker.h` of width 16, bf16): 8 requests x 64 rows with no hit, and the same with 5
requests starting on a 512-row hit (32 blocks), 3 of them on contiguous blocks (one slot run)
and 2 on scattered blocks (32 runs). A `TorchDispatchMode` counts the aten copy and gather ops
(`copy_`, `clone`, `_to_copy`, `index_select`, `index_copy_`, `index_put_`, `index`, `cat`,
...) per key (told apart by row width); ops on int64 tensors (slot ids, indices) are counted
apart as `index`. The pool write is a numpy row assignment through byte views (`scatter_rows`:
of rows, or of whole KV blocks where the slots are), no aten op: its calls are counted by a
wrapper around the committer's `scatter_rows`. The phases, told
apart by the manager's range hooks (the NVTX range names):
- `save`: inside `save_outputs`, the pool write aside; on CUDA the on-device clone (DEV-1) and
  the copy into the landing page, one each per key; on the CPU none (DESIGN D27: the rows go
  from the caller's tensors straight into the pool);
- `pool write`: the rows into the host pool, one assignment per key;
- `own rows`: `materialize` outside the hit gathers: the step's own rows (on the CPU gathered
  out of the pool, one `index_select` per key for the requests without a hit; on CUDA the
  page's rows cloned once per key and each hit request's copied behind its prefix);
- `hit gather`: the hit prefixes gathered out of the pool, whatever the layout: on CUDA one
  `index_select` per hit request and key; on the CPU without a prefetch the hit requests'
  prefixes and own rows together, one `index_select` per key for up to 16 MiB of rows (DESIGN
  D27). Next to it the hit's contiguous slot runs (the copies a per-run gather, as a
  device-side one would be, launches) and its blocks (a per-block copy's count);
- `to device`: the caller moving the returned rows to the device, one `.to(device)` per
  contiguous buffer and key (the requests without a hit share one buffer; on CUDA each hit
  request has its own, on the CPU the hit requests gathered together share theirs); on the
  CPU a `.to(copy=True)` stands in.
The counting manager is inline and does not prefetch (HIT-7), so every op runs on the thread
the mode watches; the threaded committer and the prefetch worker launch the same ops elsewhere.

Run: python bench/gpu_step.py [--reps N]. Without CUDA it prints a message and exits 0.
`--device cpu` runs the same script on the CPU to check it end to end; its timings are no
device-to-host transfer and mean nothing, its copy counts are the CPU path's.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from omni_cache_cuda import (
    HIDDEN_KEY,
    OmniPrefixCacheManager,
    PrefixCacheConfig,
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
    PrefixCacheStep,
    PrefixCacheWriteLayout,
    _committer,
)
from omni_cache_cuda._storage import registered_pinned_bytes

BLOCK_SIZE = 16
WIDTH = 2048
DTYPE = torch.bfloat16
SIZES = (1024, 8192, 16384)
MM_KEY = "talker.h"
MM_WIDTH = 16
SHORT: dict[str, str] = {HIDDEN_KEY: "hidden"}  # column names
# The aten ops that copy or gather rows (any overload: in place, out=, functional).
COPY_OPS = frozenset(
    {
        "copy_",
        "clone",
        "_to_copy",
        "index_select",
        "index_copy_",
        "index_copy",
        "index_put_",
        "index_put",
        "_index_put_impl_",
        "index",
        "cat",
        "gather",
        "take",
        "scatter",
        "scatter_",
        "masked_scatter_",
        "narrow_copy",
    }
)


def wait_rows_written(m: OmniPrefixCacheManager, rows: int, timeout_s: float = 60.0) -> None:
    """Wait until the committer has written ``rows`` hidden rows to the pool in all."""
    deadline = time.monotonic() + timeout_s
    while m.stats().rows_written.get(HIDDEN_KEY, 0) < rows:
        if time.monotonic() > deadline:
            raise TimeoutError(f"pool writes did not reach {rows} rows")
        time.sleep(0.0002)


def med(values: list[float]) -> float:
    return statistics.median(values)


class CopyCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts the aten copy and gather ops launched on this thread, by phase, key and op.

    A key is told by the row width of the op's result (``widths``); results of an integer
    dtype (slot ids, gather indices) count under ``index``. Ops under the manager's
    ``omni_cache.hit_gather`` range count as the phase ``hit gather``, under
    ``omni_cache.pool_write`` as ``pool write``; the others as the phase set by the caller.
    """

    def __init__(self, widths: dict[int, str]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.widths = widths
        self.byte_widths = {w * DTYPE.itemsize: k for w, k in widths.items()}
        self.counts: Counter[tuple[str, str, str]] = Counter()
        self.phase = "other"
        self._ranges = threading.local()

    def _stack(self) -> list[str]:
        stack: list[str] | None = getattr(self._ranges, "stack", None)
        if stack is None:
            stack = self._ranges.stack = []
        return stack

    @contextlib.contextmanager
    def range(self, name: str) -> Iterator[None]:
        """The manager's range function (NVTX names): marks the ops run inside it."""
        stack = self._stack()
        stack.append(name)
        try:
            yield
        finally:
            stack.pop()

    def current_phase(self) -> str:
        stack = self._stack()
        if "omni_cache.hit_gather" in stack:
            return "hit gather"
        if "omni_cache.pool_write" in stack:
            return "pool write"
        return self.phase

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in COPY_OPS:
            result = out[0] if isinstance(out, (tuple, list)) else out
            if isinstance(result, torch.Tensor) and result.is_floating_point():
                key = self.widths.get(result.shape[-1] if result.ndim else 0, "other")
            else:
                key = "index"
            self.counts[(self.current_phase(), key, name)] += 1
        return out

    def count_pool_assignment(self, row_nbytes: int) -> None:
        key = self.byte_widths.get(row_nbytes, "other")
        self.counts[("pool write", key, "numpy row assignment")] += 1


@contextlib.contextmanager
def counting(m: OmniPrefixCacheManager, counter: CopyCounter) -> Iterator[None]:
    """Count ``m``'s copies on this thread: the dispatch mode, the range hooks, the pool write."""
    state = m._state
    # The pool write's one call per key and run of rows, patched where the committer looks it
    # up (_committer imports it from _storage without re-exporting it).
    plain_scatter = _committer.scatter_rows  # type: ignore[attr-defined]

    def counted_scatter(target: np.ndarray, *args: Any, **kwargs: Any) -> None:
        counter.count_pool_assignment(target.shape[1])
        plain_scatter(target, *args, **kwargs)

    saved = state.ranges, state.committer.ranges
    state.ranges = state.committer.ranges = counter.range
    _committer.scatter_rows = counted_scatter  # type: ignore[attr-defined]
    try:
        with counter:
            yield
    finally:
        state.ranges, state.committer.ranges = saved
        _committer.scatter_rows = plain_scatter  # type: ignore[attr-defined]


def slot_runs(slots: list[int]) -> int:
    """The number of runs of consecutive slots: the copies a per-run gather launches."""
    return sum(1 for i, s in enumerate(slots) if i == 0 or s != slots[i - 1] + 1)


def count_copies(device: torch.device) -> None:
    """Print the copy ops launched per step, by phase and key, for a step without and with hits."""
    own_rows, hit_rows, requests = 64, 512, 8
    hit_blocks = hit_rows // BLOCK_SIZE
    # Two shared prefixes: one on contiguous blocks, one on every other block (scattered).
    prefixes = {
        "contiguous": list(range(hit_blocks)),
        "scattered": list(range(hit_blocks, 3 * hit_blocks, 2)),
    }
    # Which prefix each of the step's requests starts on (None: no hit).
    starts_on: list[str | None] = ["contiguous"] * 3 + ["scattered"] * 2 + [None] * 3
    widths = {WIDTH: HIDDEN_KEY, MM_WIDTH: MM_KEY}
    keys = list(widths.values())
    config = PrefixCacheConfig(
        num_blocks=1024, block_size=BLOCK_SIZE, staging_capacity_tokens=2048, staging_depth=2
    )
    kind = PrefixCacheEventKind
    print()
    print("copies launched per step, by phase and key: aten ops seen by a TorchDispatchMode,")
    print("the pool write's numpy row assignments counted apart; inline manager, no prefetch")
    with OmniPrefixCacheManager(config, device=device, threaded=False, prefetch=False) as m:
        # The prefixes: written by two requests that stay live.
        warm = {}
        events = []
        for name, blocks in prefixes.items():
            req = f"warm_{name}"
            warm[name] = (
                torch.randn((hit_rows, WIDTH), device=device).to(DTYPE),
                torch.randn((hit_rows, MM_WIDTH), device=device).to(DTYPE),
            )
            events.append(
                PrefixCacheRequestEvent(
                    req_id=req, kind=kind.STARTED, block_ids=blocks, scheduled_tokens=hit_rows
                )
            )
        warm_reqs = [f"warm_{name}" for name in prefixes]
        layout = PrefixCacheWriteLayout.from_block_tables(
            warm_reqs,
            dict.fromkeys(warm_reqs, hit_rows),
            dict.fromkeys(warm_reqs, 0),
            {f"warm_{n}": b for n, b in prefixes.items()},
            BLOCK_SIZE,
        )
        m.new_step_starts(
            PrefixCacheStep(events=events, scheduled_tokens=dict.fromkeys(warm_reqs, hit_rows))
        )
        step_id = m.save_outputs(
            torch.cat([warm[n][0] for n in prefixes]),
            {MM_KEY: torch.cat([warm[n][1] for n in prefixes])},
            num_tokens_unpadded=len(prefixes) * hit_rows,
            write_layout=layout,
        )
        m.materialize(step_id, warm_reqs)

        next_block = 4 * hit_blocks
        for label, with_hits in (("no hit", False), ("5 hits", True)):
            reqs = [f"{label}_{i}" for i in range(requests)]
            computed: dict[str, int] = {}
            block_ids: dict[str, list[int]] = {}
            events = []
            hit_slots: dict[str, list[int]] = {}
            for req, prefix in zip(reqs, starts_on, strict=True):
                prefix = prefix if with_hits else None
                own = list(range(next_block, next_block + own_rows // BLOCK_SIZE))
                next_block += len(own)
                if prefix is None:
                    computed[req], block_ids[req] = 0, own
                else:
                    computed[req], block_ids[req] = hit_rows, prefixes[prefix] + own
                    hit_slots[req] = [
                        b * BLOCK_SIZE + o for b in prefixes[prefix] for o in range(BLOCK_SIZE)
                    ]
                events.append(
                    PrefixCacheRequestEvent(
                        req_id=req,
                        kind=kind.STARTED,
                        hit_end=computed[req],
                        block_ids=block_ids[req],
                        scheduled_tokens=own_rows,
                    )
                )
            n = requests * own_rows
            hidden = torch.randn((n, WIDTH), device=device).to(DTYPE)
            mm = torch.randn((n, MM_WIDTH), device=device).to(DTYPE)
            scheduled = dict.fromkeys(reqs, own_rows)
            m.new_step_starts(PrefixCacheStep(events=events, scheduled_tokens=scheduled))
            layout = PrefixCacheWriteLayout.from_block_tables(
                reqs, scheduled, computed, block_ids, BLOCK_SIZE
            )
            counter = CopyCounter(widths)
            with counting(m, counter):
                counter.phase = "save"
                step_id = m.save_outputs(
                    hidden, {MM_KEY: mm}, num_tokens_unpadded=n, write_layout=layout
                )
                counter.phase = "own rows"
                out = m.materialize(step_id, reqs)
                counter.phase = "to device"
                moved = {}
                for key in keys:
                    rows = out.hidden_states if key == HIDDEN_KEY else out.mm_outputs[key]
                    assert rows is not None
                    buffers: dict[int, torch.Tensor] = {}
                    for t in rows.values():
                        base = t if t._base is None else t._base
                        buffers.setdefault(base.data_ptr(), base)
                    # The caller's move: one copy per contiguous buffer (on the CPU, a copy).
                    moved[key] = [b.to(device, copy=True) for b in buffers.values()]
            sync_device(device)
            # The rows came back right: each request's hit prefix, then its own rows.
            for i, (req, prefix) in enumerate(zip(reqs, starts_on, strict=True)):
                prefix = prefix if with_hits else None
                assert out.hidden_states is not None
                got = out.hidden_states[req]
                mine = hidden[i * own_rows : (i + 1) * own_rows].cpu()
                if prefix is None:
                    assert torch.equal(got, mine), f"{req}: rows differ"
                else:
                    assert torch.equal(got[:hit_rows], warm[prefix][0].cpu()), f"{req}: hit rows"
                    assert torch.equal(got[hit_rows:], mine), f"{req}: own rows differ"
            del moved, out
            reqs_hit = [r for r in reqs if r in hit_slots]
            runs = sum(slot_runs(hit_slots[r]) for r in reqs_hit)
            hit_block_count = sum(len(hit_slots[r]) // BLOCK_SIZE for r in reqs_hit)
            if with_hits:
                shape = (
                    f"{requests} requests x {own_rows} rows, {len(reqs_hit)} starting on a "
                    f"{hit_rows}-row hit ({hit_blocks} blocks): "
                    f"{starts_on.count('contiguous')} on contiguous blocks (one run each), "
                    f"{starts_on.count('scattered')} on scattered blocks "
                    f"({slot_runs(hit_slots[reqs[3]])} runs each)"
                )
            else:
                shape = f"{requests} requests x {own_rows} rows, no hit"
            print(f"step {label!r}: {shape}; keys hidden ({WIDTH}) and {MM_KEY} ({MM_WIDTH})")
            print_counts(counter, keys)
            if with_hits:
                gathers = {
                    key: sum(
                        c
                        for (p, k, _), c in counter.counts.items()
                        if p == "hit gather" and k == key
                    )
                    for key in keys
                }
                how = (
                    "the hit requests' prefixes and own rows together, one index_select per key"
                    if device.type == "cpu"
                    else "one index_select per hit request and key"
                )
                print(
                    f"  hit gather: {gathers[HIDDEN_KEY]} ops for hidden, {gathers[MM_KEY]} for "
                    f"{MM_KEY}: {how}, whatever the layout ({len(reqs_hit)} hit requests);"
                )
                print(
                    f"  a gather per contiguous slot run would launch {runs} copies per key, "
                    f"a copy per block {hit_block_count}"
                )
            m.new_step_starts(
                PrefixCacheStep(
                    events=[PrefixCacheRequestEvent(req_id=r, kind=kind.FINISHED) for r in reqs],
                    scheduled_tokens={},
                )
            )


def print_counts(counter: CopyCounter, keys: list[str]) -> None:
    """One line per phase: the row copies per key, the index ops, and the ops by name."""
    phases = ("save", "pool write", "own rows", "hit gather", "to device")
    columns = [SHORT.get(k, k) for k in keys]
    print(f"  {'phase':11} " + " ".join(f"{k:>9}" for k in columns) + f" {'index':>6}  row ops")
    for phase in phases:
        per_key = [
            sum(c for (p, k, _), c in counter.counts.items() if p == phase and k == key)
            for key in keys
        ]
        index = sum(c for (p, k, _), c in counter.counts.items() if p == phase and k == "index")
        ops: Counter[str] = Counter()
        for (p, k, op), c in counter.counts.items():
            if p == phase and k != "index":
                ops[op] += c
        names = ", ".join(f"{op} {c}" for op, c in sorted(ops.items())) or "-"
        print(f"  {phase:11} " + " ".join(f"{c:9d}" for c in per_key) + f" {index:6d}  {names}")
    other = {p for p, _, _ in counter.counts} - set(phases)
    assert not other, f"ops outside the phases: {other}"


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu to check the script")
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        print("gpu_step: no CUDA device here; nothing measured (run it on a GPU machine).")
        return 0
    name = torch.cuda.get_device_properties(device).name if cuda else "CPU (script check only)"
    print(
        f"{name}, torch {torch.__version__}, CUDA {torch.version.cuda}; "
        f"hidden width {WIDTH} {DTYPE}, threaded committer, median of {args.reps}"
    )

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    max_rows = max(SIZES)
    region_blocks = max_rows // BLOCK_SIZE
    config = PrefixCacheConfig(
        num_blocks=2 * region_blocks,
        block_size=BLOCK_SIZE,
        staging_depth=2,
        staging_capacity_tokens=max_rows,
        staging_claim_timeout_s=60.0,
    )
    gc.collect()
    pinned_before = registered_pinned_bytes()
    kind = PrefixCacheEventKind
    print(
        f"{'rows':>6} {'MiB':>5} {'step ms':>8} {'GB/s':>6} {'raw ms':>7} {'raw GB/s':>8} "
        f"{'x raw':>6} {'save ms':>8} {'save cpu':>8} {'mat ms':>7} {'pool ms':>8}"
    )
    with OmniPrefixCacheManager(config, device=device, threaded=True) as m:
        copy_stream = m._state.copy_stream
        assert copy_stream is not None or not cuda
        written = 0
        prev: list[str] = []
        step_no = 0
        for rows in SIZES:
            nbytes = rows * WIDTH * DTYPE.itemsize
            hidden = torch.randn((rows, WIDTH), device=device).to(DTYPE)
            raw_dst = torch.empty((rows, WIDTH), dtype=DTYPE, pin_memory=cuda)
            step_s, raw_s, save_s, save_cpu, mat_s, pool_s = [], [], [], [], [], []
            for i in range(args.warmup + args.reps):
                step_no += 1
                req = f"r{step_no}"
                first = (step_no % 2) * region_blocks  # alternate between two block regions
                blocks = list(range(first, first + -(-rows // BLOCK_SIZE)))
                events = [PrefixCacheRequestEvent(req_id=r, kind=kind.FINISHED) for r in prev]
                events.append(
                    PrefixCacheRequestEvent(
                        req_id=req, kind=kind.STARTED, block_ids=blocks, scheduled_tokens=rows
                    )
                )
                m.new_step_starts(PrefixCacheStep(events=events, scheduled_tokens={req: rows}))
                prev = [req]
                layout = PrefixCacheWriteLayout.from_block_tables(
                    [req], {req: rows}, {req: 0}, {req: blocks}, BLOCK_SIZE
                )
                wait_rows_written(m, written)
                sync()

                t0 = time.perf_counter()
                c0 = time.thread_time()
                step_id = m.save_outputs(hidden, {}, num_tokens_unpadded=rows, write_layout=layout)
                c1 = time.thread_time()
                t1 = time.perf_counter()
                if copy_stream is not None:
                    copy_stream.synchronize()  # the step's rows are in the pinned page
                t2 = time.perf_counter()
                out = m.materialize(step_id, [req])
                t3 = time.perf_counter()
                written += rows
                wait_rows_written(m, written)
                t4 = time.perf_counter()
                if i == 0:
                    assert out.hidden_states is not None
                    assert torch.equal(out.hidden_states[req], hidden.cpu()), "rows differ"
                del out

                sync()
                r0 = time.perf_counter()
                raw_dst.copy_(hidden, non_blocking=cuda)
                sync()
                r1 = time.perf_counter()
                if i >= args.warmup:
                    step_s.append(t2 - t0)
                    save_s.append(t1 - t0)
                    save_cpu.append(c1 - c0)
                    mat_s.append(t3 - t2)
                    pool_s.append(t4 - t0)
                    raw_s.append(r1 - r0)
            step, raw = med(step_s), med(raw_s)
            print(
                f"{rows:6d} {nbytes / 2**20:5.0f} {step * 1e3:8.3f} {nbytes / step / 1e9:6.1f} "
                f"{raw * 1e3:7.3f} {nbytes / raw / 1e9:8.1f} {raw / step:6.2f} "
                f"{med(save_s) * 1e3:8.3f} {med(save_cpu) * 1e3:8.3f} "
                f"{med(mat_s) * 1e3:7.2f} {med(pool_s) * 1e3:8.2f}"
            )
            del hidden, raw_dst
        stats = m.stats()
        pinned = registered_pinned_bytes() - pinned_before
    row_bytes = WIDTH * DTYPE.itemsize
    pool_bytes = config.num_slots * row_bytes
    page_bytes = config.staging_depth * config.staging_capacity_tokens * row_bytes
    configured = pool_bytes + page_bytes
    print()
    print(
        f"pinned (registered) {pinned / 2**20:.1f} MiB for pool {pool_bytes / 2**20:.1f} MiB + "
        f"pages {page_bytes / 2**20:.1f} MiB: ratio {pinned / configured:.4f} "
        f"(stats: pool {stats.pool_bytes / 2**20:.1f} MiB, pages {stats.staging_bytes / 2**20:.1f} MiB)"
    )
    print(
        f"bytes device-to-host {stats.bytes_device_to_host / 2**30:.2f} GiB, to pool "
        f"{stats.bytes_to_pool / 2**30:.2f} GiB, page waits {stats.page_waits}, "
        f"failed writes {stats.writes_failed}"
    )
    count_copies(device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
