"""Drive vLLM's real scheduler with speculative decoding and a fake runner that proposes drafts.

Only imported by the tests in this folder, after ``pytest.importorskip("vllm")``.

The set-up is `harness`'s (a tiny offline model config, one full-attention KV group, the real
v1 `Scheduler`), plus an n-gram `SpeculativeConfig` with ``K`` draft tokens, built offline
from the target model and parallel configs (``shared/notes/vllm-speculative.md``), under
synchronous scheduling: the cache refuses speculative decoding with async scheduling (SPEC-6).

The engine loop is vLLM's sync engine core: ``schedule`` -> execute -> ``update_from_output``
-> ``update_draft_token_ids`` with the runner's drafts. The fake runner:

- proposes, for every request it sampled for, up to ``K`` drafts, each (seeded RNG) either the
  token the model will sample at that position (the oracle's next token) or a wrong one, so
  steps accept all, none or some of their drafts;
- computes every row from the token prefix up to it, drafts included: a row at a draft position
  is the model's output for the *draft* token, so a wrong draft gives a wrong row (SPEC-3 says
  it must never be delivered) and an accepted one gives the oracle row;
- samples like vLLM's rejection sampler with a greedy target: the drafts equal to the true
  tokens, as a prefix, plus the next true token; that list is its
  ``ModelRunnerOutput.sampled_token_ids`` entry.

Materialize modes (`Mode`):

- ``LATE``: a builder thread materializes each step after the next step's ``step_begin``
  (whose ``num_computed_tokens`` confirms the drafts, SPEC-2): it hands out exactly the
  accepted rows of every confirmed draft.
- ``EARLY``: right after the save, without sampled ids: the step hands out its confirmed rows,
  the request's next step reads the accepted ones back (SPEC-4).
- ``SAMPLED``: right after the save, with the step's sampled token ids: the step hands out
  exactly its accepted rows itself.
- ``LATE_SAMPLED``: a builder thread after the next step_begin, with the sampled ids (what the
  drop-in worker does): exactly the accepted rows, even of a request that ended meanwhile.

In LATE and EARLY the accepted drafts of a step whose request is finished, aborted or
preempted before its next step are never confirmed (SPEC-5) and so never delivered, unless
recomputed after a resume; the oracle treats those positions as not promised and checks that
each delivered row is right and delivered once.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import queue
import random
import threading
from collections.abc import Sequence
from typing import Any

import torch
from vllm.config import ParallelConfig, SpeculativeConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from omni_cache_cuda import ModelCachePolicy
from omni_cache_cuda.sim import extend_hash
from omni_cache_cuda.vllm import VllmPrefixCache
from tests.vllm.harness import (
    HIDDEN,
    MM_KEY,
    MM_WIDTH,
    STOP_TOKEN,
    VOCAB,
    Truth,
    make_kv_cache_config,
    make_vllm_config,
    rows_of,
)


class Mode(enum.Enum):
    LATE = "late"  # builder thread, after the next step_begin, no sampled ids
    EARLY = "early"  # right after the save, no sampled ids
    SAMPLED = "sampled"  # right after the save, with sampled_token_ids
    LATE_SAMPLED = "late-sampled"  # builder thread, after the next step_begin, with sampled ids


def make_spec_vllm_config(k: int, *, async_scheduling: bool = False, **kwargs: Any) -> VllmConfig:
    """`harness.make_vllm_config` plus an n-gram speculative config of ``k`` drafts."""
    base = make_vllm_config(async_scheduling=async_scheduling, **kwargs)
    parallel = ParallelConfig()
    speculative = SpeculativeConfig(
        method="ngram",
        num_speculative_tokens=k,
        target_model_config=base.model_config,
        target_parallel_config=parallel,
    )
    return VllmConfig(
        model_config=base.model_config,
        cache_config=base.cache_config,
        scheduler_config=base.scheduler_config,
        device_config=base.device_config,
        parallel_config=parallel,
        speculative_config=speculative,
    )


@dataclasses.dataclass
class SpecCounts:
    steps: int = 0
    verifications: int = 0  # request-steps that carried drafts
    drafts: int = 0  # draft tokens scheduled
    placeholder_drafts: int = 0  # [-1] drafts the scheduler padded a request with
    accepted: int = 0
    rejected: int = 0
    all_accepted: int = 0  # verifications accepting every draft
    none_accepted: int = 0
    some_accepted: int = 0  # 0 < accepted < drafts
    preemptions: int = 0
    preempted_unconfirmed: int = 0  # preempted with its last step's drafts unconfirmed
    resumes: int = 0
    resumes_with_hit: int = 0
    resumes_after_rejection: int = 0  # the step before the preemption rejected drafts
    started_with_hit: int = 0
    same_step_hits: int = 0
    aborts: int = 0
    aborted_running: int = 0
    stopped: int = 0
    stop_inside_drafts: int = 0  # the stop token was an accepted draft with tokens after it
    cut_by_max_tokens: int = 0  # accepted tokens past max_tokens that vLLM dropped
    rows_checked: int = 0
    rows_read_back: int = 0  # accepted rows handed out by the request's next step (SPEC-4)
    rows_past_end: int = 0  # accepted rows at positions >= final length - 1 (delivered)
    hits_over_unconfirmed: int = 0  # a hit on rows of drafts accepted but unconfirmed at an end
    rows_not_promised: int = 0  # below final length - 1, accepted, never confirmed (SPEC-5)
    finished: int = 0

    def add(self, other: SpecCounts) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def line(self) -> str:
        return (
            f"drafts={self.drafts} accepted={self.accepted} rejected={self.rejected} "
            f"all/none/some={self.all_accepted}/{self.none_accepted}/{self.some_accepted} "
            f"preemptions={self.preemptions} resumes_after_rejection="
            f"{self.resumes_after_rejection} stop_inside_drafts={self.stop_inside_drafts} "
            f"aborts={self.aborts} same_step_hits={self.same_step_hits} "
            f"read_back={self.rows_read_back} past_end={self.rows_past_end} "
            f"not_promised={self.rows_not_promised} "
            f"hits_over_unconfirmed={self.hits_over_unconfirmed} rows_checked={self.rows_checked}"
        )


@dataclasses.dataclass
class StepOfRequest:
    """What one step computed for one request."""

    start: int  # num_computed_tokens: the step's first position
    confirmed_end: int  # first draft position (rows below it are confirmed)
    accepted_end: int  # first rejected position (== end when every draft was accepted)
    end: int  # start + scheduled tokens
    joining: bool  # the request started or resumed in this step
    slots: list[int]  # the KV slot of each position in [start, end)


class SpecAdmission:
    """One admission of a request id: its truth, the positions owed to it, and deliveries."""

    def __init__(self, req_id: str, number: int, prompt: Sequence[int]) -> None:
        self.req_id = req_id
        self.number = number
        self.truth = Truth(prompt)
        self.request: Request | None = None
        self.started = False
        self.computed_end = 0  # accepted positions [0, computed_end) (hits included)
        self.accepted: set[int] = set()  # positions computed from the true tokens, or hit
        self.promised: set[int] = set()  # positions the cache must deliver
        self.delivered = collections.Counter[int]()
        self.pending: StepOfRequest | None = None  # last drafted step awaiting confirmation
        self.last_rejected = False  # the last step rejected drafts
        self.lock = threading.Lock()  # deliveries come from the builder thread

    def __repr__(self) -> str:
        return f"SpecAdmission({self.req_id!r}#{self.number})"


@dataclasses.dataclass
class SpecWorkload:
    num_requests: int = 40
    num_prefixes: int = 4
    prefix_len: int = 40
    suffix_len: tuple[int, int] = (1, 20)
    max_tokens: tuple[int, int] = (20, 60)
    stop_fraction: float = 0.5
    arrivals_per_step: int = 6
    abort_prob: float = 0.05
    seed: int = 0


class SpecEngine:
    """The real sync `Scheduler` with speculative decoding, a fake drafting runner, the cache."""

    def __init__(
        self,
        *,
        k: int,
        mode: Mode,
        v2_runner: bool,
        threaded: bool,
        monkeypatch: Any,
        block_size: int = 16,
        num_blocks: int = 34,
        max_num_seqs: int = 12,
        max_num_batched_tokens: int = 256,
        seed: int = 0,
    ) -> None:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1" if v2_runner else "0")
        self.vllm_config = make_spec_vllm_config(
            k,
            block_size=block_size,
            num_blocks=num_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
        )
        assert self.vllm_config.max_concurrent_batches == 1
        kv_cache_config = make_kv_cache_config(num_blocks, block_size)
        self.scheduler = Scheduler(
            vllm_config=self.vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=block_size,
        )
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(block_size, sha256)
        self.k = k
        self.mode = mode
        self.v2_runner = v2_runner
        self.block_size = block_size
        self.cache = VllmPrefixCache.from_vllm_config(
            self.vllm_config,
            kv_cache_config,
            policy=ModelCachePolicy(),
            device="cpu",
            threaded=threaded,
        )
        self.rng = random.Random(seed)
        self.counts = SpecCounts()
        self.admissions: list[SpecAdmission] = []
        self.current: dict[str, SpecAdmission] = {}
        self.runner_tokens: dict[str, list[int]] = {}  # the runner's confirmed tokens
        self.preempted: set[str] = set()
        self.step_index = 0
        # step id -> per request what it computed (read by the checks on the builder thread).
        self.steps: dict[int, dict[str, StepOfRequest]] = {}
        # Slots holding rows of drafts the sampler accepted but the cache had not confirmed when
        # their request was preempted or ended (SPEC-5 marks them absent), until rewritten.
        self.unconfirmed_slots: set[int] = set()
        self.unconfirmed_hits: list[str] = []  # what each such hit was, for the report
        self._pending: tuple[Any, ...] | None = None
        self._builds: queue.Queue[tuple[Any, ...] | None] = queue.Queue()
        self._errors: list[BaseException] = []
        # A daemon: a failed run must not keep the test process alive.
        self._builder = threading.Thread(
            target=self._build_loop, name="output-builder", daemon=True
        )
        self._builder.start()

    # --- requests ---

    def add_request(
        self, req_id: str, prompt: Sequence[int], max_tokens: int, stop: bool
    ) -> SpecAdmission:
        number = sum(1 for a in self.admissions if a.req_id == req_id)
        adm = SpecAdmission(req_id, number, prompt)
        params = SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, stop_token_ids=[STOP_TOKEN] if stop else None
        )
        adm.request = Request(
            request_id=req_id,
            prompt_token_ids=list(prompt),
            sampling_params=params,
            pooling_params=None,
            block_hasher=self.hasher,
        )
        self.admissions.append(adm)
        self.current[req_id] = adm
        self.scheduler.add_request(adm.request)
        return adm

    def abort(self, req_id: str) -> None:
        request = self.current[req_id].request
        assert request is not None
        self.counts.aborted_running += request.status == RequestStatus.RUNNING
        self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)
        self.counts.aborts += 1

    # --- the runner ---

    def _confirm(self, adm: SpecAdmission) -> None:
        """The cache learned the acceptance of the admission's pending drafted step."""
        p = adm.pending
        if p is not None:
            with adm.lock:
                adm.promised.update(range(p.confirmed_end, p.accepted_end))
            adm.pending = None

    def _end_unconfirmed(self, adm: SpecAdmission) -> None:
        """The admission is preempted or ends before a step_begin confirmed its last drafts."""
        p = adm.pending
        if p is None:
            return
        self.counts.preempted_unconfirmed += adm.req_id in self.preempted
        self.unconfirmed_slots.update(p.slots[p.confirmed_end - p.start : p.accepted_end - p.start])
        if self.mode is Mode.LATE_SAMPLED:
            self._confirm(adm)  # its materialize will report the sampled ids (SPEC-2)
        adm.pending = None

    def execute(self, so: Any) -> tuple[ModelRunnerOutput, dict[str, list[int]]]:
        """Step begin, forward, save, (materialize); returns the output and the sampled ids."""
        self.step_index += 1
        self.counts.steps += 1
        for rid in so.preempted_req_ids or ():
            self.counts.preemptions += 1
            self.preempted.add(rid)
            # No step_begin will confirm its last drafts (SPEC-5).
            self._end_unconfirmed(self.current[rid])
        for rid in so.finished_req_ids:
            if rid in self.current:
                self._end_unconfirmed(self.current[rid])
        self.cache.step_begin(so)
        for rid in so.finished_req_ids:
            self.runner_tokens.pop(rid, None)
            self.preempted.discard(rid)
        joining: list[tuple[str, int, list[int]]] = []
        for new in so.scheduled_new_reqs:
            tokens = new.prefill_token_ids if self.v2_runner else new.prompt_token_ids
            self.runner_tokens[new.req_id] = list(tokens)
            joining.append((new.req_id, new.num_computed_tokens, list(new.block_ids[0])))
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            if rid in cached.resumed_req_ids:
                if rid in cached.all_token_ids:
                    self.runner_tokens[rid] = list(cached.all_token_ids[rid])
                joining.append(
                    (rid, cached.num_computed_tokens[i], list(cached.new_block_ids[i][0]))
                )
            else:
                # SPEC-2: this step's count confirms the request's last drafts.
                self._confirm(self.current[rid])
        joined = set()
        for rid, hit, _blocks in joining:
            adm = self.current[rid]
            joined.add(rid)
            if rid in self.preempted:
                self.preempted.discard(rid)
                self.counts.resumes += 1
                self.counts.resumes_with_hit += hit > 0
                self.counts.resumes_after_rejection += adm.last_rejected
            else:
                assert not adm.started, adm
                adm.started = True
                self.counts.started_with_hit += hit > 0
            with adm.lock:
                adm.promised.update(range(hit))
                adm.accepted.update(range(hit))
            adm.computed_end = max(adm.computed_end, hit)
        computed = {n.req_id: n.num_computed_tokens for n in so.scheduled_new_reqs}
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        spec = so.scheduled_spec_decode_tokens or {}

        order = list(so.num_scheduled_tokens)
        self.rng.shuffle(order)
        layout = self.cache.layout(order) if order else None
        hidden_parts, mm_parts = [], []
        sampled: dict[str, list[int]] = {}
        this_step: dict[str, StepOfRequest] = {}
        written: dict[int, int] = {}
        row = 0
        for rid in order:
            n = so.num_scheduled_tokens[rid]
            c = computed[rid]
            drafts = list(spec.get(rid, ()))
            kd = len(drafts)
            adm = self.current[rid]
            tokens = self.runner_tokens[rid]
            d = c + n - kd  # first draft position
            assert n > 0 and kd < n, (rid, c, n, drafts)
            assert len(tokens) >= d and (kd == 0 or len(tokens) == d), (rid, c, n, kd, tokens)
            adm.truth.extend_to(c + n + 1)
            assert tokens[:d] == adm.truth.tokens[:d], rid
            # The rows: true tokens below d, then the drafts (right or wrong).
            hashes = list(adm.truth.hashes[c:d])
            h = adm.truth.hashes[d - 1]
            for t in drafts:
                h = extend_hash(h, t)
                hashes.append(h)
            rh, rm = rows_of(hashes)
            hidden_parts.append(rh)
            mm_parts.append(rm)
            slots = layout.slots_cpu[row : row + n].tolist()
            for p, s in zip(range(c, c + n), slots, strict=True):
                written[s] = hashes[p - c]
            row += n
            # The sampler: the drafts equal to the true tokens (a prefix), then one true token.
            a = 0
            while a < kd and drafts[a] == adm.truth.tokens[d + a]:
                a += 1
            if kd:
                c_ = self.counts
                c_.verifications += 1
                c_.drafts += kd
                c_.placeholder_drafts += sum(t == -1 for t in drafts)
                c_.accepted += a
                c_.rejected += kd - a
                c_.all_accepted += a == kd
                c_.none_accepted += a == 0
                c_.some_accepted += 0 < a < kd
            adm.last_rejected = a < kd
            step = StepOfRequest(c, d, d + a, c + n, rid in joined, slots)
            this_step[rid] = step
            with adm.lock:
                adm.promised.update(range(c, d))
                adm.accepted.update(range(c, d + a))
            adm.computed_end = max(adm.computed_end, d + a)
            if d >= len(tokens):  # the last chunk of what is known: sample
                out = adm.truth.tokens[d : d + a + 1]
                tokens.extend(out)
                sampled[rid] = out
            else:
                assert kd == 0
                sampled[rid] = []
            adm.pending = step if kd else None
        # Same-step hits: a joining request's hit blocks written by this very step.
        written_blocks = {s // self.block_size for s in written}
        bs = self.block_size
        # Rewritten slots hold this step's rows (a same-step hit reads those).
        self.unconfirmed_slots -= written.keys()
        for rid, hit, blocks in joining:
            if set(blocks[: hit // bs]) & written_blocks:
                self.counts.same_step_hits += 1
            # vLLM hashes a block once its tokens are known, accepted drafts included: a hit
            # may cover rows the cache marked absent (SPEC-5).
            hit_slots = {b * bs + i for b in blocks[: hit // bs] for i in range(bs)}
            if over := hit_slots & self.unconfirmed_slots:
                self.counts.hits_over_unconfirmed += 1
                self.unconfirmed_hits.append(
                    f"step {self.step_index}: {self.current[rid]} joined with a hit of {hit} "
                    f"covering {len(over)} slot(s) of accepted drafts unconfirmed when their "
                    "request was preempted or ended"
                )

        if order:
            hidden = torch.cat(hidden_parts)
            mm = {MM_KEY: torch.cat(mm_parts)}
            pad = self.rng.choice((0, 0, 3))
            if pad:
                hidden = torch.cat([hidden, torch.full((pad, HIDDEN), float("nan"))])
                mm = {MM_KEY: torch.cat([mm[MM_KEY], torch.full((pad, MM_WIDTH), float("nan"))])}
            step_id = self.cache.save(
                hidden, mm, req_ids=order, num_tokens_unpadded=row, num_tokens_padded=row + pad
            )
            self.steps[step_id] = this_step
            admissions = {rid: self.current[rid] for rid in order}
            if self.mode in (Mode.LATE, Mode.LATE_SAMPLED):
                ids = sampled if self.mode is Mode.LATE_SAMPLED else None
                self._hand_to_builder((step_id, tuple(order), admissions, ids))
            else:
                ids = sampled if self.mode is Mode.SAMPLED else None
                if ids is not None:
                    # SPEC-2: the materialize's sampled ids confirm the drafts.
                    for rid in order:
                        self._confirm(admissions[rid])
                self._check(step_id, tuple(order), admissions, ids)
        ids = list(sampled)
        out = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[sampled[r] for r in ids],
        )
        return out, sampled

    def propose(self, sampled: dict[str, list[int]]) -> DraftTokenIds:
        """The drafter: up to K drafts per request sampled for, right or wrong (seeded)."""
        req_ids, drafts = [], []
        for rid, out in sampled.items():
            if not out:
                continue
            adm = self.current[rid]
            n = len(self.runner_tokens[rid])
            adm.truth.extend_to(n + self.k)
            true = adm.truth.tokens[n : n + self.k]
            r = self.rng.random()
            if r < 0.3:
                right = [True] * self.k  # all accepted
            elif r < 0.5:
                right = [False] + [self.rng.random() < 0.5 for _ in range(self.k - 1)]
            else:
                right = [self.rng.random() < 0.7 for _ in range(self.k)]
            ids = [
                t if ok else 1 + (t + self.rng.randrange(VOCAB - 2)) % (VOCAB - 1)
                for t, ok in zip(true, right, strict=True)
            ]
            for t, ok, x in zip(true, right, ids, strict=True):
                assert (x == t) == ok
            if self.rng.random() < 0.1:
                ids = ids[: self.rng.randrange(self.k + 1)]  # the n-gram matched less
            req_ids.append(rid)
            drafts.append(ids)
        return DraftTokenIds(req_ids, drafts)

    # --- the output checks ---

    def _hand_to_builder(self, item: tuple[Any, ...]) -> None:
        if self._pending is not None:
            self._builds.put(self._pending)
        self._pending = item
        self.raise_builder_errors()

    def _build_loop(self) -> None:
        while True:
            item = self._builds.get()
            if item is None:
                return
            try:
                self._check(*item)
            except BaseException as exc:
                self._errors.append(exc)

    def _check(
        self,
        step_id: int,
        order: tuple[str, ...],
        admissions: dict[str, SpecAdmission],
        sampled: dict[str, list[int]] | None,
    ) -> None:
        out = self.cache.materialize(step_id, order, sampled_token_ids=sampled)
        hidden, mm = out
        assert hidden is not None
        step = self.steps.pop(step_id)
        for rid in order:
            adm = admissions[rid]
            mine = step[rid]
            start, end = out.positions[rid]
            got_h, got_m = hidden[rid], mm[MM_KEY][rid]
            assert got_h.shape[0] == end - start == got_m.shape[0], (adm, start, end)
            # SPEC-3: nothing at or past this step's first rejected position.
            assert end <= mine.accepted_end, (
                f"{adm}: step {step_id} delivered [{start}, {end}) past its accepted end "
                f"{mine.accepted_end} (drafts from {mine.confirmed_end})"
            )
            if end > start:
                want_h, want_m = adm.truth.rows(start, end)
                bad = [
                    start + i
                    for i in range(end - start)
                    if not torch.equal(got_h[i], want_h[i]) or not torch.equal(got_m[i], want_m[i])
                ]
                assert not bad, f"{adm}: wrong rows at positions {bad[:10]} (step {step_id})"
            with adm.lock:
                for p in range(start, end):
                    adm.delivered[p] += 1
                    assert p in adm.accepted, f"{adm}: position {p} delivered, never accepted"
            if not mine.joining and start < mine.start:
                self.counts.rows_read_back += min(end, mine.start) - start
            self.counts.rows_checked += end - start

    def raise_builder_errors(self) -> None:
        if self._errors:
            raise self._errors[0]

    def close(self) -> None:
        if self._pending is not None:
            self._builds.put(self._pending)
            self._pending = None
        self._builds.put(None)
        self._builder.join(timeout=60)
        assert not self._builder.is_alive()
        self.raise_builder_errors()
        self.stats = self.cache.stats()
        self.cache.shutdown()
        assert self.stats.steps_saved == self.stats.steps_consumed
        assert self.stats.timeouts == 0 and self.stats.writes_failed == 0

    # --- the engine loop ---

    def update(self, so: Any, out: ModelRunnerOutput, sampled: dict[str, list[int]]) -> None:
        self.scheduler.update_from_output(so, out)
        for rid, ids in sampled.items():
            adm = self.current[rid]
            request = adm.request
            assert request is not None
            if ids and request.is_finished():
                kept = len(request.all_token_ids) - (len(self.runner_tokens[rid]) - len(ids))
                if kept < len(ids):  # vLLM dropped accepted tokens after the end
                    if request.status == RequestStatus.FINISHED_STOPPED:
                        self.counts.stop_inside_drafts += 1
                    else:
                        self.counts.cut_by_max_tokens += 1
        # The engine core hands the runner's drafts to the scheduler (sync scheduling).
        self.scheduler.update_draft_token_ids(self.propose(sampled))

    def run(self, workload: SpecWorkload, *, max_steps: int = 5000) -> SpecCounts:
        rng = random.Random(workload.seed)
        prefixes = [
            [rng.randrange(1, VOCAB) for _ in range(workload.prefix_len)]
            for _ in range(workload.num_prefixes)
        ]
        todo = collections.deque(range(workload.num_requests))
        try:
            self._loop(workload, rng, prefixes, todo, max_steps)
        except BaseException:
            self._builds.put(None)
            self.cache.shutdown()
            raise
        self.close()
        self.check_exactly_once()
        return self.counts

    def _loop(
        self,
        workload: SpecWorkload,
        rng: random.Random,
        prefixes: list[list[int]],
        todo: collections.deque[int],
        max_steps: int,
    ) -> None:
        steps = 0
        while todo or self.scheduler.has_requests():
            steps += 1
            assert steps < max_steps, "the workload did not finish"
            for _ in range(workload.arrivals_per_step):
                if todo:
                    i = todo.popleft()
                    prompt = prefixes[i % len(prefixes)] + [
                        rng.randrange(1, VOCAB) for _ in range(rng.randint(*workload.suffix_len))
                    ]
                    self.add_request(
                        f"req-{i}",
                        prompt,
                        rng.randint(*workload.max_tokens),
                        stop=rng.random() < workload.stop_fraction,
                    )
            if workload.abort_prob and rng.random() < workload.abort_prob:
                live = [r for r, a in self.current.items() if not a.request.is_finished()]
                if live:
                    self.abort(rng.choice(live))
            if self.scheduler.has_requests():
                so = self.scheduler.schedule()
                out, sampled = self.execute(so)
                self.update(so, out, sampled)

    def check_exactly_once(self) -> None:
        """Every admission got each promised position exactly once (positions at or past its
        final length - 1, accepted drafts vLLM dropped after the end, at most once), and only
        positions computed from the true tokens."""
        for adm in self.admissions:
            request = adm.request
            assert request is not None and request.is_finished(), adm
            self.counts.finished += 1
            self.counts.stopped += request.status == RequestStatus.FINISHED_STOPPED
            final = len(request.all_token_ids)
            adm.truth.extend_to(final)
            got = list(request.all_token_ids)
            assert got == adm.truth.tokens[:final], f"{adm}: the scheduler's tokens differ"
            if not adm.started:
                assert request.status == RequestStatus.FINISHED_ABORTED and not adm.delivered
                continue
            owed = {p for p in adm.promised if p < final - 1}
            delivered = set(adm.delivered)
            missing = sorted(owed - delivered)
            twice = sorted(p for p, n in adm.delivered.items() if n != 1)
            unaccepted = sorted(delivered - adm.accepted)
            assert not missing and not twice and not unaccepted, (
                f"{adm} ({request.status.name}, final length {final}, mode {self.mode.value}): "
                f"missing {missing[:10]}, delivered more than once {twice[:10]}, "
                f"delivered but never accepted {unaccepted[:10]}"
            )
            self.counts.rows_past_end += sum(1 for p in delivered if p >= final - 1)
            self.counts.rows_not_promised += sum(
                1 for p in adm.accepted - delivered if p < final - 1
            )
