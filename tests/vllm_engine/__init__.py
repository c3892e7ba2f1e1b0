"""Tests in vLLM's real CPU engine (``bash .ci/setup-vllm cpu``; README)."""

from __future__ import annotations

import os
from types import ModuleType

import pytest

#: Set by CI: a missing or unusable engine fails the suite instead of skipping it.
REQUIRE_ENV = "OMNI_CACHE_REQUIRE_VLLM_ENGINE"


def require_engine() -> ModuleType:
    """Return vLLM if its CPU build is installed; skip the calling module otherwise."""
    why = "needs vLLM's CPU build: bash .ci/setup-vllm cpu"
    try:
        import vllm
        from vllm.platforms import current_platform
    except ImportError:
        if os.environ.get(REQUIRE_ENV):
            raise
        pytest.skip(why, allow_module_level=True)
    if not current_platform.is_cpu():
        if os.environ.get(REQUIRE_ENV):
            raise RuntimeError(f"vLLM's platform is {current_platform!r}, not the CPU")
        pytest.skip(why, allow_module_level=True)
    return vllm
