"""`omni_cache_cuda.vllm` without vLLM: imports, config refusals, the record translation.

Scheduler outputs here are plain stand-ins shaped like vLLM 0.33's `SchedulerOutput`; the tests
in ``tests/vllm`` drive vLLM's real scheduler.
"""

from __future__ import annotations

import importlib
import pickle
import sys
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import omni_cache_cuda
from omni_cache_cuda import (
    BadInputError,
    ConfigError,
    LifecycleError,
    OmniPrefixCacheManager,
    PrefixCacheConfig,
)
from omni_cache_cuda.vllm import (
    VLLM_VERSION_CHECKED,
    RequestIdReuseError,
    VllmPrefixCache,
    should_build_prefix_cache,
)

BS = 4


# ---------------------------------------------------------------------------------------------
# Stand-ins.


def new_req(req_id: str, blocks: list[int], computed: int = 0) -> SimpleNamespace:
    return SimpleNamespace(req_id=req_id, block_ids=(blocks,), num_computed_tokens=computed)


def output(
    sched: dict[str, int],
    *,
    new: list[SimpleNamespace] = (),  # type: ignore[assignment]
    cached: list[tuple[str, list[int] | None, int]] = (),  # type: ignore[assignment]
    resumed: set[str] = frozenset(),  # type: ignore[assignment]
    finished: set[str] = frozenset(),  # type: ignore[assignment]
    preempted: set[str] | None = None,
    **extra: Any,
) -> SimpleNamespace:
    return SimpleNamespace(
        num_scheduled_tokens=dict(sched),
        total_num_scheduled_tokens=sum(sched.values()),
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[c[0] for c in cached],
            new_block_ids=[None if c[1] is None else (c[1],) for c in cached],
            num_computed_tokens=[c[2] for c in cached],
            resumed_req_ids=set(resumed),
        ),
        finished_req_ids=set(finished),
        preempted_req_ids=preempted,
        scheduled_spec_decode_tokens=extra.get("spec", {}),
        kv_cache_block_copies=extra.get("copies"),
    )


def rows_for(cache: VllmPrefixCache, order: list[str]) -> torch.Tensor:
    """Each row holds its request's position (a pure function of the position here)."""
    layout = cache.layout(order)
    rows = []
    for write in layout.writes:
        assert cache._open_step is not None
        start = cache._open_step.starts[write.req_id]
        rows.extend(float(start + i) for i in range(write.row_end - write.row_start))
    return torch.tensor(rows, dtype=torch.float32)[:, None].repeat(1, 2)


def save(cache: VllmPrefixCache, order: list[str]) -> int:
    hidden = rows_for(cache, order)
    return cache.save(hidden, None, req_ids=order, num_tokens_unpadded=hidden.shape[0])


@pytest.fixture
def cache() -> Any:
    manager = OmniPrefixCacheManager(
        PrefixCacheConfig(num_blocks=32, block_size=BS), device="cpu", threaded=False
    )
    with VllmPrefixCache(manager, block_size=BS) as c:
        yield c


# ---------------------------------------------------------------------------------------------
# Import hygiene.


def test_the_module_imports_without_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    class NoVllm:
        def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
            if name == "vllm" or name.startswith("vllm."):
                raise ImportError(f"{name} is blocked in this test")
            return None

    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delitem(sys.modules, "omni_cache_cuda.vllm")
    # The fresh import below rebinds the package attribute too; put it back afterwards.
    monkeypatch.setattr(omni_cache_cuda, "vllm", sys.modules["omni_cache_cuda"].vllm)
    monkeypatch.setattr(sys, "meta_path", [NoVllm(), *sys.meta_path])
    module = importlib.import_module("omni_cache_cuda.vllm")
    assert not any(n == "vllm" or n.startswith("vllm.") for n in sys.modules)
    assert module.VLLM_VERSION_CHECKED == "0.33.0" == VLLM_VERSION_CHECKED
    with pytest.raises(ImportError, match="blocked"):
        importlib.import_module("vllm")


# ---------------------------------------------------------------------------------------------
# Which worker builds a cache.


@pytest.mark.parametrize(
    ("pp_rank", "pp_size", "tp_rank", "pcp_rank", "want"),
    [
        (0, 1, 0, 0, True),
        (0, 1, 1, 0, False),
        (0, 1, 7, 0, False),
        (3, 4, 0, 0, True),
        (2, 4, 0, 0, False),
        (3, 4, 5, 0, False),
        (0, 1, 0, 1, False),
    ],
)
def test_only_the_output_worker_builds_a_cache(
    pp_rank: int, pp_size: int, tp_rank: int, pcp_rank: int, want: bool
) -> None:
    got = should_build_prefix_cache(
        pp_rank=pp_rank, pp_size=pp_size, tp_rank=tp_rank, pcp_rank=pcp_rank
    )
    assert got is want
    # A TP=8 x PP=4 worker group builds exactly one cache.
    builders = [
        (pp, tp)
        for pp in range(4)
        for tp in range(8)
        if should_build_prefix_cache(pp_rank=pp, pp_size=4, tp_rank=tp, pcp_rank=0)
    ]
    assert builders == [(3, 0)]


# ---------------------------------------------------------------------------------------------
# from_vllm_config and its refusals (stand-in configs; tests/vllm uses vLLM's own).


class FullAttentionSpec(SimpleNamespace):
    pass


class SlidingWindowSpec(SimpleNamespace):
    pass


class MambaSpec(SimpleNamespace):
    pass


def vllm_config(**overrides: Any) -> SimpleNamespace:
    cache = SimpleNamespace(enable_prefix_caching=True, block_size=16)
    for key in ("enable_prefix_caching", "block_size"):
        if key in overrides:
            setattr(cache, key, overrides.pop(key))
    base = {
        "cache_config": cache,
        "scheduler_config": SimpleNamespace(max_num_batched_tokens=512, async_scheduling=True),
        "model_config": SimpleNamespace(max_model_len=2048),
        "parallel_config": SimpleNamespace(pipeline_parallel_size=1),
        "speculative_config": None,
        "kv_transfer_config": None,
    }
    base.update(overrides)
    return SimpleNamespace(**base)


def kv_config(*specs: Any, num_blocks: int = 64, **extra: Any) -> SimpleNamespace:
    groups = [SimpleNamespace(kv_cache_spec=s, layer_names=["l"]) for s in specs]
    return SimpleNamespace(num_blocks=num_blocks, kv_cache_groups=groups, **extra)


def full(block_size: int = 16) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size)


def test_from_vllm_config_sizes_the_cache() -> None:
    with VllmPrefixCache.from_vllm_config(
        vllm_config(), kv_config(full()), device="cpu", threaded=False
    ) as cache:
        assert cache.block_size == 16 and cache.kv_group == 0
        assert cache.manager.config.num_blocks == 64
        assert cache.manager.config.staging_capacity_tokens == 512
        # async_scheduling with no max_concurrent_batches property: two batches in flight
        assert cache.max_concurrent_batches == 2
        assert cache.manager.threaded is False


def test_from_vllm_config_follows_a_named_full_attention_group() -> None:
    kv = kv_config(SlidingWindowSpec(block_size=16), full(), MambaSpec(block_size=16))
    with VllmPrefixCache.from_vllm_config(
        vllm_config(max_concurrent_batches=1), kv, kv_group=1, device="cpu"
    ) as cache:
        assert cache.kv_group == 1 and cache.max_concurrent_batches == 1


@pytest.mark.parametrize(
    ("config", "kv", "kv_group", "field"),
    [
        (vllm_config(enable_prefix_caching=False), kv_config(full()), None, "enable_prefix"),
        (
            vllm_config(speculative_config=SimpleNamespace(method="ngram")),
            kv_config(full()),
            None,
            "speculative",
        ),
        (vllm_config(kv_transfer_config=object()), kv_config(full()), None, "kv_transfer"),
        (vllm_config(), kv_config(full(), full()), None, "kv_cache_groups"),
        (vllm_config(), kv_config(SlidingWindowSpec(block_size=16)), None, "kv_cache_groups"),
        (vllm_config(), kv_config(), None, "kv_cache_groups"),
        (vllm_config(), kv_config(full(), SlidingWindowSpec(block_size=16)), 1, "kv_group"),
        (vllm_config(), kv_config(full()), 1, "kv_group"),
        (vllm_config(), kv_config(full(32)), None, "block_size"),
        (vllm_config(), kv_config(full(), hash_block_size=8), None, "hash_block_size"),
        (vllm_config(), kv_config(full(), cache_hit_alignment_tokens=8), None, "alignment"),
    ],
    ids=[
        "prefix-caching-off",
        "speculative-decoding-with-async-scheduling",
        "kv-connector",
        "two-groups",
        "sliding-window-only",
        "no-group",
        "named-group-not-full-attention",
        "named-group-missing",
        "block-size-mismatch",
        "partial-block-hash",
        "partial-block-alignment",
    ],
)
def test_from_vllm_config_refuses_what_it_cannot_serve(
    config: Any, kv: Any, kv_group: int | None, field: str
) -> None:
    with pytest.raises(ConfigError) as err:
        VllmPrefixCache.from_vllm_config(config, kv, kv_group=kv_group, device="cpu")
    assert field in err.value.field
    pickle.loads(pickle.dumps(err.value))  # survives the trip back from a worker


def test_constructor_refuses_a_block_size_the_manager_does_not_have() -> None:
    with OmniPrefixCacheManager(
        PrefixCacheConfig(num_blocks=8, block_size=16), device="cpu"
    ) as manager:
        with pytest.raises(ConfigError, match="block_size"):
            VllmPrefixCache(manager, block_size=32)
        with pytest.raises(ConfigError, match="max_concurrent_batches"):
            VllmPrefixCache(manager, block_size=16, max_concurrent_batches=0)
        with pytest.raises(BadInputError, match="manager"):
            VllmPrefixCache(object(), block_size=16)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Record translation, both runner conventions.


def positions(cache: VllmPrefixCache, step_id: int, order: list[str]) -> dict[str, list[int]]:
    out = cache.materialize(step_id, order)
    assert out.hidden_states is not None
    got = {}
    for rid in order:
        start, end = out.positions[rid]
        rows = out.hidden_states[rid][:, 0].tolist()
        assert rows == [float(p) for p in range(start, end)]  # each row is its position
        got[rid] = list(range(start, end))
    return got


def test_new_running_and_finished_requests(cache: VllmPrefixCache) -> None:
    cache.step_begin(output({"a": 6, "b": 3}, new=[new_req("a", [0, 1]), new_req("b", [2])]))
    assert cache.layout(["b", "a"]).slots_cpu.tolist() == [8, 9, 10, 0, 1, 2, 3, 4, 5]
    s1 = save(cache, ["b", "a"])
    # b shares a's first block: a hit of 4 tokens, on rows a wrote one step earlier.
    cache.step_begin(
        output(
            {"a": 1, "c": 2},
            new=[new_req("c", [0, 5], computed=4)],
            cached=[("a", None, 6)],
        )
    )
    s2 = save(cache, ["c", "a"])
    cache.step_begin(output({}, finished={"a", "b", "c", "never-scheduled"}))
    assert positions(cache, s1, ["a", "b"]) == {"a": list(range(6)), "b": [0, 1, 2]}
    assert positions(cache, s2, ["a", "c"]) == {"a": [6], "c": list(range(6))}
    assert cache.counts() == {
        "steps": 3,
        "started": 3,
        "started_with_hit": 1,
        "resumed": 0,
        "resumed_with_hit": 0,
        "preempted": 0,
        "finished": 3,
    }
    assert cache.live_requests() == {}


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_preempt_and_resume_under_both_runners(cache: VllmPrefixCache, runner: str) -> None:
    cache.step_begin(output({"a": 8}, new=[new_req("a", [0, 1])]))
    s1 = save(cache, ["a"])
    cache.step_begin(output({"a": 1}, cached=[("a", [2], 8)]))
    assert cache._translation.running["a"] == [0, 1, 2]
    s2 = save(cache, ["a"])
    cache.step_begin(output({}, preempted={"a"}))
    assert cache.live_requests() == {"a": "preempted"}
    # Back with a 4-token hit in a new block list, under the runner's convention.
    if runner == "v2":
        so = output({"a": 6}, new=[new_req("a", [0, 7, 8], computed=4)])
    else:
        so = output({"a": 6}, cached=[("a", [0, 7, 8], 4)], resumed={"a"})
    cache.step_begin(so)
    assert cache._translation.running["a"] == [0, 7, 8]
    assert cache._open_step is not None and cache._open_step.starts["a"] == 4
    assert cache.layout(["a"]).slots_cpu.tolist() == [28, 29, 30, 31, 32, 33]
    s3 = save(cache, ["a"])
    cache.step_begin(output({}, finished={"a"}))
    assert positions(cache, s1, ["a"]) == {"a": list(range(8))}
    assert positions(cache, s2, ["a"]) == {"a": [8]}
    # Positions 4..8 were delivered before the preemption: only 9 is new.
    assert positions(cache, s3, ["a"]) == {"a": [9]}
    counts = cache.counts()
    assert counts["preempted"] == 1 and counts["resumed"] == 1 == counts["resumed_with_hit"]


def tracked(cache: VllmPrefixCache) -> tuple[Any, ...]:
    """What the glue keeps between calls: block lists, preempted ids, the open step, counts."""
    translation = cache._translation
    return (
        {req_id: list(blocks) for req_id, blocks in translation.running.items()},
        set(translation.preempted),
        list(translation.in_flight),
        cache._open_step,
        cache.counts(),
    )


def test_a_refused_step_changes_nothing(cache: VllmPrefixCache) -> None:
    cache.step_begin(output({"a": 4}, new=[new_req("a", [0])]))
    save(cache, ["a"])
    before = tracked(cache)
    # RESUMED of a request that was never preempted: the cache refuses the whole step.
    with pytest.raises(LifecycleError):
        cache.step_begin(
            output(
                {"a": 1, "b": 4},
                new=[new_req("b", [3])],
                cached=[("a", [1, 2], 4)],
                resumed={"a"},
            )
        )
    assert tracked(cache) == before
    with pytest.raises(BadInputError, match="scheduled_cached_reqs"):
        cache.step_begin(output({"zz": 1}, cached=[("zz", None, 3)]))
    with pytest.raises(BadInputError, match="spec"):
        cache.step_begin(output({"a": 1}, cached=[("a", None, 4)], spec={"a": [1]}))
    with pytest.raises(BadInputError, match="kv_cache_block_copies"):
        cache.step_begin(output({"a": 1}, cached=[("a", None, 4)], copies=[(1, 2)]))
    # Cached-request lists of different lengths: refused before the new request b starts.
    torn = output({"a": 1, "b": 4}, new=[new_req("b", [3])], cached=[("a", [1], 4)])
    torn.scheduled_cached_reqs.num_computed_tokens = []
    with pytest.raises(BadInputError, match="scheduled_cached_reqs"):
        cache.step_begin(torn)
    assert tracked(cache) == before
    # The engine goes on normally, b starting now (the torn step did not start it).
    cache.step_begin(output({"a": 1, "b": 4}, new=[new_req("b", [3])], cached=[("a", [1], 4)]))
    save(cache, ["a", "b"])


def test_save_needs_its_step_and_every_scheduled_request(cache: VllmPrefixCache) -> None:
    with pytest.raises(BadInputError, match="step_begin"):
        cache.save(torch.zeros(1, 2), None, req_ids=["a"], num_tokens_unpadded=1)
    cache.step_begin(output({"a": 2, "b": 2}, new=[new_req("a", [0]), new_req("b", [1])]))
    for bad in (["a"], ["a", "a"], ["a", "c"], "ab"):
        with pytest.raises(BadInputError, match="req_ids"):
            cache.save(torch.zeros(4, 2), None, req_ids=bad, num_tokens_unpadded=4)
    step = save(cache, ["a", "b"])
    with pytest.raises(BadInputError, match="step_begin"):  # one save per step
        save(cache, ["a", "b"])
    cache.discard_step(step)


def test_id_reuse_while_a_step_may_be_in_flight_raises() -> None:
    manager = OmniPrefixCacheManager(PrefixCacheConfig(num_blocks=32, block_size=BS), device="cpu")
    with VllmPrefixCache(manager, block_size=BS, max_concurrent_batches=2) as cache:
        cache.step_begin(output({"a": 4}, new=[new_req("a", [0])]))
        save(cache, ["a"])
        cache.step_begin(output({"a": 1}, cached=[("a", [1], 4)]))
        save(cache, ["a"])
        # "a" was aborted while the step above is in flight, and a new "a" arrives at once.
        reuse = output({"a": 4}, new=[new_req("a", [2])], finished={"a"})
        with pytest.raises(RequestIdReuseError, match="in flight") as err:
            cache.step_begin(reuse)
        assert err.value.req_id == "a"
        assert isinstance(err.value, BadInputError)
        pickle.loads(pickle.dumps(err.value))
        assert cache.live_requests() == {"a": "running"}
        # A new request under a running id is refused too.
        with pytest.raises(RequestIdReuseError, match="still running"):
            cache.step_begin(output({"a": 4}, new=[new_req("a", [2])]))
        # Once a step without "a" went by, the id may come back.
        cache.step_begin(output({}, finished={"a"}))
        cache.step_begin(output({"a": 4}, new=[new_req("a", [2])]))
        assert cache.counts()["started"] == 2


def test_without_async_scheduling_an_id_comes_back_at_once(cache: VllmPrefixCache) -> None:
    cache.step_begin(output({"a": 4}, new=[new_req("a", [0])]))
    s1 = save(cache, ["a"])
    cache.step_begin(output({"a": 4}, new=[new_req("a", [0], computed=0)], finished={"a"}))
    s2 = save(cache, ["a"])
    assert positions(cache, s1, ["a"]) == {"a": [0, 1, 2, 3]}
    assert positions(cache, s2, ["a"]) == {"a": [0, 1, 2, 3]}  # a new admission


def test_kept_block_lists_are_copies(cache: VllmPrefixCache) -> None:
    blocks = [0, 1]
    cache.step_begin(output({"a": 5}, new=[new_req("a", blocks)]))
    blocks.append(99)  # the scheduler reuses its lists
    added = [2]
    cache.step_begin(output({"a": 4}, cached=[("a", added, 5)]))
    added.append(98)
    assert cache._translation.running["a"] == [0, 1, 2]
