"""vLLM's configs read for `VllmPrefixCache.from_vllm_config`: one check per refusal.

Each ``refuse_*`` function raises `ConfigError` naming the field of a configuration the cache
cannot serve correctly, and returns nothing otherwise; the two readers (`followed_kv_group`,
`checked_block_size`) return what they checked. Configs are read duck-typed, by the few fields
named here (vLLM 0.33's ``VllmConfig`` and ``KVCacheConfig``), so no vLLM import is needed.
"""

from __future__ import annotations

from typing import Any

from omni_cache_core import ConfigError

__all__ = [
    "SPECULATIVE_METHODS_CHECKED",
    "check_speculative_decoding",
    "checked_block_size",
    "followed_kv_group",
    "is_full_attention",
    "max_concurrent_batches",
    "refuse_kv_connector",
    "refuse_partial_block_hits",
    "refuse_without_prefix_caching",
]

# KV cache spec classes (by name, so no vLLM import is needed) whose groups hold every token's
# KV in one slot per token for the request's whole life: the slots a hit reads.
_FULL_ATTENTION_SPECS = frozenset({"FullAttentionSpec", "MLAAttentionSpec"})


def is_full_attention(spec: object) -> bool:
    """Tell whether a KV cache spec keeps one slot per token (full attention), by class name."""
    name = type(spec).__name__
    if name == "UniformTypeKVCacheSpecs":
        specs = getattr(spec, "kv_cache_specs", None) or {}
        return bool(specs) and all(is_full_attention(s) for s in specs.values())
    if name not in _FULL_ATTENTION_SPECS:
        return False
    # Whisper-style block pooling keeps fewer states than tokens.
    return getattr(spec, "tokens_per_state", 1) == 1


def refuse_without_prefix_caching(cache_config: Any) -> None:
    """Refuse a config with prefix caching off: there would be no hit to serve."""
    if not getattr(cache_config, "enable_prefix_caching", False):
        raise ConfigError(
            field="cache_config.enable_prefix_caching",
            value=getattr(cache_config, "enable_prefix_caching", None),
            expected="True: without prefix caching there is no hit to serve",
        )


#: Speculative methods whose scheduling was checked: n-gram drafts drive vLLM 0.33's real
#: scheduler in tests/vllm; EAGLE-style and MTP drafters reach the scheduler through the same
#: ``scheduled_spec_decode_tokens`` and ``num_computed_tokens`` (the drafter runs after the
#: target model's forward, whose rows are the ones cached), and their configs are accepted.
SPECULATIVE_METHODS_CHECKED = ("ngram", "eagle", "eagle3", "mtp")


def check_speculative_decoding(vllm_config: Any, depth: int) -> None:
    """SPEC-2: speculative decoding needs each step's acceptance in the next scheduler output.

    Under async scheduling (or any other batch queue deeper than one step) the next step is
    scheduled before this one's rejections are known, so its computed-token counts cannot say
    which drafts were accepted (``shared/notes/vllm-speculative.md``): refused.
    """
    speculative = getattr(vllm_config, "speculative_config", None)
    if speculative is None:
        return
    if depth > 1:
        raise ConfigError(
            field="speculative_config",
            value=getattr(speculative, "method", type(speculative).__name__),
            expected="synchronous scheduling (async_scheduling=False, one batch in flight): "
            "with more steps in flight the scheduler output does not say which drafts were "
            f"accepted; got {depth} batches in flight",
        )


def refuse_kv_connector(vllm_config: Any) -> None:
    """Refuse a KV connector: the tokens it loads have no rows here."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    if transfer is not None:
        raise ConfigError(
            field="kv_transfer_config",
            value=type(transfer).__name__,
            expected="None: tokens a KV connector loads were never computed here, so a hit "
            "on them has no rows",
        )


def followed_kv_group(kv_cache_config: Any, kv_group: int | None) -> int:
    """Return the full-attention KV cache group to follow, or refuse the KV layout.

    ``kv_group`` None asks for the model's only group, which must be of full attention.
    """
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    kinds = [type(getattr(g, "kv_cache_spec", None)).__name__ for g in groups]
    if kv_group is None:
        if len(groups) != 1 or not is_full_attention(groups[0].kv_cache_spec):
            raise ConfigError(
                field="kv_cache_config.kv_cache_groups",
                value=kinds,
                expected="exactly one full-attention KV cache group, or kv_group naming "
                "a full-attention group",
            )
        return 0
    if (
        not isinstance(kv_group, int)
        or isinstance(kv_group, bool)
        or not 0 <= kv_group < len(groups)
        or not is_full_attention(groups[kv_group].kv_cache_spec)
    ):
        raise ConfigError(
            field="kv_group",
            value=kv_group,
            expected=f"the index of a full-attention group among {kinds}",
        )
    return kv_group


def checked_block_size(kv_cache_config: Any, kv_group: int, cache_config: Any) -> Any:
    """Return the group's block size, refusing one that differs from the cache config's."""
    spec = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())[kv_group].kv_cache_spec
    block_size = getattr(spec, "block_size", None)
    if block_size is None and type(spec).__name__ == "UniformTypeKVCacheSpecs":
        specs = getattr(spec, "kv_cache_specs", None) or {}
        block_size = getattr(next(iter(specs.values()), None), "block_size", None)
    configured = getattr(cache_config, "block_size", None)
    if configured is not None and block_size != configured:
        raise ConfigError(
            field="kv_cache_spec.block_size",
            value=block_size,
            expected=f"the cache config's block size {configured}",
        )
    return block_size


def refuse_partial_block_hits(kv_cache_config: Any, cache_config: Any, block_size: int) -> None:
    """Refuse prefix hits that may end inside a block (a hash or alignment finer than one)."""
    for source, name in (
        (kv_cache_config, "hash_block_size"),
        (cache_config, "hash_block_size"),
        (kv_cache_config, "cache_hit_alignment_tokens"),
    ):
        granularity = getattr(source, name, None)
        if isinstance(granularity, int) and granularity and granularity % block_size:
            raise ConfigError(
                field=name,
                value=granularity,
                expected=f"a multiple of the block size {block_size}: prefix hits must "
                "end on a block boundary",
            )


def max_concurrent_batches(vllm_config: Any) -> int:
    """Steps vLLM's engine core keeps in flight: its batch queue depth."""
    try:
        depth = vllm_config.max_concurrent_batches
    except Exception:  # an older or stand-in config without the property
        depth = None
    if isinstance(depth, int) and not isinstance(depth, bool) and depth >= 1:
        return depth
    scheduler_config = getattr(vllm_config, "scheduler_config", None)
    parallel = getattr(vllm_config, "parallel_config", None)
    pp = getattr(parallel, "pipeline_parallel_size", 1)
    pp = pp if isinstance(pp, int) and pp >= 1 else 1
    return max(pp, 2 if getattr(scheduler_config, "async_scheduling", False) else 1)
