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
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import numpy as np
import torch
from attrs import define, field, frozen
from attrs.validators import gt

from ._model import ModelConfig, PagedKVCache, SeqSlice, TinyCausalLM
from ._workload import RequestSpec

__all__ = [
    "BlockAllocator",
    "EndedRecord",
    "Engine",
    "EngineConfig",
    "RunReport",
    "StartedRecord",
    "StepPlan",
    "StepSink",
    "block_hash",
]


def block_hash(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """Hash one full block of token ids, chained on the hash of the block before it.

    Args:
        parent: Hash of the previous block of the same sequence, None for the first block.
        tokens: The block's token ids.

    Returns:
        A 16-byte digest; equal digests mean equal token prefixes up to and including this block.
    """
    digest = hashlib.blake2b(parent or b"", digest_size=16)
    digest.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return digest.digest()


class BlockAllocator:
    """KV block pool with reference counts and a least-recently-freed reuse order."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        """Create ``num_blocks`` free, uncached blocks.

        Args:
            num_blocks: Number of KV blocks.
            block_size: Tokens per block.
        """
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref_count = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        # Insertion order is reuse order: the front is the block freed longest ago.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self._ever_allocated = [False] * num_blocks
        #: Cached blocks whose hash was dropped because the block was handed out again.
        self.evictions = 0
        #: Allocations of a block that some earlier request already wrote (slots recycled).
        self.reuses = 0

    @property
    def num_free(self) -> int:
        """Blocks with no reference, cached or not."""
        return len(self._free)

    def count_unreferenced(self, block_ids: Sequence[int]) -> int:
        """Return how many of ``block_ids`` sit in the free queue (touching them takes them out)."""
        return sum(1 for b in block_ids if self._ref_count[b] == 0)

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """Return the cached blocks of the longest prefix of ``hashes`` that is cached."""
        found = []
        for h in hashes:
            block = self._cached.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a reference on cached blocks a request hits."""
        for b in block_ids:
            if self._ref_count[b] == 0:
                del self._free[b]
            self._ref_count[b] += 1

    def allocate(self, count: int) -> list[int]:
        """Hand out ``count`` blocks, least recently freed first, evicting their hashes.

        Raises:
            RuntimeError: Fewer than ``count`` blocks are free; nothing is allocated.
        """
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} KV blocks, {len(self._free)} free")
        blocks = []
        for _ in range(count):
            b, _ = self._free.popitem(last=False)
            old = self._hash[b]
            if old is not None:
                del self._cached[old]
                self._hash[b] = None
                self.evictions += 1
            if self._ever_allocated[b]:
                self.reuses += 1
            self._ever_allocated[b] = True
            self._ref_count[b] = 1
            blocks.append(b)
        return blocks

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block; unreferenced ones join the free queue, tail first."""
        for b in reversed(block_ids):
            self._ref_count[b] -= 1
            if self._ref_count[b] == 0:
                self._free[b] = None

    def cache(self, block_id: int, h: bytes) -> bool:
        """Register a full block under its hash; False if another block already holds the hash."""
        if h in self._cached:
            return False
        self._cached[h] = block_id
        self._hash[block_id] = h
        return True

    def check_invariants(self) -> None:
        """Assert that reference counts, the free queue and the hash map agree."""
        for b in range(self.num_blocks):
            assert self._ref_count[b] >= 0, b
            assert (self._ref_count[b] == 0) == (b in self._free), b
        for h, b in self._cached.items():
            assert self._hash[b] == h, b


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
    tokens: list[int]
    num_computed: int
    block_ids: list[int]
    block_hashes: list[bytes]
    reserved_blocks: int
    output: list[int] = field(factory=list)


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
        self.allocator = BlockAllocator(config.num_blocks, config.block_size)
        self._reserved_blocks = 0
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
        self.allocator.check_invariants()
        assert self._reserved_blocks == 0, self._reserved_blocks
        return RunReport(
            outputs=outputs,
            aborted=frozenset(aborted),
            steps=steps_run,
            wall_s=wall_s,
            prompt_tokens=self._prompt_tokens,
            hit_tokens=self._hit_tokens,
            computed_tokens=self._computed_tokens,
            evictions=self.allocator.evictions,
            block_reuses=self.allocator.reuses,
            step_s=tuple(step_s),
            step_tokens=tuple(step_tokens),
            step_prompt_tokens=tuple(step_prompt),
            step_hit_tokens=tuple(step_hit),
            step_done=tuple(step_done),
        )

    def _prompt_hashes(self, prompt: Sequence[int]) -> list[bytes]:
        bs = self.config.block_size
        # Only blocks strictly before the last prompt token may hit: the last token must be
        # computed so that its hidden state yields the first output token.
        hashes: list[bytes] = []
        for i in range((len(prompt) - 1) // bs):
            hashes.append(block_hash(hashes[-1] if hashes else None, prompt[i * bs : (i + 1) * bs]))
        return hashes

    def _register_full_blocks(self, req: _Request, upto: int) -> None:
        if not self.config.enable_prefix_caching:
            return
        bs = self.config.block_size
        while (len(req.block_hashes) + 1) * bs <= upto:
            i = len(req.block_hashes)
            parent = req.block_hashes[-1] if req.block_hashes else None
            h = block_hash(parent, req.tokens[i * bs : (i + 1) * bs])
            # A duplicate (the same prefix computed twice) stays uncached; the chain goes on.
            self.allocator.cache(req.block_ids[i], h)
            req.block_hashes.append(h)

    def _ensure_blocks(self, req: _Request, upto: int) -> None:
        need = self._blocks_for(upto) - len(req.block_ids)
        if need > 0:
            assert need <= req.reserved_blocks, (req.spec.req_id, need, req.reserved_blocks)
            req.block_ids.extend(self.allocator.allocate(need))
            req.reserved_blocks -= need
            self._reserved_blocks -= need

    def _schedule(
        self,
        step: int,
        waiting: deque[RequestSpec],
        running: dict[str, _Request],
        ended: Sequence[EndedRecord],
    ) -> StepPlan:
        cfg = self.config
        budget = cfg.max_batched_tokens
        order: list[str] = []
        scheduled: dict[str, int] = {}
        computed: dict[str, int] = {}
        started: list[StartedRecord] = []
        for req_id, req in running.items():
            if budget == 0:
                break
            n = min(len(req.tokens) - req.num_computed, budget)
            self._ensure_blocks(req, req.num_computed + n)
            self._register_full_blocks(req, req.num_computed + n)
            order.append(req_id)
            scheduled[req_id] = n
            computed[req_id] = req.num_computed
            budget -= n
        while waiting and budget > 0 and len(running) < cfg.max_num_seqs:
            spec = waiting[0]
            hashes = self._prompt_hashes(spec.prompt) if cfg.enable_prefix_caching else []
            hit_blocks = self.allocator.lookup(hashes)
            hit_end = len(hit_blocks) * cfg.block_size
            prompt_blocks = self._blocks_for(len(spec.prompt)) - len(hit_blocks)
            total_blocks = self._blocks_for(len(spec.prompt) + spec.max_tokens - 1) - len(
                hit_blocks
            )
            available = self.allocator.num_free - self._reserved_blocks
            if total_blocks + self.allocator.count_unreferenced(hit_blocks) > available:
                break
            remaining = len(spec.prompt) - hit_end
            n = min(remaining, budget)
            if n < remaining and not cfg.enable_chunked_prefill:
                break
            waiting.popleft()
            self.allocator.touch(hit_blocks)
            req = _Request(
                spec=spec,
                tokens=list(spec.prompt),
                num_computed=hit_end,
                block_ids=hit_blocks + self.allocator.allocate(prompt_blocks),
                block_hashes=hashes[: len(hit_blocks)],
                reserved_blocks=total_blocks - prompt_blocks,
            )
            self._reserved_blocks += req.reserved_blocks
            self._register_full_blocks(req, hit_end + n)
            running[spec.req_id] = req
            self._prompt_tokens += len(spec.prompt)
            self._hit_tokens += hit_end
            order.append(spec.req_id)
            scheduled[spec.req_id] = n
            computed[spec.req_id] = hit_end
            started.append(
                StartedRecord(
                    req_id=spec.req_id,
                    hit_end=hit_end,
                    block_ids=tuple(req.block_ids),
                    scheduled_tokens=n,
                )
            )
            budget -= n
        self._computed_tokens += sum(scheduled.values())
        return StepPlan(
            step_index=step,
            order=tuple(order),
            num_scheduled=scheduled,
            num_computed=computed,
            block_ids={r: tuple(running[r].block_ids) for r in order},
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
            req = running[req_id]
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
        row = 0
        for req_id in plan.order:
            req = running[req_id]
            n = plan.num_scheduled[req_id]
            req.num_computed += n
            row += n
            if req.num_computed == len(req.tokens):
                rows.append(row - 1)
                sampled.append(req)
        ended: list[EndedRecord] = []
        if not sampled:
            return ended
        tokens = self.model.greedy(hidden[torch.tensor(rows, device=hidden.device)])
        for req, token in zip(sampled, tokens, strict=True):
            req.tokens.append(token)
            req.output.append(token)
            spec = req.spec
            if len(req.output) >= spec.max_tokens:
                ended.append(EndedRecord(req_id=spec.req_id, aborted=False))
            elif spec.abort_after is not None and len(req.output) >= spec.abort_after:
                ended.append(EndedRecord(req_id=spec.req_id, aborted=True))
            else:
                continue
            # The blocks are free for the next step's scheduler; the sink hears of the end in
            # that step's begin_step, before any forward can write the recycled slots.
            self.allocator.free(req.block_ids)
            self._reserved_blocks -= req.reserved_blocks
            req.reserved_blocks = 0
        return ended
