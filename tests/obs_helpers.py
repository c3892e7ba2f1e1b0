"""A short scripted run through the public API whose counters are known in advance.

The metrics, log and NVTX tests drive it. Rows are float32: a hidden row of width 3 is 12 bytes,
a ``codes.audio`` row of width 1 is 4 bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from omni_cache_cuda import (
    ModelCachePolicy,
    OmniPrefixCacheManager,
    PrefixCacheConfig,
    PrefixCacheRequestEvent,
    PrefixCacheStep,
    PrefixCacheWriteLayout,
    StageCacheOutputs,
)
from tests import core_helpers
from tests.core_helpers import finished

BLOCK = 4
WIDTH = 3
MM = "codes.audio"


def config(**overrides: Any) -> PrefixCacheConfig:
    """8 blocks of 4 slots, 2 pages of 16 rows."""
    values: dict[str, Any] = {
        "num_blocks": 8,
        "block_size": BLOCK,
        "staging_depth": 2,
        "staging_capacity_tokens": 16,
    }
    values.update(overrides)
    return PrefixCacheConfig(**values)


def started(
    req: str, blocks: Sequence[int], scheduled: int, hit_end: int = 0
) -> PrefixCacheRequestEvent:
    """A STARTED record (`tests.core_helpers.started`, positional as these tests call it)."""
    return core_helpers.started(req, hit_end=hit_end, block_ids=blocks, scheduled=scheduled)


def step(
    mgr: OmniPrefixCacheManager,
    events: Sequence[PrefixCacheRequestEvent],
    batch: Sequence[tuple[str, Sequence[int], int, int]],
    device: str | torch.device = "cpu",
) -> int:
    """Start a step, then save one: ``batch`` is (request, blocks, computed, scheduled) rows.

    Each row's hidden values are its KV slot (so a hit shows where it came from); the mm rows are
    the slot times 10.
    """
    mgr.new_step_starts(
        PrefixCacheStep(events=list(events), scheduled_tokens={r: n for r, _, _, n in batch})
    )
    slots = [
        blocks[pos // BLOCK] * BLOCK + pos % BLOCK
        for _, blocks, computed, n in batch
        for pos in range(computed, computed + n)
    ]
    hidden = torch.tensor(slots, dtype=torch.float32, device=device)[:, None].repeat(1, WIDTH)
    layout = PrefixCacheWriteLayout.from_block_tables(
        order=[r for r, _, _, _ in batch],
        num_scheduled={r: n for r, _, _, n in batch},
        num_computed={r: c for r, _, c, _ in batch},
        block_ids={r: list(b) for r, b, _, _ in batch},
        block_size=BLOCK,
    )
    return mgr.save_outputs(
        hidden, {MM: hidden[:, :1] * 10}, num_tokens_unpadded=len(slots), write_layout=layout
    )


def scripted_run(
    mgr: OmniPrefixCacheManager, device: str | torch.device = "cpu"
) -> list[StageCacheOutputs]:
    """Three steps: ``a`` prefills 8 tokens; ``b`` starts on a 4-token hit of a's first block
    and computes 2 more while ``a`` finishes; ``b`` decodes one token and that step is discarded.

    Expected counters: 3 steps saved, 2 materialized, 1 discarded, 1 hit request, 4 hit rows
    per cached key from the pool (8 in all), 11 rows written per key.
    """
    outs = []
    s1 = step(mgr, [started("a", [0, 1], 8)], [("a", [0, 1], 0, 8)], device)
    outs.append(mgr.materialize(s1, ["a"]))
    s2 = step(
        mgr, [finished("a"), started("b", [0, 5], 2, hit_end=4)], [("b", [0, 5], 4, 2)], device
    )
    outs.append(mgr.materialize(s2, ["b"]))
    s3 = step(mgr, [], [("b", [0, 5], 6, 1)], device)
    mgr.discard_step(s3)
    return outs


def cpu_manager(policy: ModelCachePolicy | None = None, **overrides: Any) -> OmniPrefixCacheManager:
    """A CPU manager with inline writes over `config`."""
    return OmniPrefixCacheManager(config(**overrides), policy=policy, device="cpu", threaded=False)
