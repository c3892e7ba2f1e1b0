"""`VllmPrefixCache` against vLLM's real scheduler, sync and async, both model runners.

Every workload runs through `harness.Engine` (vLLM's `Scheduler`, or its `AsyncScheduler` with a
batch queue of depth 2, and a fake runner whose rows are pure functions of the token prefix,
materialized one step late on a builder thread), checks the oracle (each admission of a request
receives the recomputed row of every computed position exactly once, and every row it receives
is right), and asserts that the run exercised what the test is about. The last test checks the
module's totals: at least 50 preemptions and 20 resumes with a hit.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM: bash .ci/setup-vllm")

from omni_cache_cuda.vllm import RequestIdReuseError
from tests.vllm.harness import Counts, Engine, Workload, check_run

#: (async scheduling, v2 model runner), the tests' indirect `mode` parameter.
MODES = [
    pytest.param((False, True), id="sync-v2"),
    pytest.param((False, False), id="sync-v1"),
    pytest.param((True, True), id="async-v2"),
    pytest.param((True, False), id="async-v1"),
]
SYNC_V2, SYNC_V1, ASYNC_V2, ASYNC_V1 = MODES

#: Counts of every run in this module, checked by the last test.
TOTAL = Counts()
RUNS: list[str] = []

#: The `run` fixture: ``run(workload, **engine) -> Counts``.
Run = Callable[..., Counts]


@pytest.fixture
def mode(request: pytest.FixtureRequest) -> tuple[bool, bool]:
    """(async scheduling, v2 model runner), from the test's indirect parameter."""
    mode: tuple[bool, bool] = request.param
    return mode


@pytest.fixture
def run(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, mode: tuple[bool, bool]
) -> Run:
    """Run a workload through an engine in the test's mode and check what every run must hold;
    extra keywords go to `harness.Engine`."""
    async_scheduling, v2_runner = mode

    def run_workload(workload: Workload, **engine: Any) -> Counts:
        eng = Engine(
            async_scheduling=async_scheduling,
            v2_runner=v2_runner,
            monkeypatch=monkeypatch,
            **engine,
        )
        counts = eng.run(workload)
        TOTAL.add(counts)
        RUNS.append(request.node.name)
        check_run(eng, counts)
        if not async_scheduling:
            assert counts.rows_past_stop == 0  # a synchronous engine never computes past a stop
        return counts

    return run_workload


@pytest.mark.parametrize("mode", MODES, indirect=True)
def test_shared_prefixes_and_same_step_hits(run: Run) -> None:
    # Three shared 48-token prompts, eight requests arriving at once: requests of the first
    # step hit blocks their neighbours compute in that very step.
    counts = run(
        Workload(num_requests=24, arrivals_per_step=8, seed=1),
        num_blocks=96,
    )
    assert counts.same_step_hits >= 1
    assert counts.hit_rows_this_step >= 16  # served by the producer in that same step
    assert counts.started_with_hit >= 12
    assert counts.preemptions == 0


@pytest.mark.parametrize("mode", [SYNC_V1, ASYNC_V2], indirect=True)
def test_chunked_prefill(run: Run) -> None:
    # Prompts of 110 to 200 tokens through a 48-token step budget.
    counts = run(
        Workload(num_requests=12, prefix_len=80, suffix_len=(30, 120), arrivals_per_step=3, seed=2),
        num_blocks=128,
        max_num_batched_tokens=48,
    )
    assert counts.chunked_steps >= 10
    assert counts.started_with_hit >= 4


@pytest.mark.parametrize(
    ("threaded", "deferred"),
    [(False, False), (True, True)],
    ids=["inline", "threaded-deferred"],
)
@pytest.mark.parametrize("mode", MODES, indirect=True)
def test_kv_pressure_preemptions_and_resumes(run: Run, threaded: bool, deferred: bool) -> None:
    # Few KV blocks for long outputs: many preemptions; resumed requests hit what survived of
    # their blocks. Threaded with a deferred mm key: the preemption escalates its writes.
    counts = run(
        Workload(
            num_requests=28,
            num_prefixes=4,
            prefix_len=40,
            suffix_len=(1, 20),
            max_tokens=(30, 70),
            arrivals_per_step=6,
            seed=3,
        ),
        threaded=threaded,
        deferred=deferred,
        num_blocks=36,
        max_num_seqs=12,
        seed=4,
    )
    assert counts.preemptions >= 15
    assert counts.resumes_with_hit >= 10
    assert counts.resume_hit_shrunk >= 5
    assert counts.resume_hit_beyond_prompt >= 1
    assert counts.recycled_blocks >= 100


@pytest.mark.parametrize("mode", [SYNC_V2, ASYNC_V1], indirect=True)
def test_resume_hits_zero_shrinking_growing_beyond_the_prompt(run: Run) -> None:
    # Five prompts of 20 tokens shared by 40 requests of 10 to 80 output tokens, 30 blocks of
    # 8 tokens: neighbours with the same prompt generate the same tokens, so a resumed request
    # may hit far beyond its prompt; its own blocks may also all be gone (a zero hit). Some
    # requests stop early on a stop token.
    counts = run(
        Workload(
            num_requests=40,
            num_prefixes=5,
            prefix_len=20,
            suffix_len=(0, 0),
            max_tokens=(10, 80),
            arrivals_per_step=8,
            stop_fraction=0.3,
            seed=7,
        ),
        block_size=8,
        num_blocks=30,
        seed=5,
    )
    assert counts.preemptions >= 30
    assert counts.resumes_with_hit >= 20
    assert counts.resume_hit_zero >= 3
    assert counts.resume_hit_shrunk >= 10
    assert counts.resume_hit_grown >= 10
    assert counts.resume_hit_beyond_prompt >= 10
    assert counts.same_step_hits >= 1


@pytest.mark.parametrize("mode", [SYNC_V1, ASYNC_V2], indirect=True)
def test_aborts_under_pressure(run: Run) -> None:
    # Unique prompts, a request aborted every fourth step or so: running, waiting and
    # preempted requests are aborted, with steps of theirs in flight under async scheduling.
    counts = run(
        Workload(
            num_requests=40,
            num_prefixes=40,
            prefix_len=8,
            suffix_len=(1, 30),
            max_tokens=(20, 60),
            arrivals_per_step=8,
            abort_prob=0.25,
            stop_fraction=0.5,
            seed=6,
        ),
        num_blocks=16,
        seed=5,
    )
    assert counts.aborts >= 20
    assert counts.aborted_running >= 5
    assert counts.preemptions >= 5
    assert counts.finished_while_preempted >= 1


@pytest.mark.parametrize("mode", [SYNC_V2, ASYNC_V1], indirect=True)
def test_request_ids_come_back(run: Run) -> None:
    # Finished ids return as new requests (a new admission each), once no step naming the old
    # request is still in flight; the oracle is per admission.
    counts = run(
        Workload(
            num_requests=40,
            arrivals_per_step=3,
            max_tokens=(2, 12),
            reuse_prob=0.9,
            abort_prob=0.1,
            seed=8,
        ),
        num_blocks=64,
        seed=6,
    )
    assert counts.id_reuses >= 15
    assert counts.started_with_hit >= 10


@pytest.mark.parametrize("mode", [ASYNC_V2, ASYNC_V1], indirect=True)
def test_rows_past_a_stop_token_are_delivered(run: Run) -> None:
    # Every request may stop on STOP_TOKEN. Under async scheduling the step scheduled while
    # the stop is sampled computes the stop token's own position; its row is delivered (and
    # is what a recompute of the final tokens gives there), exactly once.
    counts = run(
        Workload(num_requests=30, max_tokens=(60, 120), stop_fraction=1.0, seed=9),
        num_blocks=160,
    )
    assert counts.stopped >= 10
    assert counts.rows_past_stop >= counts.stopped // 2


@pytest.mark.parametrize("mode", [ASYNC_V2, ASYNC_V1], indirect=True)
def test_id_reuse_with_a_step_in_flight_raises(
    monkeypatch: pytest.MonkeyPatch, mode: tuple[bool, bool]
) -> None:
    async_scheduling, v2_runner = mode
    eng = Engine(async_scheduling=async_scheduling, v2_runner=v2_runner, monkeypatch=monkeypatch)
    prompt = list(range(1, 40))
    eng.add_request("x", prompt, 50)
    eng.add_request("y", prompt[::-1], 50)
    batch_queue: collections.deque[Any] = collections.deque()
    for _ in range(4):  # the engine core's loop, batch queue of depth 2
        so = eng.scheduler.schedule()
        batch_queue.appendleft((so, eng.execute(so)))
        if len(batch_queue) == 2:
            eng.update(*batch_queue.pop())
    assert "x" in batch_queue[0][0].num_scheduled_tokens  # a step naming x is in flight
    # The client aborts x and sends a new request under the same id at once.
    eng.abort("x")
    new_x = eng.add_request("x", prompt[:20], 5).request
    so = eng.scheduler.schedule()
    assert "x" in so.finished_req_ids and "x" in so.num_scheduled_tokens
    before = eng.cache.counts()
    with pytest.raises(RequestIdReuseError, match="in flight") as err:
        eng.execute(so)
    assert err.value.req_id == "x"
    assert eng.cache.counts() == before  # nothing changed
    # Not a false alarm: the in-flight step's output now lands on the new request.
    assert len(new_x.all_token_ids) == 20
    eng.update(*batch_queue.pop())
    assert len(new_x.all_token_ids) == 21, "vLLM no longer mixes the two up: revisit the docs"
    eng.close()


# (the module's last test)
def test_the_suite_exercised_enough() -> None:
    if len(RUNS) < 20:
        pytest.skip("counts the whole module's runs; run the module as a whole")
    assert TOTAL.preemptions >= 50
    assert TOTAL.resumes_with_hit >= 20
    assert TOTAL.same_step_hits >= 5
    assert TOTAL.recycled_blocks >= 1000
    assert TOTAL.chunked_steps >= 20
    print(f"\nvLLM suite totals over {len(RUNS)} runs: {TOTAL}")
