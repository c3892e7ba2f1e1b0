"""Host memory planned and reserved up front (D20): `host_bytes`, `reserve`, pinned bytes.

`host_bytes` says what each key will take; `reserve` allocates it off the hot path, so the key's
first save allocates nothing; `stats()` shows the bytes pinned and not pinned. Runs inline and
with a committer thread on the CPU (nothing is pinned there; tests/gpu checks the pinned side).
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from omni_cache_cuda import (
    HIDDEN_KEY,
    BadInputError,
    HostBytes,
    ModelCachePolicy,
    OmniPrefixCacheManager,
    PrefixCacheConfig,
    ShutDownError,
)
from tests.adapter_helpers import DEF, MM, Engine, settle
from tests.reliability_helpers import usable

Make = Callable[..., OmniPrefixCacheManager]

#: The test engine's keys (tests.adapter_helpers.ROW_SHAPES) as `reserve` takes them.
KEYS: dict[str, tuple[Any, torch.dtype]] = {
    HIDDEN_KEY: (4, torch.float32),
    MM: ((3,), torch.float32),
    DEF: ((2, 2), torch.int64),
}


def test_host_bytes_is_the_arithmetic(make: Make) -> None:
    """Pool: a row per KV slot; pages: depth x capacity rows, none for a deferred key."""
    manager = make()  # 16 blocks of 4 slots, 3 pages of 64 rows
    plan = manager.host_bytes(KEYS)
    assert plan == {
        HIDDEN_KEY: HostBytes(pool=64 * 16, pages=3 * 64 * 16, occupancy=64 * 8),
        MM: HostBytes(pool=64 * 12, pages=3 * 64 * 12, occupancy=64 * 8),
        DEF: HostBytes(pool=64 * 32, pages=0, occupancy=64 * 8),
    }
    assert plan[DEF].total == 64 * 32 + 64 * 8
    assert manager.stats().pool_bytes == 0  # planning allocates nothing


def test_reserve_allocates_what_host_bytes_says(make: Make) -> None:
    """After reserve the stats show exactly the planned bytes, none of it pinned on the CPU."""
    manager = make()
    plan = manager.host_bytes(KEYS)
    manager.reserve(KEYS)
    stats = manager.stats()
    assert stats.pool_bytes == sum(p.pool for p in plan.values())
    assert stats.staging_bytes == sum(p.pages for p in plan.values())
    assert stats.occupancy_bytes == sum(p.occupancy for p in plan.values())
    assert stats.host_pinned_bytes == 0
    assert stats.host_unpinned_bytes == stats.pool_bytes + stats.staging_bytes
    with manager._state.lock:
        manager._state.core.check_invariants()


def test_first_save_after_reserve_allocates_nothing(make: Make) -> None:
    """Reserved keys: the first save allocates no pool, page or occupancy table."""
    manager = make()
    manager.reserve(KEYS)
    pool = dict(manager._state.pool.tensors)
    pages = dict(manager._state.pages.buffers)
    reserved = manager._state.core.reserved_keys()
    tables_allocated = manager._state.core.occupancy_tables_allocated
    allocations: list[Any] = []
    manager._inject_fault("alloc", allocations.append)
    engine = Engine(manager)
    engine.start("a", [0, 1, 2])
    engine.materialize(engine.step({"a": 6}))  # hidden, MM and DEF: every reserved key
    assert allocations == []
    assert manager._state.pool.tensors == pool
    assert manager._state.pages.buffers == pages
    # The first save took every reserved table and allocated none of its own.
    core = manager._state.core
    assert reserved and set(reserved) <= set(core.installed_keys)
    assert core.reserved_keys() == ()
    assert core.occupancy_tables_allocated == tables_allocated
    usable(manager)
    assert allocations == []


def test_without_reserve_the_first_save_allocates(make: Make) -> None:
    """The counter-check: a key's first save allocates its pool and pages when not reserved."""
    manager = make()
    allocations: list[Any] = []
    manager._inject_fault("alloc", allocations.append)
    engine = Engine(manager)
    engine.start("a", [0, 1, 2])
    engine.materialize(engine.step({"a": 6}))
    assert sorted(allocations, key=str) == sorted(
        [("pool", HIDDEN_KEY), ("pool", MM), ("pool", DEF), ("pages", HIDDEN_KEY), ("pages", MM)],
        key=str,
    )


def test_reserve_is_idempotent_and_keeps_the_shape(make: Make) -> None:
    """Reserving a key again with its shape changes nothing; a save of another shape raises."""
    manager = make()
    manager.reserve({MM: (3, torch.float32)})
    storage = manager._state.pool.tensors[MM]
    manager.reserve({MM: ((3,), torch.float32), HIDDEN_KEY: (4, torch.float32)})
    assert manager._state.pool.tensors[MM] is storage
    engine = Engine(manager)
    engine.start("a", [0, 1, 2])
    engine.begin({"a": 2})
    with pytest.raises(BadInputError, match="as first seen"):
        manager.save_outputs(
            torch.zeros(2, 4),
            {MM: torch.zeros(2, 5)},
            num_tokens_unpadded=2,
            write_layout=engine.layout()[0],
        )
    assert settle(manager).steps_saved == 0
    usable(manager)


def test_reserve_of_a_key_seen_at_a_save_is_checked_against_it(make: Make) -> None:
    """A key the cache saw at a save takes a reserve of the same shape, refuses another."""
    manager = make()
    engine = Engine(manager)
    engine.start("a", [0, 1, 2])
    engine.materialize(engine.step({"a": 2}))
    before = manager.stats()
    manager.reserve(KEYS)  # all three known: nothing new
    assert manager.stats().pool_bytes == before.pool_bytes
    with pytest.raises(BadInputError, match="as first seen"):
        manager.reserve({DEF: ((4,), torch.int64)})
    usable(manager)


def test_a_refusal_under_the_lock_keeps_nothing_allocated(
    make: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Storage allocated for a reserve that is then refused under the lock (here: another
    reserve installed the key first with another shape) is freed, even while the caller holds
    the error and its frames (D20: keeps nothing)."""
    manager = make()
    allocated: list[weakref.ref[torch.Tensor]] = []
    real_allocate = manager._state.pool.allocate

    def allocate(shape: Any, key: str) -> torch.Tensor:
        storage = real_allocate(shape, key)
        allocated.append(weakref.ref(storage))
        return storage

    monkeypatch.setattr(manager._state.pool, "allocate", allocate)
    checks = iter([None, BadInputError(what="rows", expected="first shape", got="another")])

    def check_first_shape(what: str, key: str, shape: Any) -> None:
        refusal = next(checks, None)
        if refusal is not None:  # the second check: the one under the lock
            raise refusal

    monkeypatch.setattr(manager._host_memory, "check_first_shape", check_first_shape)
    with pytest.raises(BadInputError) as caught:
        manager.reserve({MM: (3, torch.float32)})
    gc.collect()
    assert allocated and all(ref() is None for ref in allocated), caught.value
    assert MM not in manager._state.pool.tensors
    monkeypatch.undo()
    usable(manager)


def test_reserve_after_shutdown_raises(make: Make) -> None:
    """A shut-down cache refuses to reserve (FAIL-4); planning still answers."""
    manager = make()
    manager.shutdown()
    with pytest.raises(ShutDownError):
        manager.reserve(KEYS)
    with pytest.raises(ShutDownError):
        manager.reserve({"": (0, "x")})  # type: ignore[dict-item]
    assert manager.host_bytes({MM: (3, torch.float32)})[MM].pool == 64 * 12


def test_the_readme_host_memory_figures_are_host_bytes() -> None:
    """The README's example of host memory is what `host_bytes` says for that configuration."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("## Host memory", 1)[1].split("\n## ", 1)[0]
    config = PrefixCacheConfig(num_blocks=65536, block_size=16, staging_capacity_tokens=8192)
    with OmniPrefixCacheManager(
        config, policy=ModelCachePolicy(deferred_keys={"codes.audio"}), device="cpu"
    ) as manager:
        plan = manager.host_bytes(
            {
                HIDDEN_KEY: (3584, torch.bfloat16),
                "talker.h": (896, torch.bfloat16),
                "codes.audio": (8, torch.int64),
            }
        )
    gib, mib = 2**30, 2**20
    hidden, talker, codes = plan[HIDDEN_KEY], plan["talker.h"], plan["codes.audio"]
    assert (hidden.pool / gib, hidden.pages / mib, hidden.occupancy / mib) == (7.0, 224, 8)
    assert f"| {hidden.total / gib:.2f} GiB |" in section
    assert (talker.pool / gib, talker.pages / mib) == (1.75, 56)
    assert f"| {talker.total / gib:.2f} GiB |" in section
    assert (codes.pool / mib, codes.pages, codes.total / mib) == (64, 0, 72)
    total = sum(p.total for p in plan.values()) / gib
    assert f"| {total:.2f} GiB pinned |" in section
    assert manager.stats().pool_bytes == 0
