"""The save path: `save_outputs` from its input checks to the dispatch of the step's write.

A save is one transaction with the core: `SaveBegin`, then `SaveProceed` until a page is
claimed, the page copy, then `SaveCommit`; any failure after the begin aborts it with
`SaveAbort` and leaves no trace (STEP-5, D19). The core's effects are executed by the
`EffectInterpreter`; this module owns what is particular to a save: classifying the step's
outputs, the copies into the page with their device clones and events (DEV-1, PAGE-6), and the
leftover snapshot the consume reads (STEP-3, OUT-4).
"""

from __future__ import annotations

import contextlib
import itertools
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
from omni_cache_cuda._state import AdapterState, StepContext
from omni_cache_cuda._storage import KeyShape

__all__ = ["SavePath"]


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
            for key, rows in cached.items():
                # An early check: `install_keys` checks again under the lock (a reserve on
                # another thread may install the key meanwhile).
                known = self._pool.shapes.get(key)
                if known is None:
                    shapes[key] = KeyShape.of(rows)
                else:
                    known.check(key, rows)  # FAIL-5: a width or dtype change raises
                    shapes[key] = known
        except BadInputError:
            # FAIL-1, FAIL-4: a failed or shut-down cache refuses every call with that error,
            # bad input included, as the core does for the checks it makes itself.
            state.refuse_if_unusable("save_outputs")
            raise
        req_ids = cast(tuple[ReqId, ...], write_layout.req_ids)
        bounds = np.array(write_layout.bounds, dtype=np.int64)
        # STEP-3: engines refill one slot-mapping buffer every step, while this step's writes
        # and reads are still pending; the tables and the writes keep a private copy.
        slot_ids = write_layout.slots_cpu.clone() if n else torch.zeros(0, dtype=torch.int64)
        slots = slot_ids.numpy()
        deferred_bytes = sum(t.numel() * t.element_size() for t in parts.deferred.values())
        immediate_bytes = sum(
            t.numel() * t.element_size() for t in parts.immediate.values() if t.is_cuda
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
        with state.lock:
            state.drain()
            state.core.save_begin(begin)
        try:
            page = self._effects.proceed()
            self._host_memory.install_keys(shapes, set(parts.immediate))
            ctx, step_job = self.stage(parts, n, page, write_layout, slot_ids)
            step_id, preserves = self._effects.commit(ctx, step_job, slot_ids)
        except BaseException:
            with state.lock:
                state.core.save_abort(SaveAbort())
            state.signal.bump()
            raise
        # HIT-6: preserve rows older reads planned on before the new write can land.
        for record, effect in preserves:
            self._effects.preserve_rows(record, effect)
        if step_job is not None:
            state.committer.submit(step_job)
            if not state.threaded:
                with state.lock:
                    state.drain()
        return step_id

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
        if (n and len(layout.slots_cpu) != n) or rows != n:
            # OUT-3: fail at the cause; skipping rows would leave holes behind published hashes.
            raise BadInputError(
                what="write layout",
                expected=f"rows and slots covering the {n} unpadded tokens",
                got=f"{rows} rows and {len(layout.slots_cpu)} slots",
            )
        return n, padded

    def stage(
        self,
        parts: Classified,
        n: int,
        page: int,
        layout: PrefixCacheWriteLayout,
        slot_ids: torch.Tensor,
    ) -> tuple[StepContext, WriteJob | None]:
        """Copy the step's rows into its page and take its clones and leftover snapshot."""
        state = self._state
        ctx = StepContext()
        ctx.n = n
        ctx.page = page
        ctx.immediate_keys = tuple(parts.immediate)
        bounds = layout.bounds
        ctx.req_rows = dict(zip(layout.req_ids, itertools.pairwise(bounds), strict=True))
        ctx.shapes = {k: self._pool.shapes[k] for k in (*parts.immediate, *parts.deferred)}
        on_device = state.cuda and (
            any(t.is_cuda for t in (*parts.immediate.values(), *parts.deferred.values()))
            or _has_cuda_tensor(parts.leftover)
        )
        hold: list[torch.Tensor] = []
        with state.ranges("omni_cache.step_copy"):
            try:
                ctx.deferred_rows = self._copy_step(parts, n, page, ctx, on_device, hold)
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
        return ctx, step_job

    def _copy_step(
        self,
        parts: Classified,
        n: int,
        page: int,
        ctx: StepContext,
        on_device: bool,
        hold: list[torch.Tensor],
    ) -> dict[TensorName, torch.Tensor]:
        """Copy the immediate rows into the page; return the deferred clones (DEV-1)."""
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
            for key, rows in parts.immediate.items():
                self._copy_into_page(key, rows, page, n, non_blocking=False)
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
            self._pages.rows(key, page, n).copy_(rows.reshape(n, -1), non_blocking=non_blocking)
        except Exception as exc:
            raise StagingCopyError(key=key, reason=f"{type(exc).__name__}: {exc}") from exc


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
