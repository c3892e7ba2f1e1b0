"""The README's integration example runs as written against a stand-in engine."""

from __future__ import annotations

import queue
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK_SIZE = 4
WIDTH = 3


def _example_source() -> str:
    text = README.read_text()
    section = text.split("## Wiring it into a model runner", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None, "the README lost its integration example"
    return match.group(1)


class _Model:
    """Hidden row = its KV slot, so the merged rows show where each one came from."""

    def forward(self, batch: SimpleNamespace) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        slots = []
        for r in batch.all:
            for pos in range(batch.num_computed[r.id], batch.num_computed[r.id] + r.num_scheduled):
                slots.append(r.block_ids[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        rows = torch.tensor(slots, dtype=torch.float32)[:, None].repeat(1, WIDTH)
        return rows, {"codes.audio": rows[:, :1] * 10}


class _Talker:
    def __init__(self) -> None:
        self.fed: dict[str, list[torch.Tensor]] = {}

    def feed(self, req_id: str, hidden: torch.Tensor, codes: torch.Tensor) -> None:
        self.fed.setdefault(req_id, []).append(hidden)


def _request(req_id: str, blocks: list[int], cached: int, scheduled: int) -> SimpleNamespace:
    return SimpleNamespace(
        id=req_id, block_ids=blocks, num_cached_tokens=cached, num_scheduled=scheduled
    )


def _batch(
    new: list[SimpleNamespace], finished: list[str], computed: dict[str, int]
) -> SimpleNamespace:
    return SimpleNamespace(
        new=new,
        all=new,
        finished=finished,
        num_scheduled={r.id: r.num_scheduled for r in new},
        num_computed=computed,
        block_ids={r.id: r.block_ids for r in new},
        num_tokens=sum(r.num_scheduled for r in new),
        padded_tokens=None,
    )


def test_readme_example_serves_a_hit_from_the_cache() -> None:
    """The README example saves a prompt and serves a later request's hit from the cache."""
    talker = _Talker()
    namespace: dict[str, Any] = {
        "num_blocks": 8,
        "block_size": BLOCK_SIZE,
        "max_num_batched_tokens": 64,
        "model": _Model(),
        "output_queue": queue.Queue(),
        "talker": talker,
    }
    exec(compile(_example_source(), str(README), "exec"), namespace)
    cache = namespace["cache"]
    try:
        first = _request("a", [0, 1], 0, 8)
        namespace["run_step"](_batch([first], [], {"a": 0}))
        namespace["build_outputs"]()
        # "b" shares the first block of "a" (a 4-token hit) and computes 2 more tokens.
        second = _request("b", [0, 5], 4, 2)
        namespace["run_step"](_batch([second], ["a"], {"b": 4}))
        namespace["build_outputs"]()
    finally:
        cache.shutdown()
    (rows,) = talker.fed["b"]
    assert rows[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0, 20.0, 21.0]
