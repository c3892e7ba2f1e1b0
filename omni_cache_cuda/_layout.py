"""The write layout of a step: which rows belong to which request, and each row's KV slot."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
import numpy as np
import torch

from omni_cache_core import BadInputError

__all__ = ["PrefixCacheWrite", "PrefixCacheWriteLayout"]

# A request with at most this many scheduled tokens gets its slots from a plain loop; longer runs
# use numpy (a decode step has hundreds of one-token requests; a prefill a few long ones).
_LOOP_TOKENS = 16


@attrs.frozen
class PrefixCacheWrite:
    """One request's rows in the step: ``[row_start, row_end)`` in batch order."""

    req_id: str
    row_start: int
    row_end: int


def _check_writes(
    instance: PrefixCacheWriteLayout, attribute: object, writes: tuple[PrefixCacheWrite, ...]
) -> None:
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


def _check_slots(instance: PrefixCacheWriteLayout, attribute: object, slots: torch.Tensor) -> None:
    if not isinstance(slots, torch.Tensor) or slots.dtype != torch.int64 or slots.ndim != 1:
        raise BadInputError(
            what="slots_cpu", expected="a 1-D int64 tensor", got=f"{type(slots).__name__}"
        )
    if slots.device.type != "cpu":
        raise BadInputError(what="slots_cpu", expected="a CPU tensor", got=str(slots.device))


@attrs.frozen(eq=False)
class PrefixCacheWriteLayout:
    """Where each row of a step goes: per-request row ranges and one KV slot id per row.

    Attributes:
        writes: One entry per request of the step, in batch order, with contiguous row ranges
            from 0 (a request with 0 scheduled tokens has an empty range).
        slots_cpu: One slot id per row (``block_id * block_size + offset``), int64, on the CPU.
    """

    writes: tuple[PrefixCacheWrite, ...] = attrs.field(converter=tuple, validator=_check_writes)
    slots_cpu: torch.Tensor = attrs.field(validator=_check_slots)
    #: Request ids in batch order (derived once; the save path reads them every step).
    req_ids: tuple[str, ...] = attrs.field(init=False)
    #: ``len(writes) + 1`` row bounds: request ``i`` owns rows ``[bounds[i], bounds[i + 1])``.
    bounds: tuple[int, ...] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "req_ids", tuple(w.req_id for w in self.writes))
        object.__setattr__(self, "bounds", (0, *(w.row_end for w in self.writes)))

    @property
    def num_rows(self) -> int:
        """Rows the writes cover."""
        return self.writes[-1].row_end if self.writes else 0

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
        writes: list[PrefixCacheWrite] = []
        pieces: list[np.ndarray] = []
        short: list[int] = []  # slots of consecutive short requests, flushed as one array
        row = 0
        for req_id in order:
            try:
                count = num_scheduled[req_id]
                computed = num_computed[req_id] if count else 0
                blocks = block_ids[req_id] if count else ()
            except KeyError as exc:
                raise BadInputError(
                    what=f"block tables of request {req_id!r}",
                    expected="an entry in num_scheduled, num_computed and block_ids",
                    got=f"no {exc}",
                ) from None
            if count < 0 or computed < 0:
                raise BadInputError(
                    what=f"counts of request {req_id!r}",
                    expected="non-negative scheduled and computed counts",
                    got=f"scheduled={count}, computed={computed}",
                )
            last = computed + count - 1
            if count and last // block_size >= len(blocks):
                raise BadInputError(
                    what=f"position {last} of request {req_id!r}",
                    expected=f"a position inside its {len(blocks)} blocks of {block_size}",
                    got=f"block index {last // block_size}",
                )
            if count <= _LOOP_TOKENS:
                short.extend(
                    blocks[p // block_size] * block_size + p % block_size
                    for p in range(computed, computed + count)
                )
            else:
                if short:
                    pieces.append(np.asarray(short, dtype=np.int64))
                    short = []
                positions = np.arange(computed, computed + count, dtype=np.int64)
                table = np.asarray(blocks, dtype=np.int64)
                pieces.append(table[positions // block_size] * block_size + positions % block_size)
            writes.append(PrefixCacheWrite(req_id, row, row + count))
            row += count
        if short or not pieces:
            pieces.append(np.asarray(short, dtype=np.int64))
        flat = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        return cls(writes, torch.from_numpy(flat))
