"""What a step's outputs are (OUT-1..3), their leftover snapshot (OUT-4) and per-request split
(OUT-5), and the value `materialize` returns."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

import torch

from omni_cache_core import HIDDEN_KEY, ModelCachePolicy, TensorName

__all__ = [
    "Classified",
    "DeliveredPositions",
    "StageCacheOutputs",
    "classify",
    "snapshot_leftover",
    "split_leftover",
]


class _OutputFields(NamedTuple):
    hidden_states: dict[str, torch.Tensor] | None
    mm_outputs: dict[str, dict[str, Any]]


_NO_POSITIONS: Mapping[str, tuple[int, int]] = MappingProxyType({})


class StageCacheOutputs(_OutputFields):
    """Per-request merged stage outputs of one step.

    A two-field tuple, so ``hidden, mm = out`` works, plus the positions each request received.

    Attributes:
        hidden_states: Request id -> the rows of the positions delivered to it by this
            materialize, in position order: on the step that registers its hit, the hit prefix
            rows followed by this step's rows. None when the policy does not cache hidden states
            (OUT-7); that is not a miss.
        mm_outputs: Tensor name -> request id -> payload: merged rows for cached keys, built
            like the hidden rows, and the request's share of every uncached value (OUT-5).
        positions: Request id -> ``(start, end)``, the absolute positions (token indices of the
            request) of those rows (DLV-7). Each position is delivered once per admission
            (DLV-2): after a preemption, rows below what was already delivered are not handed
            out again, so ``start`` can be above the first position the step computed and
            ``start == end`` means nothing new. Not part of tuple equality.
    """

    positions: Mapping[str, tuple[int, int]] = _NO_POSITIONS

    def __new__(
        cls,
        hidden_states: dict[str, torch.Tensor] | None,
        mm_outputs: dict[str, dict[str, Any]],
        positions: Mapping[str, tuple[int, int]] | None = None,
    ) -> StageCacheOutputs:
        self = super().__new__(cls, hidden_states, mm_outputs)
        if positions is not None:
            self.positions = positions
        return self

    def __getnewargs__(self) -> tuple[Any, ...]:  # pickling keeps the positions
        return (self.hidden_states, self.mm_outputs, dict(self.positions))


class DeliveredPositions(Mapping[str, tuple[int, int]]):
    """Request id -> ``(start, end)``, built from the core's arrays on first look (DLV-7)."""

    __slots__ = ("_ends", "_map", "_req_ids", "_starts")

    def __init__(self, req_ids: tuple[str, ...], starts: Any, ends: Any) -> None:
        self._req_ids = req_ids
        self._starts = starts
        self._ends = ends
        self._map: dict[str, tuple[int, int]] | None = None

    def _built(self) -> dict[str, tuple[int, int]]:
        if self._map is None:
            pairs = zip(self._starts.tolist(), self._ends.tolist(), strict=True)
            self._map = dict(zip(self._req_ids, pairs, strict=True))
        return self._map

    def __getitem__(self, req_id: str) -> tuple[int, int]:
        return self._built()[req_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._built())

    def __len__(self) -> int:
        return len(self._built())

    def __repr__(self) -> str:
        return f"DeliveredPositions({self._built()!r})"


class Classified(NamedTuple):
    """A step's outputs sorted by how they are kept (OUT-1).

    Attributes:
        immediate: Cached keys copied at save -> rows ``[:n]`` (hidden first when cached).
        deferred: Deferred keys that are step-token tensors -> rows ``[:n]``.
        leftover: Every mm value that is not immediate (deferred keys included: two consumers).
    """

    immediate: dict[TensorName, torch.Tensor]
    deferred: dict[TensorName, torch.Tensor]
    leftover: dict[str, Any]


def is_step_token_tensor(value: object, n: int, padded: int) -> bool:
    """A tensor with ``ndim >= 2`` whose first dimension is ``n`` or the padded count (OUT-2)."""
    return (
        isinstance(value, torch.Tensor)
        and value.ndim >= 2
        and (value.shape[0] == n or value.shape[0] == padded)
    )


def classify(
    hidden: torch.Tensor | None,
    mm: Mapping[str, Any],
    n: int,
    padded: int,
    policy: ModelCachePolicy,
) -> Classified:
    """Sort a step's outputs into immediate, deferred and leftover (OUT-1, OUT-2).

    Only rows ``[:n]`` of a cached tensor are ever kept. With ``n == 0`` nothing is cached.
    """
    immediate: dict[TensorName, torch.Tensor] = {}
    deferred: dict[TensorName, torch.Tensor] = {}
    leftover: dict[str, Any] = {}
    if n and hidden is not None and policy.needs_full_hidden_states:
        immediate[HIDDEN_KEY] = hidden[:n]
    for name, value in mm.items():
        key = TensorName(name)
        cacheable = n > 0 and is_step_token_tensor(value, n, padded)
        if key in policy.deferred_keys:
            if cacheable:
                deferred[key] = value[:n]
            leftover[name] = value  # OUT-1: the step's own read takes it from the leftover too
        elif cacheable and not policy.skip_immediate_mm(key):
            immediate[key] = value[:n]
        else:
            leftover[name] = value
    return Classified(immediate, deferred, leftover)


def snapshot_leftover(value: Any, n: int, *, pin: bool) -> Any:
    """Copy a leftover value to host memory, slicing ``[:n]`` only when ``shape[0] == n`` (OUT-4).

    CUDA tensors go into pinned memory with a non-blocking copy on the current stream (the
    caller records an event after); other tensors are cloned. Mappings, lists and tuples recurse;
    anything else is kept by reference.
    """
    if isinstance(value, torch.Tensor):
        part = value[:n] if value.ndim >= 1 and value.shape[0] == n else value
        if part.device.type == "cuda":
            host = torch.empty(part.shape, dtype=part.dtype, pin_memory=pin)
            host.copy_(part, non_blocking=pin)
            return host
        return part.detach().clone()
    if isinstance(value, Mapping):
        return {k: snapshot_leftover(v, n, pin=pin) for k, v in value.items()}
    if isinstance(value, list):
        return [snapshot_leftover(v, n, pin=pin) for v in value]
    if isinstance(value, tuple):
        return tuple(snapshot_leftover(v, n, pin=pin) for v in value)
    return value


def unpin(value: Any) -> Any:
    """Clone pinned tensors into pageable memory so the payload holds no pinned pages (OUT-4)."""
    if isinstance(value, torch.Tensor):
        return value.clone() if value.is_pinned() else value
    if isinstance(value, Mapping):
        return {k: unpin(v) for k, v in value.items()}
    if isinstance(value, list):
        return [unpin(v) for v in value]
    if isinstance(value, tuple):
        return tuple(unpin(v) for v in value)
    return value


def split_leftover(value: Any, req_rows: Mapping[str, tuple[int, int]], n: int) -> dict[str, Any]:
    """Hand an uncached value to each request (OUT-5).

    Tensors whose first dimension covers the step's rows are sliced to each request's rows;
    lists are passed whole to every request; mappings recurse; anything else is passed as is.
    """
    if isinstance(value, torch.Tensor) and value.ndim >= 1 and n and value.shape[0] >= n:
        return {req: value[start:end] for req, (start, end) in req_rows.items()}
    if isinstance(value, Mapping):
        parts = {k: split_leftover(v, req_rows, n) for k, v in value.items()}
        return {req: {k: parts[k][req] for k in parts} for req in req_rows}
    return dict.fromkeys(req_rows, value)
