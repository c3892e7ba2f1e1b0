"""`PrefixCacheWriteLayout.from_block_tables` against the slot formula, decode steps included."""

from __future__ import annotations

import copy
import pickle

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from omni_cache_cuda import BadInputError, PrefixCacheWrite, PrefixCacheWriteLayout

BS = 4


@st.composite
def steps(
    draw: st.DrawFn,
) -> tuple[list[str], dict[str, int], dict[str, int], dict[str, list[int]]]:
    n = draw(st.integers(0, 12))
    one_token = draw(st.booleans())  # the decode path: every request schedules one token
    order, sched, computed, blocks = [], {}, {}, {}
    for i in range(n):
        rid = f"r{i}"
        count = 1 if one_token else draw(st.integers(0, 40))
        start = draw(st.integers(0, 30))
        need = (start + count - 1) // BS + 1 if count else 0
        order.append(rid)
        sched[rid] = count
        computed[rid] = start
        blocks[rid] = draw(st.lists(st.integers(0, 500), min_size=need, max_size=need + 2))
    draw(st.randoms()).shuffle(order)
    return order, sched, computed, blocks


@given(steps())
def test_slots_follow_the_formula(step: tuple) -> None:
    order, sched, computed, blocks = step
    layout = PrefixCacheWriteLayout.from_block_tables(order, sched, computed, blocks, BS)
    want, row, writes = [], 0, []
    for rid in order:
        c, n = computed[rid], sched[rid]
        want.extend(blocks[rid][p // BS] * BS + p % BS for p in range(c, c + n))
        writes.append(PrefixCacheWrite(rid, row, row + n))
        row += n
    assert layout.slots_cpu.tolist() == want
    assert layout.slots_cpu.dtype == torch.int64
    assert layout.writes == tuple(writes)
    assert layout.req_ids == tuple(order)
    assert layout.bounds == (0, *(w.row_end for w in writes))
    assert layout.num_rows == row
    again = pickle.loads(pickle.dumps(layout))
    assert again.writes == layout.writes and torch.equal(again.slots_cpu, layout.slots_cpu)
    assert copy.copy(layout).req_ids == layout.req_ids
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        layout.req_ids = ()  # type: ignore[misc]


@pytest.mark.parametrize(
    ("computed", "blocks", "sched", "match"),
    [
        ({"a": 0, "b": 8}, {"a": [1], "b": [2]}, {"a": 1, "b": 1}, "position 8 of request 'b'"),
        ({"a": 0, "b": -1}, {"a": [1], "b": [2]}, {"a": 1, "b": 1}, "counts of request 'b'"),
        ({"a": 0}, {"a": [1], "b": [2]}, {"a": 1, "b": 1}, "no 'b' in num_computed"),
        ({"a": 0, "b": 0}, {"a": [1]}, {"a": 1, "b": 1}, "no 'b' in block_ids"),
        ({"a": 0, "b": 0}, {"a": [1], "b": [2]}, {"a": 1}, "no 'b' in num_scheduled"),
        ({"a": 0, "b": 0}, {"a": [1], "b": [2]}, {"a": 1, "b": -2}, "counts of request 'b'"),
    ],
)
def test_bad_tables_name_the_request(computed: dict, blocks: dict, sched: dict, match: str) -> None:
    with pytest.raises(BadInputError, match=match):
        PrefixCacheWriteLayout.from_block_tables(["a", "b"], sched, computed, blocks, BS)


def test_requests_without_tokens_need_no_tables() -> None:
    layout = PrefixCacheWriteLayout.from_block_tables(
        ["a", "idle"], {"a": 2, "idle": 0}, {"a": 1}, {"a": [3]}, BS
    )
    assert layout.slots_cpu.tolist() == [13, 14] and layout.bounds == (0, 2, 2)
