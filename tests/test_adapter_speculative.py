"""Speculative decoding through `OmniPrefixCacheManager`, inline and threaded (SPEC-1..SPEC-5).

One request ``a`` with blocks 0 and 1 (block size from the test config): a prefill of positions
0..2, then a decode step with position 3 and two drafts (positions 4 and 5). Every row holds its
position, except that a rejected draft's row holds ``-position`` (the model's output for a
wrong token), so a rejected row that reaches the caller reads as a negative value.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from omni_cache_cuda import (
    BadInputError,
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
    PrefixCacheStep,
    PrefixCacheWriteLayout,
)
from tests.adapter_helpers import BLOCK

WIDTH = 3


def _rows(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)[:, None].repeat(1, WIDTH)


def _begin(m: Any, *, computed: dict[str, int] | None = None, **events: Any) -> None:
    records = []
    for kind, req in events.items():
        records.append(PrefixCacheRequestEvent(req_id=req, kind=PrefixCacheEventKind[kind]))
    m.new_step_starts(PrefixCacheStep(events=tuple(records), computed_tokens=computed or {}))


def _save(m: Any, first: int, values: list[float], drafts: int = 0) -> Any:
    n = len(values)
    layout = PrefixCacheWriteLayout.from_block_tables(
        ["a"], {"a": n}, {"a": first}, {"a": [0, 1, 2]}, BLOCK
    )
    return m.save_outputs(
        _rows(values),
        None,
        num_tokens_unpadded=n,
        write_layout=layout,
        draft_tokens={"a": drafts} if drafts else None,
    )


def _delivered(out: Any) -> tuple[tuple[int, int], list[float]]:
    return out.positions["a"], out.hidden_states["a"][:, 0].tolist()


def _decoding(m: Any) -> Any:
    """Prefill 0..2, then save position 3 with drafts 4 (accepted later) and 5 (rejected)."""
    m.new_step_starts(
        PrefixCacheStep(
            events=(PrefixCacheRequestEvent(req_id="a", kind=PrefixCacheEventKind.STARTED),)
        )
    )
    assert _delivered(m.materialize(_save(m, 0, [0, 1, 2]), ["a"])) == ((0, 3), [0, 1, 2])
    _begin(m)
    return _save(m, 3, [3, 4, -5], drafts=2)


def test_spec_1_and_spec_4_rows_before_acceptance_then_read_back(make: Any) -> None:
    """Materialized before the count comes, the step hands out position 3 only (SPEC-1); the
    next step hands out the accepted draft's row 4, read back from the pool, then its own
    row 5 (SPEC-4). The rejected row -5 never reaches the caller (SPEC-3)."""
    m = make()
    step = _decoding(m)
    assert _delivered(m.materialize(step, ["a"])) == ((3, 4), [3])
    _begin(m, computed={"a": 5})
    nxt = _save(m, 5, [5])
    assert _delivered(m.materialize(nxt, ["a"])) == ((4, 6), [4, 5])


@pytest.mark.parametrize("where", ["start", "materialize"])
def test_spec_2_a_confirmed_step_hands_out_its_accepted_rows(make: Any, where: str) -> None:
    """Confirmed at the next start, or by the materialize's own report, the step hands out
    positions 3 and 4 from its page, and the next step only its own rows (SPEC-2)."""
    m = make()
    step = _decoding(m)
    if where == "start":
        _begin(m, computed={"a": 5})
        out = m.materialize(step, ["a"])
    else:
        out = m.materialize(step, ["a"], computed_tokens={"a": 5})
        _begin(m, computed={"a": 5})
    assert _delivered(out) == ((3, 5), [3, 4])
    nxt = _save(m, 5, [5, 6], drafts=1)
    assert _delivered(m.materialize(nxt, ["a"])) == ((5, 6), [5])


def test_spec_3_a_rejected_row_never_reaches_the_pool(make: Any) -> None:
    """Once position 5 is recomputed, a hit on its block reads the recomputed row, never the
    rejected one, in either mode (SPEC-3)."""
    m = make()
    step = _decoding(m)
    _begin(m, computed={"a": 5})
    m.materialize(step, ["a"])
    m.materialize(_save(m, 5, [5, 6, 7]), ["a"])
    m.new_step_starts(
        PrefixCacheStep(
            events=(
                PrefixCacheRequestEvent(req_id="a", kind=PrefixCacheEventKind.FINISHED),
                PrefixCacheRequestEvent(
                    req_id="b",
                    kind=PrefixCacheEventKind.STARTED,
                    hit_end=2 * BLOCK,
                    block_ids=(0, 1, 2),
                ),
            )
        )
    )
    layout = PrefixCacheWriteLayout.from_block_tables(
        ["b"], {"b": 1}, {"b": 2 * BLOCK}, {"b": [0, 1, 2]}, BLOCK
    )
    out = m.save_outputs(_rows([8.0]), None, num_tokens_unpadded=1, write_layout=layout)
    rows = m.materialize(out, ["b"]).hidden_states["b"][:, 0].tolist()
    assert rows == [0, 1, 2, 3, 4, 5, 6, 7, 8]


def test_spec_5_a_finish_hands_out_what_its_materialize_reports(make: Any) -> None:
    """The request finishes before a start confirms its last step: a materialize reporting the
    count hands out the accepted rows; a bad count raises, naming the range (SPEC-5)."""
    m = make()
    step = _decoding(m)
    _begin(m, FINISHED="a")
    with pytest.raises(BadInputError, match=r"\[4, 6\]"):
        m.materialize(step, ["a"], computed_tokens={"a": 9})
    m2 = make()
    step2 = _decoding(m2)
    _begin(m2, FINISHED="a")
    assert _delivered(m2.materialize(step2, ["a"], computed_tokens={"a": 5})) == ((3, 5), [3, 4])


def test_spec_2_bad_draft_counts_raise_at_save(make: Any) -> None:
    """Draft counts for a request outside the layout, or as many as its rows, raise and the
    cache stays usable (SPEC-1)."""
    m = make()
    m.new_step_starts(
        PrefixCacheStep(
            events=(PrefixCacheRequestEvent(req_id="a", kind=PrefixCacheEventKind.STARTED),)
        )
    )
    layout = PrefixCacheWriteLayout.from_block_tables(
        ["a"], {"a": 2}, {"a": 0}, {"a": [0, 1]}, BLOCK
    )
    for drafts in ({"zz": 1}, {"a": 2}):
        with pytest.raises(BadInputError, match="draft"):
            m.save_outputs(
                _rows([0, 1]), None, num_tokens_unpadded=2, write_layout=layout, draft_tokens=drafts
            )
    assert _delivered(m.materialize(_save(m, 0, [0, 1]), ["a"])) == ((0, 2), [0, 1])
