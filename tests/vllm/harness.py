"""Drive vLLM's real scheduler with a fake model runner that saves through `VllmPrefixCache`.

Only imported by the tests in this folder, after ``pytest.importorskip("vllm")``.

Set-up (vLLM 0.33, offline, CPU only, no weights): a temporary folder with a tiny
``config.json`` for `ModelConfig(model=..., skip_tokenizer_init=True)`, `DeviceConfig("cpu")`,
a hand-made `KVCacheConfig` with one full-attention group, `init_none_hash(sha256)` and
`get_request_block_hasher(block_size, sha256)` for the requests' block hashes, then the v1
`Scheduler` or `AsyncScheduler`. The model runner convention follows `VLLM_USE_V2_MODEL_RUNNER`
(read by `VllmConfig.use_v2_model_runner` when the scheduler is built).

The fake runner: every position's output row is a pure function of the token prefix up to it
(a rolling hash of the token ids expanded into a small float vector), and so is every sampled
token. So a request's whole token list, and every row a full recompute would give, follow from
its prompt alone: that is the oracle. Each step the runner lists the scheduled requests in a
random row order, feeds its own sampled tokens forward (as vLLM's runner does under async
scheduling), saves, and hands the step to an output-builder thread one step late, which
materializes it and checks every row it receives against the recompute, and that each position
of each admission is delivered exactly once.

Drafts: when the scheduler sends some (a speculative config, `spec_harness`), the runner computes
each draft position's row from the draft token, so a wrong draft gives a wrong row, and samples
like vLLM's rejection sampler with a greedy target (`Engine.accept`). Subclasses plug in through
the hooks of `Engine`: the config, the drafter (`Engine.update`), what a step's count, a join
or a computed chunk means to them, how a saved step is materialized (`Engine.deliver`), and
what each ended admission is owed (`Engine.owed`).

Engine loops:

- sync: ``schedule`` -> execute -> ``update_from_output``, one step at a time.
- async: the engine core's ``step_with_batch_queue`` with a queue of depth 2: schedule and
  execute step k+1, then process step k's output.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import queue
import random
import tempfile
import threading
from collections.abc import Sequence
from typing import Any

import torch
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from omni_cache_cuda import ModelCachePolicy
from omni_cache_cuda.sim import extend_hash, float_rows, prefix_hashes
from omni_cache_cuda.sim import next_token as oracle_next_token
from omni_cache_cuda.vllm import VllmPrefixCache

VOCAB = 97
STOP_TOKEN = 7
HIDDEN = 8
MM_KEY = "codes.audio"
MM_WIDTH = 2


# ---------------------------------------------------------------------------------------------
# The model: rows and tokens as pure functions of the token prefix (the prefix-hash oracle of
# `omni_cache_cuda.sim`).


def next_token(h: int) -> int:
    """The token the model samples after a prefix with hash ``h``."""
    return oracle_next_token(h, VOCAB)


def rows_of(hashes: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden rows (width HIDDEN) and mm rows (width MM_WIDTH) for prefix hashes."""
    return float_rows(hashes, HIDDEN), float_rows(hashes, MM_WIDTH, first_lane=HIDDEN)


class Truth:
    """A request's token list as the model generates it from the prompt, and its rows."""

    def __init__(self, prompt: Sequence[int]) -> None:
        self.prompt = list(prompt)
        self.tokens = list(prompt)
        self.hashes = prefix_hashes(self.tokens)
        self._lock = threading.Lock()  # the engine and the builder thread both extend it

    def extend_to(self, n: int) -> None:
        with self._lock:
            while len(self.tokens) < n:
                t = next_token(self.hashes[-1])
                self.tokens.append(t)
                self.hashes.append(extend_hash(self.hashes[-1], t))

    def rows(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.extend_to(end)
        return rows_of(self.hashes[start:end])


# ---------------------------------------------------------------------------------------------
# Scheduler set-up.

_MODEL_DIR: str | None = None


def _model_dir() -> str:
    global _MODEL_DIR
    if _MODEL_DIR is None:
        _MODEL_DIR = tempfile.mkdtemp(prefix="omni-cache-vllm-model-")
        config = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "num_hidden_layers": 1,
            "vocab_size": VOCAB + 3,
            "max_position_embeddings": 4096,
            "torch_dtype": "float32",
        }
        with open(os.path.join(_MODEL_DIR, "config.json"), "w") as f:
            json.dump(config, f)
    return _MODEL_DIR


def make_vllm_config(
    *,
    block_size: int = 16,
    num_blocks: int = 64,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 256,
    max_model_len: int = 1024,
    async_scheduling: bool = False,
    enable_prefix_caching: bool = True,
) -> VllmConfig:
    model_config = ModelConfig(
        model=_model_dir(), skip_tokenizer_init=True, max_model_len=max_model_len, dtype="float32"
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        async_scheduling=async_scheduling,
        is_encoder_decoder=False,
    )
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching)
    cache_config.num_gpu_blocks = num_blocks
    return VllmConfig(
        model_config=model_config,
        cache_config=cache_config,
        scheduler_config=scheduler_config,
        device_config=DeviceConfig(device="cpu"),
    )


def kv_config(*specs: Any, num_blocks: int = 64) -> KVCacheConfig:
    """A KV cache config of one group per spec (no tensors: the scheduler needs none)."""
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate(specs)],
    )


def full(block_size: int = 16) -> FullAttentionSpec:
    """A tiny full-attention spec."""
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float32
    )


def make_kv_cache_config(num_blocks: int, block_size: int) -> KVCacheConfig:
    return kv_config(full(block_size), num_blocks=num_blocks)


# ---------------------------------------------------------------------------------------------
# Bookkeeping of what the run exercised.


@dataclasses.dataclass
class Counts:
    steps: int = 0
    preemptions: int = 0
    resumes: int = 0
    resumes_with_hit: int = 0
    resume_hit_zero: int = 0
    resume_hit_shrunk: int = 0  # 0 < hit < what the admission had computed before
    resume_hit_grown: int = 0  # hit above the admission's previous hit
    resume_hit_beyond_prompt: int = 0
    started_with_hit: int = 0
    same_step_hits: int = 0  # a hit on a block another request writes in that very step
    recycled_blocks: int = 0  # a block written again with other content
    chunked_steps: int = 0  # steps with a prefill chunk that does not finish the prompt
    aborts: int = 0
    aborted_running: int = 0  # aborts of a request that was running
    aborted_before_start: int = 0  # admissions aborted before their first step
    stopped: int = 0  # admissions finished by a stop token
    id_reuses: int = 0
    finished_while_preempted: int = 0
    rows_past_stop: int = 0  # positions computed past a stop (async): delivered
    hit_rows_this_step: int = 0  # hit rows served by a producer of the same step (stats)
    hit_rows_from_pool: int = 0  # hit rows served from the host mirror (stats)
    rows_checked: int = 0
    finished: int = 0

    def add(self, other: Counts) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


class Admission:
    """One admission of a request id: its truth and what it was delivered."""

    def __init__(self, req_id: str, number: int, prompt: Sequence[int]) -> None:
        self.req_id = req_id
        self.number = number
        self.truth = Truth(prompt)
        self.computed_end = 0  # accepted positions [0, computed_end) were computed (hits too)
        self.accepted: set[int] = set()  # positions computed from the true tokens, or hit
        self.delivered = collections.Counter[int]()
        self.request: Request | None = None
        self.last_hit = 0
        self.started = False
        self.lock = threading.Lock()  # the builder thread reads `accepted`, writes `delivered`

    def __repr__(self) -> str:
        return f"Admission({self.req_id!r}#{self.number})"


@dataclasses.dataclass
class StepOfRequest:
    """What one step computed for one request."""

    start: int  # num_computed_tokens: the step's first position
    confirmed_end: int  # first draft position (== end without drafts)
    accepted_end: int  # first rejected position (== end when every draft was accepted)
    end: int  # start + scheduled tokens
    joining: bool  # the request started or resumed in this step
    slots: list[int]  # the KV slot of each position in [start, end)


# ---------------------------------------------------------------------------------------------
# The engine loop with its fake runner.


@dataclasses.dataclass
class Workload:
    """What to run. Prompts share ``num_prefixes`` system prompts."""

    num_requests: int = 24
    num_prefixes: int = 3
    prefix_len: int = 48
    suffix_len: tuple[int, int] = (1, 24)
    max_tokens: tuple[int, int] = (4, 24)
    stop_fraction: float = 0.0  # requests that may also stop on STOP_TOKEN
    arrivals_per_step: int = 4
    abort_prob: float = 0.0  # per step, abort one random live request
    reuse_prob: float = 0.0  # a finished id comes back as a new request
    seed: int = 0


class Engine:
    """vLLM's scheduler, a fake runner saving through a `VllmPrefixCache`, a builder thread.

    Hooks for subclasses (`spec_harness.SpecEngine`): `make_config`, `before_step_begin`,
    `running`, `joined`, `computed`, `after_forward`, `deliver`, `checked`, `update` and
    `owed`; `counts_type` and `admission_type` name the classes of the figures and admissions.
    """

    counts_type: type[Counts] = Counts
    admission_type: type[Admission] = Admission
    #: Finished ids may come back as new requests (`Workload.reuse_prob`).
    reuses_ids = True

    def __init__(
        self,
        *,
        async_scheduling: bool,
        v2_runner: bool,
        threaded: bool = False,
        block_size: int = 16,
        num_blocks: int = 64,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 256,
        deferred: bool = False,
        seed: int = 0,
        monkeypatch: Any,
    ) -> None:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1" if v2_runner else "0")
        self.vllm_config = self.make_config(
            block_size=block_size,
            num_blocks=num_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            async_scheduling=async_scheduling,
        )
        assert self.vllm_config.use_v2_model_runner is v2_runner
        kv_cache_config = make_kv_cache_config(num_blocks, block_size)
        cls = AsyncScheduler if async_scheduling else Scheduler
        self.scheduler = cls(
            vllm_config=self.vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=block_size,
        )
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(block_size, sha256)
        self.async_scheduling = async_scheduling
        self.v2_runner = v2_runner
        self.depth = 2 if async_scheduling else 1
        assert self.vllm_config.max_concurrent_batches == self.depth
        self.block_size = block_size
        policy = ModelCachePolicy(deferred_keys={MM_KEY} if deferred else set())
        self.cache = VllmPrefixCache.from_vllm_config(
            self.vllm_config, kv_cache_config, policy=policy, device="cpu", threaded=threaded
        )
        assert self.cache.max_concurrent_batches == self.depth
        self.rng = random.Random(seed)
        self.counts = self.counts_type()
        self.admissions: list[Admission] = []
        self.current: dict[str, Admission] = {}  # req_id -> its current admission
        # The runner's own per-request state (token lists it feeds forward).
        self.runner_tokens: dict[str, list[int]] = {}
        self.preempted: set[str] = set()
        # slot -> prefix hash last written there (block reuse and same-step hits).
        self.slot_hash: dict[int, int] = {}
        self.step_index = 0
        self.last_scheduled: dict[str, int] = {}  # req_id -> last step index naming it
        self.processed = 0  # steps whose output the scheduler has processed
        # step id -> per request what it computed (read by the checks on the builder thread).
        self.steps: dict[int, dict[str, StepOfRequest]] = {}
        # Builder thread: materializes one step late.
        self._pending: tuple[Any, ...] | None = None
        self._builds: queue.Queue[tuple[Any, ...] | None] = queue.Queue()
        self._errors: list[BaseException] = []
        # A daemon: a failed run must not keep the test process alive.
        self._builder = threading.Thread(
            target=self._build_loop, name="output-builder", daemon=True
        )
        self._builder.start()

    def make_config(self, **kwargs: Any) -> VllmConfig:
        """The engine's `VllmConfig` (keywords of `make_vllm_config`)."""
        return make_vllm_config(**kwargs)

    # --- requests ---

    def add_request(
        self, req_id: str, prompt: Sequence[int], max_tokens: int, stop: bool = False
    ) -> Admission:
        number = sum(1 for a in self.admissions if a.req_id == req_id)
        adm = self.admission_type(req_id, number, prompt)
        params = SamplingParams(
            max_tokens=max_tokens,
            ignore_eos=True,
            stop_token_ids=[STOP_TOKEN] if stop else None,
        )
        request = Request(
            request_id=req_id,
            prompt_token_ids=list(prompt),
            sampling_params=params,
            pooling_params=None,
            block_hasher=self.hasher,
        )
        adm.request = request
        self.admissions.append(adm)
        self.current[req_id] = adm
        self.scheduler.add_request(request)
        return adm

    def abort(self, req_id: str) -> None:
        request = self.current[req_id].request
        assert request is not None
        self.counts.aborted_running += request.status == RequestStatus.RUNNING
        self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)
        self.counts.aborts += 1

    # --- hooks (no-ops here) ---

    def before_step_begin(self, so: Any) -> None:
        """The step's records are about to reach the cache (preemptions already counted)."""

    def running(self, adm: Admission) -> None:
        """The step's ``num_computed_tokens`` of a running request reaches the cache."""

    def joined(self, adm: Admission, hit: int, resumed: bool) -> None:
        """The admission starts (or resumes) in this step with a hit of ``hit`` tokens."""

    def computed(self, adm: Admission, step: StepOfRequest, drafts: list[int]) -> None:
        """The runner computed ``step`` for the admission (with ``drafts`` scheduled)."""

    def after_forward(
        self, joining: list[tuple[str, int, list[int]]], written: dict[int, int]
    ) -> None:
        """The step's joins ``(req_id, hit, blocks)`` and the slots it wrote (slot -> hash)."""

    def checked(self, adm: Admission, step: StepOfRequest, start: int, end: int) -> None:
        """The step's materialize handed out the admission's right rows ``[start, end)``."""

    # --- the runner ---

    def accept(self, adm: Admission, first_draft: int, drafts: Sequence[int]) -> int:
        """vLLM's rejection sampler with a greedy target: how many drafts are accepted (the
        prefix of those equal to the model's tokens)."""
        a = 0
        while a < len(drafts) and drafts[a] == adm.truth.tokens[first_draft + a]:
            a += 1
        return a

    def execute(self, so: Any) -> ModelRunnerOutput:
        """The fake model runner: step begin, forward, save; returns the sampled tokens."""
        self.step_index += 1
        self.counts.steps += 1
        # What this step does to requests, for the counters (read before the runner updates).
        for rid in so.preempted_req_ids or ():
            self.counts.preemptions += 1
            self.preempted.add(rid)
        self.before_step_begin(so)
        self.cache.step_begin(so)
        # The runner's own state, as vLLM's runners keep it.
        for rid in so.finished_req_ids:
            self.runner_tokens.pop(rid, None)
            if rid in self.preempted:
                self.preempted.discard(rid)
                self.counts.finished_while_preempted += 1
        joining: list[tuple[str, int, list[int]]] = []  # (req_id, hit, blocks)
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
                self.running(self.current[rid])
        for rid, hit, _blocks in joining:
            adm = self.current[rid]
            resumed = rid in self.preempted
            if resumed:
                self.preempted.discard(rid)
                self.counts.resumes += 1
                c = self.counts
                c.resumes_with_hit += hit > 0
                c.resume_hit_zero += hit == 0
                c.resume_hit_shrunk += 0 < hit < adm.computed_end
                c.resume_hit_grown += hit > adm.last_hit
                c.resume_hit_beyond_prompt += hit > len(adm.truth.prompt)
            else:
                assert not adm.started, adm
                adm.started = True
                self.counts.started_with_hit += hit > 0
            adm.last_hit = hit
            with adm.lock:
                adm.accepted.update(range(hit))
            self.joined(adm, hit, resumed)
        joined = {rid for rid, _hit, _blocks in joining}
        computed = {n.req_id: n.num_computed_tokens for n in so.scheduled_new_reqs}
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        spec = so.scheduled_spec_decode_tokens or {}

        sched = so.num_scheduled_tokens
        order = list(sched)
        self.rng.shuffle(order)
        layout = self.cache.layout(order) if order else None
        hidden_parts, mm_parts = [], []
        sampled: dict[str, list[int]] = {}
        this_step: dict[str, StepOfRequest] = {}
        written: dict[int, int] = {}
        chunked = False
        row = 0
        for rid in order:
            n = sched[rid]
            c = computed[rid]
            drafts = list(spec.get(rid, ()))
            kd = len(drafts)
            adm = self.current[rid]
            tokens = self.runner_tokens[rid]
            d = c + n - kd  # first draft position
            assert n > 0 and kd < n, (rid, c, n, drafts)
            assert len(tokens) >= d and (kd == 0 or len(tokens) == d), (rid, c, n, kd, tokens)
            # The runner's tokens must agree with the model's truth.
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
            a = self.accept(adm, d, drafts)
            step = StepOfRequest(c, d, d + a, c + n, rid in joined, slots)
            this_step[rid] = step
            with adm.lock:
                adm.accepted.update(range(c, d + a))
            adm.computed_end = max(adm.computed_end, d + a)
            if d >= len(tokens):  # the last chunk of what is known: sample
                out = adm.truth.tokens[d : d + a + 1]
                tokens.extend(out)
                sampled[rid] = out
            else:
                assert kd == 0
                sampled[rid] = []
                if d < len(adm.truth.prompt):
                    chunked = True
            self.last_scheduled[rid] = self.step_index
            self.computed(adm, step, drafts)
        self.counts.chunked_steps += chunked
        # Same-step hits: a joining request's hit blocks written by this very step.
        written_blocks = {s // self.block_size for s in written}
        for _rid, hit, blocks in joining:
            hit_blocks = set(blocks[: hit // self.block_size])
            if hit_blocks & written_blocks:
                self.counts.same_step_hits += 1
        # Block reuse: slots written again with other content.
        recycled = set()
        for s, h in written.items():
            old = self.slot_hash.get(s)
            if old is not None and old != h:
                recycled.add(s // self.block_size)
            self.slot_hash[s] = h
        self.counts.recycled_blocks += len(recycled)
        self.after_forward(joining, written)

        if order:
            hidden = torch.cat(hidden_parts)
            mm = {MM_KEY: torch.cat(mm_parts)}
            pad = self.rng.choice((0, 0, 3))
            if pad:
                hidden = torch.cat([hidden, torch.full((pad, HIDDEN), float("nan"))])
                mm = {MM_KEY: torch.cat([mm[MM_KEY], torch.full((pad, MM_WIDTH), float("nan"))])}
            step_id = self.cache.save(
                hidden,
                mm,
                req_ids=order,
                num_tokens_unpadded=row,
                num_tokens_padded=row + pad,
            )
            self.steps[step_id] = this_step
            admissions = {rid: self.current[rid] for rid in order}
            self.deliver(step_id, tuple(order), admissions, sampled)
        ids = list(sampled)
        return ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[sampled[r] for r in ids],
        )

    # --- the output builder, one step late ---

    def deliver(
        self,
        step_id: int,
        order: tuple[str, ...],
        admissions: dict[str, Admission],
        sampled: dict[str, list[int]],
    ) -> None:
        """Have the saved step materialized and checked: here by the builder thread, after the
        next step's ``step_begin``, without sampled token ids."""
        self.hand_to_builder((step_id, order, admissions, None))

    def hand_to_builder(self, item: tuple[Any, ...]) -> None:
        """Queue the previous item for the builder thread (one step late), keep this one."""
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
                self.check_step(*item)
            except BaseException as exc:
                self._errors.append(exc)

    def check_step(
        self,
        step_id: int,
        order: tuple[str, ...],
        admissions: dict[str, Admission],
        sampled: dict[str, list[int]] | None,
    ) -> None:
        """Materialize a saved step and check every row it hands out against the recompute."""
        out = self.cache.materialize(step_id, order, sampled_token_ids=sampled)
        hidden, mm = out
        assert hidden is not None
        step = self.steps.pop(step_id)
        for rid in order:
            adm = admissions[rid]
            mine = step[rid]
            start, end = out.positions[rid]
            got_h = hidden[rid]
            got_m = mm[MM_KEY][rid]
            assert got_h.shape[0] == end - start == got_m.shape[0], (adm, start, end, got_h.shape)
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
            self.checked(adm, mine, start, end)
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
        self.counts.hit_rows_this_step += self.stats.hit_rows.get("THIS_STEP", 0)
        self.counts.hit_rows_from_pool += self.stats.hit_rows.get("POOL", 0)

    # --- engine loops ---

    def update(self, so: Any, out: ModelRunnerOutput) -> None:
        """The engine core processes the step's output."""
        self.scheduler.update_from_output(so, out)
        self.processed += 1

    def run(self, workload: Workload, *, max_steps: int = 5000) -> Counts:
        """Run the workload to the end; check the oracle; return the counts."""
        assert self.reuses_ids or not workload.reuse_prob, "this engine does not reuse ids"
        try:
            self._loop(workload, max_steps)
        except BaseException:
            self._builds.put(None)
            self.cache.shutdown()
            raise
        self.close()
        self.check_exactly_once()
        return self.counts

    def _loop(self, workload: Workload, max_steps: int) -> None:
        rng = random.Random(workload.seed)
        prefixes = [
            [rng.randrange(1, VOCAB) for _ in range(workload.prefix_len)]
            for _ in range(workload.num_prefixes)
        ]
        todo = collections.deque(range(workload.num_requests))
        finished_ids: list[str] = []
        batch_queue: collections.deque[tuple[Any, ModelRunnerOutput, int]] = collections.deque()

        def admit() -> None:
            for _ in range(workload.arrivals_per_step):
                if todo:
                    i = todo.popleft()
                    reuse = None
                    if finished_ids and rng.random() < workload.reuse_prob:
                        reuse = self._safe_reuse(finished_ids)
                    rid = reuse or f"req-{i}"
                    if reuse:
                        self.counts.id_reuses += 1
                    prompt = prefixes[i % len(prefixes)] + [
                        rng.randrange(1, VOCAB) for _ in range(rng.randint(*workload.suffix_len))
                    ]
                    self.add_request(
                        rid,
                        prompt,
                        rng.randint(*workload.max_tokens),
                        stop=rng.random() < workload.stop_fraction,
                    )

        steps = 0
        while todo or self.scheduler.has_requests() or batch_queue:
            steps += 1
            assert steps < max_steps, "the workload did not finish"
            admit()
            if workload.abort_prob and rng.random() < workload.abort_prob:
                live = [r for r, a in self.current.items() if not a.request.is_finished()]
                if live:
                    self.abort(rng.choice(live))
            if self.scheduler.has_requests():
                so = self.scheduler.schedule()
                out = self.execute(so)
                batch_queue.appendleft((so, out, self.step_index))
                if len(batch_queue) < self.depth and self.scheduler.has_requests():
                    continue
            if batch_queue:
                so, out, _ = batch_queue.pop()
                self.update(so, out)
            if self.reuses_ids:
                for rid, adm in list(self.current.items()):
                    if adm.request.is_finished() and rid not in finished_ids:
                        finished_ids.append(rid)

    def _safe_reuse(self, finished_ids: list[str]) -> str | None:
        """A finished id whose last step's output the scheduler has processed."""
        for rid in finished_ids:
            adm = self.current[rid]
            if self.last_scheduled.get(rid, 0) <= self.processed and adm.request.is_finished():
                finished_ids.remove(rid)
                return rid
        return None

    def owed(self, adm: Admission) -> set[int]:
        """The positions the cache must deliver to the ended admission exactly once (here every
        computed one); counts what lies past a stop token."""
        request = adm.request
        assert request is not None
        if request.status == RequestStatus.FINISHED_STOPPED:
            final = len(request.all_token_ids)
            # At most the stop token's own position, and only with steps in flight.
            past = max(0, adm.computed_end - (final - 1))
            assert past <= self.depth - 1, (adm, past)
            self.counts.rows_past_stop += past
        return set(range(adm.computed_end))

    def check_exactly_once(self) -> None:
        """Every admission received each position it is owed (`owed`) exactly once, and only
        positions computed from the true tokens."""
        for adm in self.admissions:
            request = adm.request
            assert request is not None
            self.counts.stopped += request.status == RequestStatus.FINISHED_STOPPED
            if not adm.started:
                assert request.status == RequestStatus.FINISHED_ABORTED, adm
                assert adm.computed_end == 0 and not adm.delivered, adm
                self.counts.aborted_before_start += 1
            if request.is_finished():
                self.counts.finished += 1
                # The scheduler's tokens agree with the model's.
                adm.truth.extend_to(len(request.all_token_ids))
                got = list(request.all_token_ids)
                assert got == adm.truth.tokens[: len(got)], (
                    f"{adm}: the scheduler's tokens {got} differ from the model's "
                    f"{adm.truth.tokens[: len(got)]} (prompt {len(adm.truth.prompt)})"
                )
            owed = self.owed(adm)
            delivered = set(adm.delivered)
            missing = sorted(owed - delivered)
            never = sorted(delivered - adm.accepted)
            twice = sorted(p for p, n in adm.delivered.items() if n != 1)
            assert not missing and not never and not twice, (
                f"{adm} ({request.status.name}, computed [0, {adm.computed_end})): "
                f"missing {missing[:10]}, delivered but never computed {never[:10]}, "
                f"delivered more than once {twice[:10]}"
            )


def check_run(eng: Engine, counts: Counts) -> None:
    """What every finished run must hold: the oracle ran on real rows, for every admission to
    its end, and the records the glue fed in match what the scheduler did."""
    assert counts.rows_checked > 0 and counts.finished == len(eng.admissions)
    glue = eng.cache.counts()
    assert glue["steps"] == counts.steps
    assert glue["preempted"] == counts.preemptions
    assert glue["resumed"] == counts.resumes
    assert glue["resumed_with_hit"] == counts.resumes_with_hit
    assert glue["started_with_hit"] == counts.started_with_hit
    assert glue["started"] == len(eng.admissions) - counts.aborted_before_start
    assert eng.cache.live_requests() == {}
    assert eng.stats.steps_saved == eng.stats.steps_consumed > 0
