"""Host storage: allocation (zeroed, large pools backed by transparent huge pages), the pool's
row writes (whole KV blocks at a time where the slots are) and the memory of returned rows, kept
for reuse."""

from __future__ import annotations

import re
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from omni_cache_cuda import _storage as storage
from omni_cache_cuda._save_path import _shadowed_rows
from omni_cache_cuda._storage import (
    advise_huge_pages,
    alloc_host,
    scatter_rows,
    whole_blocks,
    write_blocks,
)

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    """The selected mode (``always``, ``madvise``, ``never``), or None off Linux."""
    if not sys.platform.startswith("linux") or not _THP.exists():
        return None
    found = re.search(r"\[(\w+)\]", _THP.read_text())
    return found.group(1) if found else None


def _thp_eligible(address: int) -> bool | None:
    """Whether the mapping holding ``address`` may get huge pages (``THPeligible`` in smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            inside = int(head.group(1), 16) <= address < int(head.group(2), 16)
        elif inside and line.startswith("THPeligible:"):
            return line.split()[1] == "1"
    return None


def test_alloc_host_returns_zeroed_memory_of_the_shape() -> None:
    rows = alloc_host((4096, 2048), torch.bfloat16, pin=False)
    assert rows.shape == (4096, 2048) and rows.dtype == torch.bfloat16
    assert int(rows.count_nonzero()) == 0


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason="no transparent huge pages")
def test_a_large_pool_is_advised_huge_pages_and_a_small_one_is_not() -> None:
    """A pool of 32 MiB lies in a mapping eligible for huge pages once advised; 1 MiB is left."""
    large = torch.empty((8192, 2048), dtype=torch.bfloat16)
    assert advise_huge_pages(large)
    assert _thp_eligible(large.data_ptr() + (4 << 20)) is True
    small = torch.empty((256, 2048), dtype=torch.bfloat16)
    assert not advise_huge_pages(small)


@pytest.mark.skipif(_thp_mode() != "madvise", reason="huge pages only on request under madvise")
def test_alloc_host_advises_before_the_first_touch() -> None:
    """Under ``madvise`` a mapping is eligible only if advised: alloc_host's pool is."""
    pool = alloc_host((8192, 2048), torch.bfloat16, pin=False)
    assert _thp_eligible(pool.data_ptr() + (4 << 20)) is True


@pytest.mark.parametrize(
    ("slots", "blocks"),
    [
        ([4, 5, 6, 7, 0, 1, 2, 3], [1, 0]),
        ([8, 9, 10, 11, 8, 9, 10, 11], [2, 2]),  # a block may come twice
        ([4, 5, 6, 7, 0, 1, 2], None),  # not a whole number of blocks
        ([5, 6, 7, 8], None),  # a run of four, not from a multiple of four
        ([4, 5, 7, 6], None),  # the block's slots, out of order
        ([0, 1, 2, 3, 4, 5, 6, 8], None),  # the second block's last slot is not its own
        ([3, 9, 17, 30], None),  # a decode step's scattered slots
        ([], None),
    ],
)
def test_whole_blocks_finds_a_write_made_of_whole_kv_blocks(
    slots: list[int], blocks: list[int] | None
) -> None:
    found = whole_blocks(np.array(slots, dtype=np.int64), 4)
    assert (found is None) == (blocks is None)
    if found is not None:
        assert found.tolist() == blocks


def test_whole_blocks_with_blocks_of_one_slot_is_never_a_block_write() -> None:
    assert whole_blocks(np.arange(8, dtype=np.int64), 1) is None


def _whole_blocks_in_random_order(blocks: int, block_size: int) -> list[int]:
    """The slots of ``blocks`` whole blocks out of twice as many, in random order, the first
    block repeated at the end."""
    order = np.random.default_rng(blocks).permutation(2 * blocks)[:blocks].tolist()
    order.append(order[0])
    return [b * block_size + o for b in order for o in range(block_size)]


@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize(
    "slots",
    [
        [12, 13, 14, 15, 0, 1, 2, 3, 12, 13, 14, 15],  # whole blocks, one twice: the later wins
        [12, 13, 14, 15, 0, 1, 2, 3, 12, 13, 14],  # not whole blocks: row by row
        [7, 2, 7, 30],  # scattered, one slot twice
        _whole_blocks_in_random_order(200, 4),  # past the threshold: block by block
    ],
    ids=["blocks", "ragged", "scattered", "many-blocks"],
)
@pytest.mark.parametrize("threshold", ["default", "none"])
@pytest.mark.parametrize("blocks", ["looked for", "given"])
def test_scatter_rows_writes_what_a_row_assignment_writes(
    slots: list[int],
    contiguous: bool,
    threshold: str,
    blocks: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Block by block or row by row, the pool ends as ``pool[slots] = rows`` leaves it (D33);
    with no size threshold, the few slots of the small cases take the block path too. Blocks
    found beforehand (`write_blocks`, as a step's write finds them once for all its keys) are
    taken as found, and strided rows still go row by row."""
    if threshold == "none":
        monkeypatch.setattr(storage, "_BLOCK_WRITE_MIN_ROWS", 0)
    rng = np.random.default_rng(len(slots))
    index = np.array(slots, dtype=np.int64)
    wide = rng.integers(0, 255, size=(len(slots), 16), dtype=np.uint8)
    rows = wide if contiguous else wide[:, ::2]
    expected = np.zeros((max(slots) + 1, rows.shape[1]), dtype=np.uint8)
    for slot, row in zip(slots, rows, strict=True):
        expected[slot] = row
    pool = np.zeros_like(expected)
    if blocks == "given":
        found = write_blocks(index, 4)
        scatter_rows(pool, index, rows, 4 if found is not None else 1, found)
    else:
        scatter_rows(pool, index, rows, 4)
    np.testing.assert_array_equal(pool, expected)


def test_write_blocks_only_for_writes_of_the_threshold_and_more() -> None:
    """D33: a write under `_BLOCK_WRITE_MIN_ROWS` rows goes row by row, whole blocks or not."""
    many = np.array(_whole_blocks_in_random_order(200, 4), dtype=np.int64)
    assert len(many) >= storage._BLOCK_WRITE_MIN_ROWS
    found = write_blocks(many, 4)
    assert found is not None and found.tolist() == (many[::4] // 4).tolist()
    assert write_blocks(many[: 4 * 8], 4) is None


@pytest.mark.parametrize("repeat", [False, True])
def test_shadowed_rows_from_whole_blocks_are_those_of_the_slots(repeat: bool) -> None:
    """TASK-5, D33: the save's check for repeated slots, given the write's whole blocks, names
    the rows that a later row of the step shadows, as the check of the slots alone does."""
    slots = np.array(_whole_blocks_in_random_order(200, 4), dtype=np.int64)
    if not repeat:
        slots = slots[:-4]  # the first block's repeat at the end
    blocks = whole_blocks(slots, 4)
    assert blocks is not None
    shadowed = _shadowed_rows(slots, blocks)
    assert shadowed.tolist() == _shadowed_rows(slots).tolist()
    later = {int(slot): row for row, slot in enumerate(slots)}
    assert shadowed.tolist() == [row for row, slot in enumerate(slots) if later[slot] != row]
    assert bool(len(shadowed)) == repeat


def test_page_rows_are_one_view_while_the_row_count_stays() -> None:
    """`StagingPages.rows` hands the same view for the same page and count (a decode step asks
    every step), a new one for another count, each over the right rows; none after release."""
    pages = storage.StagingPages(3, 4, pin=False)
    key = "k"
    pages.install(key, torch.zeros(12, 2))
    first = pages.rows(key, 1, 3)
    assert pages.rows(key, 1, 3) is first
    first.copy_(torch.arange(6.0).reshape(3, 2))
    assert pages.buffers[key][4:7].tolist() == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
    assert (
        pages.buffers[key][:4].count_nonzero() == 0 and pages.buffers[key][7:].count_nonzero() == 0
    )
    shorter = pages.rows(key, 1, 2)
    assert shorter is not first and shorter.tolist() == [[0.0, 1.0], [2.0, 3.0]]
    assert pages.rows(key, 2, 2).data_ptr() == pages.buffers[key][8:].data_ptr()
    pages.release()
    with pytest.raises(KeyError):
        pages.rows(key, 1, 2)


# ---------------------------------------------------------------------------------------------
# The memory of returned rows, kept for reuse (D40, OUT-8).

_MiB = 1 << 20


def _output_memory(limit: int = 64 * _MiB) -> storage.OutputMemory:
    return storage.OutputMemory(lambda: limit)


def _address(rows: torch.Tensor) -> int:
    """Where the memory behind ``rows`` (and any view of it) starts."""
    return rows.untyped_storage().data_ptr()


def test_d40_a_buffer_is_handed_out_again_once_no_view_of_it_is_left() -> None:
    """Handed out, held through a view, then let go of: only then is it handed out again,
    for any size of its class, and both buffers stay kept."""
    memory = _output_memory()
    first = memory.rows((512, 2048), torch.bfloat16)  # 2 MiB
    first_at = _address(first)
    view = first[10:20]
    del first
    second = memory.rows((512, 2048), torch.bfloat16)
    second_at = _address(second)
    assert second_at != first_at  # a view of the first is alive
    del view, second
    third = memory.rows((500, 2048), torch.bfloat16)
    assert _address(third) in (first_at, second_at)
    assert third.shape == (500, 2048) and third.dtype == torch.bfloat16 and third.is_contiguous()
    assert memory.nbytes() == 4 * _MiB


@pytest.mark.parametrize(
    "hold",
    [
        lambda rows: rows[5:9],
        lambda rows: rows.t(),
        lambda rows: rows.view(torch.uint8),
        lambda rows: rows.reshape(-1),
        lambda rows: rows.numpy(),
        lambda rows: rows.untyped_storage(),
        lambda rows: torch.as_strided(rows, (2, 2), (1, 1), 7),
    ],
    ids=["slice", "transpose", "dtype view", "reshape", "numpy", "storage", "as_strided"],
)
def test_out_8_no_buffer_is_handed_out_while_the_caller_holds_any_part_of_it(
    hold: Callable[[torch.Tensor], object],
) -> None:
    """Whatever the caller keeps of returned rows (a view, a numpy array, the storage), their
    memory is not handed out again: the bytes behind it stay as they were."""
    memory = _output_memory()
    rows = memory.rows((1024, 1024), torch.float32)  # 4 MiB
    rows.copy_(torch.arange(1024 * 1024, dtype=torch.float32).view(1024, 1024))
    before = rows.clone()
    at = _address(rows)
    held = hold(rows)
    del rows
    others = []
    for _ in range(3):
        other = memory.rows((1024, 1024), torch.float32)
        assert _address(other) != at
        other.fill_(-1.0)
        others.append(other)
        del other
    others.clear()
    kept = torch.empty(0, dtype=torch.float32).set_(
        held if isinstance(held, torch.UntypedStorage) else torch.as_tensor(held).untyped_storage()
    )
    assert torch.equal(kept[: 1024 * 1024].view(1024, 1024), before)


@pytest.mark.parametrize("change", ["share_memory_", "resize_"])
def test_out_8_rows_moved_to_shared_memory_or_resized_are_forgotten(change: str) -> None:
    """torch.multiprocessing moves a tensor it sends into shared memory, which the receiving
    process may still read after the caller drops its own tensors; a resize puts other memory
    under the buffer. Either way the buffer is not handed out again, and no longer counted."""
    memory = _output_memory()
    rows = memory.rows((512, 1024), torch.float32)  # 2 MiB
    if change == "share_memory_":
        rows.share_memory_()
    else:
        rows.resize_(1024, 1024)
    at = _address(rows)
    del rows
    again = memory.rows((512, 1024), torch.float32)
    assert _address(again) != at
    assert memory.nbytes() == 2 * _MiB  # the new buffer alone


def test_d40_kept_bytes_stay_within_the_limit_let_go_buffers_forgotten_first() -> None:
    """A new buffer past the limit forgets kept buffers the caller let go of before those it
    holds; one larger than the limit is not kept at all."""
    memory = _output_memory(limit=8 * _MiB)
    held = memory.rows((1024, 768), torch.float32)  # 3 MiB, held throughout
    held_at = _address(held)
    let_go = memory.rows((1024, 768), torch.float32)
    del let_go
    assert memory.nbytes() == 6 * _MiB
    bigger = memory.rows((1024, 1024), torch.float32)  # 4 MiB: room made by the let-go one
    assert memory.nbytes() == 7 * _MiB <= 8 * _MiB
    assert memory.rows((4096, 1024), torch.float32).shape == (4096, 1024)  # 16 MiB: not kept
    assert memory.nbytes() == 7 * _MiB
    del held, bigger
    assert _address(memory.rows((1024, 768), torch.float32)) == held_at  # still kept


def test_d40_small_buffers_come_from_the_allocator(monkeypatch: pytest.MonkeyPatch) -> None:
    """Below `OutputMemory.MIN_BYTES` nothing is kept: the allocator keeps such memory."""
    monkeypatch.setattr(storage.OutputMemory, "MIN_BYTES", 2 * _MiB)
    memory = _output_memory()
    assert memory.rows((16, 16), torch.bfloat16).shape == (16, 16)
    assert memory.clone(torch.ones(4, 4)).equal(torch.ones(4, 4))
    assert memory.nbytes() == 0
    copied = memory.clone(torch.ones(512, 1024))  # 2 MiB: kept
    assert copied.equal(torch.ones(512, 1024)) and memory.nbytes() == 2 * _MiB


def test_d40_without_torch_s_use_count_nothing_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the count of a storage's owners no buffer can be known free: none is kept."""
    monkeypatch.setattr(storage, "_use_count", None)
    memory = _output_memory()
    for _ in range(2):
        assert memory.rows((1024, 1024), torch.float32).shape == (1024, 1024)
    assert memory.nbytes() == 0


def test_d40_release_forgets_every_buffer_and_leaves_the_callers_rows() -> None:
    memory = _output_memory()
    rows = memory.rows((512, 1024), torch.float32)
    rows.fill_(3.0)
    memory.release()
    assert memory.nbytes() == 0
    assert _address(memory.rows((512, 1024), torch.float32)) != _address(rows)
    assert bool((rows == 3.0).all())


def test_d40_size_classes_round_up_by_at_most_a_quarter() -> None:
    previous = 0
    for nbytes in [*range(1, 4096), *range(2 * _MiB - 4096, 2 * _MiB + 4096, 64)]:
        size = storage._size_class(nbytes)
        assert nbytes <= size <= nbytes * 5 // 4 + 1, nbytes
        assert size >= previous, nbytes
        previous = size


def test_d40_threads_taking_buffers_at_once_never_share_one() -> None:
    """The consume and the prefetch worker take buffers at once: each one is one thread's."""
    memory = _output_memory()
    errors: list[str] = []
    start = threading.Barrier(4)

    def take(mark: float) -> None:
        start.wait()
        for _ in range(200):
            rows = memory.rows((512, 1024), torch.float32)
            rows.fill_(mark)
            time.sleep(0)
            if not bool((rows == mark).all()):
                errors.append(f"thread {mark}: a buffer written by another thread")
            del rows

    threads = [threading.Thread(target=take, args=(float(i),)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[:3]
    assert memory.nbytes() <= 4 * 2 * _MiB
