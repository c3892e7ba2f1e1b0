"""The second stage ("talker") and the sinks that feed it from the engine.

Two ways to feed the talker:

* ``DirectSink`` hands it the rows the forward computed, nothing else. Without prefix caching that
  is every row of every request: the reference. With prefix caching the hit prefix rows are
  missing, which is the gap the omni cache exists to fill.
* ``OmniSink`` drives the omni prefix cache the way an engine integration does: the step's request
  events before the forward, ``save_outputs`` after it, and ``materialize`` one step late on an
  output-builder thread, whose merged rows (hit prefix from the cache, then this step's rows) are
  what the talker receives.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from attrs import frozen
from torch import nn

from ._engine import EndedRecord, StepPlan

if TYPE_CHECKING:
    from omni_cache_cuda import OmniPrefixCacheManager, StepId

__all__ = ["TALKER_KEY", "DirectSink", "OmniSink", "Talker"]

#: Name of the per-token multimodal tensor the thinker emits for the talker.
TALKER_KEY = "talker.h"


@frozen(kw_only=True)
class _Chunk:
    start: int
    hidden: torch.Tensor
    talker_h: torch.Tensor


class Talker:
    """Second stage: collects each request's hidden rows and summarises its full prompt.

    Rows arrive as chunks tagged with the position of their first row. Once a request has rows
    for its whole prompt, a small linear head turns them into a per-request "voice" vector; that
    is the computation that needs the FULL prompt hidden states, prefix included.
    """

    def __init__(self, prompt_lens: Mapping[str, int], *, d_model: int, width: int = 16) -> None:
        """Create a talker for the given requests.

        Args:
            prompt_lens: Prompt length per request id.
            d_model: Width of the hidden rows it receives.
            width: Width of the voice vector.
        """
        self.prompt_lens = dict(prompt_lens)
        self._head = nn.Linear(d_model, width)
        gen = torch.Generator().manual_seed(1234)
        nn.init.normal_(self._head.weight, std=d_model**-0.5, generator=gen)
        nn.init.zeros_(self._head.bias)
        self._head.requires_grad_(False)
        self._chunks: dict[str, list[_Chunk]] = {}
        self._rows: dict[str, int] = {}
        self.voices: dict[str, torch.Tensor] = {}

    def consume(
        self, req_id: str, start: int, hidden: torch.Tensor, talker_h: torch.Tensor
    ) -> None:
        """Take one chunk of a request's rows.

        Args:
            req_id: Request id.
            start: Position of the chunk's first row in the request.
            hidden: ``(rows, d_model)`` hidden states.
            talker_h: ``(rows, talker_width)`` per-token talker features.
        """
        if hidden.shape[0] != talker_h.shape[0]:
            raise ValueError(
                f"{req_id}: {hidden.shape[0]} hidden rows but {talker_h.shape[0]} {TALKER_KEY} rows"
            )
        chunk = _Chunk(start=start, hidden=hidden.detach().cpu(), talker_h=talker_h.detach().cpu())
        self._chunks.setdefault(req_id, []).append(chunk)
        if start == self._rows.get(req_id, 0):
            self._rows[req_id] = start + hidden.shape[0]
            prompt_len = self.prompt_lens[req_id]
            if req_id not in self.voices and self._rows[req_id] >= prompt_len:
                full = torch.cat([c.hidden for c in self._chunks[req_id]])[:prompt_len]
                with torch.inference_mode():
                    self.voices[req_id] = torch.tanh(self._head(full)).mean(dim=0)

    def chunks(self, req_id: str) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """Return a request's chunks as (start, hidden, talker_h), in arrival order."""
        return [(c.start, c.hidden, c.talker_h) for c in self._chunks.get(req_id, [])]

    def rows(self, req_id: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Return a request's hidden and talker rows from position 0 on, in one piece.

        Raises:
            ValueError: The chunks do not tile ``0 .. n`` without gaps or overlaps.
        """
        chunks = self._chunks.get(req_id, [])
        pos = 0
        for c in chunks:
            if c.start != pos:
                raise ValueError(f"{req_id}: chunk at {c.start}, expected one at {pos}")
            pos += c.hidden.shape[0]
        if not chunks:
            raise ValueError(f"{req_id}: no rows received")
        return torch.cat([c.hidden for c in chunks]), torch.cat([c.talker_h for c in chunks])


class DirectSink:
    """Feeds the talker the rows each forward computed, and nothing from any cache."""

    def __init__(self, talker: Talker) -> None:
        """Feed ``talker``."""
        self.talker = talker

    def begin_step(self, plan: StepPlan) -> None:
        """Do nothing: no cache to tell."""

    def end_step(self, plan: StepPlan, hidden: torch.Tensor, talker_h: torch.Tensor) -> None:
        """Hand each request its computed rows, tagged with their first position."""
        hidden, talker_h = hidden.cpu(), talker_h.cpu()
        row = 0
        for req_id in plan.order:
            n = plan.num_scheduled[req_id]
            self.talker.consume(
                req_id, plan.num_computed[req_id], hidden[row : row + n], talker_h[row : row + n]
            )
            row += n

    def finish(self, ended: Sequence[EndedRecord]) -> None:
        """Do nothing: everything was delivered at once."""


@frozen(kw_only=True)
class _Job:
    step_id: StepId
    order: tuple[str, ...]
    starts: Mapping[str, int]


class OmniSink:
    """Drives an ``OmniPrefixCacheManager`` and feeds the talker from an output-builder thread.

    The engine thread calls ``begin_step`` (request events), then ``end_step`` (save). The step id
    of step k is handed to the builder only after step k+1 was saved, so every ``materialize``
    runs one step late and concurrently with the engine's next step (CONC-3), as with an async
    output processor.
    """

    def __init__(
        self,
        mgr: OmniPrefixCacheManager,
        talker: Talker,
        *,
        block_size: int,
        api: Any = None,
    ) -> None:
        """Start the output-builder thread.

        Args:
            mgr: The cache manager, owned by the caller.
            talker: The second stage.
            block_size: KV block size of the engine.
            api: Where the request-event and layout types come from: the ``omni_cache_cuda``
                package when None (tests pass a stand-in namespace with the same names).
        """
        if api is None:
            import omni_cache_cuda as api

        self._occ = api
        self.mgr = mgr
        self.talker = talker
        self.block_size = block_size
        self._held: _Job | None = None
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._error: BaseException | None = None
        self.materialized = 0
        self.discarded = 0
        self._thread = threading.Thread(target=self._build, name="demo-output-builder", daemon=True)
        self._thread.start()

    def _events(self, ended: Sequence[EndedRecord]) -> list[Any]:
        kind = self._occ.PrefixCacheEventKind
        return [
            self._occ.PrefixCacheRequestEvent(
                req_id=e.req_id, kind=kind.ABORTED if e.aborted else kind.FINISHED
            )
            for e in ended
        ]

    def begin_step(self, plan: StepPlan) -> None:
        """Send the step's request events: last step's ends, then this step's starts (HIT-2)."""
        self._raise_if_failed()
        events = self._events(plan.ended)
        for s in plan.started:
            events.append(
                self._occ.PrefixCacheRequestEvent(
                    req_id=s.req_id,
                    kind=self._occ.PrefixCacheEventKind.STARTED,
                    hit_end=s.hit_end,
                    block_ids=s.block_ids,
                    scheduled_tokens=s.scheduled_tokens,
                )
            )
        self.mgr.new_step_starts(
            self._occ.PrefixCacheStep(
                events=tuple(events), scheduled_tokens=dict(plan.num_scheduled)
            )
        )

    def end_step(self, plan: StepPlan, hidden: torch.Tensor, talker_h: torch.Tensor) -> None:
        """Save the step's outputs and pass the previous step's id to the output builder."""
        layout = self._occ.PrefixCacheWriteLayout.from_block_tables(
            order=list(plan.order),
            num_scheduled=dict(plan.num_scheduled),
            num_computed=dict(plan.num_computed),
            block_ids={r: list(b) for r, b in plan.block_ids.items()},
            block_size=self.block_size,
        )
        step_id = self.mgr.save_outputs(
            hidden,
            {TALKER_KEY: talker_h},
            num_tokens_unpadded=plan.num_tokens,
            num_tokens_padded=None,
            write_layout=layout,
        )
        # On the step that registers a hit the merged rows start at position 0 (hit prefix, then
        # this step's rows); on every other step they start where the computed tokens end.
        hits = {s.req_id: s.hit_end for s in plan.started}
        starts = {r: plan.num_computed[r] - hits.get(r, 0) for r in plan.order}
        if self._held is not None:
            self._jobs.put(self._held)
        self._held = _Job(step_id=step_id, order=plan.order, starts=starts)

    def finish(self, ended: Sequence[EndedRecord]) -> None:
        """Report the last ends, deliver the held step and wait for the builder to drain."""
        if ended:
            self.mgr.new_step_starts(
                self._occ.PrefixCacheStep(events=tuple(self._events(ended)), scheduled_tokens={})
            )
        self.close()
        self._raise_if_failed()

    def close(self) -> None:
        """Hand over any held step and stop the builder thread; safe to call twice."""
        if self._held is not None:
            self._jobs.put(self._held)
            self._held = None
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError("the output builder failed") from self._error

    def _build(self) -> None:
        while (job := self._jobs.get()) is not None:
            if self._error is not None:
                # Keep consuming step ids so the engine never waits on a page that nobody will
                # release; it stops at its next step anyway.
                with contextlib.suppress(Exception):
                    self.mgr.discard_step(job.step_id)
                    self.discarded += 1
                continue
            try:
                out = self.mgr.materialize(job.step_id, list(job.order))
                self.materialized += 1
                if out.hidden_states is None:
                    raise RuntimeError("the policy caches hidden states, yet none came back")
                talker_rows = out.mm_outputs[TALKER_KEY]
                for req_id in job.order:
                    self.talker.consume(
                        req_id, job.starts[req_id], out.hidden_states[req_id], talker_rows[req_id]
                    )
            except BaseException as exc:
                # Kept for the engine thread, which re-raises it at its next step or at finish.
                self._error = exc
