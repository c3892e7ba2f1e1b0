"""`VllmPrefixCache` with speculative decoding against vLLM's real sync `Scheduler` (SPEC-1..6).

Every run goes through `spec_harness.SpecEngine` (a `harness.Engine`): n-gram speculative config with K drafts,
a fake runner proposing right and wrong drafts (seeded), rows computed from the drafts, a greedy
rejection sampler, a small KV cache (preemptions), shared prefixes (hits, same-step hits),
aborts and stop tokens. The oracle: each admission receives the recomputed row of every
promised position exactly once, and never a row at a rejected position (SPEC-3): every row it
receives is right, and no step hands out anything at or past its first rejected position.

Materialize modes: ``late`` (builder thread, after the next step_begin), ``early`` (right after
the save, no sampled ids: accepted rows come by read-back, SPEC-4), ``sampled`` (right after
the save with sampled_token_ids, SPEC-2) and ``late-sampled`` (after the next step_begin with
sampled_token_ids, as the drop-in worker does). ``pytest -s`` prints each run's figures.

Drafts accepted but unconfirmed when their request is preempted or ends keep their rows as
written (SPEC-5); vLLM hashes their block, and a later hit on it is served: every row such a hit
covers reaches the admission once and is checked (`test_hit_over_unconfirmed_accepted_drafts`).
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM: bash .ci/setup-vllm")

from omni_cache_cuda import ConfigError
from omni_cache_cuda.vllm import VllmPrefixCache
from tests.vllm.harness import Workload, check_run, make_kv_cache_config
from tests.vllm.spec_harness import Mode, SpecCounts, SpecEngine, make_spec_vllm_config

#: Each run's figures, for the module's last test.
RESULTS: list[tuple[str, SpecCounts]] = []

WORKLOAD = dict(
    num_requests=36,
    num_prefixes=4,
    prefix_len=40,
    suffix_len=(1, 20),
    max_tokens=(25, 60),
    stop_fraction=0.6,
    arrivals_per_step=6,
    abort_prob=0.1,
)


def run_spec(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, **engine: Any
) -> SpecCounts:
    """Run the module's workload through a `SpecEngine` and check what every run must hold
    (`harness.check_run`, as test_scheduler.py's runs)."""
    k = engine["k"]
    seed = 10 * k + list(Mode).index(engine["mode"])
    eng = SpecEngine(monkeypatch=monkeypatch, seed=seed, **engine)
    eng.run(Workload(seed=seed + 100, **WORKLOAD))  # type: ignore[arg-type]
    counts = eng.counts
    name = request.node.name
    RESULTS.append((name, counts))
    print(f"\n{name}: {counts.line()}")
    check_run(eng, counts)
    return counts


@pytest.mark.parametrize("mode", list(Mode), ids=[m.value for m in Mode])
@pytest.mark.parametrize("threaded", [False, True], ids=["inline", "threaded"])
@pytest.mark.parametrize("k", [1, 2, 3, 4], ids=lambda k: f"k{k}")
def test_drafts_accepted_rejected_preempted(
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    k: int,
    threaded: bool,
    mode: Mode,
) -> None:
    # Both model runners' conventions (a resumed request's place in the output), alternating.
    counts = run_spec(request, monkeypatch, k=k, mode=mode, threaded=threaded, v2_runner=k % 2 == 1)
    # The run exercised what it is about.
    assert counts.rejected >= 20 and counts.accepted >= 20
    assert counts.all_accepted >= 10 and counts.none_accepted >= 10
    if k >= 2:
        assert counts.some_accepted >= 5
    assert counts.preemptions >= 5
    assert counts.resumes_after_rejection >= 1  # SPEC-5: preempted mid-verification
    assert counts.started_with_hit >= 5 and counts.same_step_hits >= 1
    assert counts.aborts >= 1
    if mode in (Mode.SAMPLED, Mode.LATE_SAMPLED):
        # SPEC-2: the sampled ids confirm every step's drafts at its own materialize.
        assert counts.rows_read_back == 0 and counts.rows_not_promised == 0
    if mode is Mode.EARLY:
        assert counts.rows_read_back >= 10  # SPEC-4: the next step hands the accepted rows out


def test_stop_token_inside_accepted_drafts(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every request may stop; K = 4 drafts, most of them right: the stop token is often an
    # accepted draft with more accepted tokens after it, which vLLM drops.
    counts = run_spec(request, monkeypatch, k=4, mode=Mode.SAMPLED, threaded=False, v2_runner=True)
    assert counts.stop_inside_drafts >= 1


@pytest.mark.parametrize(
    ("k", "mode"),
    [(1, Mode.LATE), (3, Mode.EARLY), (4, Mode.LATE)],
    ids=["k1-late", "k3-early", "k4-late"],
)
def test_hit_over_unconfirmed_accepted_drafts(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, k: int, mode: Mode
) -> None:
    # SPEC-5: the module's workload with 40 KV blocks: a request is preempted (or ends) right
    # after a step whose accepted drafts complete a block, before any step_begin confirmed
    # them; the block stays in vLLM's prefix cache and a resume or another request's start
    # hits it. The cache left those rows as written and they are right (the drafts were
    # accepted): the hit is served, and the oracle checks each of its rows, delivered once.
    counts = run_spec(
        request,
        monkeypatch,
        k=k,
        mode=mode,
        threaded=False,
        v2_runner=k % 2 == 1,
        num_blocks=40,
    )
    assert counts.hits_over_unconfirmed >= 1  # the scenario was reached ...
    assert counts.hit_rows_over_unconfirmed >= 1  # ... and its rows served and checked


def test_config_accepts_sync_and_refuses_async(monkeypatch: pytest.MonkeyPatch) -> None:
    # SPEC-6: a speculative config with one step in flight is served ...
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    config = make_spec_vllm_config(3)
    kv = make_kv_cache_config(64, 16)
    VllmPrefixCache.from_vllm_config(config, kv, device="cpu").shutdown()
    # ... and refused under async scheduling, naming the field.
    config = make_spec_vllm_config(3, async_scheduling=True)
    assert config.max_concurrent_batches == 2
    with pytest.raises(ConfigError, match="speculative_config") as err:
        VllmPrefixCache.from_vllm_config(config, kv, device="cpu")
    assert "async_scheduling" in str(err.value)


# (the module's last test)
def test_the_module_figures() -> None:
    if len(RESULTS) < 33:
        pytest.skip("sums the whole module's runs; run the module as a whole")
    total = SpecCounts()
    for _name, counts in RESULTS:
        total.add(counts)
    print(f"\nspeculative decoding totals over {len(RESULTS)} runs: {total.line()}")
    assert total.resumes_after_rejection >= 24
