"""A simulated vLLM-style scheduler with prefix caching, for the demo, the soak and the tests.

Theory of operation. Requests carry their token sequence (the prompt, then what they generate;
a generating user appends tokens as it samples them), and each position's prefix hash
(`_oracle.prefix_hashes`). Full blocks are registered in the pool's hash table under the hash of
the position ending them as soon as a step schedules them, as vLLM does: a request admitted later
in the same step may hit a block another request computes in this very forward (HIT-5). A new
request hits the longest registered prefix of its full prompt blocks, capped so that at least one
prompt token is computed (the last token's hidden state picks the first output token).

A request is *live* (running) or *waiting* (preempted: its blocks went back to the free queue,
tail first, and stay registered until reused). A resumed request hits the longest registered
prefix of the tokens it knows and recomputes from there in chunks up to where it was. Ends,
preemptions, starts and resumes are told to a `RequestListener` as they happen, in the order a
model runner must hear them.

`Scheduler` holds the mechanism: `admit`, `preempt`, `resume`, `end`, `schedule` (a chunk for one
request this step), `commit` (the step ran) and `fail` (the step's forward failed). Two planning
policies drive it. `Scheduler.plan` is the randomized one of the soak and the tests (`Knobs`:
abort, preemption, resume, idle, chunk and recycling chances). A token-budget policy (the demo's:
first come first served, a step budget, no preemption) calls the mechanism itself with blocks
reserved up front (`admit(reserve_tokens=...)`, `grow`).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Protocol

from attrs import define, field, frozen
from attrs.validators import ge, gt

from ._blocks import BlockPool
from ._oracle import extend_hash, prefix_hashes

__all__ = [
    "Knobs",
    "RequestListener",
    "Scheduler",
    "SchedulerCounts",
    "SimRequest",
    "StepPlan",
]


class RequestListener(Protocol):
    """Hears every lifecycle record as the scheduler makes it (a model runner's inputs)."""

    def start(
        self,
        req: str,
        blocks: Sequence[int],
        *,
        hit_end: int = 0,
        tokens: Sequence[int] | None = None,
    ) -> None:
        """A request starts on ``blocks`` with ``hit_end`` tokens found in the prefix cache."""

    def finish(self, req: str, *, abort: bool = False) -> None:
        """A request ended (finished, or aborted); its blocks are free for the next step."""

    def preempt(self, req: str) -> None:
        """A request lost its blocks; it may resume later."""

    def resume(self, req: str, blocks: Sequence[int], *, hit_end: int = 0) -> None:
        """A preempted request runs again on ``blocks``, computing from ``hit_end``."""


@frozen(kw_only=True)
class Knobs:
    """The randomized policy's chances and sizes (`Scheduler.plan`).

    Attributes:
        max_running: Most live requests.
        max_chunk: Most prompt (or recompute) tokens one step schedules for a request.
        max_decode: Most tokens a request generates after its prompt.
        families: Prompt families; a prompt starts with whole blocks of one of them.
        family_blocks: Blocks of each family.
        admit_p: Chance, per admission slot, that the step admits one more request.
        abort_p: Chance, per step, that a live request is aborted.
        reuse_p: Chance that an admission takes the id of a request ended in this step (HIT-2).
        idle_p: Chance a live request gets no tokens in a step (in the layout with no rows).
        idle_fresh: Whether a request started or resumed in this step may get none too (else
            its first step always computes, so the first step of a run has rows).
        preempt_p: Chance, per step, a live request is preempted (four times that at a block
            boundary, where vLLM most often needs a new block).
        resume_p: Chance, per step, a preempted request resumes.
        same_step_resume_p: Chance a request preempted in this step may resume in it (LIFE-2).
        end_preempted_p: Chance, per step, a preempted request ends (half of them aborted).
        cut_hit_p: Chance a resume takes a random hit shorter than the longest.
        aim_hit_p: Chance a resume takes its hit at the block of the position ``aim`` names.
        mru_p: Chance an allocation takes the block freed last (`BlockPool`).
    """

    max_running: int = field(default=4, validator=gt(0))
    max_chunk: int = field(default=6, validator=gt(0))
    max_decode: int = field(default=4, validator=ge(0))
    families: int = field(default=3, validator=gt(0))
    family_blocks: int = field(default=3, validator=gt(0))
    admit_p: float = 0.7
    abort_p: float = 0.04
    reuse_p: float = 0.1
    idle_p: float = 0.04
    idle_fresh: bool = True
    preempt_p: float = 0.0
    resume_p: float = 0.5
    same_step_resume_p: float = 0.2
    end_preempted_p: float = 0.0
    cut_hit_p: float = 0.0
    aim_hit_p: float = 0.0
    mru_p: float = 0.5


@define
class SchedulerCounts:
    """What the scheduler exercised, so a run can show it covered the interesting cases."""

    admissions: int = 0
    hit_requests: int = 0
    hit_rows: int = 0
    #: Admissions that hit a block another request computes in that very step (HIT-5).
    same_step_hits: int = 0
    finishes: int = 0
    aborts: int = 0
    id_reuses: int = 0
    blocks_allocated: int = 0
    recycled_blocks: int = 0
    preemptions: int = 0
    resumes: int = 0
    resumes_with_hit: int = 0
    #: Resume hits beyond the prompt (the request's own generated blocks stayed cached).
    resume_beyond_prompt: int = 0
    #: Resume hits on a block another request computes in that very step (HIT-5).
    resume_same_step_hits: int = 0
    #: Requests preempted and resumed in one step (LIFE-2).
    same_step_resumes: int = 0
    preempted_finishes: int = 0
    preempted_aborts: int = 0


@define
class SimRequest:
    """The scheduler's side of a request.

    Attributes:
        req_id: The request id.
        tokens: The prompt, then the tokens generated so far (or all of them, known up front).
        keys: Per position, the hash of the token prefix ending there.
        prompt_len: Prompt tokens.
        blocks: KV blocks, in order (empty while preempted).
        computed: Tokens in its KV blocks (hits included); while preempted, how far it had come.
        prefill_end: Below it the request computes chunks, from it one token a step.
        reserved: Blocks promised to it and not allocated yet (budget policy).
    """

    req_id: str
    tokens: list[int]
    keys: list[int]
    prompt_len: int
    blocks: list[int]
    computed: int
    prefill_end: int
    reserved: int = 0

    def append(self, token: int) -> None:
        """Add a generated token (its position's hash follows from the one before)."""
        self.tokens.append(token)
        self.keys.append(extend_hash(self.keys[-1], token))


@frozen(kw_only=True)
class StepPlan:
    """What `Scheduler.plan` decided for one step.

    Attributes:
        schedule: Tokens per live request, in batch order.
        ended: Requests ended at the start of this step.
        resumed: (request, hit end) of each resume of this step.
    """

    schedule: dict[str, int]
    ended: tuple[str, ...]
    resumed: tuple[tuple[str, int], ...]


class Scheduler:
    """Requests, blocks and lifecycle records of a vLLM-style scheduler (module doc)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        listener: RequestListener,
        *,
        rng: random.Random | None = None,
        knobs: Knobs | None = None,
        counts: SchedulerCounts | None = None,
        aim: Callable[[str], int] | None = None,
        first_token: int = 1_000_000,
        prefix_caching: bool = True,
    ) -> None:
        """Create a scheduler over ``num_blocks`` free blocks of ``block_size`` tokens.

        Args:
            num_blocks: KV blocks.
            block_size: Tokens per block.
            listener: Hears the lifecycle records.
            rng: The randomized policy's draws (also the pool's recycling order); None for a
                deterministic user, whose blocks are recycled least recently freed first.
            knobs: The randomized policy's chances and sizes.
            counts: Where to count what was exercised (a user may pass a subclass with fields
                of its own).
            aim: For ``aim_hit_p``: the position a resume of the request should hit up to.
            first_token: The first of the fresh tokens that make each prompt's tail unique.
            prefix_caching: Register full blocks and hit them; False computes every token.
        """
        self.knobs = knobs if knobs is not None else Knobs()
        self.block_size = block_size
        self.listener = listener
        self.rng = rng if rng is not None else random.Random(0)
        self.pool = BlockPool(num_blocks, rng=rng, mru_p=self.knobs.mru_p)
        self.counts = counts if counts is not None else SchedulerCounts()
        self.aim = aim
        self.prefix_caching = prefix_caching
        self.live: dict[str, SimRequest] = {}
        self.waiting: dict[str, SimRequest] = {}  # preempted, oldest first
        #: Blocks promised to live requests and not allocated yet.
        self.reserved = 0
        self.families = [
            tuple(f * 10_000 + i for i in range(self.knobs.family_blocks * block_size))
            for f in range(self.knobs.families)
        ]
        self._next_req = 0
        self._next_token = first_token
        # This step's blocks: scheduled for computing, and registered (dropped if it fails).
        self._producing: set[int] = set()
        self._registered: list[tuple[int, int]] = []
        self._preempted_now: set[str] = set()

    # Mechanism --------------------------------------------------------------------------------

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold ``tokens`` tokens."""
        return -(-tokens // self.block_size)

    def cached_blocks(self, keys: Sequence[int], limit: int) -> int:
        """How many leading full blocks of a sequence are registered, at most ``limit``."""
        size = self.block_size
        count = 0
        while count < limit and self.pool.is_registered(keys[(count + 1) * size - 1]):
            count += 1
        return count

    def hit_blocks(self, keys: Sequence[int], hit: int) -> list[int]:
        """The registered blocks of the first ``hit`` full blocks of a sequence."""
        size = self.block_size
        return self.pool.lookup(keys[(i + 1) * size - 1] for i in range(hit))

    def _take(
        self, keys: Sequence[int], hit: int, now_tokens: int, reserve: int
    ) -> list[int] | None:
        """The hit blocks plus fresh ones for ``now_tokens``, with ``reserve`` more promised."""
        hit_blocks = self.hit_blocks(keys, hit)
        needed = self.blocks_for(now_tokens) - hit
        # Blocks promised to other requests are not free for this one.
        free = self.pool.num_free - self.reserved - self.pool.count_unreferenced(hit_blocks)
        if needed + reserve > free:
            return None
        blocks = self.pool.take(hit_blocks, needed)
        if blocks is not None:
            self.reserved += reserve
            self.counts.blocks_allocated = self.pool.allocations
            self.counts.recycled_blocks = self.pool.recycled
        return blocks

    def admit(
        self,
        req_id: str,
        tokens: Sequence[int],
        prompt_len: int,
        *,
        hit_cap: int | None = None,
        reserve_tokens: int = 0,
    ) -> SimRequest | None:
        """Start a request with its longest prompt hit; None when its blocks do not fit.

        Args:
            req_id: The id (may be one that ended earlier: a new admission, LIFE-1).
            tokens: Its tokens (all of them, or the prompt of a request that generates).
            prompt_len: Prompt tokens.
            hit_cap: Most hit tokens (None: the longest registered prefix).
            reserve_tokens: Tokens beyond ``tokens`` to promise blocks for (allocated by `grow`).
        """
        keys = prefix_hashes(tokens)
        hit = self.cached_blocks(keys, (prompt_len - 1) // self.block_size)
        if not self.prefix_caching:
            hit = 0
        if hit_cap is not None:
            hit = min(hit, hit_cap // self.block_size)
        total = len(tokens) + reserve_tokens
        reserve = self.blocks_for(total) - self.blocks_for(len(tokens))
        blocks = self._take(keys, hit, len(tokens), reserve)
        if blocks is None:
            return None
        hit_end = hit * self.block_size
        req = SimRequest(
            req_id, list(tokens), keys, prompt_len, blocks, hit_end, prompt_len, reserve
        )
        counts = self.counts
        counts.admissions += 1
        if hit:
            counts.hit_requests += 1
            counts.hit_rows += hit_end
            if any(b in self._producing for b in blocks[:hit]):
                counts.same_step_hits += 1
        self.listener.start(req_id, blocks, hit_end=hit_end, tokens=tokens)
        self.live[req_id] = req
        return req

    def grow(self, req: SimRequest, upto: int) -> None:
        """Allocate promised blocks so the request's blocks cover ``upto`` tokens."""
        need = self.blocks_for(upto) - len(req.blocks)
        if need > 0:
            assert need <= req.reserved, (req.req_id, need, req.reserved)
            req.blocks.extend(self.pool.allocate(need))
            req.reserved -= need
            self.reserved -= need
            self.counts.blocks_allocated = self.pool.allocations
            self.counts.recycled_blocks = self.pool.recycled

    def end(self, req_id: str, *, abort: bool) -> None:
        """End a live or preempted request; a live one's blocks go back, tail first."""
        req = self.live.pop(req_id, None)
        self.listener.finish(req_id, abort=abort)
        counts = self.counts
        if req is None:
            del self.waiting[req_id]  # its blocks went back when it was preempted
            if abort:
                counts.preempted_aborts += 1
            else:
                counts.preempted_finishes += 1
            return
        self.pool.release(reversed(req.blocks))
        self.reserved -= req.reserved
        req.reserved = 0
        if abort:
            counts.aborts += 1
        else:
            counts.finishes += 1

    def preempt(self, req_id: str) -> None:
        """Take a live request's blocks (tail first, like vLLM); it waits to resume (LIFE-3)."""
        req = self.live.pop(req_id)
        self.listener.preempt(req_id)
        self.pool.release(reversed(req.blocks))
        self.reserved -= req.reserved
        req.reserved = 0
        req.blocks = []
        self.waiting[req_id] = req
        self._preempted_now.add(req_id)
        self.counts.preemptions += 1

    def resume(self, req_id: str, *, hit: int | None = None) -> int | None:
        """Resume a preempted request (LIFE-4); return its hit end, None if it does not fit.

        It hits ``hit`` blocks (default: the longest registered prefix of the tokens it knows:
        its prompt, or what it computed plus the token it sampled last) and recomputes up to
        where it was.
        """
        req = self.waiting[req_id]
        known = max(req.prompt_len, req.computed + 1)
        if hit is None:
            hit = self.cached_blocks(req.keys, (known - 1) // self.block_size)
        blocks = self._take(req.keys, hit, len(req.tokens), 0)
        if blocks is None:
            return None
        hit_end = hit * self.block_size
        self.listener.resume(req_id, blocks, hit_end=hit_end)
        req.blocks = blocks
        req.computed = hit_end
        req.prefill_end = known
        self.live[req_id] = self.waiting.pop(req_id)
        counts = self.counts
        counts.resumes += 1
        counts.resumes_with_hit += hit_end > 0
        counts.same_step_resumes += req_id in self._preempted_now
        counts.resume_beyond_prompt += hit_end > req.prompt_len
        counts.resume_same_step_hits += any(b in self._producing for b in blocks[:hit])
        return hit_end

    def schedule(self, req: SimRequest, count: int) -> None:
        """Schedule ``count`` tokens of a live request: register the full blocks they complete.

        vLLM caches a block when it is scheduled, before the forward computes it (HIT-5).
        """
        size = self.block_size
        self.grow(req, req.computed + count)
        for i in range(req.computed // size, (req.computed + count) // size):
            block = req.blocks[i]
            self._producing.add(block)
            key = req.keys[(i + 1) * size - 1]
            if self.prefix_caching and self.pool.register(block, key):
                self._registered.append((key, block))
        for pos in range(req.computed, req.computed + count):
            self.pool.mark_written(req.blocks[pos // size])

    def begin_step(self) -> None:
        """Start planning a step: no block is being computed or registered in it yet."""
        self._producing = set()
        self._registered = []
        self._preempted_now = set()

    def commit(self, schedule: dict[str, int]) -> None:
        """The step ran: each scheduled request computed its tokens."""
        for req_id, count in schedule.items():
            req = self.live.get(req_id)
            if req is not None:
                req.computed += count

    def fail(self, schedule: dict[str, int]) -> None:
        """The step's forward failed (STEP-5): publish none of its blocks, abort its requests.

        As after a failed forward in vLLM (D6, D10); the aborts reach the listener for the next
        step.
        """
        for key, block in self._registered:
            self.pool.unregister(block, key)
        self._registered = []
        for req_id in schedule:
            if req_id in self.live:
                self.end(req_id, abort=True)

    def drain(self) -> None:
        """End every live and preempted request (finished)."""
        for req_id in [*self.live, *self.waiting]:
            self.end(req_id, abort=False)

    # The randomized policy --------------------------------------------------------------------

    def plan(self) -> StepPlan:
        """Plan one randomized step (`Knobs`): ends, preemptions, chunks, resumes, admissions.

        Every step: finish requests that are done and abort a few at random; end some preempted
        ones; preempt live ones; schedule a prefill chunk or one decode token for each live
        request, now and then none; resume preempted requests (preempted ones come back before
        new ones) with the longest registered prefix of the tokens they know as their hit, or a
        random shorter one (``cut_hit_p``), or one ending at the position ``aim`` names
        (``aim_hit_p``); admit new requests, whose prompts share whole blocks of a few families,
        some under the id of a request that ended in this step.
        """
        knobs = self.knobs
        rng = self.rng
        ended = self._end_requests()
        self.begin_step()
        if knobs.preempt_p:
            self._preempt()
        schedule: dict[str, int] = {}
        for req in self.live.values():
            self._schedule_one(req, schedule)
        resumed: list[tuple[str, int]] = []
        for req_id in list(self.waiting):
            if len(self.live) >= knobs.max_running:
                break
            back = req_id not in self._preempted_now or rng.random() < knobs.same_step_resume_p
            if back and rng.random() < knobs.resume_p:
                hit_end = self.resume(req_id, hit=self._resume_hit(self.waiting[req_id]))
                if hit_end is None:
                    break
                self._schedule_one(self.live[req_id], schedule, fresh=True)
                resumed.append((req_id, hit_end))
        while len(self.live) < knobs.max_running and rng.random() < knobs.admit_p:
            if ended and rng.random() < knobs.reuse_p:
                req_id = ended.pop()  # HIT-2: ended and admitted again in one step
                self.counts.id_reuses += 1
            else:
                req_id = f"r{self._next_req}"
                self._next_req += 1
            admitted = self._admit_random(req_id)
            if admitted is None:
                break
            self._schedule_one(admitted, schedule, fresh=True)
        return StepPlan(schedule=schedule, ended=tuple(ended), resumed=tuple(resumed))

    def _end_requests(self) -> list[str]:
        rng = self.rng
        knobs = self.knobs
        ended: list[str] = []
        for req_id, req in list(self.live.items()):
            done = req.computed >= len(req.tokens)
            if done or rng.random() < knobs.abort_p:
                self.end(req_id, abort=not done)
                ended.append(req_id)
        for req_id in list(self.waiting):
            chance = rng.random()
            if chance < knobs.end_preempted_p:
                # LIFE-2: a preempted request may end.
                self.end(req_id, abort=chance < knobs.end_preempted_p / 2)
                ended.append(req_id)
        return ended

    def _preempt(self) -> None:
        for req_id, req in list(self.live.items()):
            # vLLM preempts a request when it needs a new block and none is free: most often
            # at a block boundary.
            boundary = req.computed % self.block_size == 0
            if self.rng.random() >= self.knobs.preempt_p * (4 if boundary else 1):
                continue
            self.preempt(req_id)

    def _resume_hit(self, req: SimRequest) -> int:
        knobs = self.knobs
        known = max(req.prompt_len, req.computed + 1)
        longest = self.cached_blocks(req.keys, (known - 1) // self.block_size)
        chance = self.rng.random()
        if chance < knobs.cut_hit_p:
            return self.rng.randint(0, longest)
        if chance < knobs.cut_hit_p + knobs.aim_hit_p and self.aim is not None:
            return min(longest, self.aim(req.req_id) // self.block_size)
        return longest

    def _admit_random(self, req_id: str) -> SimRequest | None:
        rng = self.rng
        size = self.block_size
        family = self.families[rng.randrange(len(self.families))]
        shared = rng.randrange(0, len(family) // size + 1) * size
        tail = rng.randint(1, 2 * size + 1)
        decode = rng.randint(0, self.knobs.max_decode)
        fresh = self._next_token
        prompt = (*family[:shared], *range(fresh, fresh + tail))
        tokens = (*prompt, *range(fresh + tail, fresh + tail + decode))
        req = self.admit(req_id, tokens, len(prompt))
        if req is not None:
            self._next_token += tail + decode
        return req

    def _schedule_one(
        self, req: SimRequest, schedule: dict[str, int], *, fresh: bool = False
    ) -> None:
        rng = self.rng
        may_idle = self.knobs.idle_fresh or not fresh
        if may_idle and rng.random() < self.knobs.idle_p:
            count = 0  # in the layout with no rows this step
        elif req.computed < req.prefill_end:
            count = min(rng.randint(1, self.knobs.max_chunk), req.prefill_end - req.computed)
        else:
            count = 1
        schedule[req.req_id] = count
        self.schedule(req, count)
