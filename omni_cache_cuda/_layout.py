"""The write layout of a step: which rows belong to which request, and each row's KV slot."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from typing import NoReturn

import attrs
import numpy as np
import torch

from omni_cache_core import BadInputError

__all__ = [
    "PrefixCacheWrite",
    "PrefixCacheWriteLayout",
    "decode_layout_from_rows",
    "decode_layout_from_table",
]

# A request with at most this many scheduled tokens gets its slots from a plain loop; longer runs
# use numpy (a decode step has hundreds of one-token requests; a prefill a few long ones).
_LOOP_TOKENS = 16


@functools.lru_cache(maxsize=64)
def _unit_bounds(n: int) -> tuple[int, ...]:
    """``tuple(range(n + 1))``, the bounds of n one-row requests: one tuple per size, so the save
    that reads a decode layout's bounds as an array makes that array once per size."""
    return tuple(range(n + 1))


@attrs.frozen
class PrefixCacheWrite:
    """One request's rows in the step: ``[row_start, row_end)`` in batch order."""

    req_id: str
    row_start: int
    row_end: int


def _check_writes(writes: tuple[PrefixCacheWrite, ...]) -> None:
    expected = 0
    for write in writes:
        if not isinstance(write, PrefixCacheWrite):
            raise BadInputError(
                what="write layout entry", expected="a PrefixCacheWrite", got=type(write).__name__
            )
        if write.row_start != expected or write.row_end < write.row_start:
            raise BadInputError(
                what=f"rows of request {write.req_id!r}",
                expected=f"a contiguous range starting at row {expected}",
                got=f"[{write.row_start}, {write.row_end})",
            )
        expected = write.row_end


def _check_slots(slots: object) -> None:
    if not isinstance(slots, torch.Tensor) or slots.dtype != torch.int64 or slots.ndim != 1:
        raise BadInputError(
            what="slots_cpu", expected="a 1-D int64 tensor", got=f"{type(slots).__name__}"
        )
    if slots.device.type != "cpu":
        raise BadInputError(what="slots_cpu", expected="a CPU tensor", got=str(slots.device))


class PrefixCacheWriteLayout:
    """Where each row of a step goes: per-request row ranges and one KV slot id per row.

    Immutable once built (setting an attribute raises `attrs.exceptions.FrozenInstanceError`).

    Args:
        writes: One entry per request of the step, in batch order, with contiguous row ranges
            from 0 (a request with 0 scheduled tokens has an empty range). Any iterable.
        slots_cpu: One slot id per row (``block_id * block_size + offset``), int64, on the CPU.

    Attributes:
        writes: The entries, a tuple (built on first use when the layout came from
            `from_block_tables`, which a decode step of hundreds of requests never needs).
        slots_cpu: The slot ids.
        req_ids: Request ids in batch order.
        bounds: ``len(writes) + 1`` row bounds: request ``i`` owns rows
            ``[bounds[i], bounds[i + 1])``.

    Raises:
        BadInputError: An entry is not a `PrefixCacheWrite`, the ranges are not contiguous
            from row 0, or ``slots_cpu`` is not a 1-D int64 CPU tensor. Nothing is built.
    """

    __slots__ = ("_private_slots", "_writes", "bounds", "req_ids", "slots_cpu")

    _writes: tuple[PrefixCacheWrite, ...] | None
    #: ``slots_cpu`` as the array it views, when nothing outside the library holds either (a
    #: layout the vLLM glue builds for its own save): the save keeps it without the private
    #: copy STEP-3 takes of a caller's buffer. None for every layout a caller can reach.
    _private_slots: np.ndarray | None
    slots_cpu: torch.Tensor
    req_ids: tuple[str, ...]
    bounds: tuple[int, ...]

    def __init__(self, writes: Iterable[PrefixCacheWrite], slots_cpu: torch.Tensor) -> None:
        entries = tuple(writes)
        _check_writes(entries)
        _check_slots(slots_cpu)
        _set = object.__setattr__
        _set(self, "_writes", entries)
        _set(self, "_private_slots", None)
        _set(self, "slots_cpu", slots_cpu)
        _set(self, "req_ids", tuple(w.req_id for w in entries))
        _set(self, "bounds", (0, *(w.row_end for w in entries)))

    @classmethod
    def _from_bounds(
        cls,
        req_ids: tuple[str, ...],
        bounds: tuple[int, ...],
        slots_cpu: torch.Tensor,
        private_slots: np.ndarray | None = None,
    ) -> PrefixCacheWriteLayout:
        """Build from ids and row bounds already known to be consistent (no entry objects).

        ``private_slots``: the array ``slots_cpu`` views, when the layout will reach no caller
        (`_private_slots`).
        """
        self = object.__new__(cls)
        _set = object.__setattr__
        _set(self, "_writes", None)
        _set(self, "_private_slots", private_slots)
        _set(self, "slots_cpu", slots_cpu)
        _set(self, "req_ids", req_ids)
        _set(self, "bounds", bounds)
        return self

    @property
    def writes(self) -> tuple[PrefixCacheWrite, ...]:
        """One `PrefixCacheWrite` per request, in batch order."""
        writes = self._writes
        if writes is None:
            bounds = self.bounds
            writes = tuple(
                PrefixCacheWrite(req_id, bounds[i], bounds[i + 1])
                for i, req_id in enumerate(self.req_ids)
            )
            object.__setattr__(self, "_writes", writes)
        return writes

    @property
    def num_rows(self) -> int:
        """Rows the writes cover."""
        return self.bounds[-1]

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return (PrefixCacheWriteLayout._from_bounds, (self.req_ids, self.bounds, self.slots_cpu))

    def __setattr__(self, name: str, value: object) -> None:
        raise attrs.exceptions.FrozenInstanceError()

    def __delattr__(self, name: str) -> None:
        raise attrs.exceptions.FrozenInstanceError()

    def __repr__(self) -> str:
        return (
            f"PrefixCacheWriteLayout(writes={self.writes!r}, "
            f"slots_cpu=tensor of {len(self.slots_cpu)} slots)"
        )

    @classmethod
    def from_block_tables(
        cls,
        order: Sequence[str],
        num_scheduled: Mapping[str, int],
        num_computed: Mapping[str, int],
        block_ids: Mapping[str, Sequence[int]],
        block_size: int,
    ) -> PrefixCacheWriteLayout:
        """Build the layout on the CPU from block tables, with no device sync.

        A request's scheduled positions are ``num_computed[r] .. num_computed[r] +
        num_scheduled[r] - 1``; position ``p`` goes to slot ``block_ids[r][p // block_size] *
        block_size + p % block_size``.

        Raises:
            BadInputError: A request misses from a mapping, a count is negative, or a position
                falls outside the request's blocks. Nothing is built.
        """
        req_ids = tuple(order)
        try:
            counts = [num_scheduled[r] for r in req_ids]
        except KeyError:
            _raise_missing(req_ids, num_scheduled, num_computed, block_ids)
        if counts and min(counts) == 1 == max(counts):
            # A decode step: one token per request, hundreds of requests. One pass per list.
            try:
                computed = [num_computed[r] for r in req_ids]
                if min(computed) >= 0:
                    table = [
                        block_ids[r][c // block_size]
                        for r, c in zip(req_ids, computed, strict=True)
                    ]
                    slots = np.asarray(table, dtype=np.int64) * block_size
                    slots += np.asarray(computed, dtype=np.int64) % block_size
                    return cls._from_bounds(
                        req_ids, _unit_bounds(len(req_ids)), torch.from_numpy(slots)
                    )
            except (KeyError, IndexError):
                pass
            # Something is wrong: the general pass below names it.
        pieces: list[np.ndarray] = []
        short: list[int] = []  # slots of consecutive short requests, flushed as one array
        bounds = [0]
        row = 0
        for req_id, count in zip(req_ids, counts, strict=True):
            try:
                computed_at = num_computed[req_id] if count else 0
                blocks = block_ids[req_id] if count else ()
            except KeyError:
                _raise_missing(req_ids, num_scheduled, num_computed, block_ids)
            if count < 0 or computed_at < 0:
                raise BadInputError(
                    what=f"counts of request {req_id!r}",
                    expected="non-negative scheduled and computed counts",
                    got=f"scheduled={count}, computed={computed_at}",
                )
            last = computed_at + count - 1
            if count and last // block_size >= len(blocks):
                raise BadInputError(
                    what=f"position {last} of request {req_id!r}",
                    expected=f"a position inside its {len(blocks)} blocks of {block_size}",
                    got=f"block index {last // block_size}",
                )
            if count <= _LOOP_TOKENS:
                short.extend(
                    blocks[p // block_size] * block_size + p % block_size
                    for p in range(computed_at, computed_at + count)
                )
            else:
                if short:
                    pieces.append(np.asarray(short, dtype=np.int64))
                    short = []
                positions = np.arange(computed_at, computed_at + count, dtype=np.int64)
                table_np = np.asarray(blocks, dtype=np.int64)
                pieces.append(
                    table_np[positions // block_size] * block_size + positions % block_size
                )
            row += count
            bounds.append(row)
        if short or not pieces:
            pieces.append(np.asarray(short, dtype=np.int64))
        flat = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        return cls._from_bounds(req_ids, tuple(bounds), torch.from_numpy(flat))


def decode_layout_from_table(
    order: Sequence[str],
    num_scheduled: Mapping[str, int],
    num_computed: Mapping[str, int],
    table_rows: Mapping[str, int],
    table: np.ndarray,
    block_size: int,
) -> PrefixCacheWriteLayout | None:
    """A decode step's layout from block lists kept as one array; None if it is not that.

    The same layout `PrefixCacheWriteLayout.from_block_tables` builds when every request of
    ``order`` has exactly one scheduled token, with request ``r``'s block list held as the
    leading entries of ``table[table_rows[r]]`` and -1 after them: two lookups per request, the
    rest array work. None when a request has another count, misses from a mapping, has a
    negative computed count or a position outside its blocks (a -1 or past the table), or
    ``order`` and ``num_scheduled`` differ in length: `from_block_tables` then builds the
    layout or names what is wrong.
    """
    n = len(order)
    if n == 0 or len(num_scheduled) != n:
        return None
    try:
        counts = np.fromiter(num_scheduled.values(), dtype=np.int64, count=n)
        if not (counts == 1).all():
            return None
        rows = np.fromiter(map(table_rows.__getitem__, order), dtype=np.int64, count=n)
        computed = np.fromiter(map(num_computed.__getitem__, order), dtype=np.int64, count=n)
        if computed.min() < 0:
            return None
        blocks = table[rows, computed // block_size]
    except (KeyError, TypeError, ValueError, OverflowError, IndexError):
        return None
    if blocks.min() < 0:
        return None
    slots = blocks.astype(np.int64) * block_size
    slots += computed % block_size
    req_ids = order if isinstance(order, tuple) else tuple(order)
    return PrefixCacheWriteLayout._from_bounds(req_ids, _unit_bounds(n), torch.from_numpy(slots))


def decode_layout_from_rows(
    order: Sequence[str],
    rows: np.ndarray,
    starts: np.ndarray,
    table: np.ndarray,
    block_size: int,
    *,
    private: bool = False,
) -> PrefixCacheWriteLayout | None:
    """A decode step's layout from its requests' table rows and starts; None if out of blocks.

    Request ``order[i]`` has one token, at position ``starts[i]`` (int64, >= 0), and its block
    list is the leading entries of ``table[rows[i]]``, -1 after them: the caller has checked
    that ``order`` is the step's requests, each once. The layout is the one
    `PrefixCacheWriteLayout.from_block_tables` builds from the same lists; None when a position
    falls outside its request's blocks (a -1 or past the table), where that one names it.
    ``private``: the layout goes to the caller's own save and no further, so the save may keep
    its slot array (`PrefixCacheWriteLayout._private_slots`).
    """
    if block_size & (block_size - 1):
        columns, offsets = np.divmod(starts, block_size)
    else:  # a power of two (vLLM's block sizes): shifts and masks are cheaper
        columns = starts >> (block_size.bit_length() - 1)
        offsets = starts & (block_size - 1)
    try:
        blocks = table[rows, columns]
    except IndexError:
        return None
    slots = np.multiply(blocks, block_size, dtype=np.int64)
    slots += offsets
    # An entry of -1 (no block there) gives -block_size plus an offset below block_size: < 0.
    if slots[slots.argmin()] < 0:  # argmin: ndarray.min is a Python-level wrapper
        return None
    req_ids = order if isinstance(order, tuple) else tuple(order)
    return PrefixCacheWriteLayout._from_bounds(
        req_ids, _unit_bounds(len(req_ids)), torch.from_numpy(slots), slots if private else None
    )


def _raise_missing(
    order: tuple[str, ...],
    num_scheduled: Mapping[str, int],
    num_computed: Mapping[str, int],
    block_ids: Mapping[str, Sequence[int]],
) -> NoReturn:
    """Raise the error naming the first request that misses from a mapping it needs."""
    for req_id in order:
        for name, table in (
            ("num_scheduled", num_scheduled),
            ("num_computed", num_computed),
            ("block_ids", block_ids),
        ):
            if name != "num_scheduled" and not num_scheduled.get(req_id):
                continue  # a request with no scheduled token needs no computed count or blocks
            if req_id not in table:
                raise BadInputError(
                    what=f"block tables of request {req_id!r}",
                    expected="an entry in num_scheduled, num_computed and block_ids",
                    got=f"no {req_id!r} in {name}",
                )
    raise AssertionError("a mapping lookup failed, but every request is in every mapping")
