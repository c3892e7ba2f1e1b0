"""The glue's block lists kept as one array, and the decode layout read from it.

`TranslationState` keeps every running request's block list twice: as the list the general
layout reads and as a row of one int array, which a decode step's layout reads without a
per-request list lookup (`decode_layout_from_table`). Both must always name the same blocks, and
the two layouts must be the same slots (the write layout of SPEC section 3: one slot per row,
``block_ids[p // block_size] * block_size + p % block_size``).
"""

from __future__ import annotations

import pickle
import random
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from omni_cache_core import BadInputError, PrefixCacheStep, RequestEventError
from omni_cache_cuda import OmniPrefixCacheManager, PrefixCacheConfig, PrefixCacheWriteLayout
from omni_cache_cuda._layout import decode_layout_from_rows, decode_layout_from_table
from omni_cache_cuda.vllm import VllmPrefixCache
from omni_cache_cuda.vllm._scheduler_output import TranslationState
from tests.test_vllm_glue import new_req
from tests.test_vllm_glue import output as glue_output

BS = 4


def output(
    sched: dict[str, int],
    new: list[tuple[str, list[int], int]],
    cached: list[tuple[str, list[int] | None, int]],
    finished: set[str],
    preempted: set[str],
    resumed: set[str],
) -> SimpleNamespace:
    """`tests.test_vllm_glue.output` with every part given in order; ``new`` as
    ``(req_id, blocks, computed)``."""
    return glue_output(
        sched,
        new=[new_req(*n) for n in new],
        cached=cached,
        finished=finished,
        preempted=set(preempted),
        resumed=resumed,
    )


def assert_table_matches(state: TranslationState) -> None:
    assert state.table_ok
    assert state.table_rows.keys() == state.running.keys()
    assert len(set(state.table_rows.values())) == len(state.table_rows)  # a row each
    for req_id, blocks in state.running.items():
        row = state.table_rows[req_id]
        assert state.table_lens[row] == len(blocks), req_id
        assert state.table[row, : len(blocks)].tolist() == blocks, req_id
        assert (state.table[row, len(blocks) :] == -1).all(), req_id
    for row in set(range(len(state.table_lens))) - set(state.table_rows.values()):
        assert state.table_lens[row] == 0 and (state.table[row] == -1).all()


def layouts(
    state: TranslationState, order: list[str], sched: dict[str, int], starts: dict[str, int]
) -> tuple[PrefixCacheWriteLayout | None, PrefixCacheWriteLayout]:
    fast = decode_layout_from_table(order, sched, starts, state.table_rows, state.table, BS)
    return fast, PrefixCacheWriteLayout.from_block_tables(order, sched, starts, state.running, BS)


@pytest.mark.parametrize("seed", range(6))
def test_the_table_follows_the_lists_and_gives_the_same_decode_layout(seed: int) -> None:
    """Random admissions (some with more blocks than the table's first width), decode steps
    adding blocks, finishes, preemptions and resumes under both runners' conventions: after
    every step the table holds each running request's list, and every decode step's layout
    from it is the general layout, slot for slot (SPEC section 3)."""
    rng = random.Random(seed)
    state = TranslationState(kv_group=0, max_concurrent_batches=1)
    next_block = iter(range(10**6))
    live: dict[str, list[Any]] = {}  # request -> [computed, blocks]
    paused: dict[str, int] = {}  # preempted request -> computed
    counter = 0
    decode_checked = 0
    for _ in range(60):
        finished = set(rng.sample(sorted(live), k=min(len(live), rng.randrange(3))))
        left = sorted(set(live) - finished)
        preempted = set(rng.sample(left, k=min(len(left), rng.randrange(2))))
        sched: dict[str, int] = {}
        new: list[tuple[str, list[int], int]] = []
        cached: list[tuple[str, list[int] | None, int]] = []
        resumed: set[str] = set()
        joining = rng.random() < 0.3
        if joining:
            for _ in range(rng.randrange(1, 40)):
                counter += 1
                rid, tokens = f"r{counter}", rng.choice([3, 9, 700])  # 700: > 128 blocks
                blocks = [next(next_block) for _ in range(tokens // BS + 1)]
                new.append((rid, blocks, 0))
                sched[rid] = tokens
            for rid in rng.sample(sorted(paused), k=min(len(paused), 2)):
                blocks = [next(next_block) for _ in range(paused[rid] // BS + 2)]
                if rng.random() < 0.5:
                    new.append((rid, blocks, paused[rid]))  # the v2 runner's resume
                else:
                    cached.append((rid, blocks, paused[rid]))  # the v1 runner's
                    resumed.add(rid)
                sched[rid] = 1
        for rid, (computed, blocks) in live.items():
            if rid in finished or rid in preempted:
                continue
            added = None
            if computed // BS >= len(blocks):
                added = [next(next_block)]
            cached.append((rid, added, computed))
            sched[rid] = 1
        so = output(sched, new, cached, finished, preempted, resumed)
        step = state.translate(so)
        state.commit(step, sched)
        for rid in finished:
            live.pop(rid)
        for rid in preempted:
            paused[rid] = live.pop(rid)[0]
        for rid, blocks, computed in new + [c for c in cached if c[0] in resumed]:
            paused.pop(rid, None)
            live[rid] = [computed, list(blocks)]
        for rid, added, _ in cached:
            if rid not in resumed and added:
                live[rid][1].extend(added)
        assert_table_matches(state)
        order = list(sched)
        rng.shuffle(order)
        fast, general = layouts(state, order, sched, step.starts)
        if sched and all(v == 1 for v in sched.values()):
            assert fast is not None
            decode_checked += 1
            assert fast.req_ids == general.req_ids and fast.bounds == general.bounds
            assert torch.equal(fast.slots_cpu, general.slots_cpu)
            assert fast.slots_cpu.dtype == torch.int64
        else:
            assert fast is None  # not a decode step: the general layout is used
        for rid in sched:
            live[rid][0] += sched[rid]
    assert decode_checked >= 10


def test_a_decode_position_outside_its_blocks_falls_back_to_the_named_error() -> None:
    """No fast layout for a position past a request's blocks; the general one names it."""
    state = TranslationState(kv_group=0, max_concurrent_batches=1)
    so = output({"a": 4}, [("a", [5], 0)], [], set(), set(), set())
    state.commit(state.translate(so), {"a": 4})
    sched, starts = {"a": 1}, {"a": 4}  # position 4 is in block 1, which "a" lacks
    fast, _ = (
        decode_layout_from_table(["a"], sched, starts, state.table_rows, state.table, BS),
        None,
    )
    assert fast is None
    with pytest.raises(BadInputError):
        PrefixCacheWriteLayout.from_block_tables(["a"], sched, starts, state.running, BS)
    assert (
        decode_layout_from_table(["b"], {"b": 1}, {"b": 0}, state.table_rows, state.table, BS)
        is None
    )  # a request without a row
    assert (
        decode_layout_from_table(["a"], {"a": 1}, {"a": -1}, state.table_rows, state.table, BS)
        is None
    )  # a negative computed count


def test_block_ids_the_table_cannot_hold_leave_the_lists_in_charge() -> None:
    """A block id beyond int32 turns the table off; the lists still give the layout."""
    state = TranslationState(kv_group=0, max_concurrent_batches=1)
    big = 2**40
    so = output({"a": 2}, [("a", [big], 0)], [], set(), set(), set())
    state.commit(state.translate(so), {"a": 2})
    assert not state.table_ok
    assert state.running["a"] == [big]
    layout = PrefixCacheWriteLayout.from_block_tables(["a"], {"a": 1}, {"a": 2}, state.running, BS)
    assert layout.slots_cpu.tolist() == [big * BS + 2]
    assert np.int64(layout.slots_cpu[0]) == big * BS + 2


# ---------------------------------------------------------------------------------------------
# The decode step's fast path: the runner's order checked and laid out from arrays.


def fast_and_general(
    state: TranslationState, step: Any, order: Sequence[str]
) -> tuple[PrefixCacheWriteLayout | None, PrefixCacheWriteLayout]:
    """The fast path's layout (None if it refuses the order) and the general one."""
    general = PrefixCacheWriteLayout.from_block_tables(
        list(order), step.scheduled, step.starts, state.running, BS
    )
    found = state.decode_rows(order, step.decode)
    if found is None:
        return None, general
    return decode_layout_from_rows(order, *found, state.table, BS), general


@pytest.mark.parametrize("seed", range(4))
def test_the_decode_fast_path_lays_out_what_the_general_path_does(seed: int) -> None:
    """Random decode steps (some adding blocks, some with requests finishing, joining steps
    between them), each laid out in a shuffled order, in the previous order again and in the
    scheduler's own order: the fast path's layout is `from_block_tables`'s, slot for slot
    (SPEC section 3), and it takes every pure decode step."""
    rng = random.Random(seed)
    state = TranslationState(kv_group=0, max_concurrent_batches=1)
    next_block = iter(range(10**6))
    live: dict[str, list[Any]] = {}
    counter = 0
    fast_steps = 0
    previous: list[str] = []
    for s in range(50):
        finished = set(rng.sample(sorted(live), k=min(len(live), rng.randrange(3))))
        new: list[tuple[str, list[int], int]] = []
        sched: dict[str, int] = {}
        if s % 7 == 0:
            for _ in range(rng.randrange(2, 30)):
                counter += 1
                rid, tokens = f"r{counter}", rng.choice([1, 5, 40, 600])
                new.append((rid, [next(next_block) for _ in range(tokens // BS + 1)], 0))
                sched[rid] = tokens
        cached: list[tuple[str, list[int] | None, int]] = []
        running = [r for r in live if r not in finished]
        rng.shuffle(running)
        for rid in running:
            computed, blocks = live[rid]
            added = [next(next_block)] if computed // BS >= len(blocks) else None
            cached.append((rid, added, computed))
            sched[rid] = 1
        step = state.translate(output(sched, new, cached, finished, set(), set()))
        state.commit(step, sched)
        for rid in finished:
            live.pop(rid)
        for rid, blocks, computed in new:
            live[rid] = [computed, list(blocks)]
        for rid, added, _ in cached:
            if added:
                live[rid][1].extend(added)
        pure = not new and len(cached) >= 2
        assert (step.decode is not None) == pure
        if pure:
            fast_steps += 1
            shuffled = list(sched)
            rng.shuffle(shuffled)
            for order in (shuffled, list(shuffled), list(sched), previous):
                if order is previous and sorted(previous) != sorted(sched):
                    # Last step's order, not this step's requests: refused.
                    assert state.decode_rows(order, step.decode) is None
                    continue
                fast, general = fast_and_general(state, step, order)
                assert fast is not None
                assert fast.req_ids == general.req_ids == tuple(order)
                assert fast.bounds == general.bounds
                assert torch.equal(fast.slots_cpu, general.slots_cpu)
            previous = shuffled
        for rid in sched:
            live[rid][0] += sched[rid]
    assert fast_steps >= 20


def decode_cache() -> VllmPrefixCache:
    """A glue over a CPU manager with requests a, b, c and d running, one decode step open."""
    manager = OmniPrefixCacheManager(
        PrefixCacheConfig(num_blocks=64, block_size=BS), device="cpu", threaded=False
    )
    cache = VllmPrefixCache(manager, block_size=BS)
    ids = ["a", "b", "c", "d", "e"]
    cache.step_begin(
        output(
            {r: 3 for r in ids},
            [(r, [2 * i, 2 * i + 1], 0) for i, r in enumerate(ids)],
            [],
            set(),
            set(),
            set(),
        )
    )
    cache.discard_step(cache.save(torch.zeros(15, 2), None, req_ids=ids, num_tokens_unpadded=15))
    # e is running but not scheduled in the decode step.
    cache.step_begin(
        output(dict.fromkeys("abcd", 1), [], [(r, None, 3) for r in "abcd"], set(), set(), set())
    )
    assert cache._open_step is not None and cache._open_step.decode is not None
    return cache


@pytest.mark.parametrize(
    ("rule", "order"),
    [
        ("an id twice", ["a", "b", "c", "c"]),
        ("an id twice, one missing", ["a", "a", "b", "c"]),
        ("an id the cache never saw", ["a", "b", "c", "zz"]),
        ("a running id not scheduled in this step", ["a", "b", "c", "e"]),
        ("a scheduled id missing", ["a", "b", "c"]),
        ("one id too many", ["a", "b", "c", "d", "e"]),
    ],
)
def test_a_decode_save_refuses_an_order_that_is_not_its_requests_each_once(
    rule: str, order: list[str]
) -> None:
    """The fast path proves the runner's order is the step's requests, each once; any other
    order gets the save's own refusal (BadInputError on "save req_ids"), nothing saved, and
    the right order is saved after it with the general path's layout."""
    with decode_cache() as cache:
        with pytest.raises(BadInputError, match="save req_ids"):
            cache.save(torch.zeros(4, 2), None, req_ids=order, num_tokens_unpadded=4)
        right = ["d", "b", "a", "c"]
        assert cache._open_step is not None
        assert cache._decode_layout(cache._open_step, right) is not None  # the fast path's
        layout = cache.layout(right)
        general = PrefixCacheWriteLayout.from_block_tables(
            right,
            dict.fromkeys("abcd", 1),
            dict.fromkeys("abcd", 3),
            cache._translation.running,
            BS,
        )
        assert torch.equal(layout.slots_cpu, general.slots_cpu), rule
        cache.discard_step(
            cache.save(torch.zeros(4, 2), None, req_ids=right, num_tokens_unpadded=4)
        )


def test_the_schedulers_own_order_is_answered_from_a_copy_taken_at_translation() -> None:
    """A runner's order equal to the scheduler's list of the step gets the step's own rows and
    starts after one compare. The compare is with a copy taken when the step was translated: a
    list the engine reorders afterwards is checked row by row like any other order, and a
    tuple of the same ids too; all give the general path's slots."""
    state = TranslationState(kv_group=0, max_concurrent_batches=1)
    ids = ["a", "b", "c"]
    first = output(
        {r: 5 for r in ids},
        [(r, [3 * i, 3 * i + 1], 0) for i, r in enumerate(ids)],
        [],
        set(),
        set(),
        set(),
    )
    state.commit(state.translate(first), dict.fromkeys(ids, 5))
    so = output(dict.fromkeys(ids, 1), [], [(r, None, 5) for r in ids], set(), set(), set())
    scheduler_list = so.scheduled_cached_reqs.req_ids
    step = state.translate(so)
    state.commit(step, step.scheduled)
    assert step.decode is not None
    rows, starts, kept = step.decode
    assert kept == ids and kept is not scheduler_list
    found = state.decode_rows(list(ids), step.decode)
    assert found is not None and found[0] is rows and found[1] is starts
    scheduler_list.reverse()  # the engine reuses its list: the copy still says a, b, c
    assert step.decode[2] == ids
    for order in (scheduler_list, tuple(ids)):
        found = state.decode_rows(order, step.decode)
        assert found is not None and found[0] is not rows
        fast, general = fast_and_general(state, step, order)
        assert fast is not None and torch.equal(fast.slots_cpu, general.slots_cpu)
        assert fast.slots_cpu.tolist() == [state.running[r][5 // BS] * BS + 5 % BS for r in order]


def test_a_kept_runner_order_is_proved_once_while_no_row_changes() -> None:
    """A runner order that comes back unchanged, over decode steps whose scheduler order and
    rows do not change, is proved to be the step's requests once; later steps reuse the proof
    and put their own starts in that order. A step where a request ends and another joins
    changes the rows, and the order is proved again. Every layout is the general path's."""
    state = TranslationState(kv_group=0, max_concurrent_batches=1)
    ids = ["a", "b", "c", "d"]
    blocks = {r: [10 * i, 10 * i + 1, 10 * i + 2] for i, r in enumerate(ids)}
    first = output(dict.fromkeys(ids, 5), [(r, blocks[r], 0) for r in ids], [], set(), set(), set())
    state.commit(state.translate(first), dict.fromkeys(ids, 5))
    runner = ["c", "a", "d", "b"]
    computed = dict.fromkeys(ids, 5)
    proofs = []

    def decode_step(live: list[str], order: list[str]) -> None:
        so = output(
            dict.fromkeys(live, 1), [], [(r, None, computed[r]) for r in live], set(), set(), set()
        )
        step = state.translate(so)
        state.commit(step, step.scheduled)
        assert step.decode is not None
        fast, general = fast_and_general(state, step, order)
        proofs.append(state._order_proof)
        assert fast is not None and torch.equal(fast.slots_cpu, general.slots_cpu)
        for r in live:
            computed[r] += 1

    for _ in range(3):
        decode_step(ids, runner)
    assert proofs[0] is not None and proofs[1] is proofs[0] and proofs[2] is proofs[0]
    # d ends and e joins in d's place of the runner's order: rows change, the proof is new.
    join = output({"e": 3}, [("e", [90, 91], 0)], [], {"d"}, set(), set())
    state.commit(state.translate(join), {"e": 3})
    computed["e"] = 3
    live = ["a", "b", "c", "e"]
    decode_step(live, ["c", "a", "e", "b"])
    decode_step(live, ["c", "a", "e", "b"])
    assert proofs[3] is not proofs[0] and proofs[4] is proofs[3]


def test_only_the_glues_own_save_keeps_a_decode_layouts_slot_array(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The save keeps the slot array of a layout only the glue's own save sees, without its
    private copy; a layout a caller can reach (`VllmPrefixCache.layout`, any layout built
    without ``private``, a copy of one) has none, so its save copies it as every caller's
    buffer is copied. The rows saved through the kept array are the rows handed out."""
    built: list[PrefixCacheWriteLayout | None] = []

    def spy(*args: Any, **kwargs: Any) -> PrefixCacheWriteLayout | None:
        layout = decode_layout_from_rows(*args, **kwargs)
        built.append(layout)
        return layout

    monkeypatch.setattr("omni_cache_cuda.vllm._glue.decode_layout_from_rows", spy)
    with decode_cache() as cache:
        order = ["d", "b", "a", "c"]
        inspected = cache.layout(order)
        assert built[-1] is inspected and inspected._private_slots is None
        copy = pickle.loads(pickle.dumps(inspected))
        assert copy._private_slots is None
        core = cache.manager._state.core
        begins: list[Any] = []
        save_begin = core.save_begin
        monkeypatch.setattr(core, "save_begin", lambda b: (begins.append(b), save_begin(b))[1])
        step_id = cache.save(
            torch.arange(8.0).reshape(4, 2), None, req_ids=order, num_tokens_unpadded=4
        )
        own = built[-1]
        assert own is not None and own is not inspected and own._private_slots is not None
        assert np.shares_memory(own._private_slots, own.slots_cpu.numpy())
        assert begins[-1].slots is own._private_slots  # kept, not copied
        assert own.slots_cpu.tolist() == inspected.slots_cpu.tolist()
        out = cache.materialize(step_id, order)
        assert [out.hidden_states[r].tolist() for r in order] == [
            [[0.0, 1.0]],
            [[2.0, 3.0]],
            [[4.0, 5.0]],
            [[6.0, 7.0]],
        ]


@pytest.mark.parametrize("count", [1, 1.0, np.int64(1)])
def test_a_decode_steps_record_skips_the_count_check_only_for_int_ones(
    monkeypatch: pytest.MonkeyPatch, count: Any
) -> None:
    """A decode step whose counts are int ones gets its record without the validator's passes
    (its translation proved them), as a private copy with the same counts; counts that equal
    1 without being ints go through the validator, which refuses them by name, and nothing
    changes."""
    built: list[PrefixCacheStep] = []
    unchecked = PrefixCacheStep._of_checked_counts.__func__  # type: ignore[attr-defined]

    def spy(cls: type[PrefixCacheStep], counts: Any) -> PrefixCacheStep:
        built.append(unchecked(cls, counts))
        return built[-1]

    monkeypatch.setattr(PrefixCacheStep, "_of_checked_counts", classmethod(spy))
    with decode_cache() as cache:
        cache.discard_step(
            cache.save(torch.zeros(4, 2), None, req_ids=list("abcd"), num_tokens_unpadded=4)
        )
        built.clear()
        so = output(
            dict.fromkeys("abcd", 1), [], [(r, None, 4) for r in "abcd"], set(), set(), set()
        )
        so.num_scheduled_tokens = dict.fromkeys("abcd", count)
        if type(count) is not int:
            running = {r: list(b) for r, b in cache._translation.running.items()}
            with pytest.raises(RequestEventError, match="scheduled_tokens"):
                cache.step_begin(so)
            assert not built and cache._open_step is None
            assert cache._translation.running == running
            return
        cache.step_begin(so)
        assert len(built) == 1
        step = built[0]
        assert step.scheduled_tokens == dict.fromkeys("abcd", 1) and not step.events
        assert step.scheduled_tokens is not so.num_scheduled_tokens
        so.num_scheduled_tokens["a"] = 7  # the engine's dict changes; the record does not
        assert step.scheduled_tokens["a"] == 1
        cache.discard_step(
            cache.save(torch.zeros(4, 2), None, req_ids=list("abcd"), num_tokens_unpadded=4)
        )


def test_a_stray_cached_id_in_a_decode_step_is_named_and_the_open_step_kept() -> None:
    """A cached id the cache does not track as running (never seen, or finishing in the same
    step) is refused by name as before, with nothing changed; the decode step still open
    saves with its own starts, and a cached list with a repeat takes the general path."""
    with decode_cache() as cache:
        translation = cache._translation
        running = {r: list(b) for r, b in translation.running.items()}
        for cached, finished in (
            ([("a", None, 4), ("zz", None, 0)], set()),
            ([("a", None, 4), ("b", None, 4)], {"b"}),
        ):
            stray = cached[1][0]
            with pytest.raises(BadInputError, match=f"scheduled_cached_reqs \\['{stray}'\\]"):
                cache.step_begin(output({"a": 1, stray: 1}, [], cached, finished, set(), set()))
            assert translation.running == running
        order = ["c", "a", "d", "b"]
        assert cache._open_step is not None
        assert cache._decode_layout(cache._open_step, order) is not None
        layout = cache.layout(order)
        assert layout.slots_cpu.tolist() == [running[r][3 // BS] * BS + 3 % BS for r in order]
        cache.discard_step(
            cache.save(torch.zeros(4, 2), None, req_ids=order, num_tokens_unpadded=4)
        )
        # A repeat in the scheduler's cached list: accepted as before, no fast layout.
        cache.step_begin(
            output(
                dict.fromkeys("ab", 1),
                [],
                [("a", None, 4), ("b", None, 4), ("a", None, 4)],
                set(),
                set(),
                set(),
            )
        )
        assert cache._open_step is not None and cache._open_step.decode is None
        assert cache.layout(["b", "a"]).slots_cpu.tolist() == [running[r][1] * BS for r in "ba"]


@pytest.mark.parametrize("bad", [(), [], 7])
def test_a_decode_steps_bad_added_block_ids_are_named(bad: Any) -> None:
    """Added block ids that are not one list per KV cache group (an empty tuple next to real
    additions, an int) are refused naming the request, whichever path picks the
    requests that add blocks; the same step with good ids is a decode step."""
    state = TranslationState(kv_group=0, max_concurrent_batches=1)
    so = output({"a": 4, "b": 4}, [("a", [0], 0), ("b", [1], 0)], [], set(), set(), set())
    state.commit(state.translate(so), {"a": 4, "b": 4})
    so = output({"a": 1, "b": 1}, [], [("a", [3], 4), ("b", [2], 4)], set(), set(), set())
    so.scheduled_cached_reqs.new_block_ids[1] = bad
    with pytest.raises(BadInputError, match="block ids of request 'b'"):
        state.translate(so)
    so.scheduled_cached_reqs.new_block_ids[1] = ([2],)
    step = state.translate(so)
    assert step.extending == [("a", [3]), ("b", [2])] and step.decode is not None
