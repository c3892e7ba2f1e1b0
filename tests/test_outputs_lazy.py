"""`RequestRows`: a cached key's per-request rows as views of one tensor, made when read (OUT-5).

`materialize` hands each cached key's rows out as one tensor plus each request's row range; the
per-request views exist once a caller reads them. Whatever is read, it must be what a plain dict
of ``base[start:end]`` per request, in the materialize's request order, would give.
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch

from omni_cache_core import PrefixCacheEventKind, PrefixCacheRequestEvent
from omni_cache_cuda import (
    OmniPrefixCacheManager,
    PrefixCacheConfig,
    PrefixCacheStep,
    PrefixCacheWrite,
    PrefixCacheWriteLayout,
)
from omni_cache_cuda._outputs import _SINGLE_LOOKUPS, RequestRows, request_rows

BASE = torch.arange(12.0).reshape(6, 2)
ROWS = {"a": (0, 1), "b": (1, 3), "c": (3, 3), "d": (3, 6)}
ALL = ("a", "b", "c", "d")


def plain(wanted: tuple[str, ...] = ALL) -> dict[str, torch.Tensor]:
    return {r: BASE[ROWS[r][0] : ROWS[r][1]] for r in wanted}


def assert_same(actual: Any, expected: dict[str, torch.Tensor]) -> None:
    assert list(actual) == list(expected)
    for req, rows in expected.items():
        assert torch.equal(actual[req], rows), req


@pytest.mark.parametrize(
    "use",
    [
        dict,
        lambda d: {**d},
        copy.copy,
        copy.deepcopy,
        lambda d: pickle.loads(pickle.dumps(d)),
        lambda d: dict(d.items()),
        lambda d: d.copy(),
        lambda d: dict(zip(d.keys(), d.values(), strict=True)),
    ],
    ids=["dict", "unpack", "copy", "deepcopy", "pickle", "items", "dict.copy", "keys-values"],
)
def test_every_view_of_a_bulk_use_is_the_plain_dicts(use: Callable[[Any], Any]) -> None:
    """Copies, pickles and iteration give a plain dict equal to the per-request slices (OUT-5)."""
    got = use(request_rows(BASE, ROWS, ALL))
    assert type(got) is dict
    assert_same(got, plain())


def test_single_lookups_slice_one_request_and_answer_like_a_dict() -> None:
    """Lookups, membership and length before any view exists follow the wanted ids (OUT-5)."""
    rows = request_rows(BASE, ROWS, ("d", "a"))
    assert isinstance(rows, dict)
    assert len(rows) == 2 and bool(rows)
    assert "a" in rows and "b" not in rows
    with pytest.raises(TypeError):
        [] in rows  # noqa: B015  (unhashable, as in a dict)
    assert torch.equal(rows["d"], BASE[3:6])
    assert rows["d"].data_ptr() == BASE[3:].data_ptr()  # a view, not a copy
    with pytest.raises(KeyError):
        rows["b"]  # in the step, not asked for
    assert rows.get("b") is None and rows.get("zz", 7) == 7
    assert type(rows) is RequestRows  # still lazy: no bulk use yet
    assert_same(rows, plain(("d", "a")))
    assert type(rows) is not RequestRows  # a bulk use made every view


def test_repeated_ids_count_once_like_a_dict() -> None:
    """Ids asked for twice give one entry, at the first place, as a dict would (OUT-5)."""
    rows = request_rows(BASE, ROWS, ("b", "a", "b", "a"))
    assert len(rows) == 2 and "c" not in rows
    assert_same(rows, plain(("b", "a")))


def test_many_lookups_make_every_view_at_once() -> None:
    """Past a few single lookups every view is made by one split, rows unchanged (OUT-5)."""
    n = 4 * _SINGLE_LOOKUPS
    base = torch.arange(float(n)).reshape(n, 1)
    ids = tuple(f"r{i}" for i in range(n))
    rows = request_rows(base, {r: (i, i + 1) for i, r in enumerate(ids)}, ids)
    for i, req in enumerate(ids):
        assert rows[req].shape == (1, 1) and float(rows[req]) == i
    assert type(rows) is not RequestRows
    assert list(rows) == list(ids)


def test_entries_set_before_the_views_exist_are_kept_in_order() -> None:
    """A hit request's merged rows set before any view keep their place and value (OUT-5)."""
    rows = request_rows(BASE, ROWS, ALL)
    merged = torch.full((4, 2), -1.0)
    rows["b"] = merged
    rows["d"] = rows["d"][1:]  # a preempted request's rows cut at the front (DLV-2)
    expected = plain()
    expected["b"], expected["d"] = merged, BASE[4:6]
    assert_same(rows, expected)
    rows["new"] = BASE[:1]  # an id outside the wanted ones goes after them, like a dict
    assert list(rows)[-1] == "new"


def test_a_decode_materialize_reads_like_plain_dicts() -> None:
    """Through the manager: every request's hidden and mm rows are its own rows (OUT-5)."""
    cfg = PrefixCacheConfig(num_blocks=64, block_size=4, staging_capacity_tokens=64)
    ids = [f"q{i}" for i in range(20)]
    hidden = torch.arange(20 * 3, dtype=torch.float32).reshape(20, 3)
    mm = hidden[:, :1] * 10
    with OmniPrefixCacheManager(cfg, device="cpu", threaded=False) as manager:
        events = [
            PrefixCacheRequestEvent(
                req_id=r, kind=PrefixCacheEventKind.STARTED, block_ids=[i], scheduled_tokens=1
            )
            for i, r in enumerate(ids)
        ]
        manager.new_step_starts(
            PrefixCacheStep(events=events, scheduled_tokens=dict.fromkeys(ids, 1))
        )
        layout = PrefixCacheWriteLayout(
            [PrefixCacheWrite(r, i, i + 1) for i, r in enumerate(ids)],
            torch.arange(20, dtype=torch.int64) * 4,
        )
        sid = manager.save_outputs(hidden, {"mm": mm}, num_tokens_unpadded=20, write_layout=layout)
        wanted = ids[::-1][:15]
        out = manager.materialize(sid, wanted)
    assert out.hidden_states is not None
    assert list(out.hidden_states) == wanted and list(out.mm_outputs["mm"]) == wanted
    for req in wanted:
        i = ids.index(req)
        assert torch.equal(out.hidden_states[req], hidden[i : i + 1])
        assert torch.equal(out.mm_outputs["mm"][req], mm[i : i + 1])
    assert pickle.loads(pickle.dumps(out)).hidden_states.keys() == out.hidden_states.keys()
