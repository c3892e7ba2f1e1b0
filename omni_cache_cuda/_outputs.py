"""What a step's outputs are (OUT-1..3), their leftover snapshot (OUT-4) and per-request split
(OUT-5), and the value `materialize` returns."""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

import torch

from omni_cache_core import HIDDEN_KEY, ModelCachePolicy, TensorName

__all__ = [
    "Classified",
    "DeliveredPositions",
    "RequestRows",
    "StageCacheOutputs",
    "classify",
    "request_rows",
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


# Single lookups answered with their own slice before the next lookup makes every view at once.
# One split costs about a third of a slice per request, so a caller that reads every request
# (an output builder) should get to it at once; one that reads a request or two should not pay
# for hundreds of views.
_SINGLE_LOOKUPS = 2


class _FilledRows(dict):  # type: ignore[type-arg]
    """A `RequestRows` once its views exist: a plain dict, C lookups and all."""

    __slots__ = ("_kept", "_members_set", "_pending")

    def __reduce__(self) -> tuple[Any, ...]:  # copies and pickles are plain dicts
        return (dict, (dict(dict.items(self)),))


class RequestRows(_FilledRows):
    """Request id -> its rows of one key: views of one contiguous tensor, made when read.

    A dict (OUT-5: ``hidden_states`` and every cached ``mm_outputs`` entry are dicts of request id
    to rows), in the order of the materialize's request ids. ``materialize`` hands out the
    step's rows of a key as one tensor plus each request's row range; no per-request view is
    made until a caller reads one. The first two single lookups (``[]``, ``get``) slice just that
    request; any other use, or a third lookup, makes every view with one ``torch.split`` and the
    object then behaves as, and is, a plain dict subclass (pickles and copies are plain dicts).
    Entries set before that (a hit request's merged rows) are kept as set.
    """

    __slots__ = ()

    def __init__(
        self,
        base: torch.Tensor,
        req_rows: Mapping[str, tuple[int, int]],
        wanted: tuple[str, ...],
    ) -> None:
        # The views live nowhere yet; dict storage holds what was set or read one by one.
        self._pending: tuple[torch.Tensor, Mapping[str, tuple[int, int]], tuple[str, ...]] | None
        self._pending = (base, req_rows, wanted)
        # The wanted ids, found when needed: the step's own rows when they are the whole
        # layout in its order (the usual call), else a set of them.
        self._members_set: Collection[str] | None = None
        self._kept: dict[str, torch.Tensor] | None = None  # entries set before the views exist

    # -- lookups that need one view ---------------------------------------------------------

    def _members(self) -> Collection[str]:
        members = self._members_set
        if members is None:
            assert self._pending is not None
            _, req_rows, wanted = self._pending
            # The ids may repeat or leave some out: a set then, as a dict keeps one of each.
            members = req_rows if tuple(req_rows) == wanted else frozenset(wanted)
            self._members_set = members
        return members

    def __getitem__(self, req_id: str) -> torch.Tensor:
        try:
            return dict.__getitem__(self, req_id)  # type: ignore[no-any-return]
        except KeyError:
            pending = self._pending
            if pending is None or req_id not in self._members():
                raise
        if dict.__len__(self) >= _SINGLE_LOOKUPS:
            self._fill()
            return dict.__getitem__(self, req_id)  # type: ignore[no-any-return]
        start, end = pending[1][req_id]
        view = pending[0][start:end]
        dict.__setitem__(self, req_id, view)
        return view

    def get(self, req_id: str, default: Any = None) -> Any:
        if self._pending is None:
            return dict.get(self, req_id, default)
        try:
            return self[req_id]
        except KeyError:
            return default

    def __contains__(self, req_id: object) -> bool:
        if self._pending is None:
            return dict.__contains__(self, req_id)
        return req_id in self._members()  # an unhashable key raises, as in a dict

    def __len__(self) -> int:
        return dict.__len__(self) if self._pending is None else len(self._members())

    def __setitem__(self, req_id: str, rows: torch.Tensor) -> None:
        if self._pending is not None:
            if isinstance(req_id, str) and req_id in self._members():
                if self._kept is None:
                    self._kept = {}
                self._kept[req_id] = rows
            else:
                self._fill()
        dict.__setitem__(self, req_id, rows)

    # -- everything else makes every view first ----------------------------------------------

    def _fill(self) -> None:
        """Make every request's view (one split), keep what was set, and become a plain dict."""
        pending = self._pending
        if pending is None:
            return
        base, req_rows, wanted = pending
        sizes = [end - start for start, end in req_rows.values()]
        pieces = torch.split(base, sizes) if sizes else ()
        # Entries set (not read) before now win; a view read one by one is made again, alike.
        kept = self._kept
        dict.clear(self)
        if self._members_set is req_rows or tuple(req_rows) == wanted:
            dict.update(self, zip(wanted, pieces, strict=True))
        else:
            by_req = dict(zip(req_rows, pieces, strict=True))
            dict.update(self, zip(wanted, map(by_req.__getitem__, wanted), strict=True))
        if kept:
            dict.update(self, kept)  # their ids are wanted ones: the order stays
        self._pending = None
        self._members_set = None
        self._kept = None
        self.__class__ = _FilledRows  # type: ignore[assignment]

    def _filled(name: str) -> Any:  # type: ignore[misc]
        method = getattr(dict, name)

        def call(self: RequestRows, *args: Any, **kwargs: Any) -> Any:
            self._fill()
            return method(self, *args, **kwargs)

        call.__name__ = name
        call.__doc__ = method.__doc__
        return call

    __iter__ = _filled("__iter__")
    __reversed__ = _filled("__reversed__")
    __eq__ = _filled("__eq__")
    __ne__ = _filled("__ne__")
    __repr__ = _filled("__repr__")
    __delitem__ = _filled("__delitem__")
    __or__ = _filled("__or__")
    __ror__ = _filled("__ror__")
    __ior__ = _filled("__ior__")
    keys = _filled("keys")
    values = _filled("values")
    items = _filled("items")
    copy = _filled("copy")
    pop = _filled("pop")
    popitem = _filled("popitem")
    setdefault = _filled("setdefault")
    update = _filled("update")
    clear = _filled("clear")
    del _filled

    def __reduce__(self) -> tuple[Any, ...]:
        self._fill()
        return (dict, (dict(dict.items(self)),))


def request_rows(
    base: torch.Tensor, req_rows: Mapping[str, tuple[int, int]], wanted: tuple[str, ...]
) -> RequestRows:
    """The rows of ``wanted`` out of ``base`` (every request of ``req_rows``' rows, in order),
    as a `RequestRows` whose views are made when read (OUT-5)."""
    return RequestRows(base, req_rows, wanted)


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

    Only rows ``[:n]`` of a cached tensor are ever kept (a tensor of exactly ``n`` rows is
    kept as it is: no view to make). With ``n == 0`` nothing is cached.
    """
    immediate: dict[TensorName, torch.Tensor] = {}
    deferred: dict[TensorName, torch.Tensor] = {}
    leftover: dict[str, Any] = {}
    if n and hidden is not None and policy.needs_full_hidden_states:
        immediate[HIDDEN_KEY] = hidden if hidden.shape[0] == n else hidden[:n]
    deferred_keys = policy.deferred_keys
    for name, value in mm.items():
        key = TensorName(name)
        cacheable = n > 0 and is_step_token_tensor(value, n, padded)
        if key in deferred_keys:
            if cacheable:
                deferred[key] = value if value.shape[0] == n else value[:n]
            leftover[name] = value  # OUT-1: the step's own read takes it from the leftover too
        elif cacheable and not policy.skip_immediate_mm(key):
            immediate[key] = value if value.shape[0] == n else value[:n]
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
