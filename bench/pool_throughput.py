"""Host pool throughput on the CPU: the committer's pool write and the manager's hit gather.

Both run through the library's own code paths on a manager's real pool and pages:
- write: `Committer._write_pool` of one step write (page rows `index_copy_`-ed into the pool at
  the step's slots), with no lost slot and with one lost slot (a tombstone, SLOT-2);
- gather: the consume path's `ConsumePath.gather` of one hit read whose rows are all committed
  (`index_select` from the pool).
Each is set against, in the same run on the same buffers: a plain contiguous `copy_` of the same
bytes (the memory-speed reference; target ratio >= 0.8) and the bare torch op the path wraps
(`index_copy_` or `index_select` with the same slots). Slots come in runs of one block (16),
blocks in random order, as a prefill over recycled blocks lays them out.

Also: occupancy metadata bytes per (slot, key) (SLOT-6: <= 8) and host bytes per cached row.

Sizes: num_blocks=16384, block_size=16; hidden width 2048 and an mm key of width 16, bf16;
steps of 256 and 8192 rows. Times are medians of time.perf_counter after a warm-up, with the
CPU time (time.thread_time) checked alongside: a ratio of wall to CPU far above 1 means other
load on the machine.

Run: python bench/pool_throughput.py [--reps N] [--threads T]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from omni_cache_core import HIDDEN_KEY, ReadPlan, ReqId, SlotSource, TensorName, Tid
from omni_cache_cuda import (
    OmniPrefixCacheManager,
    PrefixCacheConfig,
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
    PrefixCacheStep,
    PrefixCacheWriteLayout,
)
from omni_cache_cuda._committer import WriteJob
from omni_cache_cuda._state import StepContext

NUM_BLOCKS = 16384
BLOCK_SIZE = 16
MM_KEY = TensorName("talker.h")
WIDTHS = {HIDDEN_KEY: 2048, MM_KEY: 16}
DTYPE = torch.bfloat16
CAPACITY = 8192
TARGET = 0.8


def timeit(fn: Callable[[], object], reps: int, warmup: int = 3) -> tuple[float, float]:
    """Median wall and thread-CPU seconds of ``fn`` over ``reps`` runs after a warm-up."""
    for _ in range(warmup):
        fn()
    wall, cpu = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        c0 = time.thread_time()
        fn()
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - t0)
    return statistics.median(wall), statistics.median(cpu)


def block_slots(rng: np.random.Generator, rows: int) -> np.ndarray:
    """``rows`` slots in whole blocks of consecutive slots, blocks in random order."""
    blocks = rng.choice(NUM_BLOCKS, size=-(-rows // BLOCK_SIZE), replace=False)
    slots = (blocks[:, None] * BLOCK_SIZE + np.arange(BLOCK_SIZE)).reshape(-1)
    return slots[:rows].astype(np.int64)


def install_keys(m: OmniPrefixCacheManager) -> None:
    """One small step through the public API, so the pool and pages of both keys exist."""
    m.new_step_starts(
        PrefixCacheStep(
            events=[
                PrefixCacheRequestEvent(
                    req_id="w", kind=PrefixCacheEventKind.STARTED, scheduled_tokens=16
                )
            ],
            scheduled_tokens={"w": 16},
        )
    )
    layout = PrefixCacheWriteLayout.from_block_tables(
        ["w"], {"w": 16}, {"w": 0}, {"w": [0]}, BLOCK_SIZE
    )
    step_id = m.save_outputs(
        torch.zeros(16, WIDTHS[HIDDEN_KEY], dtype=DTYPE),
        {MM_KEY: torch.zeros(16, WIDTHS[MM_KEY], dtype=DTYPE)},
        num_tokens_unpadded=16,
        write_layout=layout,
    )
    m.materialize(step_id, ["w"])


class Table:
    """Prints one line per measurement, with its ratios to the plain copy of the same bytes."""

    def __init__(self) -> None:
        print(
            f"{'operation':38} {'rows':>5} {'MiB':>6} {'ms':>7} {'cpu ms':>7} {'GB/s':>6} "
            f"{'x copy':>6} {'x copy cpu':>10} {'x op':>5}  target"
        )

    @staticmethod
    def line(
        name: str,
        rows: int,
        nbytes: int,
        t: tuple[float, float],
        plain: tuple[float, float],
        op: tuple[float, float] | None = None,
        target: bool = False,
    ) -> None:
        """Print ``t`` (wall, cpu seconds) against the plain copy and the bare op."""
        ratio = plain[0] / t[0]
        tail = ""
        if target:
            tail = f"  >= {TARGET} x copy {'ok' if ratio >= TARGET else 'MISSED'}"
        print(
            f"{name:38} {rows:5d} {nbytes / 2**20:6.2f} {t[0] * 1e3:7.3f} {t[1] * 1e3:7.3f} "
            f"{nbytes / t[0] / 1e9:6.2f} {ratio:6.2f} {plain[1] / t[1]:10.2f} "
            f"{'' if op is None else format(op[0] / t[0], '5.2f'):>5}{tail}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    reps = args.reps
    rng = np.random.default_rng(0)
    config = PrefixCacheConfig(
        num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, staging_capacity_tokens=CAPACITY
    )
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} intra-op thread(s), median of {reps}"
    )
    table = Table()
    with OmniPrefixCacheManager(config, device="cpu", threaded=False) as m:
        install_keys(m)
        committer = m._state.committer
        for key, width in WIDTHS.items():
            pool = m._state.pool.tensors[key]
            page = m._state.pages.buffers[key]
            page.normal_()
            pool.normal_()
            label = f"{'hidden' if key == HIDDEN_KEY else key} w{width}"
            for rows in (256, 8192):
                nbytes = rows * width * DTYPE.itemsize
                slots_np = block_slots(rng, rows)
                slots = torch.from_numpy(slots_np)
                src = page[:rows]
                dst = torch.empty_like(src)
                plain = timeit(lambda: dst.copy_(src), reps)  # noqa: B023
                table.line(f"plain copy_ {label}", rows, nbytes, plain, plain)

                # The committer's pool write of a step write viewing page 0 (CONC-4: one writer).
                bare_write = timeit(lambda: pool.index_copy_(0, slots, src), reps)  # noqa: B023
                job = WriteJob(Tid(1 << 30), (key,), page=0, slots=slots)
                write = timeit(lambda: committer._write_pool(job), reps)  # noqa: B023
                table.line(
                    f"pool write (_write_pool) {label}",
                    rows,
                    nbytes,
                    write,
                    plain,
                    bare_write,
                    target=True,
                )
                lost = WriteJob(Tid((1 << 30) + 1), (key,), page=0, slots=slots)
                lost.add_tombstone(key, slots[:1].clone())  # SLOT-2: skip the lost slot
                write_lost = timeit(lambda: committer._write_pool(lost), reps)  # noqa: B023
                table.line(
                    f"  with 1 slot lost {label}", rows, nbytes, write_lost, plain, bare_write
                )
                table.line(f"  bare index_copy_ {label}", rows, nbytes, bare_write, plain)

                # The manager's gather of a hit read whose rows are all committed (HIT-3).
                read = ReadPlan(
                    read_id=0,
                    req_id=ReqId("bench"),
                    key=key,
                    slots=slots_np,
                    source=np.full(rows, SlotSource.POOL.value, dtype=np.int8),
                    writer=np.zeros(rows, dtype=np.int32),
                    chunk_limit=(),
                    step_row=np.full(rows, -1, dtype=np.int32),
                    preserved=np.zeros(rows, dtype=bool),
                )
                ctx = StepContext()
                got = torch.empty_like(src)
                consume = m._consume
                consume.gather(got, read, None, ctx, {})
                assert torch.equal(got, pool[slots]), "the gather returned wrong rows"
                gathered = torch.empty_like(src)
                bare_gather = timeit(
                    lambda: torch.index_select(pool, 0, slots, out=gathered),  # noqa: B023
                    reps,
                )
                gather = timeit(lambda: consume.gather(got, read, None, ctx, {}), reps)  # noqa: B023
                table.line(
                    f"hit gather (gather) {label}",
                    rows,
                    nbytes,
                    gather,
                    plain,
                    bare_gather,
                    target=True,
                )
                table.line(f"  bare index_select {label}", rows, nbytes, bare_gather, plain)
        stats = m.stats()
    num_slots = config.num_slots
    keys = len(WIDTHS)
    payload = sum(WIDTHS.values()) * DTYPE.itemsize
    host = stats.pool_bytes + stats.staging_bytes + stats.occupancy_bytes
    print()
    print(
        f"occupancy metadata: {stats.occupancy_bytes} B for {num_slots} slots x {keys} keys = "
        f"{stats.occupancy_bytes / (num_slots * keys):.2f} B per (slot, key) (SLOT-6: <= 8)"
    )
    print(
        f"host bytes per cached row, both keys ({payload} B of payload): pool "
        f"{stats.pool_bytes / num_slots:.1f} + pages {stats.staging_bytes / num_slots:.1f} + "
        f"metadata {stats.occupancy_bytes / num_slots:.1f} = {host / num_slots:.1f} B "
        f"({host / num_slots / payload:.3f}x payload)"
    )


if __name__ == "__main__":
    main()
