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

Run: python bench/gpu_step.py [--reps N]. Without CUDA it prints a message and exits 0.
`--device cpu` runs the same script on the CPU to check it end to end; its figures are no
device-to-host transfer and mean nothing.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import torch

from omni_cache_cuda import (
    HIDDEN_KEY,
    OmniPrefixCacheManager,
    PrefixCacheConfig,
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
    PrefixCacheStep,
    PrefixCacheWriteLayout,
)
from omni_cache_cuda._storage import registered_pinned_bytes

BLOCK_SIZE = 16
WIDTH = 2048
DTYPE = torch.bfloat16
SIZES = (1024, 8192, 16384)


def wait_rows_written(m: OmniPrefixCacheManager, rows: int, timeout_s: float = 60.0) -> None:
    """Wait until the committer has written ``rows`` hidden rows to the pool in all."""
    deadline = time.monotonic() + timeout_s
    while m.stats().rows_written.get(HIDDEN_KEY, 0) < rows:
        if time.monotonic() > deadline:
            raise TimeoutError(f"pool writes did not reach {rows} rows")
        time.sleep(0.0002)


def med(values: list[float]) -> float:
    return statistics.median(values)


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
    return 0


if __name__ == "__main__":
    sys.exit(main())
