"""The README's vLLM example runs as written against a stand-in vLLM model runner."""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"
BS = 4


def _example_source() -> str:
    text = README.read_text()
    section = text.split("## Using it in vLLM and vLLM-Omni", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None, "the README lost its vLLM example"
    return match.group(1)


class StepOutput(NamedTuple):
    step_id: int | None
    req_ids: list[str]


class FullAttentionSpec(SimpleNamespace):
    pass


class GPUModelRunner:
    """Stands in for vLLM's runner: its own row order, rows that are the token positions."""

    def __init__(self) -> None:
        self.vllm_config = SimpleNamespace(
            cache_config=SimpleNamespace(enable_prefix_caching=True, block_size=BS),
            scheduler_config=SimpleNamespace(max_num_batched_tokens=64, async_scheduling=False),
            model_config=SimpleNamespace(max_model_len=256),
            speculative_config=None,
            kv_transfer_config=None,
            max_concurrent_batches=1,
        )
        self.model = SimpleNamespace()
        self.input_batch = SimpleNamespace(req_ids=[])
        self.starts: dict[str, int] = {}

    def initialize_kv_cache(self, kv_cache_config: Any) -> None:
        self.kv_cache_config = kv_cache_config

    def _update_states(self, so: SimpleNamespace) -> None:
        self.starts = {n.req_id: n.num_computed_tokens for n in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        self.starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        self.input_batch.req_ids = sorted(so.num_scheduled_tokens, reverse=True)

    def _forward(self, so: SimpleNamespace) -> tuple[torch.Tensor, None, int]:
        rows: list[int] = []
        for rid in self.input_batch.req_ids:
            start = self.starts[rid]
            rows.extend(range(start, start + so.num_scheduled_tokens[rid]))
        hidden = torch.tensor(rows, dtype=torch.float32)[:, None].repeat(1, 2)
        return hidden, None, len(rows)


def _output(
    sched: dict[str, int],
    new: list[tuple[str, list[int], int]],
    cached: list[tuple[str, int, list[int] | None]],
    finished: set[str],
) -> SimpleNamespace:
    return SimpleNamespace(
        num_scheduled_tokens=sched,
        total_num_scheduled_tokens=sum(sched.values()),
        scheduled_new_reqs=[
            SimpleNamespace(req_id=r, block_ids=(b,), num_computed_tokens=c) for r, b, c in new
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _, _ in cached],
            new_block_ids=[None if b is None else (b,) for _, _, b in cached],
            num_computed_tokens=[c for _, c, _ in cached],
            resumed_req_ids=set(),
        ),
        finished_req_ids=finished,
        preempted_req_ids=set(),
    )


def test_readme_vllm_example_serves_a_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    module = importlib.import_module("omni_cache_cuda.vllm")  # what the example's import finds
    monkeypatch.setattr(module, "should_build_prefix_cache", lambda: True)
    namespace: dict[str, Any] = {"GPUModelRunner": GPUModelRunner, "StepOutput": StepOutput}
    exec(compile(_example_source(), str(README), "exec"), namespace)
    runner = namespace["PrefixCachedRunner"]()
    runner.initialize_kv_cache(
        SimpleNamespace(
            num_blocks=16,
            kv_cache_groups=[SimpleNamespace(kv_cache_spec=FullAttentionSpec(block_size=BS))],
        )
    )
    cache = runner.prefix_cache
    try:
        # "a" computes 8 tokens; then "b" starts on a's first block (a 4-token hit) and
        # computes 2 more while "a" decodes; then both finish.
        first = runner.execute_model(_output({"a": 8}, [("a", [0, 1], 0)], [], set()))
        second = runner.execute_model(
            _output({"a": 1, "b": 2}, [("b", [0, 5], 4)], [("a", 8, [2])], set())
        )
        assert runner.input_batch.req_ids == ["b", "a"]
        assert runner.execute_model(_output({}, [], [], {"a", "b"})) is None
        got_first = runner.build_stage_outputs(first)
        got_second = runner.build_stage_outputs(second)
    finally:
        cache.shutdown()
    (positions, rows) = got_first["a"]
    assert positions == (0, 8) and rows[:, 0].tolist() == [float(p) for p in range(8)]
    (positions, rows) = got_second["b"]
    assert positions == (0, 6)
    assert rows[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]  # 4 hit rows, then its own
    assert got_second["a"][0] == (8, 9)
    assert cache.counts()["started_with_hit"] == 1
