"""Fixtures of the CUDA conformance suite.

The `gpu` marker itself is handled by `tests/conftest.py`, which skips these tests when no CUDA
device is present; nothing here touches CUDA before a test that needs it runs.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from omni_cache_cuda import OmniPrefixCacheManager


@pytest.fixture
def cuda() -> Iterator[torch.device]:
    """The CUDA device, with the device drained before and after the test.

    The synchronize after the test surfaces an asynchronous CUDA error in the test that caused
    it rather than in the next one.
    """
    device = torch.device("cuda")
    torch.cuda.synchronize(device)
    yield device
    torch.cuda.synchronize(device)
    gc.collect()


@pytest.fixture
def make_manager(cuda: torch.device) -> Iterator[Callable[..., OmniPrefixCacheManager]]:
    """Build CUDA managers that are shut down when the test ends, passed or failed."""
    managers: list[OmniPrefixCacheManager] = []

    def make(config: Any, **kwargs: Any) -> OmniPrefixCacheManager:
        kwargs.setdefault("device", cuda)
        manager = OmniPrefixCacheManager(config, **kwargs)
        managers.append(manager)
        return manager

    yield make
    for manager in managers:
        manager.shutdown()
    managers.clear()
    gc.collect()
