"""Shared pytest configuration: hypothesis profiles, the `gpu` marker, `make_core`, the
adapter tests' `threaded` and `make`, every hit prefetched and every returned buffer kept for
reuse.

Profiles: `ci` (the default) is derandomized so a CI failure reproduces with the same command;
hypothesis also draws constants from the project modules a session has loaded, so the same test
run alone may take another path (rerun the command that failed). `nightly` runs many more
examples. Select one with the HYPOTHESIS_PROFILE environment variable.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from omni_cache_core import ModelCachePolicy
from omni_cache_core._core import CacheCore
from tests.core_helpers import MakeCore, config

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    max_examples=200,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("nightly", max_examples=5000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked `gpu` when no CUDA device is present."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        # Importing torch costs seconds; a run without GPU tests never pays it.
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(autouse=True)
def _prefetch_every_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Managers prefetch hit reads of any size, not only those of 512 KiB and more (D34), and
    on the CPU too (D38).

    The tests' rows are a few bytes wide: at the library's threshold no hit of theirs would
    reach the prefetch worker, and HIT-7's paths (a prefetched prefix, a failed prefetch, a
    prefetch overtaken by a newer write) would go untested. The threshold itself has its own
    tests, which set it back. Modules that never loaded the adapter are left alone.
    """
    _prefetch_all(monkeypatch)


@pytest.fixture(autouse=True)
def _keep_every_output(monkeypatch: pytest.MonkeyPatch) -> None:
    """Managers keep the buffers of returned rows of any size for reuse, not only those of
    2 MiB and more (D40).

    The tests' rows are a few bytes wide: at the library's threshold every buffer would come
    from the allocator, and no test would meet a buffer handed out again, or a caller still
    holding one (OUT-8). The threshold has its own test, which sets it back. Modules that never
    loaded the adapter are left alone.
    """
    _keep_all(monkeypatch)


def _keep_all(monkeypatch: pytest.MonkeyPatch) -> None:
    """Set the size from which returned buffers are kept to 1 byte for this test (D40), if the
    adapter is loaded."""
    storage = sys.modules.get("omni_cache_cuda._storage")
    if storage is not None:
        monkeypatch.setattr(storage.OutputMemory, "MIN_BYTES", 1)


def _prefetch_all(monkeypatch: pytest.MonkeyPatch) -> None:
    """Set the adapter's prefetch threshold to 0 for this test, and CPU managers to prefetch
    unless told not to (D38), if the adapter is loaded."""
    effects = sys.modules.get("omni_cache_cuda._effects")
    if effects is not None:
        monkeypatch.setattr(effects, "PREFETCH_MIN_BYTES", 0)
    manager = sys.modules.get("omni_cache_cuda._manager")
    if manager is not None:
        monkeypatch.setattr(manager, "PREFETCH_ON_CPU", True)


@pytest.fixture
def make_core() -> Iterator[MakeCore]:
    """Build cores from `config(**overrides)` and check every one's invariants at the end."""
    cores: list[CacheCore] = []

    def build(policy: ModelCachePolicy | None = None, **overrides: Any) -> CacheCore:
        core = CacheCore(config(**overrides), policy)
        cores.append(core)
        return core

    yield build
    for core in cores:
        core.check_invariants()


@pytest.fixture(params=[False, True], ids=["inline", "threaded"])
def threaded(request: pytest.FixtureRequest) -> bool:
    """Run the test with inline writes and with a committer thread."""
    return bool(request.param)


@pytest.fixture
def make(threaded: bool, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Build CPU managers in the test's mode and shut them all down afterwards.

    Yields ``make(**config) -> OmniPrefixCacheManager``; torch is imported only by tests that
    ask for it (and then the threshold of `_prefetch_every_hit` is set here).
    """
    from tests.adapter_helpers import make_manager

    _prefetch_all(monkeypatch)
    _keep_all(monkeypatch)

    made: list[Any] = []

    def build(**kwargs: Any) -> Any:
        manager = make_manager(threaded, **kwargs)
        made.append(manager)
        return manager

    yield build
    for manager in made:
        manager.shutdown()
