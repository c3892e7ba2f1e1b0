"""A vLLM-style engine: paged KV blocks, hash-based prefix caching and a token-budget scheduler.

Theory of operation, in the order one engine step runs:

1. Arrivals join the waiting queue (first come, first served).
2. The scheduler spends the step's token budget (``max_batched_tokens``): running requests first
   (one token for a decoding request, the next prompt chunk for one still in prefill), then
   waiting requests while the budget, ``max_num_seqs`` and the free blocks allow. A new request
   looks up the chained hashes of its full prompt blocks in the prefix cache; the hit is capped so
   that at least one prompt token is computed (the last token's hidden state picks the first
   output token). It is admitted only if the blocks it may ever need (prompt plus outputs) are
   free, so the engine never preempts.
3. The blocks covered by this step's tokens are hashed and registered as soon as they are
   scheduled, as vLLM does: a request admitted later in the same step may hit a block another
   request is computing in this very forward (the model writes every token's K/V before any
   token attends).
4. The sink is told the step's plan (requests started this step with their hit and block ids,
   requests that ended in the previous step), the model runs, the sink gets the hidden states.
5. Requests whose prompt is complete get their next token by argmax. A request that reaches its
   output length finishes; every ``abort_every``-th request of the workload is aborted half way.
   Their blocks go back to the free queue at once (cached blocks stay cached), and the sink hears
   of the end at the start of the next step, before the freed blocks can be written again.

Freed blocks are reused least recently freed first (a request's tail blocks ahead of its head
blocks), so slots really are recycled: reusing a cached block evicts its hash.

The requests, the KV blocks and the prefix cache are the simulated scheduler's
(`omni_cache_cuda.sim.Scheduler`, which the soak and the tests drive too); this module adds the
token-budget policy above, the model's forward over the paged KV cache and the sink.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import numpy as np
import torch
from attrs import define, field, frozen
from attrs.validators import gt

from omni_cache_cuda.sim import Scheduler, SimRequest, prefix_hashes

from ._model import ModelConfig, PagedKVCache, SeqSlice, TinyCausalLM
from ._workload import RequestSpec

__all__ = [
    "EndedRecord",
    "Engine",
    "EngineConfig",
    "RunReport",
    "StartedRecord",
    "StepPlan",
    "StepSink",
]


@frozen(kw_only=True)
class EngineConfig:
    """Engine sizing.

    Attributes:
        num_blocks: KV blocks in the cache.
        block_size: Tokens per KV block.
        max_batched_tokens: Token budget of one step.
        max_num_seqs: Most requests running at once.
        enable_prefix_caching: Reuse cached KV blocks of equal prefixes.
        enable_chunked_prefill: Split a prompt over several steps when the budget runs out.
    """

    num_blocks: int = field(default=512, validator=gt(0))
    block_size: int = field(default=16, validator=gt(0))
    max_batched_tokens: int = field(default=256, validator=gt(0))
    max_num_seqs: int = field(default=32, validator=gt(0))
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True


@frozen(kw_only=True)
class StartedRecord:
    """A request scheduled for the first time in this step.

    Attributes:
        req_id: Request id.
        hit_end: Prompt tokens found in the KV prefix cache (a multiple of the block size).
        block_ids: All of the request's KV blocks so far, in order.
        scheduled_tokens: Tokens scheduled for it in this step.
    """

    req_id: str
    hit_end: int
    block_ids: tuple[int, ...]
    scheduled_tokens: int


@frozen(kw_only=True)
class EndedRecord:
    """A request that finished or was aborted in the previous step.

    Attributes:
        req_id: Request id.
        aborted: True if the client aborted it, False if it reached its output length.
    """

    req_id: str
    aborted: bool


@frozen(kw_only=True)
class StepPlan:
    """What one engine step runs.

    Attributes:
        step_index: Engine step number.
        order: Request ids in batch order.
        num_scheduled: Tokens scheduled per request.
        num_computed: Tokens already in each request's KV before this step (hits included).
        block_ids: Each request's KV blocks covering at least its tokens after this step.
        started: Requests scheduled for the first time.
        ended: Requests that ended in the previous step.
    """

    step_index: int
    order: tuple[str, ...]
    num_scheduled: Mapping[str, int]
    num_computed: Mapping[str, int]
    block_ids: Mapping[str, tuple[int, ...]]
    started: tuple[StartedRecord, ...]
    ended: tuple[EndedRecord, ...]

    @property
    def num_tokens(self) -> int:
        """Tokens in the step's batch."""
        return sum(self.num_scheduled.values())


class StepSink(Protocol):
    """Receives what every step runs and produces; the second stage sits behind it."""

    def begin_step(self, plan: StepPlan) -> None:
        """Hear of the step before its forward."""

    def end_step(self, plan: StepPlan, hidden: torch.Tensor, talker_h: torch.Tensor) -> None:
        """Take the step's hidden states and per-token ``talker.h`` rows (batch order)."""

    def finish(self, ended: Sequence[EndedRecord]) -> None:
        """Hear of the requests that ended in the last step, and deliver everything pending."""


@define
class _Request:
    spec: RequestSpec
    sim: SimRequest
    output: list[int] = field(factory=list)


class _NoRecords:
    """The scheduler's lifecycle records: the demo's plan carries its own (`StepPlan`)."""

    def start(
        self,
        req: str,
        blocks: Sequence[int],
        *,
        hit_end: int = 0,
        tokens: Sequence[int] | None = None,
    ) -> None:
        pass

    def finish(self, req: str, *, abort: bool = False) -> None:
        pass

    def preempt(self, req: str) -> None:
        raise AssertionError(f"the demo's engine never preempts ({req})")

    def resume(self, req: str, blocks: Sequence[int], *, hit_end: int = 0) -> None:
        raise AssertionError(f"the demo's engine never preempts ({req})")


@frozen(kw_only=True)
class RunReport:
    """Outcome of one engine run.

    Attributes:
        outputs: Generated token ids per request.
        aborted: Requests the client aborted.
        steps: Engine steps run.
        wall_s: Seconds from the first step until the sink delivered everything.
        prompt_tokens: Prompt tokens of all requests.
        hit_tokens: Prompt tokens served by the KV prefix cache.
        computed_tokens: Tokens the model ran (prompt tokens not hit plus fed-back outputs).
        evictions: Cached blocks evicted because their block was reused.
        block_reuses: Block allocations that recycled slots some earlier request wrote.
        step_s: Seconds of each step on the engine thread (schedule, forward, sink, update);
            the last one includes delivering what the sink still held.
        step_tokens: Tokens the model ran in each step.
        step_prompt_tokens: Prompt tokens of the requests each step admitted.
        step_hit_tokens: Of those, the tokens served by the KV prefix cache.
        step_done: Requests ended (finished or aborted) after each step.
    """

    outputs: Mapping[str, tuple[int, ...]]
    aborted: frozenset[str]
    steps: int
    wall_s: float
    prompt_tokens: int
    hit_tokens: int
    computed_tokens: int
    evictions: int
    block_reuses: int
    step_s: tuple[float, ...] = ()
    step_tokens: tuple[int, ...] = ()
    step_prompt_tokens: tuple[int, ...] = ()
    step_hit_tokens: tuple[int, ...] = ()
    step_done: tuple[int, ...] = ()

    @property
    def hit_rate(self) -> float:
        """Hit tokens over prompt tokens."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def total_tokens(self) -> int:
        """Prompt plus generated tokens: the useful work, the same with and without caching."""
        return self.prompt_tokens + sum(len(o) for o in self.outputs.values())

    @property
    def tokens_per_s(self) -> float:
        """Useful tokens per second of wall time."""
        return self.total_tokens / self.wall_s if self.wall_s > 0 else float("inf")


class Engine:
    """Runs a workload through the model, step by step, reporting to a sink."""

    def __init__(
        self, model: TinyCausalLM, config: EngineConfig, *, device: torch.device | str = "cpu"
    ) -> None:
        """Create an engine with an empty KV cache on ``device``.

        Args:
            model: The model; it is moved to ``device``.
            config: Engine sizing.
            device: Where the model and the KV cache live.
        """
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.config = config
        self.kv_cache = PagedKVCache(
            model.config,
            num_blocks=config.num_blocks,
            block_size=config.block_size,
            device=self.device,
        )
        self.scheduler = Scheduler(
            config.num_blocks,
            config.block_size,
            _NoRecords(),
            prefix_caching=config.enable_prefix_caching,
        )
        self._prompt_tokens = 0
        self._hit_tokens = 0
        self._computed_tokens = 0

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.config.block_size)

    @staticmethod
    def check_workload(
        specs: Sequence[RequestSpec], config: EngineConfig, model_config: ModelConfig
    ) -> None:
        """Check that every request can run alone on an engine of this size.

        Raises:
            ValueError: A request needs more positions than the model has, more KV blocks than
                the cache has, or (without chunked prefill) a prompt longer than the step budget.
        """
        for spec in specs:
            fed = len(spec.prompt) + spec.max_tokens - 1
            blocks = -(-fed // config.block_size)
            if fed > model_config.max_positions:
                raise ValueError(
                    f"{spec.req_id} needs {fed} positions, the model has "
                    f"{model_config.max_positions}"
                )
            if blocks > config.num_blocks:
                raise ValueError(
                    f"{spec.req_id} needs {blocks} KV blocks, the cache has {config.num_blocks}"
                )
            if not config.enable_chunked_prefill and len(spec.prompt) > config.max_batched_tokens:
                raise ValueError(
                    f"{spec.req_id} has a {len(spec.prompt)}-token prompt; without chunked "
                    f"prefill max_batched_tokens={config.max_batched_tokens} must cover it"
                )

    def run(
        self,
        specs: Sequence[RequestSpec],
        sink: StepSink,
        *,
        progress: Callable[[int, int], None] | None = None,
    ) -> RunReport:
        """Run every request to its end.

        Args:
            specs: The workload.
            sink: Receives every step's plan and outputs.
            progress: Called after each step with (requests ended, requests in all).

        Returns:
            Outputs and counters of the run.
        """
        self.check_workload(specs, self.config, self.model.config)
        arrivals = deque(sorted(specs, key=lambda s: s.arrival_step))
        waiting: deque[RequestSpec] = deque()
        running: dict[str, _Request] = {}
        outputs: dict[str, tuple[int, ...]] = {}
        aborted: set[str] = set()
        ended: list[EndedRecord] = []
        step = 0
        steps_run = 0
        step_s: list[float] = []
        step_tokens: list[int] = []
        step_prompt: list[int] = []
        step_hit: list[int] = []
        step_done: list[int] = []
        start_s = last_s = time.perf_counter()
        while arrivals or waiting or running:
            while arrivals and arrivals[0].arrival_step <= step:
                waiting.append(arrivals.popleft())
            if not waiting and not running:
                step = arrivals[0].arrival_step
                continue
            prompt_before, hit_before = self._prompt_tokens, self._hit_tokens
            plan = self._schedule(step, waiting, running, ended)
            if not plan.order:
                raise RuntimeError(f"step {step} could schedule nothing; the KV cache is too small")
            sink.begin_step(plan)
            hidden = self._forward(plan, running)
            sink.end_step(plan, hidden, self.model.talker_features(hidden))
            ended = self._update(plan, hidden, running)
            for record in ended:
                outputs[record.req_id] = tuple(running.pop(record.req_id).output)
                if record.aborted:
                    aborted.add(record.req_id)
            step += 1
            steps_run += 1
            step_tokens.append(plan.num_tokens)
            step_prompt.append(self._prompt_tokens - prompt_before)
            step_hit.append(self._hit_tokens - hit_before)
            step_done.append(len(outputs))
            if progress is not None:
                progress(len(outputs), len(specs))
            now_s = time.perf_counter()
            step_s.append(now_s - last_s)
            last_s = now_s
        sink.finish(ended)
        end_s = time.perf_counter()
        if step_s:
            step_s[-1] += end_s - last_s
        wall_s = end_s - start_s
        self.scheduler.pool.check_invariants()
        assert self.scheduler.reserved == 0, self.scheduler.reserved
        return RunReport(
            outputs=outputs,
            aborted=frozenset(aborted),
            steps=steps_run,
            wall_s=wall_s,
            prompt_tokens=self._prompt_tokens,
            hit_tokens=self._hit_tokens,
            computed_tokens=self._computed_tokens,
            evictions=self.scheduler.pool.evictions,
            block_reuses=self.scheduler.pool.recycled,
            step_s=tuple(step_s),
            step_tokens=tuple(step_tokens),
            step_prompt_tokens=tuple(step_prompt),
            step_hit_tokens=tuple(step_hit),
            step_done=tuple(step_done),
        )

    def _schedule(
        self,
        step: int,
        waiting: deque[RequestSpec],
        running: dict[str, _Request],
        ended: Sequence[EndedRecord],
    ) -> StepPlan:
        cfg = self.config
        scheduler = self.scheduler
        budget = cfg.max_batched_tokens
        order: list[str] = []
        scheduled: dict[str, int] = {}
        computed: dict[str, int] = {}
        started: list[StartedRecord] = []
        scheduler.begin_step()
        for req_id, run in running.items():
            if budget == 0:
                break
            req = run.sim
            n = min(len(req.tokens) - req.computed, budget)
            order.append(req_id)
            scheduled[req_id] = n
            computed[req_id] = req.computed
            scheduler.schedule(req, n)
            budget -= n
        while waiting and budget > 0 and len(running) < cfg.max_num_seqs:
            spec = waiting[0]
            prompt_len = len(spec.prompt)
            hit_end = 0
            if cfg.enable_prefix_caching:
                hashes = prefix_hashes(spec.prompt)
                hit_end = scheduler.cached_blocks(hashes, (prompt_len - 1) // cfg.block_size)
                hit_end *= cfg.block_size
            remaining = prompt_len - hit_end
            n = min(remaining, budget)
            if n < remaining and not cfg.enable_chunked_prefill:
                break
            # Every block it may ever need (prompt plus outputs) is promised now: no preemption.
            admitted = scheduler.admit(
                spec.req_id,
                spec.prompt,
                prompt_len,
                hit_cap=hit_end,
                reserve_tokens=spec.max_tokens - 1,
            )
            if admitted is None:
                break
            waiting.popleft()
            assert admitted.computed == hit_end, (spec.req_id, admitted.computed, hit_end)
            running[spec.req_id] = _Request(spec=spec, sim=admitted)
            self._prompt_tokens += prompt_len
            self._hit_tokens += hit_end
            order.append(spec.req_id)
            scheduled[spec.req_id] = n
            computed[spec.req_id] = hit_end
            started.append(
                StartedRecord(
                    req_id=spec.req_id,
                    hit_end=hit_end,
                    block_ids=tuple(admitted.blocks),
                    scheduled_tokens=n,
                )
            )
            scheduler.schedule(admitted, n)
            budget -= n
        self._computed_tokens += sum(scheduled.values())
        return StepPlan(
            step_index=step,
            order=tuple(order),
            num_scheduled=scheduled,
            num_computed=computed,
            block_ids={r: tuple(running[r].sim.blocks) for r in order},
            started=tuple(started),
            ended=tuple(ended),
        )

    def _forward(self, plan: StepPlan, running: Mapping[str, _Request]) -> torch.Tensor:
        bs = self.config.block_size
        ids: list[int] = []
        positions: list[np.ndarray] = []
        new_slots: list[np.ndarray] = []
        context_slots: list[np.ndarray] = []
        for req_id in plan.order:
            req = running[req_id].sim
            start, n = plan.num_computed[req_id], plan.num_scheduled[req_id]
            ids.extend(req.tokens[start : start + n])
            pos = np.arange(start + n)
            table = np.asarray(plan.block_ids[req_id], dtype=np.int64)
            slots = table[pos // bs] * bs + pos % bs
            positions.append(pos[start:])
            new_slots.append(slots[start:])
            context_slots.append(slots)
        dev = self.device
        flat_context = torch.from_numpy(np.concatenate(context_slots)).to(dev)
        seqs = []
        row = 0
        offset = 0
        for req_id, slots in zip(plan.order, context_slots, strict=True):
            n = plan.num_scheduled[req_id]
            seqs.append(
                SeqSlice(
                    row_start=row,
                    row_end=row + n,
                    context_len=len(slots),
                    context_slots=flat_context[offset : offset + len(slots)],
                )
            )
            row += n
            offset += len(slots)
        hidden: torch.Tensor = self.model(
            torch.tensor(ids, dtype=torch.long).to(dev),
            torch.from_numpy(np.concatenate(positions)).to(dev),
            torch.from_numpy(np.concatenate(new_slots)).to(dev),
            seqs,
            self.kv_cache,
        )
        return hidden

    def _update(
        self, plan: StepPlan, hidden: torch.Tensor, running: Mapping[str, _Request]
    ) -> list[EndedRecord]:
        rows: list[int] = []
        sampled: list[_Request] = []
        self.scheduler.commit(dict(plan.num_scheduled))
        row = 0
        for req_id in plan.order:
            run = running[req_id]
            row += plan.num_scheduled[req_id]
            if run.sim.computed == len(run.sim.tokens):
                rows.append(row - 1)
                sampled.append(run)
        ended: list[EndedRecord] = []
        if not sampled:
            return ended
        tokens = self.model.greedy(hidden[torch.tensor(rows, device=hidden.device)])
        for run, token in zip(sampled, tokens, strict=True):
            run.sim.append(token)
            run.output.append(token)
            spec = run.spec
            if len(run.output) >= spec.max_tokens:
                ended.append(EndedRecord(req_id=spec.req_id, aborted=False))
            elif spec.abort_after is not None and len(run.output) >= spec.abort_after:
                ended.append(EndedRecord(req_id=spec.req_id, aborted=True))
            else:
                continue
            # The blocks are free for the next step's scheduler (tail first); the sink hears of
            # the end in that step's begin_step, before any forward can write the recycled slots.
            self.scheduler.end(spec.req_id, abort=ended[-1].aborted)
        return ended
