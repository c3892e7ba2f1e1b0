"""`VllmPrefixCache.from_vllm_config` on vLLM 0.33's own config and KV cache spec classes."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM: bash .ci/setup-vllm")

import torch
from vllm.v1.kv_cache_interface import (
    MLAAttentionSpec,
    RSWASpec,
    SlidingWindowSpec,
)

from omni_cache_cuda import ConfigError
from omni_cache_cuda.vllm import VllmPrefixCache
from tests.vllm.harness import full, kv_config, make_vllm_config

BS = 16


def sliding() -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float32, sliding_window=64
    )


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_built_from_vllms_configs(async_scheduling: bool) -> None:
    config = make_vllm_config(
        num_blocks=64, max_num_batched_tokens=384, async_scheduling=async_scheduling
    )
    with VllmPrefixCache.from_vllm_config(config, kv_config(full()), device="cpu") as cache:
        assert cache.block_size == BS and cache.kv_group == 0
        assert cache.manager.config.num_blocks == 64
        assert cache.manager.config.staging_capacity_tokens == 384
        assert cache.max_concurrent_batches == config.max_concurrent_batches
        assert cache.max_concurrent_batches == (2 if async_scheduling else 1)


def test_mla_is_full_attention() -> None:
    mla = MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float32)
    with VllmPrefixCache.from_vllm_config(make_vllm_config(), kv_config(mla), device="cpu"):
        pass


def test_a_named_full_attention_group_among_others() -> None:
    kv = kv_config(sliding(), full())
    with VllmPrefixCache.from_vllm_config(
        make_vllm_config(), kv, kv_group=1, device="cpu"
    ) as cache:
        assert cache.kv_group == 1


def rswa() -> RSWASpec:
    return RSWASpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float32, rswa_window=32)


@pytest.mark.parametrize(
    ("make", "kv_group", "field"),
    [
        (
            lambda: (make_vllm_config(enable_prefix_caching=False), kv_config(full())),
            None,
            "enable_prefix",
        ),
        (lambda: (make_vllm_config(), kv_config(sliding(), full())), None, "kv_cache_groups"),
        (lambda: (make_vllm_config(), kv_config(sliding())), None, "kv_cache_groups"),
        (lambda: (make_vllm_config(), kv_config(sliding(), full())), 0, "kv_group"),
        (lambda: (make_vllm_config(), kv_config(rswa())), None, "kv_cache_groups"),
        (lambda: (make_vllm_config(), kv_config(full(32))), None, "block_size"),
    ],
    ids=[
        "prefix-caching-off",
        "two-groups",
        "sliding-window",
        "named-sliding-window",
        "recycled-window",
        "block-size-mismatch",
    ],
)
def test_refusals_on_vllms_configs(make: Any, kv_group: int | None, field: str) -> None:
    config, kv = make()
    with pytest.raises(ConfigError) as err:
        VllmPrefixCache.from_vllm_config(config, kv, kv_group=kv_group, device="cpu")
    assert field in err.value.field


@pytest.mark.parametrize("method", ["ngram", "eagle", "eagle3", "mtp"])
def test_spec_6_speculative_decoding_is_served_with_sync_scheduling_only(method: str) -> None:
    """Every checked method is accepted with one batch in flight and refused under async
    scheduling, whose next scheduler output cannot say which drafts were accepted (SPEC-6)."""
    config = make_vllm_config(async_scheduling=False)
    # The glue reads only the method and the batch depth; a real EAGLE or MTP config needs
    # draft weights, so a stand-in carries the method.
    object.__setattr__(config, "speculative_config", SimpleNamespace(method=method))
    assert config.max_concurrent_batches == 1
    with VllmPrefixCache.from_vllm_config(config, kv_config(full()), device="cpu") as cache:
        assert cache.max_concurrent_batches == 1
    config = make_vllm_config(async_scheduling=True)
    object.__setattr__(config, "speculative_config", SimpleNamespace(method=method))
    with pytest.raises(ConfigError, match="synchronous scheduling") as err:
        VllmPrefixCache.from_vllm_config(config, kv_config(full()), device="cpu")
    assert err.value.field == "speculative_config"
