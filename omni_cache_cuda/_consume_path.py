"""The consume path: `materialize` and `discard_step`, and the merge of hit rows with a step's.

A consume is `ConsumeBegin` (through the `EffectInterpreter`, which waits for the hit join),
the build of the outputs outside the state lock, then `ConsumeEnd`, which releases the step's
page. The build reads only what the save captured in the step's context (STEP-3) and gathers
each hit row from the source the core planned for it (HIT-3): the pool, a deferred write's own
rows, zeros, or the step itself; a prefetch covers committed rows (HIT-7) and preserved rows win
over everything gathered (HIT-6).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

import numpy as np
import torch

from omni_cache_core import (
    HIDDEN_KEY,
    BadInputError,
    ConsumeEnd,
    ConsumePlan,
    HitUnreadableError,
    OmniPrefixCacheUnmatchError,
    ReadPlan,
    ReqId,
    ShutDownError,
    SlotSource,
    StepId,
    TensorName,
    Tid,
)
from omni_cache_cuda._committer import WriteJob
from omni_cache_cuda._effects import EffectInterpreter
from omni_cache_cuda._outputs import (
    DeliveredPositions,
    StageCacheOutputs,
    request_rows,
    split_leftover,
    unpin,
)
from omni_cache_cuda._state import AdapterState, ReadRecord, StepContext

__all__ = ["ConsumePath"]


class ConsumePath:
    """Consumes saved steps, on any thread (`materialize`, `discard_step`; CONC-3)."""

    def __init__(self, state: AdapterState, effects: EffectInterpreter) -> None:
        self._state = state
        self._effects = effects
        self._pool = state.pool
        self._pages = state.pages

    def materialize(
        self,
        step_id: object,
        req_ids: Sequence[str],
        computed_tokens: Mapping[str, int] | None = None,
    ) -> StageCacheOutputs:
        """Return the requests' merged outputs of a saved step, consuming its id (STEP-1).

        Blocks for the hit join and the gathers, never under the state lock.
        """
        state = self._state
        checked_id = self._step_id(step_id, "materialize")
        wanted = None if isinstance(req_ids, str) else _as_tuple(req_ids)
        if wanted is None:
            state.refuse_if_unusable("materialize")
            raise BadInputError(
                what="materialize req_ids",
                expected="a sequence of request ids",
                got="a str" if isinstance(req_ids, str) else type(req_ids).__name__,
            )
        computed = _checked_counts(computed_tokens)
        plan, ctx, records = self._effects.consume(checked_id, wanted, computed)
        delivered = False
        try:
            out = self._build(plan, ctx, records, wanted)
            delivered = True
            return out
        except Exception as exc:
            if state.closed and not isinstance(exc, OmniPrefixCacheUnmatchError):
                # The cache shut down while this materialize was reading (FAIL-4).
                raise ShutDownError(operation="materialize") from exc
            raise
        finally:
            with state.lock:
                # D19: outputs that never reached the caller were not delivered.
                state.core.consume_end(ConsumeEnd(step_id=checked_id, delivered=delivered))
                state.forget_step(checked_id)
            state.signal.bump()  # a page may be free now

    def discard(self, step_id: object) -> None:
        """Consume a step id without reading it (STEP-1); its writes go on. Does not block."""
        self._effects.consume(self._step_id(step_id, "discard_step"), None)
        self._state.signal.bump()

    def _step_id(self, step_id: object, operation: str) -> StepId:
        """A step id given to a consume, or `BadInputError` (FAIL-5)."""
        if isinstance(step_id, (int, np.integer)) and not isinstance(step_id, bool):
            return StepId(int(step_id))
        self._state.refuse_if_unusable(operation)
        raise BadInputError(
            what=f"{operation} step_id",
            expected="an int step id returned by save_outputs",
            got=repr(step_id),
        )

    def _build(
        self,
        plan: ConsumePlan,
        ctx: StepContext,
        records: Mapping[int, ReadRecord],
        wanted: tuple[str, ...],
    ) -> StageCacheOutputs:
        """Merge hit prefix rows with the step's rows, per request and key (HIT-3, OUT-5)."""
        if ctx.d2h_event is not None or ctx.leftover_event is not None:
            with self._state.ranges("omni_cache.wait.step_copy"):
                if ctx.d2h_event is not None:
                    ctx.d2h_event.synchronize()
                if ctx.leftover_event is not None:
                    ctx.leftover_event.synchronize()
        leftover = ctx.leftover
        if ctx.leftover_event is not None:
            leftover = unpin(leftover)  # OUT-4: the payload holds no pinned pages
        n = ctx.n
        # This step's rows per cached key, copied out of the page once (the page is released
        # right after this call), shaped back to the key's row shape.
        current: dict[TensorName, torch.Tensor] = {}
        for key in ctx.immediate_keys:
            if key in ctx.own:
                continue  # D27: no page copy; each returned row is read out of the pool once
            current[key] = self._state.outputs.clone(self._pages.rows(key, ctx.page, n)).reshape(
                n, *ctx.shapes[key].features
            )
        for key, rows in ctx.deferred_rows.items():
            host = leftover.get(key)
            current[key] = host[:n] if isinstance(host, torch.Tensor) else rows.cpu()
        reads = {(r.req_id, r.key): r for r in plan.reads}
        req_rows = ctx.req_rows
        cuts = plan.skip is not None or plan.cut_tail
        # Each wanted request's row range, in the order asked; the step's own mapping where
        # that is the layout's order and no range is cut (a decode step: 256 entries not made).
        rows_of = (
            req_rows
            if not cuts and wanted == ctx.req_ids
            else {req: req_rows[req] for req in wanted}
        )
        # DLV-2: rows of positions already delivered (after a preemption) are cut off the front;
        # SPEC-1: draft rows not confirmed (or rejected) off the back.
        skips: dict[str, int] = {}
        takes: dict[str, int] = {}
        if cuts:
            hit_len: dict[str, int] = {r.req_id: len(r.slots) for r in plan.reads}
            if plan.skip is not None:
                skips = {r: k for r, k in zip(wanted, plan.skip.tolist(), strict=True) if k}
            if plan.cut_tail:
                takes = dict(zip(wanted, (plan.ends - plan.starts).tolist(), strict=True))
            for req in {*skips, *takes}:
                start, end = rows_of[req]
                hit, k = hit_len.get(req, 0), skips.get(req, 0)
                start = min(end, start + max(0, k - hit))
                if req in takes:
                    # The request's own rows end where its handed rows end.
                    end = min(end, max(start, rows_of[req][0] + k + takes[req] - hit))
                rows_of[req] = (start, end)

        hit_keys = {key for _, key in reads}
        shared = _StepIndex(ctx)

        def merged(key: TensorName) -> dict[str, torch.Tensor]:
            if key in ctx.own:
                if key in hit_keys or len(wanted) != len(ctx.req_rows):
                    return self._merged_from_pool(
                        key, ctx, (reads, records, current), wanted, (skips, takes), shared
                    )
                # D27: every request, none with a hit: the step's rows in one gather, in layout
                # order, then handed out as a page's rows are.
                shape = ctx.shapes[key]
                rows = self._state.outputs.rows((ctx.n, shape.width), shape.dtype)
                self._own_rows(ctx, key, np.arange(ctx.n, dtype=np.int64), rows)
                current[key] = rows.view(ctx.n, *shape.features)
            # The key's rows and each request's range; its views are made when read (OUT-5).
            out = request_rows(current[key], ctx.req_rows, wanted)
            key_reads = [read for (_, read_key), read in reads.items() if read_key == key]
            plain = self._pool_rows_only(key_reads)
            for read in key_reads:
                req: str = read.req_id
                if req not in out:
                    continue
                # One buffer per hit request: its prefix, then its rows of the page.
                tail = out[req]
                record = records.get(read.read_id)
                flat = self._hit_buffer(read, record, len(tail), plain, ctx, current)
                # An explicit width: a request with 0 rows this step has an empty tail.
                flat[len(read.slots) :].copy_(tail.reshape(len(tail), flat.shape[1]))
                out[req] = flat.view(len(flat), *tail.shape[1:])
            for req, k in skips.items():
                out[req] = out[req][k:]
            for req, take in takes.items():
                out[req] = out[req][:take]
            return out

        hidden_states = None
        mm_outputs: dict[str, dict[str, Any]] = {}
        for key in plan.keys:
            if key == HIDDEN_KEY:
                hidden_states = (
                    merged(key)
                    if key in current or key in ctx.own
                    else {
                        req: self._hit_only(
                            reads.get((cast(ReqId, req), key)), records, ctx, current, key
                        )[skips.get(req, 0) :][: takes.get(req)]
                        for req in rows_of
                    }
                )
            elif key in current or key in ctx.own:
                mm_outputs[key] = merged(key)
        cached = set(plan.keys)
        for name, value in leftover.items():
            if name not in cached:
                mm_outputs[name] = split_leftover(value, rows_of, n)
        return StageCacheOutputs(
            hidden_states, mm_outputs, DeliveredPositions(wanted, plan.starts, plan.ends)
        )

    def _merged_from_pool(
        self,
        key: TensorName,
        ctx: StepContext,
        sources: tuple[
            Mapping[tuple[ReqId, TensorName], ReadPlan],
            Mapping[int, ReadRecord],
            Mapping[TensorName, torch.Tensor],
        ],
        wanted: tuple[str, ...],
        cuts: tuple[Mapping[str, int], Mapping[str, int]],
        shared: _StepIndex,
    ) -> dict[str, torch.Tensor]:
        """Each wanted request's rows of a key the step wrote straight to the pool (D27).

        Every returned row is copied once: the rows of the requests without a hit in one
        gather from the pool, each hit request's prefix and own rows straight into its buffer.
        ``sources`` are the hit reads by (request, key), their records and the step's other
        rows; ``cuts`` are the rows to cut off each request's front and back (DLV-2, SPEC-1);
        ``shared`` the step's gather indexes, which its keys share (D39).
        """
        reads, records, current = sources
        skips, takes = cuts
        shape = ctx.shapes[key]
        hit_reads = {req: read for (req, k), read in reads.items() if k == key}
        plain = tuple(req for req in wanted if req not in hit_reads)
        out: dict[str, torch.Tensor] = {}
        if plain:
            positions, index, lengths = shared.plain(plain)
            total = len(positions)
            base = self._state.outputs.rows((total, shape.width), shape.dtype)
            self._own_rows(ctx, key, positions, base, index)
            # The method, not `torch.split`: the same views without two Python wrappers.
            pieces = base.view(total, *shape.features).split_with_sizes(lengths)
            out.update(zip(plain, pieces, strict=True))
        if hit_reads:
            self._hit_requests(key, ctx, hit_reads, (records, current), out, shared)
        for req, k in skips.items():
            out[req] = out[req][k:]
        for req, take in takes.items():
            out[req] = out[req][:take]
        return {req: out[req] for req in wanted}

    def _hit_requests(
        self,
        key: TensorName,
        ctx: StepContext,
        hit_reads: Mapping[ReqId, ReadPlan],
        sources: tuple[Mapping[int, ReadRecord], Mapping[TensorName, torch.Tensor]],
        out: dict[str, torch.Tensor],
        shared: _StepIndex,
    ) -> None:
        """Each hit request's rows of a key the step wrote to the pool: its prefix, then its own
        rows, next to each other in a buffer (HIT-3, D27), into ``out``. ``sources`` are the
        reads' records and the step's other rows.

        A prefill of hundreds of short requests has hundreds of hit requests, so the usual case
        takes no per-row check (`_pool_rows_only`) and no per-request gather where it can: the
        requests no prefetch covers (HIT-7) are gathered together, prefix and own rows, into
        shared buffers (`_gather_together`); a request whose prefix the prefetch holds whole
        gets its own rows gathered behind it. The step's own preserved rows are laid over the
        own rows after, as `_own_rows` does. Any other request (a prefix prefetched in part, a
        plan with other sources, a fault hook) goes through `gather`.
        """
        records, current = sources
        shape = ctx.shapes[key]
        pool = self._pool.tensors[key]
        slots, req_rows = ctx.slots, ctx.req_rows
        plain = self._pool_rows_only(hit_reads.values())
        own_rows: list[_OwnRows] = []
        together: list[_Together] = []
        for req, read in hit_reads.items():
            record = records.get(read.read_id)
            start, end = req_rows[req]
            if plain and (record is None or record.prefetch is None):
                together.append((req, read, record, start, end))
                continue
            buffer = self._hit_buffer(read, record, end - start, plain, ctx, current)
            hit = len(read.slots)
            torch.index_select(pool, 0, torch.from_numpy(slots[start:end]), out=buffer[hit:])
            own_rows.append((start, end, buffer, hit))
            out[req] = buffer.view(len(buffer), *shape.features)
        if together:
            self._gather_together(key, together, own_rows, out, shared)
        record = ctx.own[key]
        with record.lock:
            if record.preserved:
                for start, end, buffer, lo in own_rows:
                    own = buffer[lo : lo + end - start]
                    _lay_over(record, np.arange(start, end, dtype=np.int64), own)

    def _hit_buffer(
        self,
        read: ReadPlan,
        record: ReadRecord | None,
        tail: int,
        plain: bool,
        ctx: StepContext,
        current: Mapping[TensorName, torch.Tensor],
    ) -> torch.Tensor:
        """A buffer of a hit's prefix rows and ``tail`` more rows, the prefix in place (HIT-3):
        the prefetch's own when it holds the whole prefix with room for the tail (HIT-7), else
        a new one. ``plain`` (`_pool_rows_only`) lets a prefix be gathered without per-row
        checks; a prefix prefetched in part, or any other, goes through `gather`, which takes
        the prefetched rows and reports a failed prefetch. The rows behind are the caller's.
        """
        shape = ctx.shapes[read.key]
        hit = len(read.slots)
        prefetch = record is not None and record.prefetch is not None
        buffer = _prefetched_buffer(record, hit, tail, shape.width) if prefetch else None
        if buffer is not None and plain:
            assert record is not None
            with self._state.ranges("omni_cache.hit_gather"):
                _close_read(record, buffer, 0, hit)  # the prefix is in it already
            return buffer
        if buffer is None:
            buffer = self._state.outputs.rows((hit + tail, shape.width), shape.dtype)
        if plain and not prefetch:
            self._plain_prefix(buffer[:hit], read, record)
        else:
            self.gather(buffer[:hit], read, record, ctx, current)
        return buffer

    def _gather_together(
        self,
        key: TensorName,
        together: list[_Together],
        own_rows: list[_OwnRows],
        out: dict[str, torch.Tensor],
        shared: _StepIndex,
    ) -> None:
        """Hit requests whose prefix and own rows are all pool rows, no prefetch holding any:
        their rows in one gather per group into one buffer, each request's prefix and own rows
        next to each other, handed out as views (OUT-5), as the requests without a hit are.

        A group stops short of `_TOGETHER_MAX_BYTES`: a larger new buffer costs the kernel more
        to fault in than the gathers it saves (DESIGN D27). A gather that fails is made again
        request by request, so the error names the request (HIT-4). A prefill of hundreds of
        short requests has hundreds of these: per request, only what it needs is made (its
        view, and its prefix's only where a record wants it).
        """
        shape = shared.ctx.shapes[key]
        pool = self._pool.tensors[key]
        max_rows = _TOGETHER_MAX_BYTES // (shape.width * pool.element_size())
        hits = [len(read.slots) for _, read, _, _, _ in together]
        sizes = [hit + end - start for hit, (*_, start, end) in zip(hits, together, strict=True)]
        first = 0
        while first < len(together):
            # The group: as many requests as fit under the bound, at least one.
            last, rows = first + 1, sizes[first]
            while last < len(together) and rows + sizes[last] <= max_rows:
                rows += sizes[last]
                last += 1
            group = together[first:last]
            index = shared.together(group)
            base = self._state.outputs.rows((len(index), shape.width), shape.dtype)
            group_sizes = sizes[first:last]
            with self._state.ranges("omni_cache.hit_gather"):
                try:
                    torch.index_select(pool, 0, index, out=base)
                except Exception:
                    for (_, read, record, _, _), piece in zip(
                        group, torch.split(base, group_sizes), strict=True
                    ):
                        self._plain_prefix(piece[: len(read.slots)], read, record)
                    raise
                pieces = base.view(len(index), *shape.features).split_with_sizes(group_sizes)
                lo = 0
                for (req, _, record, start, end), hit, size, piece in zip(
                    group, hits[first:last], group_sizes, pieces, strict=True
                ):
                    if record is not None:
                        _close_read(record, base, lo, hit)
                    own_rows.append((start, end, base, lo + hit))
                    out[req] = piece
                    lo += size
            first = last

    def _pool_rows_only(self, reads: Iterable[ReadPlan]) -> bool:
        """Whether plain gathers may serve ``reads``: every planned row is a pool row (POOL, or
        AFTER_WRITE, whose write the consume awaited) and no fault hook is set (HIT-3)."""
        if self._state.faults.hooks:
            return False
        sources = [read.source for read in reads]
        return not sources or not np.count_nonzero(np.concatenate(sources) > _LAST_POOL_SOURCE)

    def _plain_prefix(self, out: torch.Tensor, read: ReadPlan, record: ReadRecord | None) -> None:
        """A hit prefix read only from pool rows: one gather, then its preserved rows laid over
        under the record's lock, closing it, as `gather` does (HIT-3, HIT-6)."""
        with self._state.ranges("omni_cache.hit_gather"):
            try:
                pool = self._pool.tensors[read.key]
                torch.index_select(pool, 0, torch.from_numpy(read.slots), out=out)
            except Exception as exc:
                raise self._unreadable(read, exc) from exc
            if record is not None:
                _close_read(record, out)

    def _own_rows(
        self,
        ctx: StepContext,
        key: TensorName,
        positions: np.ndarray,
        out: torch.Tensor,
        index: torch.Tensor | None = None,
    ) -> None:
        """Fill ``out`` with the step's rows at ``positions``, read from the pool (D27, STEP-3).

        ``index``: their slots, when the caller has them (`_StepIndex.plain`). Rows a later
        write took were copied into the step's record before that write (and rows that never
        reached their slot at the save); they win, the earliest copy first. As for a hit
        (HIT-6), they are laid over the gathered rows under the record's lock.
        """
        pool = self._pool.tensors[key]
        if index is None:
            index = torch.from_numpy(ctx.slots[positions])
        torch.index_select(pool, 0, index, out=out)
        record = ctx.own[key]
        with record.lock:
            _lay_over(record, positions, out)

    def _hit_only(
        self,
        read: ReadPlan | None,
        records: Mapping[int, ReadRecord],
        ctx: StepContext,
        current: Mapping[TensorName, torch.Tensor],
        key: TensorName,
    ) -> torch.Tensor:
        """Hidden rows of a step with no rows of its own: the hit prefix, or nothing."""
        shape = self._pool.shapes.get(key)
        if read is None:
            if shape is None:
                return torch.empty((0, 0))
            return torch.empty((0, *shape.features), dtype=shape.dtype)
        assert shape is not None
        out = torch.empty((len(read.slots), shape.width), dtype=shape.dtype)
        self.gather(out, read, records.get(read.read_id), ctx, current)
        return out.reshape(len(out), *shape.features)

    def gather(
        self,
        out: torch.Tensor,
        read: ReadPlan,
        record: ReadRecord | None,
        ctx: StepContext,
        current: Mapping[TensorName, torch.Tensor],
    ) -> None:
        """Fill ``out`` (one row per hit slot) from the sources the core planned (HIT-3).

        A gather that fails (here or in its prefetch) raises `HitUnreadableError`: the rows
        cannot be served, and the materialize that needed them fails (D19).
        """
        state = self._state
        with state.ranges("omni_cache.hit_gather"):
            try:
                state.faults.fire("gather", read)
                self.gather_rows(out, read, record, ctx, current)
            except OmniPrefixCacheUnmatchError:
                raise
            except (Exception, concurrent.futures.CancelledError) as exc:
                raise self._unreadable(read, exc) from exc

    def _unreadable(self, read: ReadPlan, exc: BaseException) -> Exception:
        """The error a failed hit gather raises: `HitUnreadableError`, or `ShutDownError`
        when the cache shut down meanwhile (FAIL-4)."""
        if self._state.closed:
            return ShutDownError(operation="materialize")
        return HitUnreadableError(
            req_id=read.req_id,
            key=read.key,
            reason=f"gathering the hit rows failed: {type(exc).__name__}: {exc}",
            slot_count=len(read.slots),
        )

    def gather_rows(
        self,
        out: torch.Tensor,
        read: ReadPlan,
        record: ReadRecord | None,
        ctx: StepContext,
        current: Mapping[TensorName, torch.Tensor],
    ) -> None:
        """Gather each row from its planned source, then lay the preserved rows over them."""
        key = read.key
        pool = self._pool.tensors[key]
        source = read.source
        pooled = (source == SlotSource.POOL.value) | (source == SlotSource.AFTER_WRITE.value)
        prefetched = record.prefetch if record is not None else None
        if prefetched is not None:
            positions, future = prefetched
            rows = future.result()[: len(positions)]  # the buffer's tail is the step's rows
            if len(positions) == len(source):
                if out.data_ptr() != rows.data_ptr():  # else gathered in place already
                    out.copy_(rows)  # HIT-7: the prefetch covered every row
                pooled = np.zeros(len(source), dtype=np.bool_)
            elif len(positions):
                out[torch.from_numpy(positions)] = rows
                pooled[positions] = False
        if pooled.all():
            torch.index_select(pool, 0, torch.from_numpy(read.slots), out=out)
        else:
            if pooled.any():
                todo = np.flatnonzero(pooled)
                out[torch.from_numpy(todo)] = pool.index_select(
                    0, torch.from_numpy(read.slots[todo])
                )
            zeros = np.flatnonzero(source == SlotSource.ZEROS.value)
            if len(zeros):
                out[torch.from_numpy(zeros)] = 0
            tasked = np.flatnonzero(source == SlotSource.TASK.value)
            if len(tasked):
                limits = dict(read.chunk_limit)
                for tid in np.unique(read.writer[tasked]).tolist():
                    mine = tasked[read.writer[tasked] == tid]
                    out[torch.from_numpy(mine)] = self._task_rows(
                        ctx.task_jobs[Tid(tid)], key, read.slots[mine], limits[Tid(tid)]
                    )
            own = np.flatnonzero(source == SlotSource.THIS_STEP.value)
            if len(own) and key in ctx.own:
                mine = torch.empty((len(own), out.shape[1]), dtype=out.dtype)
                self._own_rows(ctx, key, read.step_row[own].astype(np.int64), mine)
                out[torch.from_numpy(own)] = mine
            elif len(own):
                rows = current[key].reshape(len(current[key]), -1)
                index = torch.from_numpy(read.step_row[own].astype(np.int64))
                out[torch.from_numpy(own)] = rows[index]
        if record is not None:
            _close_read(record, out)  # HIT-6: preserved rows win over what was gathered

    def _task_rows(
        self, job: WriteJob, key: TensorName, slots: np.ndarray, limit: int
    ) -> torch.Tensor:
        """Rows of a deferred write for ``slots``, from its first ``limit`` chunks (last wins)."""
        with job.lock:  # the committer swaps device clones for host rows under this lock
            chunks = [(c.slots.numpy(), c.rows(key)) for c in job.chunks[:limit]]
        sources = [(s, r) for s, r in chunks if r is not None]
        all_slots = np.concatenate([s for s, _ in sources])
        order = np.argsort(all_slots, kind="stable")
        at = np.searchsorted(all_slots[order], slots, side="right") - 1
        index = torch.from_numpy(order[at])
        parts = [r.reshape(len(r), -1) for _, r in sources]
        if not parts[0].is_cuda:
            rows = parts[0] if len(parts) == 1 else torch.cat(parts)
            return rows.index_select(0, index)
        stream = self._state.read_stream
        assert stream is not None
        with torch.cuda.stream(stream):
            # DEV-1: the clones are read only after the compute stream finished writing them;
            # everything here, the concatenation included, runs on the read stream.
            if job.freeze_event is not None:
                stream.wait_event(job.freeze_event)
            rows = parts[0] if len(parts) == 1 else torch.cat(parts)
            picked = rows.index_select(0, index.to(rows.device, non_blocking=False)).to("cpu")
        stream.synchronize()
        return picked


#: A hit request `ConsumePath._gather_together` serves: its id, read, record and own rows' range.
_Together = tuple[str, ReadPlan, ReadRecord | None, int, int]


class _StepIndex:
    """The pool slots a consume's gathers read, worked out once per step for all its keys (D39).

    Every key of a step was written at the step's slots, and a hit's reads of its keys plan
    the same slots (one array): so the rows of the requests without a hit, and a group of hit
    requests' prefixes and own rows, are gathered by every key at the same index. A group is
    known by its requests' reads' slot arrays and own rows: a key whose reads hold other
    arrays gets an index of its own. Lives for one build, while the plan holds those arrays.
    """

    def __init__(self, ctx: StepContext) -> None:
        self.ctx = ctx
        self._plain: dict[tuple[str, ...], tuple[np.ndarray, torch.Tensor, list[int]]] = {}
        self._together: dict[tuple[tuple[int, int, int], ...], torch.Tensor] = {}

    def plain(self, reqs: tuple[str, ...]) -> tuple[np.ndarray, torch.Tensor, list[int]]:
        """``reqs``' rows of the step in order: their positions, slots and row counts."""
        got = self._plain.get(reqs)
        if got is None:
            ctx = self.ctx
            req_rows = ctx.req_rows
            spans = np.array([req_rows[req] for req in reqs], dtype=np.int64).reshape(-1, 2)
            lengths = spans[:, 1] - spans[:, 0]
            total = int(lengths.sum())
            if spans[0, 0] == 0 and not np.count_nonzero(spans[1:, 0] != spans[:-1, 1]):
                positions = np.arange(total, dtype=np.int64)  # one run from the first row
            else:
                offsets = lengths.cumsum() - lengths
                positions = np.arange(total, dtype=np.int64) + (spans[:, 0] - offsets).repeat(
                    lengths
                )
            got = self._plain[reqs] = (
                positions,
                torch.from_numpy(ctx.slots[positions]),
                lengths.tolist(),
            )
        return got

    def together(self, group: list[_Together]) -> torch.Tensor:
        """The slots of a group of hit requests: each one's prefix, then its own rows."""
        known = tuple((id(read.slots), start, end) for _, read, _, start, end in group)
        index = self._together.get(known)
        if index is None:
            slots = self.ctx.slots
            index = self._together[known] = torch.from_numpy(
                np.concatenate(
                    [
                        part
                        for _, read, _, start, end in group
                        for part in (read.slots, slots[start:end])
                    ]
                )
            )
        return index


#: A hit request's own rows in its buffer: ``(start, end, buffer, lo)``, the step's rows
#: ``[start, end)`` held at ``buffer[lo : lo + end - start]`` (sliced only if laid over).
_OwnRows = tuple[int, int, torch.Tensor, int]

#: The largest buffer `ConsumePath._gather_together` fills: the allocator reuses freed memory
#: below its mapping threshold (at most 32 MiB with glibc); a larger new buffer is mapped afresh
#: and its pages faulted in and zeroed each step (BENCHMARKS.md, fifth pass).
_TOGETHER_MAX_BYTES = 16 << 20

#: Sources at or below this code are pool rows (POOL, AFTER_WRITE): a plain gather reads them.
_LAST_POOL_SOURCE = max(SlotSource.POOL.value, SlotSource.AFTER_WRITE.value)
assert min(SlotSource.TASK.value, SlotSource.ZEROS.value, SlotSource.THIS_STEP.value) > (
    _LAST_POOL_SOURCE
)


def _close_read(
    record: ReadRecord, out: torch.Tensor, first: int = 0, rows: int | None = None
) -> None:
    """Lay a hit's preserved rows over its gathered prefix and close its record, under the
    record's lock: a later Preserve then skips, the gather being done (HIT-6).

    The prefix is ``out``'s ``rows`` rows from ``first`` (all of ``out`` when ``rows`` is None);
    its view is made only when a row was preserved, the rare case.
    """
    with record.lock:
        if record.preserved:
            prefix = out if rows is None else out[first : first + rows]
            for positions, kept in record.preserved:
                prefix[torch.from_numpy(positions)] = kept
        record.closed = True


def _lay_over(record: ReadRecord, positions: np.ndarray, out: torch.Tensor) -> None:
    """Lay a step's own preserved rows over ``out``, its rows at ``positions`` (sorted), the
    earliest copy last so that it wins (D27); under ``record.lock``."""
    for kept, rows in reversed(record.preserved):
        at = np.minimum(np.searchsorted(kept, positions), len(kept) - 1)
        match = np.flatnonzero(kept[at] == positions)
        if len(match):
            out[torch.from_numpy(match)] = rows[torch.from_numpy(at[match])]


def _prefetched_buffer(
    record: ReadRecord | None, hit: int, tail: int, width: int
) -> torch.Tensor | None:
    """The prefetch's buffer when it holds the whole prefix and room for exactly ``tail`` rows.

    Then the consume fills the tail and hands the buffer out: each row is copied once (D27).
    None otherwise, or when the prefetch failed (the gather raises that, as it does now).
    """
    if record is None or record.prefetch is None or record.prefetch_tail != tail:
        return None
    positions, future = record.prefetch
    if len(positions) != hit:
        return None
    try:
        buffer = future.result()
    except (Exception, concurrent.futures.CancelledError):  # the gather reports it
        return None
    if buffer.shape != (hit + tail, width):
        return None
    return buffer


def _checked_counts(counts: Mapping[str, int] | None) -> dict[ReqId, int] | None:
    """A private copy of a materialize's computed-token counts, checked (FAIL-5).

    Raises:
        BadInputError: Not a mapping of str to int >= 0; nothing changes.
    """
    if counts is None:
        return None
    if not isinstance(counts, Mapping) or not all(
        isinstance(r, str) and isinstance(c, int) and not isinstance(c, bool) and c >= 0
        for r, c in counts.items()
    ):
        raise BadInputError(
            what="materialize computed_tokens",
            expected="a mapping of request id (str) to a count (int >= 0), or None",
            got=type(counts).__name__,
        )
    return {cast(ReqId, r): c for r, c in counts.items()}


def _as_tuple(items: Any) -> tuple[Any, ...] | None:
    """``tuple(items)``, or None when `items` is not iterable."""
    try:
        return tuple(items)
    except TypeError:
        return None
