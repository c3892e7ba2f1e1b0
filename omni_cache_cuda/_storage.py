"""Host storage: the pool (one row per KV slot per key), the staging pages (PAGE-1) and the
memory of the rows handed out (`OutputMemory`, D40).

Both are allocated per key, at `reserve` or lazily at the key's first save, outside the state
lock, and installed under it (first install wins). On a CUDA machine they are pinned at their
exact size: a plain host tensor registered with ``cudaHostRegister`` rather than the caching host
allocator, which rounds every block up to a power of two (a 0.9 GiB pool would cost 1 GiB). An
allocation or a pin that fails raises and keeps nothing (D20); `alloc_host` fires the ``alloc``
and ``pin`` fault points (`omni_cache_cuda._faults`) for the tests.
"""

from __future__ import annotations

import ctypes
import math
import sys
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import attrs
import numpy as np
import torch

from omni_cache_core import BadInputError, TensorName
from omni_cache_cuda._faults import Faults

if TYPE_CHECKING:
    from _ctypes import CFuncPtr

__all__ = [
    "HostPool",
    "KeyShape",
    "OutputMemory",
    "StagingPages",
    "advise_huge_pages",
    "alloc_host",
    "empty_rows",
    "row_bytes",
    "scatter_rows",
    "whole_blocks",
    "write_blocks",
]

_registered_lock = threading.Lock()
_registered_bytes = 0


def registered_pinned_bytes() -> int:
    """Bytes this process pinned through `alloc_host` and still holds."""
    return _registered_bytes


class _Unregister:
    """Unpins a registered host tensor when its storage is collected."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.ptr = ptr
        self.nbytes = nbytes

    def __call__(self) -> None:
        global _registered_bytes
        torch.cuda.cudart().cudaHostUnregister(self.ptr)  # type: ignore[no-untyped-call]
        with _registered_lock:
            _registered_bytes -= self.nbytes


def alloc_host(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    *,
    pin: bool,
    faults: Faults | None = None,
    detail: Any = None,
) -> torch.Tensor:
    """Allocate zeroed host memory, pinned at its exact size when ``pin`` (see module doc).

    Raises what the allocation or the pinning raised; then nothing stays allocated or pinned
    (the caller must not keep the exception's frames alive either: no local holds the memory).
    ``faults`` fires the ``alloc`` point before the allocation and ``pin`` before pinning, with
    ``detail``.
    """
    if faults is not None:
        faults.fire("alloc", detail)
    tensor = torch.empty(shape, dtype=dtype)
    advise_huge_pages(tensor)
    tensor.zero_()
    if not pin or tensor.numel() == 0:
        return tensor
    try:
        if faults is not None:
            faults.fire("pin", detail)
    except BaseException:
        del tensor  # the exception's frame must not keep the memory
        raise
    global _registered_bytes
    nbytes = tensor.untyped_storage().nbytes()
    ptr = tensor.data_ptr()
    status = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)  # type: ignore[no-untyped-call]
    if int(status) != 0:
        # Registration can be refused (for example under a locked-memory limit); fall back to
        # the caching allocator, which pins a rounded-up block. If that fails too, it raises.
        try:
            return tensor.pin_memory()
        finally:
            del tensor
    with _registered_lock:
        _registered_bytes += nbytes

    weakref.finalize(tensor.untyped_storage(), _Unregister(ptr, nbytes))
    return tensor


#: Linux's ``MADV_HUGEPAGE``, and the huge page size it asks for on x86-64 and arm64.
_MADV_HUGEPAGE = 14
_HUGE_PAGE = 2 << 20
#: Smaller tensors are not worth a system call: they span a few huge pages at most.
_HUGE_PAGE_MIN_BYTES = 8 * _HUGE_PAGE
_madvise: Any = None


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask Linux to back a large, untouched host tensor with transparent huge pages.

    A pool write or a hit gather touches rows at random slots of a pool of up to gigabytes: with
    4 KiB pages nearly every row is a TLB miss (on the CPU a 1 MiB scatter into a 1 GiB pool ran
    about 15 % faster, a gather 20 %, with huge pages). Only whole huge pages inside the tensor
    are advised, before the first touch. Best effort: returns whether the advice was taken; on
    another system, under ``transparent_hugepage=never`` or on a refusal nothing changes.
    """
    global _madvise
    nbytes = tensor.untyped_storage().nbytes()
    if not sys.platform.startswith("linux") or nbytes < _HUGE_PAGE_MIN_BYTES:
        return False
    if _madvise is None:
        madvise: CFuncPtr | Literal[False]
        try:
            madvise = ctypes.CDLL(None, use_errno=True).madvise
            madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            madvise.restype = ctypes.c_int
        except (OSError, AttributeError):
            madvise = False
        _madvise = madvise
    if _madvise is False:
        return False
    ptr = tensor.data_ptr()
    start = -(-ptr // _HUGE_PAGE) * _HUGE_PAGE
    length = (ptr + nbytes - start) // _HUGE_PAGE * _HUGE_PAGE
    return length > 0 and _madvise(start, length, _MADV_HUGEPAGE) == 0


def empty_rows(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A fresh host tensor for rows handed out, huge pages advised where large.

    Outputs of a prefill are tens of megabytes of fresh memory every step: with 4 KiB pages
    their first touch is thousands of page faults (a 24 MiB gather out of the pool took 18 ms
    instead of 3 when the allocator handed out new pages), with huge pages a dozen.
    """
    rows = torch.empty(shape, dtype=dtype)
    advise_huge_pages(rows)
    return rows


def row_bytes(rows: torch.Tensor) -> np.ndarray:
    """A contiguous host tensor's rows as a ``(rows, row_bytes)`` uint8 numpy view (no copy)."""
    flat = rows.reshape(rows.shape[0], -1)  # `len` of a tensor is a Python call in torch
    return flat.view(torch.uint8).numpy()


#: Fewer rows than this go row by row whatever their slots: the test for whole blocks and the
#: block-wide assignment cost about 10-20 us, which a few dozen rows do not win back (narrow
#: rows of 32 bytes broke even at about 700 rows here, rows of 4 KiB at about 150).
_BLOCK_WRITE_MIN_ROWS = 512


def whole_blocks(slots: np.ndarray, block_size: int) -> np.ndarray | None:
    """The KV blocks that ``slots`` fill, in order, when they are whole blocks; else None.

    Whole blocks: ``slots`` is a run of ``block_size`` consecutive slots from a multiple of
    ``block_size``, then another, and so on (a prefill's slots, mostly). A block may come twice.
    The first test is on two elements, so a decode step's scattered slots cost next to nothing.
    """
    n = len(slots)
    if block_size < 2 or n < block_size or n % block_size:
        return None
    if slots[block_size - 1] - slots[0] != block_size - 1:
        return None
    by_block = slots.reshape(-1, block_size)
    heads = by_block[:, 0]
    # Counts, not `any`/`all`: those go through numpy's Python-level wrappers first.
    if np.count_nonzero(heads % block_size) or np.count_nonzero(
        by_block - heads[:, None] != np.arange(block_size)
    ):
        return None
    return heads // block_size


def write_blocks(slots: np.ndarray, block_size: int) -> np.ndarray | None:
    """The KV blocks a pool write of ``slots`` goes by, a block at a time (D33); None: row by row.

    A write of at least `_BLOCK_WRITE_MIN_ROWS` rows whose slots are whole blocks
    (`whole_blocks`). Every key of a step is written at the same slots, so a step finds them
    once (`WriteJob.write_blocks`).
    """
    if len(slots) < _BLOCK_WRITE_MIN_ROWS:
        return None
    return whole_blocks(slots, block_size)


def scatter_rows(
    target: np.ndarray,
    slots: np.ndarray,
    source: np.ndarray,
    block_size: int = 1,
    blocks: np.ndarray | None = None,
) -> None:
    """``target[slots] = source`` for byte rows (`row_bytes`), a block at a time where it can.

    Where a write's slots are whole blocks (`write_blocks`) and both arrays are contiguous, one
    assignment of block-wide rows moves the same bytes with a ``block_size``-th of numpy's
    per-row work: a 32 MiB write of 16-slot blocks into a 1 GiB pool took 3.7 ms instead of 4.5
    here. Anything else, a decode step's scattered slots for one, goes row by row. A repeated
    slot keeps its later row either way: slots repeat only as whole blocks on the block path.

    ``blocks``: the `write_blocks` of ``slots``, when the caller found them already; None looks
    for them (``block_size`` 1: the write goes row by row, and nothing is looked for).
    """
    if len(target) % block_size or not (target.flags.c_contiguous and source.flags.c_contiguous):
        blocks = None
    elif blocks is None:
        blocks = write_blocks(slots, block_size)
    if blocks is None:
        target[slots] = source
        return
    width = block_size * target.shape[1]
    target.reshape(-1, width)[blocks] = source.reshape(-1, width)


@attrs.frozen
class KeyShape:
    """What every row of a cached key looks like; fixed at first sight (FAIL-5)."""

    features: tuple[int, ...]
    dtype: torch.dtype

    @property
    def width(self) -> int:
        """Elements per row."""
        return math.prod(self.features)

    @property
    def row_bytes(self) -> int:
        """Bytes per row."""
        return self.width * self.dtype.itemsize

    @classmethod
    def of(cls, rows: torch.Tensor) -> KeyShape:
        """The shape of a step-token tensor's rows."""
        return cls(tuple(rows.shape[1:]), rows.dtype)

    def check(self, key: str, rows: torch.Tensor) -> None:
        """Raise when a tensor's rows do not match this key's shape (FAIL-5)."""
        self.require(f"rows of cached key {key!r}", KeyShape.of(rows))

    def require(self, what: str, other: KeyShape) -> None:
        """Raise when `other` is not this shape, the one the key was first seen with (FAIL-5)."""
        if other != self:
            raise BadInputError(
                what=what,
                expected=f"row shape {self.features} and dtype {self.dtype} as first seen (FAIL-5)",
                got=f"row shape {other.features} and dtype {other.dtype}",
            )


class HostPool:
    """One ``(num_slots, width)`` host tensor per cached key (SPEC section 0).

    Written by one writer only (CONC-4): the committer thread, or the caller in inline mode.
    """

    def __init__(
        self, num_slots: int, *, pin: bool, faults: Faults | None = None, block_size: int = 1
    ) -> None:
        self.num_slots = num_slots
        #: Slots per KV block: a write of whole blocks goes a block at a time (`scatter_rows`).
        self.block_size = block_size
        self.pin = pin
        self.faults = faults
        self.tensors: dict[TensorName, torch.Tensor] = {}
        self.shapes: dict[TensorName, KeyShape] = {}
        #: Each key's storage as ``(num_slots, row_bytes)`` uint8 numpy rows, made at install:
        #: a write then runs in numpy alone, with no torch call that hands the GIL around.
        self.byte_rows: dict[TensorName, np.ndarray] = {}

    def nbytes_for(self, shape: KeyShape) -> int:
        """Bytes a key of this row shape takes: one row per KV slot (D20)."""
        return self.num_slots * shape.row_bytes

    def allocate(self, shape: KeyShape, key: TensorName | None = None) -> torch.Tensor:
        """Allocate a key's storage; call outside the state lock, then `install` under it."""
        return alloc_host(
            (self.num_slots, shape.width),
            shape.dtype,
            pin=self.pin,
            faults=self.faults,
            detail=("pool", key),
        )

    def install(self, key: TensorName, shape: KeyShape, storage: torch.Tensor) -> None:
        """Install a key's storage unless one is there already (first install wins)."""
        if key not in self.tensors:
            self.tensors[key] = storage
            self.shapes[key] = shape
            self.byte_rows[key] = row_bytes(storage)

    def nbytes(self) -> int:
        """Bytes of every key's storage."""
        return sum(t.untyped_storage().nbytes() for t in self.tensors.values())

    def release(self) -> None:
        """Drop every key's storage (shutdown); the memory goes once no reader holds it."""
        self.tensors = {}
        self.byte_rows = {}


class StagingPages:
    """``staging_depth`` pages of ``staging_capacity_tokens`` rows per immediate key (PAGE-1)."""

    def __init__(
        self, depth: int, capacity: int, *, pin: bool, faults: Faults | None = None
    ) -> None:
        self.depth = depth
        self.capacity = capacity
        self.pin = pin
        self.faults = faults
        self.buffers: dict[TensorName, torch.Tensor] = {}
        self._byte_rows: dict[TensorName, np.ndarray] = {}
        #: The last `rows` view of each key's page, with its row count: a decode step asks for
        #: the same rows every step, and a torch slice costs a few microseconds.
        self._views: dict[tuple[TensorName, int], tuple[int, torch.Tensor]] = {}

    def nbytes_for(self, shape: KeyShape) -> int:
        """Bytes an immediate key of this row shape takes: every page's rows (D20)."""
        return self.depth * self.capacity * shape.row_bytes

    def allocate(self, shape: KeyShape, key: TensorName | None = None) -> torch.Tensor:
        """Allocate a key's pages; call outside the state lock, then `install` under it."""
        return alloc_host(
            (self.depth * self.capacity, shape.width),
            shape.dtype,
            pin=self.pin,
            faults=self.faults,
            detail=("pages", key),
        )

    def install(self, key: TensorName, buffer: torch.Tensor) -> None:
        """Install a key's pages unless they are there already."""
        if key not in self.buffers:
            self.buffers[key] = buffer
            self._byte_rows[key] = row_bytes(buffer)

    def rows(self, key: TensorName, page: int, n: int) -> torch.Tensor:
        """The first ``n`` rows of one page of one key (a view, the same one while ``n`` is)."""
        last = self._views.get((key, page))
        if last is not None and last[0] == n:
            return last[1]
        start = page * self.capacity
        view = self.buffers[key][start : start + n]
        self._views[key, page] = (n, view)
        return view

    def byte_rows(self, key: TensorName, page: int, n: int) -> np.ndarray:
        """`rows` as ``(n, row_bytes)`` uint8 numpy rows (a view, made without a torch call)."""
        start = page * self.capacity
        return self._byte_rows[key][start : start + n]

    def nbytes(self) -> int:
        """Bytes of every key's pages."""
        return sum(t.untyped_storage().nbytes() for t in self.buffers.values())

    def release(self) -> None:
        """Drop every key's pages (shutdown); the memory goes once no reader holds it."""
        self.buffers = {}
        self._byte_rows = {}
        self._views = {}


#: A storage's count of owners in torch: every tensor and view of its memory, and its storage
#: object (one, whoever holds it). A private torch function; without it nothing is kept.
_use_count: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)


def _references(kept: list[Any], i: int) -> int:
    """Python's count of references to ``kept[i]``, this call's own included."""
    return sys.getrefcount(kept[i])


#: `_references` of an object that only its list holds (the call's own references differ
#: between Python versions, so they are counted once here, the same way).
_LIST_ONLY = _references([object()], 0)


def _let_go(kept: list[torch.UntypedStorage], i: int) -> bool:
    """Whether nothing refers to the memory of ``kept[i]`` but that list: no tensor or view of
    it (torch counts them) and no other reference to its storage object, which
    ``untyped_storage()`` of any of its tensors returns (Python counts those)."""
    return (
        _use_count is not None
        and _use_count(kept[i]._cdata) == 1
        and _references(kept, i) == _LIST_ONLY
    )


class OutputMemory:
    """Host buffers for the rows a consume hands out, used again once the caller lets go (D40).

    The rows a consume returns are the caller's: they stay valid, and unchanged, for as long as
    the caller holds any part of them (OUT-8). A prefill of a thousand requests hands out
    hundreds of megabytes a step; when the caller drops them, the allocator gives memory that
    large back to the kernel, which maps and zeroes it afresh for the next step (tens of
    milliseconds of system time). So buffers of at least ``min_bytes`` are kept here once
    handed out, and one is handed out again only when nothing refers to its memory but this
    object (`_let_go`). Sizes are rounded up, by at most a quarter, so that steps of similar
    sizes share buffers.

    A buffer the caller moved to shared memory (``share_memory_``, which torch.multiprocessing
    does to send a tensor to another process, which may still read it) or resized is not the
    cache's any more: it is forgotten rather than handed out again.

    ``limit`` gives the most bytes kept (the manager passes `StagingPages.nbytes`). A new
    buffer that would take the kept bytes past it makes room by forgetting the buffers the
    caller has let go of, then those it still holds (they are freed when the caller drops
    them); one that still does not fit is not kept. Thread-safe: the prefetch worker and the
    consume take buffers at once.
    """

    #: The default ``min_bytes``: smaller buffers come from the allocator's own free memory,
    #: which it keeps.
    MIN_BYTES = 2 << 20

    def __init__(self, limit: Callable[[], int]) -> None:
        self._limit = limit
        self.min_bytes = OutputMemory.MIN_BYTES
        self._lock = threading.Lock()
        #: Kept storage objects by size class, oldest first; only these lists refer to them.
        self._kept: dict[int, list[torch.UntypedStorage]] = {}
        self._kept_bytes = 0

    def rows(self, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized, contiguous ``shape`` tensor of ``dtype`` nothing else refers to."""
        nbytes = shape[0] * shape[1] * dtype.itemsize
        if nbytes < self.min_bytes or _use_count is None:
            return empty_rows(shape, dtype)
        size = _size_class(nbytes)
        with self._lock:
            kept = self._kept.get(size, [])
            for i in reversed(range(len(kept))):  # by index: a loop variable would refer to it
                if not _let_go(kept, i):
                    continue
                if kept[i].nbytes() == size and not kept[i].is_shared():
                    return torch.empty(0, dtype=dtype).set_(kept[i], 0, shape, (shape[1], 1))
                del kept[i]  # moved or resized by the caller: not this cache's memory now
                self._kept_bytes -= size
            keep = self._make_room(size)
            if keep:  # the whole size class, so that any size of it can take the buffer later
                fresh = empty_rows((size // dtype.itemsize,), dtype)
                self._kept.setdefault(size, []).append(fresh.untyped_storage())
                self._kept_bytes += size
        if not keep:
            return empty_rows(shape, dtype)
        return fresh[: shape[0] * shape[1]].view(shape)

    def clone(self, rows: torch.Tensor) -> torch.Tensor:
        """A copy of a 2-D host tensor, in a buffer of `rows` when it is that large."""
        if rows.numel() * rows.element_size() < self.min_bytes:
            return rows.clone()
        out = self.rows((rows.shape[0], rows.shape[1]), rows.dtype)
        out.copy_(rows)
        return out

    def _make_room(self, size: int) -> bool:
        """Forget kept buffers until ``size`` more bytes fit the limit; whether they do."""
        limit = self._limit()
        if size > limit:
            return False
        for let_go in (True, False):  # those the caller let go of first
            for kept_size in sorted(self._kept, reverse=True):
                if self._kept_bytes + size <= limit:
                    return True
                kept = self._kept[kept_size]
                for i in reversed(range(len(kept))):
                    if self._kept_bytes + size > limit and _let_go(kept, i) is let_go:
                        del kept[i]
                        self._kept_bytes -= kept_size
                if not kept:
                    del self._kept[kept_size]
        return self._kept_bytes + size <= limit

    def nbytes(self) -> int:
        """Bytes of the buffers kept, whether the caller still holds them or not."""
        return self._kept_bytes

    def release(self) -> None:
        """Forget every kept buffer (shutdown); those the caller holds stay the caller's."""
        with self._lock:
            self._kept.clear()
            self._kept_bytes = 0


def _size_class(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of ``2 ** (bit_length - 3)``: four sizes a doubling,
    at most a quarter more than ``nbytes``."""
    step = 1 << max(nbytes.bit_length() - 3, 0)
    return -(-nbytes // step) * step
