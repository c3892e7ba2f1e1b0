"""The engine side of `CacheMachine`: what its engine knows of its requests, and what it draws.

`_EngineDraws` is the machine's base class. It holds the request ids the machine uses (`REQS`,
and `OUTSIDER`, an id that never starts: the request a step does not carry), the shape of the KV cache the engine schedules over
(`num_blocks` blocks of `block_size` slots), the reference model, and the engine's own view of
its live requests: their block lists and hits, the KV their positions are in, and the slots some
save wrote. From these it draws what the engine asks of the cache: save layouts (`_draw_spec`),
a resumed request's block list and hit around its delivery cursor (`_draw_resume`), and the
malformed records and layouts of the `misuse` rule (`_bad_events`, `_bad_lifecycle`,
`_bad_spec`). It calls no driver: running what it draws and checking the outcome is the rules'
part, in `omni_cache_core.testing._machine`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine

from omni_cache_core._contract import (
    HIDDEN_KEY,
    ModelCachePolicy,
    PrefixCacheConfig,
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
    ReqId,
    TensorName,
)
from omni_cache_core.testing._interface import DEFERRED_KEY, MM_KEY, SaveSpec, row_value
from omni_cache_core.testing._model import ReferenceModel

__all__ = ["OUTSIDER", "REQS"]

#: Request ids the machine uses; a finished id may start again (HIT-2).
REQS: tuple[ReqId, ...] = tuple(ReqId(f"r{i}") for i in range(4))
OUTSIDER = ReqId("outsider")


class _EngineDraws(RuleBasedStateMachine):
    """The engine's view of a run and the draws of its inputs (see the module docstring)."""

    #: The engine's KV cache: `num_blocks` blocks of `block_size` slots.
    num_blocks: ClassVar[int] = 4
    block_size: ClassVar[int] = 2

    def __init__(self) -> None:
        super().__init__()
        self.model = ReferenceModel(
            PrefixCacheConfig(num_blocks=1, block_size=1), ModelCachePolicy()
        )
        #: Per live request: its block ids and how many of them its hit covered.
        self.blocks: dict[ReqId, tuple[tuple[int, ...], int]] = {}
        #: The engine's view of each live request's KV: position -> (slot, the row that was
        #: there when the request's KV got there: ``(admission, position)`` of its writer).
        self.kv: dict[ReqId, dict[int, tuple[int, tuple[int, int] | None]]] = {}
        self.attempt = 0
        #: Slots some successful save wrote.
        self.written_slots: set[int] = set()

    def _hit_blocks(self, req_id: ReqId) -> tuple[int, ...]:
        """The blocks a live request's start hit."""
        blocks, hit_blocks = self.blocks.get(req_id, ((), 0))
        return blocks[:hit_blocks]

    def _own_offset(self, req_id: ReqId) -> int:
        """How many rows the request computed since its hit: its next own slot's index."""
        _, hit_blocks = self.blocks.get(req_id, ((), 0))
        return self.model.admission_of[req_id].computed - hit_blocks * self.block_size

    def _cached_prefix(self, req_id: ReqId) -> list[int]:
        """Blocks that still hold the request's first positions, in order.

        Block ``k`` of the result holds positions ``[k * block_size, (k + 1) * block_size)``
        at its offsets, and no save rewrote those slots since the request's KV got there (its
        own rows, or the rows its hit read): what an engine's prefix cache still has after a
        preemption.
        """
        bs = self.block_size
        kv = self.kv.get(req_id, {})
        out: list[int] = []
        for k in range(self.num_blocks):
            held = [kv.get(k * bs + o) for o in range(bs)]
            first = held[0]
            block = -1 if first is None else first[0] // bs
            if any(
                h is None or h[0] != block * bs + o or self.model.writer_of(h[0]) != h[1]
                for o, h in enumerate(held)
            ):
                break
            out.append(block)
        return out

    def _note_kv(self, req_id: ReqId, positions: Iterable[tuple[int, int]]) -> None:
        """The request's KV of these ``(position, slot)`` is now there (a hit or a save)."""
        kv = self.kv.setdefault(req_id, {})
        for pos, slot in positions:
            kv[pos] = (slot, self.model.writer_of(slot))

    def _draw_resume(
        self, req_id: ReqId, data: st.DataObject, freed: Sequence[int]
    ) -> tuple[tuple[int, ...], int, list[str]]:
        """A resumed request's new block list, its hit and how the hit ends (LIFE-4, DLV-3).

        The hit ends nowhere (no hit), below, at or above the delivery cursor, over every block
        that still holds the request's own rows, or beyond every position it computed (blocks
        another request wrote, a shared prefix). Blocks that still hold its rows come first;
        further hit blocks are blocks some save wrote. One or two blocks to compute in follow,
        given-back blocks first.
        """
        bs, nb = self.block_size, self.num_blocks
        admission = self.model.admission_of[req_id]
        cursor, computed = admission.cursor, admission.computed
        cached = self._cached_prefix(req_id)
        ends = [0, (cursor // bs + 1) * bs, (computed // bs + 1) * bs, len(cached) * bs]
        if cursor > bs:
            ends += [(cursor - 1) // bs * bs] * 3
        if cursor and cursor % bs == 0:
            ends += [cursor] * 3
        hit_end = data.draw(st.sampled_from([e for e in ends if e <= nb * bs]))
        hit_blocks = hit_end // bs
        blocks = cached[:hit_blocks]
        written = sorted({s // bs for s in self.written_slots})
        while len(blocks) < hit_blocks:
            blocks.append(
                data.draw(st.sampled_from([b for b in [*written, *range(nb)] if b not in blocks]))
            )
        for _ in range(data.draw(st.integers(1, 2))):
            spare = [b for b in [*freed, *freed, *range(nb)] if b not in blocks]
            if spare:
                blocks.append(data.draw(st.sampled_from(spare)))
        if not hit_end:
            cases = ["resume without a hit"]
        else:
            where = {-1: "below", 0: "at", 1: "above"}[(hit_end > cursor) - (hit_end < cursor)]
            cases = [f"resume hit {where} the cursor"]
            if hit_end > computed:
                cases.append("resume hit beyond what was computed")
            if hit_blocks <= len(cached):
                cases.append("resume hit over blocks that stayed cached")
        return tuple(blocks), hit_blocks, cases

    def _slots_of(self, req_id: ReqId) -> list[int]:
        """Slots a request computes, in order: its blocks past the hit (the last if all hit)."""
        bs = self.block_size
        blocks, hit_blocks = self.blocks.get(req_id, ((), 0))
        own = blocks[hit_blocks:] or blocks[-1:]
        return [b * bs + o for b in own for o in range(bs)]

    def _draw_spec(self, data: st.DataObject, *, max_rows: int = 3) -> SaveSpec:
        # Requests whose hit waits for this save are in it (D10), others often; at most 3.
        # A request whose hit was lost (D10) cannot be saved again; it waits for its finish.
        saveable = sorted(self.model.running - self.model.lost)
        hits = [r for r in saveable if r in self.model.hits]
        others = [
            r
            for r in saveable
            if r not in self.model.hits and data.draw(st.sampled_from([True, True, False]))
        ]
        chosen = hits + others[: max(0, 3 - len(hits))]
        reqs = list(data.draw(st.permutations(chosen))) if chosen else []
        every = list(range(self.num_blocks * self.block_size))
        used: set[int] = set()
        runs: list[tuple[int, ...]] = []
        # Rarely, two requests write one slot in the same step: its last row wins (TASK-5).
        overlap = data.draw(st.sampled_from([False] * 5 + [True]))
        for req_id in reqs:
            own = self._slots_of(req_id)
            # Mostly one to three rows; sometimes none (a request scheduled for 0 tokens).
            count = min(max_rows, data.draw(st.sampled_from([1, 2, 3, 1, 2, 0])))
            how = data.draw(
                st.sampled_from(["next", "next", "recompute", "anywhere", "recycle", "recycle"])
            )
            # Slots a delayed read of an open step planned on (HIT-6).
            planned = sorted(
                {
                    slot
                    for step_id in self.model.open_step_ids()
                    for slots in self.model.saved(step_id).hits.values()
                    for slot in slots
                }
            )
            if how == "recycle" and planned:
                # The engine recycles a block that an unconsumed step's hit read from.
                run = data.draw(
                    st.lists(
                        st.sampled_from(planned),
                        unique=True,
                        min_size=min(1, count),
                        max_size=count,
                    )
                )
            elif how in ("anywhere", "recycle") or not own:
                # A slot of any block: a recycled block, another tenant's block.
                run = data.draw(st.lists(st.sampled_from(every), unique=True, max_size=count))
            else:
                # The request's next positions, in the slots its block list gives them (so a
                # resume may find them still cached); "recompute" writes from its first own slot
                # again (its own deferred write may have lost those slots meanwhile: SLOT-5).
                at = 0 if how == "recompute" else self._own_offset(req_id)
                run = [own[(at + i) % len(own)] for i in range(min(count, len(own)))]
            if not overlap:
                run = [s for s in run if s not in used]
            used.update(run)
            runs.append(tuple(run))
        n = sum(len(r) for r in runs)
        keys: list[TensorName] = []
        if n:
            if self.model.policy.needs_full_hidden_states:
                keys.append(HIDDEN_KEY)
            # Sparse keys (SLOT-4, OUT-6): each mm key is emitted on some steps only.
            if data.draw(st.booleans()):
                keys.append(MM_KEY)
            if data.draw(st.booleans()):
                keys.append(DEFERRED_KEY)
        self.attempt += 1
        values = tuple((k, tuple(row_value(self.attempt, r, k) for r in range(n))) for k in keys)
        return SaveSpec(req_ids=tuple(reqs), slots=tuple(runs), values=values)

    def _bad_events(self, kind: str, req_id: ReqId) -> list[PrefixCacheRequestEvent]:
        bs, nb = self.block_size, self.num_blocks
        hit_end, blocks = {
            "unaligned hit": (bs + 1, (0, 1)),
            "hit without blocks": (bs, ()),
            "hit with too few blocks": (2 * bs, (0,)),
            "hit block out of range": (bs, (nb,)),
            "started twice": (0, (0,)),
        }[kind]
        event = PrefixCacheRequestEvent(
            req_id=req_id, kind=PrefixCacheEventKind.STARTED, hit_end=hit_end, block_ids=blocks
        )
        return [event, event] if kind == "started twice" else [event]

    def _bad_lifecycle(
        self, kind: str, data: st.DataObject
    ) -> list[PrefixCacheRequestEvent] | None:
        """Records that LIFE-2 forbids in the requests' current states; None: no such state."""
        model = self.model
        running, preempted = sorted(model.running), sorted(model.preempted)
        outside = next(r for r in (*REQS, OUTSIDER) if r not in model.live)
        kinds = PrefixCacheEventKind

        def record(req_id: ReqId, kind: PrefixCacheEventKind) -> PrefixCacheRequestEvent:
            return PrefixCacheRequestEvent(req_id=req_id, kind=kind, scheduled_tokens=1)

        if kind == "resume a running request":
            # RESUMED of a running request, or of one that is not live at all.
            req_id = data.draw(st.sampled_from(running)) if running else outside
            return [record(req_id, kinds.RESUMED)]
        if kind == "preempt twice":
            if preempted:
                return [record(data.draw(st.sampled_from(preempted)), kinds.PREEMPTED)]
            if running:
                req_id = data.draw(st.sampled_from(running))
                return [record(req_id, kinds.PREEMPTED), record(req_id, kinds.PREEMPTED)]
            return [record(outside, kinds.PREEMPTED)]
        if kind == "preempt after the end":
            req_id = data.draw(st.sampled_from(running)) if running else outside
            return [record(req_id, kinds.FINISHED), record(req_id, kinds.PREEMPTED)]
        if kind == "start a preempted request":
            if preempted:
                return [record(data.draw(st.sampled_from(preempted)), kinds.STARTED)]
            if not running:
                return None
            # Preempted by this very step: LIFE-2 applies the preemption first.
            req_id = data.draw(st.sampled_from(running))
            return [record(req_id, kinds.STARTED), record(req_id, kinds.PREEMPTED)]
        assert kind == "start and resume in one step", kind
        req_id = data.draw(st.sampled_from(preempted or list(REQS)))
        return [record(req_id, kinds.STARTED), record(req_id, kinds.RESUMED)]

    def _bad_spec(self, kind: str) -> SaveSpec:
        live = sorted(self.model.live)
        caches_hidden = self.model.policy.needs_full_hidden_states
        keys = [MM_KEY]
        if kind == "hit request left out":
            return SaveSpec(req_ids=(), slots=())  # D10: the pending hit would vanish
        if kind == "save a preempted request":
            reqs, slots = (sorted(self.model.preempted)[0],), ((0,),)  # LIFE-3, D9
        elif kind == "request not live" or not live:
            dead = next(r for r in (*REQS, OUTSIDER) if r not in self.model.live)
            reqs, slots = (dead,), ((0,),)
        elif kind == "slot out of range":
            reqs, slots = (live[0],), ((self.num_blocks * self.block_size,),)
        else:
            reqs, slots = (live[0],), ((0,),)
            caches_hidden = not caches_hidden  # hidden missing, or given to a policy without it
        if caches_hidden:
            keys.append(HIDDEN_KEY)
        self.attempt += 1
        return SaveSpec(
            req_ids=reqs,
            slots=slots,
            values=tuple((k, (row_value(self.attempt, 0, k),)) for k in keys),
        )
