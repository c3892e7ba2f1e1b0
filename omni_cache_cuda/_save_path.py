"""The save path: `save_outputs` from its input checks to the dispatch of the step's write.

A save is one transaction with the core: `SaveBegin`, then `SaveProceed` until a page is
claimed, the page copy, then `SaveCommit`; any failure after the begin aborts it with
`SaveAbort` and leaves no trace (STEP-5, D19). The core's effects are executed by the
`EffectInterpreter`; this module owns what is particular to a save: classifying the step's
outputs, the copies into the page with their device clones and events (DEV-1, PAGE-6), and the
leftover snapshot the consume reads (STEP-3, OUT-4).

On the CPU the page is not copied into (D27): the save takes views of the caller's rows inside
the transaction, and once the step is committed and the rows older reads planned on are
preserved (HIT-6), the step's write runs at once on the engine thread, from the caller's
tensors straight into the pool. The consume then reads the step's rows out of the pool. In
threaded mode a step under `DIRECT_WRITE_MIN_BYTES` keeps the page and the committer thread.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import torch

from omni_cache_core import (
    BadInputError,
    ReqId,
    SaveAbort,
    SaveBegin,
    StagingCopyError,
    StepId,
    TensorName,
    Tid,
)
from omni_cache_cuda._committer import WriteJob
from omni_cache_cuda._effects import EffectInterpreter
from omni_cache_cuda._host_memory import HostMemory
from omni_cache_cuda._layout import PrefixCacheWriteLayout
from omni_cache_cuda._outputs import Classified, classify, snapshot_leftover
from omni_cache_cuda._state import AdapterState, ReadRecord, StepContext
from omni_cache_cuda._storage import KeyShape

__all__ = ["DIRECT_WRITE_MIN_BYTES", "SavePath", "writes_direct"]

#: In threaded mode on the CPU, the smallest step (bytes of immediate rows) whose write runs on
#: the engine thread straight from the caller's tensors (D27). Below it the engine thread copies
#: the rows into the page and the committer thread writes the pool: for a small step the job's
#: fixed cost (its reports and wake-ups) outweighs the two copies saved. Inline mode always
#: writes straight.
DIRECT_WRITE_MIN_BYTES = 2 << 20


class SavePath:
    """Saves a step's outputs on the engine thread (`OmniPrefixCacheManager.save_outputs`)."""

    def __init__(
        self,
        state: AdapterState,
        effects: EffectInterpreter,
        host_memory: HostMemory,
    ) -> None:
        self._state = state
        self._effects = effects
        self._host_memory = host_memory
        self._pool = state.pool
        self._pages = state.pages
        # The last layout's row bounds and their array: decode layouts of one size share one
        # bounds tuple, so the array is made once per size, not per step.
        self._last_bounds: tuple[tuple[int, ...], npt.NDArray[np.int64]] | None = None
        # Scratch membership marks over the pool's slots, all False between saves: which of an
        # unconsumed step's slots a new write takes (`_preserve_open_steps`). Saves run on one
        # thread (CONC-4), so one scratch serves them all.
        self._slot_mark = np.zeros(self._pool.num_slots, dtype=np.bool_)

    def save(
        self,
        hidden: torch.Tensor | None,
        mm: Mapping[str, Any] | None,
        num_tokens_unpadded: int,
        num_tokens_padded: int | None,
        write_layout: PrefixCacheWriteLayout,
        draft_tokens: Mapping[str, int] | None = None,
    ) -> StepId:
        """Save a step's outputs; return its step id (see `OmniPrefixCacheManager.save_outputs`).

        Blocks only for the save barrier (TASK-3), a budget flush (BUDGET-2) and a page claim
        (PAGE-4), each bounded (DEV-3); on CUDA the page copy is queued on the copy stream.
        """
        state = self._state
        try:
            n, padded = self._check_save_args(
                hidden, mm, num_tokens_unpadded, num_tokens_padded, write_layout
            )
            policy = state.core.policy
            if (policy.needs_full_hidden_states and n) and (
                not isinstance(hidden, torch.Tensor) or hidden.ndim < 2 or hidden.shape[0] < n
            ):
                got = "None" if hidden is None else f"shape {tuple(getattr(hidden, 'shape', ()))}"
                raise BadInputError(
                    what="hidden states",
                    expected=f"a tensor with ndim >= 2 and at least {n} rows (OUT-3)",
                    got=got,
                )
            parts = classify(hidden, mm or {}, n, padded, policy)
            cached = {**parts.immediate, **parts.deferred}
            shapes: dict[TensorName, KeyShape] = {}
            known_shapes = self._pool.shapes
            for key, rows in cached.items():
                # An early check: `install_keys` checks again under the lock (a reserve on
                # another thread may install the key meanwhile).
                known = known_shapes.get(key)
                if known is None:
                    shapes[key] = KeyShape.of(rows)
                else:
                    if rows.dtype != known.dtype or rows.shape[1:] != known.features:
                        known.check(key, rows)  # FAIL-5: a width or dtype change raises
                    shapes[key] = known
        except BadInputError:
            # FAIL-1, FAIL-4: a failed or shut-down cache refuses every call with that error,
            # bad input included, as the core does for the checks it makes itself.
            state.refuse_if_unusable("save_outputs")
            raise
        req_ids = cast(tuple[ReqId, ...], write_layout.req_ids)
        n_requests = len(req_ids)
        bounds = self._bounds_array(write_layout.bounds, n_requests)
        # STEP-3: engines refill one slot-mapping buffer every step, while this step's writes
        # and reads are still pending; the tables and the writes keep a private copy, unless
        # the layout's array is private already (built by the vLLM glue for this save).
        slots = write_layout._private_slots
        if slots is not None:
            slot_ids = write_layout.slots_cpu
        else:
            slots = write_layout.slots_cpu.numpy().copy() if n else np.zeros(0, dtype=np.int64)
            slot_ids = torch.from_numpy(slots)
        deferred_bytes = sum(t.nbytes for t in parts.deferred.values()) if parts.deferred else 0
        immediate_bytes = (
            sum(t.nbytes for t in parts.immediate.values() if t.is_cuda) if state.cuda else 0
        )
        begin = SaveBegin(
            now_ns=time.monotonic_ns(),
            req_ids=req_ids,
            row_bounds=bounds,
            slots=slots,
            num_tokens=n,
            immediate_keys=tuple(parts.immediate),
            deferred_keys=tuple(parts.deferred),
            immediate_bytes=immediate_bytes,
            deferred_bytes=deferred_bytes,
            drafts=_draft_rows(draft_tokens, req_ids),
        )
        # D27: a CPU step written straight from the caller's tensors, not through the page.
        direct = (
            not state.cuda
            and bool(parts.immediate)
            and writes_direct(state.threaded, sum(t.nbytes for t in parts.immediate.values()))
        )
        with state.lock:
            state.drain()
            state.core.save_begin(begin)
            early = state.core.save_page
        try:
            if (
                early is not None
                and not (state.cuda or direct)
                and parts.immediate
                and parts.immediate.keys() <= self._pages.buffers.keys()
            ):
                # PAGE-7: a CPU step's rows go into the page the save will claim before it
                # waits at the barrier (TASK-3), so the committer ends the previous write
                # meanwhile, while this thread copies without the GIL. (No NVTX range: there
                # are none on the CPU, and the step's range below still marks the save.)
                self._copy_into_pages(parts, n, early)
            else:
                early = None
            page = self._effects.proceed()
            self._host_memory.install_keys(shapes, parts.immediate.keys())
            ctx, step_job = self.stage(
                parts,
                n,
                page,
                write_layout,
                slot_ids,
                direct=direct,
                copied=early == page,
            )
            step_id, preserves, others = self._effects.commit(ctx, step_job, slot_ids)
        except BaseException:
            with state.lock:
                state.core.save_abort(SaveAbort())
            state.signal.bump()
            raise
        # HIT-6: preserve rows older reads planned on before the new write can land.
        for record, effect in preserves:
            self._effects.preserve_rows(record, effect)
        if step_job is not None and others:
            # D27: and the rows of unconsumed steps read from the pool (STEP-3).
            self._preserve_open_steps(others, slots, step_job.keys)
        if step_job is not None:
            if step_job.rows is not None:
                self._write_now(ctx, step_job, slots)
            else:
                state.committer.submit(step_job)
                if not state.threaded:
                    with state.lock:
                        state.drain()
        return step_id

    def _bounds_array(self, bounds: tuple[int, ...], n_requests: int) -> npt.NDArray[np.int64]:
        """The layout's row bounds as a read-only int64 array (the core keeps it in the step)."""
        last = self._last_bounds
        if last is not None and last[0] is bounds:
            return last[1]
        array = np.fromiter(bounds, dtype=np.int64, count=n_requests + 1)
        array.flags.writeable = False
        self._last_bounds = (bounds, array)
        return array

    def _preserve_open_steps(
        self,
        others: list[StepContext],
        slots: npt.NDArray[np.int64],
        keys: tuple[TensorName, ...],
    ) -> None:
        """Copy unconsumed steps' pool-resident rows at ``slots`` aside before a write (D27).

        ``others`` are the open steps read from the pool other than the saved one, taken under
        the state lock of the save's commit (`EffectInterpreter.commit`). Runs outside the
        lock, before the new write is dispatched; a record its consume closed already is
        skipped (its gathers are over), as `EffectInterpreter.preserve_rows`.
        """
        mark = self._slot_mark
        mark[slots] = True
        try:
            for other in others:
                hit: npt.NDArray[np.intp] | None = None
                for key in keys:
                    record = other.own.get(key)
                    if record is None:
                        continue
                    with record.lock:
                        if record.closed:
                            break
                        if hit is None:
                            hit = np.flatnonzero(mark[other.slots])
                        if not len(hit):
                            break
                        rows = self._pool.tensors[key].index_select(
                            0, torch.from_numpy(other.slots[hit])
                        )
                        record.preserved.append((hit, rows))
        finally:
            mark[slots] = False

    def _write_now(self, ctx: StepContext, job: WriteJob, slots: npt.NDArray[np.int64]) -> None:
        """Run a step's write on this thread from the caller's rows: its one copy (D27).

        The write reports its stages as the committer's do (TASK-6); a failure is sticky
        (FAIL-1) and raises here. The rows that do not end in the pool at their own slot are
        copied into the step's records before the caller may reuse its tensors.
        """
        state = self._state
        # Found before the write: the slots are still in the CPU's caches then, not after the
        # step's rows went through them.
        shadowed = _shadowed_rows(slots, job.write_blocks(self._pool.block_size))
        state.committer.run_now(job)
        rows = job.rows
        job.rows = None  # the caller's tensors are the caller's again once this returns
        assert rows is not None
        for key, record in ctx.own.items():
            lost = job.lost(key)
            keep = shadowed
            if lost is not None:
                keep = np.union1d(keep, np.flatnonzero(np.isin(slots, lost.numpy())))
            if len(keep):
                index = torch.from_numpy(keep)
                with record.lock:
                    record.preserved.append((keep, rows[key].index_select(0, index)))
        with state.lock:
            state.drain()

    def _check_save_args(
        self,
        hidden: object,
        mm: object,
        n: object,
        padded: object,
        layout: object,
    ) -> tuple[int, int]:
        """Check `save_outputs` argument types and counts; return ``(unpadded, padded)``."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise BadInputError(what="num_tokens_unpadded", expected="an int >= 0", got=repr(n))
        if padded is None:
            padded = n
        if isinstance(padded, bool) or not isinstance(padded, int) or padded < n:
            raise BadInputError(
                what="num_tokens_padded",
                expected=f"None or an int >= num_tokens_unpadded ({n})",
                got=repr(padded),
            )
        if not isinstance(layout, PrefixCacheWriteLayout):
            raise BadInputError(
                what="write_layout", expected="a PrefixCacheWriteLayout", got=type(layout).__name__
            )
        if mm is not None and not isinstance(mm, Mapping):
            raise BadInputError(
                what="mm", expected="a mapping of name to value", got=type(mm).__name__
            )
        if hidden is not None and not isinstance(hidden, torch.Tensor):
            raise BadInputError(
                what="hidden", expected="a tensor or None", got=type(hidden).__name__
            )
        rows = layout.num_rows
        num_slots = layout.slots_cpu.shape[0]
        if (n and num_slots != n) or rows != n:
            # OUT-3: fail at the cause; skipping rows would leave holes behind published hashes.
            raise BadInputError(
                what="write layout",
                expected=f"rows and slots covering the {n} unpadded tokens",
                got=f"{rows} rows and {num_slots} slots",
            )
        return n, padded

    def _copy_into_pages(self, parts: Classified, n: int, page: int) -> None:
        """Copy every immediate key's rows of a CPU step into ``page``."""
        for key, rows in parts.immediate.items():
            self._copy_into_page(key, rows, page, n, non_blocking=False)

    def stage(
        self,
        parts: Classified,
        n: int,
        page: int,
        layout: PrefixCacheWriteLayout,
        slot_ids: torch.Tensor,
        *,
        direct: bool = False,
        copied: bool = False,
    ) -> tuple[StepContext, WriteJob | None]:
        """Copy the step's rows into its page and take its clones and leftover snapshot.

        ``direct``: a CPU step written straight from the caller's tensors (D27); ``copied``:
        its immediate rows are in the page already (PAGE-7).
        """
        state = self._state
        ctx = StepContext()
        ctx.n = n
        ctx.page = page
        ctx.immediate_keys = tuple(parts.immediate)
        ctx.req_ids = layout.req_ids
        ctx.bounds = layout.bounds
        ctx.shapes = {k: self._pool.shapes[k] for k in (*parts.immediate, *parts.deferred)}
        on_device = state.cuda and (
            any(t.is_cuda for t in (*parts.immediate.values(), *parts.deferred.values()))
            or _has_cuda_tensor(parts.leftover)
        )
        hold: list[torch.Tensor] = []
        direct_rows: dict[TensorName, torch.Tensor] | None = {} if direct else None
        with state.ranges("omni_cache.step_copy"):
            try:
                ctx.deferred_rows = self._copy_step(
                    parts, n, page, ctx, on_device, hold, direct_rows, copied
                )
            except Exception as exc:
                # D19: part of the save's transaction, which aborts and leaves no trace. A copy
                # already launched must be over before the page goes back.
                if state.copy_stream is not None:
                    with contextlib.suppress(Exception):
                        state.copy_stream.synchronize()
                if isinstance(exc, StagingCopyError):
                    raise
                reason = f"{type(exc).__name__}: {exc}"
                raise StagingCopyError(key=None, reason=reason) from exc
        step_job = None
        if parts.immediate:
            step_job = WriteJob(
                Tid(0),  # the real tid comes with the StepWrite effect
                tuple(parts.immediate),
                page=page,
                slots=slot_ids,
                d2h_event=ctx.d2h_event,
                freeze_event=ctx.freeze_event,
            )
            step_job.hold = hold
            if direct_rows is not None:
                # D27: the write takes the caller's rows; the consume reads the pool.
                step_job.rows = direct_rows
                ctx.slots = slot_ids.numpy()
                ctx.own = {key: ReadRecord() for key in parts.immediate}
        return ctx, step_job

    def _copy_step(
        self,
        parts: Classified,
        n: int,
        page: int,
        ctx: StepContext,
        on_device: bool,
        hold: list[torch.Tensor],
        direct: dict[TensorName, torch.Tensor] | None = None,
        copied: bool = False,
    ) -> dict[TensorName, torch.Tensor]:
        """Copy the immediate rows into the page; return the deferred clones (DEV-1).

        With ``direct`` (a CPU step written straight to the pool, D27) the immediate rows are
        not copied: ``direct`` gets a ``(n, width)`` view of each key's rows instead. With
        ``copied`` (a CPU step, PAGE-7) they are in the page already.
        """
        state = self._state
        if on_device:
            # DEV-1: clones on the compute stream, then the freeze event.
            immediate = {k: v.clone() for k, v in parts.immediate.items()}
            deferred = {k: v.clone() for k, v in parts.deferred.items()}
            ctx.leftover = {k: snapshot_leftover(v, n, pin=True) for k, v in parts.leftover.items()}
            freeze = torch.cuda.Event()  # type: ignore[no-untyped-call]
            freeze.record()
            ctx.leftover_event = freeze
            copy_stream = state.copy_stream
            assert copy_stream is not None
            with torch.cuda.stream(copy_stream):
                copy_stream.wait_event(freeze)
                for key, rows in immediate.items():
                    self._copy_into_page(key, rows, page, n, non_blocking=True)
                    state.bytes_d2h += rows.numel() * rows.element_size()
                d2h = torch.cuda.Event()  # type: ignore[no-untyped-call]
                d2h.record(copy_stream)
            ctx.d2h_event = d2h
            ctx.freeze_event = freeze
            hold.extend(immediate.values())
        else:
            if direct is not None:
                for key, rows in parts.immediate.items():
                    direct[key] = self._take_rows(key, rows, n)
            elif not copied:
                self._copy_into_pages(parts, n, page)
            deferred = {k: v.detach().clone() for k, v in parts.deferred.items()}
            # A deferred key's leftover is the same rows as its clone: one copy serves both.
            # (The leftover is keyed by the names the model emits; cached keys are those names.)
            clones = cast(Mapping[str, torch.Tensor], deferred)
            ctx.leftover = {
                k: clones[k] if k in clones else snapshot_leftover(v, n, pin=False)
                for k, v in parts.leftover.items()
            }
        return deferred

    def _copy_into_page(
        self, key: TensorName, rows: torch.Tensor, page: int, n: int, *, non_blocking: bool
    ) -> None:
        """Copy one key's rows of the step into its page (the ``page_copy`` fault point)."""
        try:
            self._state.faults.fire("page_copy", key)
            # Rows are ``[:n]`` (`classify`); a 2-D tensor needs no reshape, a torch call that
            # hands the GIL around.
            source = rows if rows.dim() == 2 else rows.reshape(n, -1)
            self._pages.rows(key, page, n).copy_(source, non_blocking=non_blocking)
        except Exception as exc:
            raise StagingCopyError(key=key, reason=f"{type(exc).__name__}: {exc}") from exc

    def _take_rows(self, key: TensorName, rows: torch.Tensor, n: int) -> torch.Tensor:
        """One key's rows of the step as ``(n, width)`` for the pool write (D27).

        The CPU's stand-in for the page copy, in the save's transaction: the ``page_copy`` fault
        point fires here, and a failure raises `StagingCopyError` (STEP-5). Copies only rows
        whose elements are not contiguous along a row (the pool write takes byte views).
        """
        try:
            self._state.faults.fire("page_copy", key)
            flat = rows.detach().reshape(n, -1)
            if n and flat.stride(-1) != 1:
                flat = flat.contiguous()
            return flat
        except Exception as exc:
            raise StagingCopyError(key=key, reason=f"{type(exc).__name__}: {exc}") from exc


def writes_direct(threaded: bool, nbytes: int) -> bool:
    """Whether a CPU step of ``nbytes`` immediate bytes is written straight to the pool (D27)."""
    return not threaded or nbytes >= DIRECT_WRITE_MIN_BYTES


#: Up to this many rows `_shadowed_rows` sorts the slots at once: cheaper than looking for runs.
_SORT_CHECK_MAX_ROWS = 1024


def _shadowed_rows(
    slots: npt.NDArray[np.int64], blocks: npt.NDArray[np.int64] | None = None
) -> npt.NDArray[np.intp]:
    """Rows whose slot appears again later in the step: the pool keeps the later row (D27).

    ``blocks``: the KV blocks the slots fill, when the pool write found them whole
    (`WriteJob.write_blocks`): a slot then repeats only with its block, so distinct blocks
    settle it. Otherwise a long step's slots come in runs of consecutive values (blocks); runs
    that do not overlap hold no slot twice, which is checked without sorting every slot. A
    short step (a decode step: one slot per request, no runs) is checked by one plain sort;
    only a step that does repeat a slot pays for the stable sort that finds which rows.
    """
    n = len(slots)
    if n < 2:
        return np.zeros(0, dtype=np.intp)
    if blocks is not None:
        heads = np.sort(blocks)
        if not np.count_nonzero(heads[1:] == heads[:-1]):
            return np.zeros(0, dtype=np.intp)
    elif n > _SORT_CHECK_MAX_ROWS:
        breaks = np.flatnonzero(np.diff(slots) != 1) + 1
        if len(breaks) < n // 4:
            starts = np.concatenate(([0], breaks))
            lengths = np.diff(np.concatenate((starts, [n])))
            low = slots[starts]
            order = np.argsort(low, kind="stable")
            if (low[order][1:] >= (low + lengths)[order][:-1]).all():
                return np.zeros(0, dtype=np.intp)
    ordered = np.sort(slots)
    if not np.count_nonzero(ordered[1:] == ordered[:-1]):
        return np.zeros(0, dtype=np.intp)
    order = np.argsort(slots, kind="stable")
    ordered = slots[order]
    return np.sort(order[:-1][ordered[1:] == ordered[:-1]])


def _has_cuda_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.is_cuda
    if isinstance(value, Mapping):
        return any(_has_cuda_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_cuda_tensor(v) for v in value)
    return False


def _draft_rows(
    draft_tokens: Mapping[str, int] | None, req_ids: tuple[ReqId, ...]
) -> npt.NDArray[np.int64] | None:
    """Draft rows per request in layout order (SPEC-1), or None when there are none.

    Raises:
        BadInputError: Not a mapping of request ids to ints, or a count for a request the
            layout does not name; nothing changes.
    """
    if not draft_tokens:
        return None
    if not isinstance(draft_tokens, Mapping) or not draft_tokens.keys() <= set(req_ids):
        raise BadInputError(
            what="draft_tokens",
            expected="a mapping of request ids of the layout to draft-token counts",
            got=type(draft_tokens).__name__
            if not isinstance(draft_tokens, Mapping)
            else f"ids outside the layout: {sorted(draft_tokens.keys() - set(req_ids))[:4]}",
        )
    try:
        drafts = np.fromiter(
            (draft_tokens.get(r, 0) for r in req_ids), dtype=np.int64, count=len(req_ids)
        )
    except (TypeError, ValueError, OverflowError):
        raise BadInputError(
            what="draft_tokens", expected="int counts", got=repr(list(draft_tokens.values())[:4])
        ) from None
    return drafts
