"""Host storage of the cached keys: planned, reserved, or allocated at a key's first save (D20).

`HostMemory` checks the keys `host_bytes` and `reserve` are given, allocates a key's host pool
and staging pages outside the state lock and installs them under it, all or nothing, and logs a
key's first allocation. A key keeps the row shape it was first installed with (FAIL-5).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from typing import TypeAlias

import torch

from omni_cache_core import (
    HIDDEN_KEY,
    BadInputError,
    HostAllocationError,
    ShutDownError,
    TensorName,
)
from omni_cache_cuda._log import log
from omni_cache_cuda._state import AdapterState
from omni_cache_cuda._stats import HostBytes
from omni_cache_cuda._storage import HostPool, KeyShape, StagingPages

__all__ = ["HostMemory", "KeySpecs"]

#: What `host_bytes` and `reserve` take: a key's name to its ``(width, dtype)``.
KeySpecs: TypeAlias = Mapping[str, tuple[int | Sequence[int], torch.dtype]]


class HostMemory:
    """Plans, reserves and installs the cached keys' host storage (D20)."""

    def __init__(self, state: AdapterState) -> None:
        self._state = state
        self._pool = state.pool
        self._pages = state.pages

    def host_bytes(self, keys: KeySpecs) -> dict[str, HostBytes]:
        """Say how many host bytes each key takes once allocated; allocates nothing."""
        shapes = self._key_shapes(keys, "host_bytes")
        core = self._state.core
        deferred = core.policy.deferred_keys
        occupancy = core.occupancy_bytes_per_key()
        return {
            key: HostBytes(
                pool=self._pool.nbytes_for(shape),
                pages=0 if key in deferred else self._pages.nbytes_for(shape),
                occupancy=occupancy,
            )
            for key, shape in shapes.items()
        }

    def reserve(self, keys: KeySpecs) -> None:
        """Allocate the keys' pools, pages (unless deferred) and occupancy tables now."""
        self._state.refuse_if_unusable("reserve")
        shapes = self._key_shapes(keys, "reserve")
        deferred = self._state.core.policy.deferred_keys
        self.install_keys(shapes, {k for k in shapes if k not in deferred}, tables=True)

    def _key_shapes(self, keys: object, operation: str) -> dict[TensorName, KeyShape]:
        """Check `host_bytes` and `reserve` input; return each key's row shape."""
        if not isinstance(keys, Mapping):
            raise BadInputError(
                what=operation,
                expected="a mapping of cached key name to (width, dtype)",
                got=type(keys).__name__,
            )
        caches_hidden = self._state.core.policy.needs_full_hidden_states
        shapes: dict[TensorName, KeyShape] = {}
        for name, spec in keys.items():
            if not isinstance(name, str) or not name:
                raise BadInputError(
                    what=f"{operation} key name", expected="a non-empty str", got=repr(name)
                )
            if not isinstance(spec, (tuple, list)) or len(spec) != 2:
                raise BadInputError(
                    what=f"{operation} entry of key {name!r}",
                    expected="a (width, dtype) pair",
                    got=repr(spec),
                )
            width, dtype = spec
            features = (width,) if isinstance(width, int) else width
            if (
                not isinstance(features, (tuple, list))
                or not features
                or not all(type(d) is int and d > 0 for d in features)
            ):
                raise BadInputError(
                    what=f"width of key {name!r}",
                    expected="an int > 0, or a tuple of them (the row shape)",
                    got=repr(width),
                )
            if not isinstance(dtype, torch.dtype):
                raise BadInputError(
                    what=f"dtype of key {name!r}", expected="a torch.dtype", got=repr(dtype)
                )
            if name == HIDDEN_KEY and not caches_hidden:
                raise BadInputError(
                    what=f"{operation} key {name!r}",
                    expected="a key the policy caches (this policy caches no hidden states, OUT-7)",
                    got="the hidden-state key",
                )
            shape = KeyShape(tuple(features), dtype)
            self.check_first_shape(f"{operation} key {name!r}", TensorName(name), shape)
            shapes[TensorName(name)] = shape
        return shapes

    def check_first_shape(self, what: str, key: TensorName, shape: KeyShape) -> None:
        """A key keeps the row shape and dtype it was first installed with (FAIL-5)."""
        known = self._pool.shapes.get(key)
        if known is not None:
            known.require(what, shape)

    def install_keys(
        self,
        shapes: Mapping[TensorName, KeyShape],
        immediate: Collection[TensorName],
        *,
        tables: bool = False,
    ) -> None:
        """Allocate storage for keys seen for the first time outside the lock; install under it.

        With ``tables`` the core's occupancy tables are allocated too (`reserve`). All or
        nothing (D20): an allocation that fails raises `HostAllocationError` and this call keeps
        nothing it allocated; the keys installed before stay.
        """
        state = self._state
        pool, pages = self._pool, self._pages
        new_pool = {k: s for k, s in shapes.items() if k not in pool.tensors}
        new_pages = {k: shapes[k] for k in immediate if k not in pages.buffers}
        if not new_pool and not new_pages and not tables:
            return
        pool_storage: dict[TensorName, torch.Tensor] = {}
        page_storage: dict[TensorName, torch.Tensor] = {}
        failed: tuple[HostPool | StagingPages, TensorName, KeyShape] | None = None
        try:
            for key, shape in new_pool.items():
                failed = (pool, key, shape)
                pool_storage[key] = pool.allocate(shape, key)
            for key, shape in new_pages.items():
                failed = (pages, key, shape)
                page_storage[key] = pages.allocate(shape, key)
        except Exception as exc:
            # Keep nothing: storage pinned for this call is unpinned as it is freed here.
            pool_storage.clear()
            page_storage.clear()
            assert failed is not None
            storage, key, shape = failed
            raise HostAllocationError(
                key=key,
                part="pool" if storage is pool else "pages",
                nbytes=storage.nbytes_for(shape),
                pinned=storage.pin,
                reason=f"{type(exc).__name__}: {exc}",
            ) from exc
        try:
            with state.lock:
                if state.closed:
                    raise ShutDownError(operation="allocate host storage")
                for key, shape in shapes.items():
                    # A reserve on another thread may have installed the key first (first wins).
                    self.check_first_shape(f"rows of cached key {key!r}", key, shape)
                if tables:
                    try:
                        state.core.reserve_tables(shapes)
                    except MemoryError as exc:
                        raise HostAllocationError(
                            key=", ".join(shapes),
                            part="occupancy",
                            nbytes=len(shapes) * state.core.occupancy_bytes_per_key(),
                            pinned=False,
                            reason=f"{type(exc).__name__}: {exc}",
                        ) from exc
                for key, rows in pool_storage.items():
                    pool.install(key, new_pool[key], rows)
                for key, buffer in page_storage.items():
                    pages.install(key, buffer)
        except BaseException:
            # Keep nothing this call allocated: the raised error's frames would hold it alive.
            pool_storage.clear()
            page_storage.clear()
            raise
        for key in dict.fromkeys((*pool_storage, *page_storage)):
            self._log_allocation(key, shapes[key], pool_storage.get(key), page_storage.get(key))

    def _log_allocation(
        self,
        key: TensorName,
        shape: KeyShape,
        pool: torch.Tensor | None,
        pages: torch.Tensor | None,
    ) -> None:
        """Log a key's first allocation: the host bytes it holds from now on."""
        state = self._state
        config = state.config
        pool_bytes = 0 if pool is None else pool.untyped_storage().nbytes()
        page_bytes = 0 if pages is None else pages.untyped_storage().nbytes()
        kind = "deferred" if key in state.core.policy.deferred_keys else "immediate"
        log(
            logging.INFO,
            "key_allocated",
            state.cache_id,
            "allocated %s key %r (rows %s %s, %d bytes each): host pool %d bytes (%d slots), "
            "staging pages %d bytes (%d pages of %d rows), %s",
            kind,
            key,
            list(shape.features),
            str(shape.dtype).removeprefix("torch."),
            shape.row_bytes,
            pool_bytes,
            config.num_slots,
            page_bytes,
            config.staging_depth if pages is not None else 0,
            config.staging_capacity_tokens,
            "pinned" if state.cuda else "not pinned",
            key=key,
            pool_bytes=pool_bytes,
            staging_bytes=page_bytes,
            row_bytes=shape.row_bytes,
        )
