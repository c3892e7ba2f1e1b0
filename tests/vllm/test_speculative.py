"""`VllmPrefixCache` with speculative decoding against vLLM's real sync `Scheduler` (SPEC-1..6).

Every run goes through `spec_harness.SpecEngine`: n-gram speculative config with K drafts,
a fake runner proposing right and wrong drafts (seeded), rows computed from the drafts, a greedy
rejection sampler, a small KV cache (preemptions), shared prefixes (hits, same-step hits),
aborts and stop tokens. The oracle: each admission receives the recomputed row of every
promised position exactly once, and never a row at a rejected position (SPEC-3): every row it
receives is right, and no step hands out anything at or past its first rejected position.

Materialize modes: ``late`` (builder thread, after the next step_begin), ``early`` (right after
the save, no sampled ids: accepted rows come by read-back, SPEC-4), ``sampled`` (right after
the save with sampled_token_ids, SPEC-2) and ``late-sampled`` (after the next step_begin with
sampled_token_ids, as the drop-in worker does). ``pytest -s`` prints each run's figures.

Known gap, pinned by `test_hit_over_unconfirmed_accepted_drafts` (strict xfail): drafts accepted
but unconfirmed when their request is preempted or ends are marked absent (SPEC-5), yet vLLM
hashes their block, and a later hit on it raises `HitUnreadableError`; a sweep run that reaches
it (the harness sees the hit coming) xfails, any other error fails.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM: bash .ci/setup-vllm")

from omni_cache_cuda import ConfigError, HitUnreadableError
from omni_cache_cuda.vllm import VllmPrefixCache
from tests.vllm.harness import make_kv_cache_config
from tests.vllm.spec_harness import (
    Mode,
    SpecCounts,
    SpecEngine,
    SpecWorkload,
    make_spec_vllm_config,
)

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
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    *,
    strict: bool = False,
    **engine: Any,
) -> SpecCounts:
    """Run the module's workload; a run that hits rows of drafts accepted but unconfirmed when
    their request was preempted or ended (the gap `test_hit_over_unconfirmed_accepted_drafts`
    pins) xfails unless ``strict``; any other error fails."""
    k = engine["k"]
    seed = 10 * k + list(Mode).index(engine["mode"])
    eng = SpecEngine(monkeypatch=monkeypatch, seed=seed, **engine)
    try:
        counts = eng.run(SpecWorkload(seed=seed + 100, **WORKLOAD))  # type: ignore[arg-type]
    except HitUnreadableError as exc:
        if eng.counts.hits_over_unconfirmed and not strict:
            RESULTS.append((request.node.name + " (xfail)", eng.counts))
            pytest.xfail(f"known gap (SPEC-5): {eng.unconfirmed_hits[0]}; raised {exc}")
        raise
    name = request.node.name
    RESULTS.append((name, counts))
    print(f"\n{name}: {counts.line()}")
    # What every run must hold: the oracle ran on real rows, to the end of every admission.
    assert counts.rows_checked > 0 and counts.finished == len(eng.admissions)
    glue = eng.cache.counts()
    assert glue["steps"] == counts.steps
    assert glue["preempted"] == counts.preemptions
    assert glue["resumed"] == counts.resumes
    assert eng.cache.live_requests() == {}
    assert eng.stats.steps_saved == eng.stats.steps_consumed > 0
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


@pytest.mark.xfail(
    strict=True,
    raises=HitUnreadableError,
    reason="SPEC-5 marks the rows of drafts accepted but unconfirmed at a preemption or end "
    "absent, yet vLLM hashes their block (the accepted drafts are tokens by then) and a later "
    "resume or start hits it: the hit raises HitUnreadableError",
)
@pytest.mark.parametrize(
    ("k", "mode"),
    [(1, Mode.LATE), (3, Mode.EARLY), (4, Mode.LATE)],
    ids=["k1-late", "k3-early", "k4-late"],
)
def test_hit_over_unconfirmed_accepted_drafts(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, k: int, mode: Mode
) -> None:
    # The module's workload with 40 KV blocks: a request is preempted (or ends) right after a
    # step whose accepted drafts complete a block, before any step_begin confirmed them; the
    # block stays in vLLM's prefix cache and a resume or another request's start hits it. The rows there are right (the
    # drafts were accepted), so the hit should be served, or at least not fail the engine.
    counts = run_spec(
        request,
        monkeypatch,
        strict=True,
        k=k,
        mode=mode,
        threaded=False,
        v2_runner=k % 2 == 1,
        num_blocks=40,
    )
    assert counts.hits_over_unconfirmed >= 1  # the scenario was reached, and served


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
