"""The counters `OmniPrefixCacheManager.stats()` returns."""

from __future__ import annotations

from types import MappingProxyType

import attrs

__all__ = ["CacheStats", "HostBytes"]


def _frozen_map(value: dict[str, int]) -> MappingProxyType[str, int]:
    return MappingProxyType(dict(value))


@attrs.frozen(kw_only=True)
class CacheStats:
    """A frozen view of the cache's counters at one moment.

    Attributes:
        steps_saved: Saves that issued a step id.
        steps_consumed: Steps materialized.
        steps_discarded: Steps discarded.
        hit_requests: Requests that started with a prefix hit.
        hit_rows: Hit rows handed out, by source: POOL (the host mirror), AFTER_WRITE (the
            mirror once an in-flight write landed), TASK (a deferred write's own rows),
            THIS_STEP (a producer of the same step), ZEROS (an mm key absent there).
        rows_written: Rows written to the pool, by key.
        bytes_device_to_host: Bytes copied from the device into staging pages or host rows.
        bytes_to_pool: Bytes written into the pool.
        page_waits: Saves that found no free page and waited.
        page_wait_s: Seconds those saves waited in total.
        budget_flushes: Deferred writes forced out early by the GPU-byte budget.
        timeouts: Waits that ran out (page claims, barriers, flushes, hit joins).
        writes_failed: Writes that failed (the first one poisons the cache).
        pages_in_use: Staging pages held right now.
        budget_bytes_in_use: Device clone bytes charged right now.
        occupancy_bytes: Bytes of the occupancy tables (SLOT-6).
        pool_bytes: Bytes of the host pool.
        staging_bytes: Bytes of the staging pages.
        host_pinned_bytes: Bytes of the pool and pages that are pinned (on CUDA).
        host_unpinned_bytes: Bytes of the pool and pages that are not pinned (on the CPU).
        output_bytes_kept: Bytes of the buffers of returned rows the cache keeps to hand out
            again once the caller has dropped them, at most ``staging_bytes`` (D40).
    """

    steps_saved: int
    steps_consumed: int
    steps_discarded: int
    hit_requests: int
    hit_rows: MappingProxyType[str, int] = attrs.field(converter=_frozen_map)
    rows_written: MappingProxyType[str, int] = attrs.field(converter=_frozen_map)
    bytes_device_to_host: int
    bytes_to_pool: int
    page_waits: int
    page_wait_s: float
    budget_flushes: int
    timeouts: int
    writes_failed: int
    pages_in_use: int
    budget_bytes_in_use: int
    occupancy_bytes: int
    pool_bytes: int
    staging_bytes: int
    host_pinned_bytes: int
    host_unpinned_bytes: int
    output_bytes_kept: int


@attrs.frozen(kw_only=True)
class HostBytes:
    """The host bytes one cached key takes once allocated (`OmniPrefixCacheManager.host_bytes`).

    Attributes:
        pool: The host pool: one row per KV slot (``num_blocks * block_size * row_bytes``).
        pages: The staging pages: ``staging_depth * staging_capacity_tokens * row_bytes`` for an
            immediate key, 0 for a deferred one.
        occupancy: The occupancy table: 8 bytes per KV slot (SLOT-6).
    """

    pool: int
    pages: int
    occupancy: int

    @property
    def total(self) -> int:
        """All three together."""
        return self.pool + self.pages + self.occupancy
