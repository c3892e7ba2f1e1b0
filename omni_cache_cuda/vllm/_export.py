"""Where the rows go: each saved step materialized a step late, its rows handed to the sinks.

`HiddenStatesExport` sits between the drop-in worker's runner and `VllmPrefixCache`. On the
engine thread it feeds the step's records in, saves the forward's rows and, at the next step's
start, materializes the steps saved before (by then their copies have landed); the rows go onto
a queue, in save order, and the export's own thread hands them to the sinks, off the engine's
critical path. Materialize runs on the engine thread because a second thread doing the same
Python work costs the engine more: it holds the interpreter lock while the engine's forward
waits for it (DESIGN D21 has the figures).

The two sinks (see `hidden_states_engine_args`):

- a folder: each request's rows are kept until the engine says the request ended, then written
  as one safetensors file (`write_request_file`: a temporary name, then a rename, so a reader
  never sees a partial file);
- a callable, handed each materialized step's `StageCacheOutputs`.

Ordering: vLLM names an ended request in the scheduler output of the step after its last one;
that step's start materializes the request's last step first, so the request's ``ended`` entry
goes onto the queue behind all its rows, and the file is complete when it is written.

Failures stop the export (DESIGN D21, SPEC FAIL-6): an error in a hook on the engine thread, or
on the output thread (a sink, a file write), shuts the cache down, so nothing it holds is served
again, and every later hook raises `ExportStoppedError` from the first error. vLLM then fails
the step and stops the engine: no hit after a failed save can be served a previous tenant's
rows, and no file is written after the failure.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import queue
import struct
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch

from omni_cache_core import OmniPrefixCacheUnmatchError, StepId
from omni_cache_cuda._outputs import StageCacheOutputs
from omni_cache_cuda.vllm._glue import VllmPrefixCache

__all__ = [
    "ExportStoppedError",
    "HiddenStatesExport",
    "RequestRows",
    "load_request_rows",
    "request_file_name",
    "write_request_file",
]

_log = logging.getLogger("omni_cache")

#: ``ended`` metadata of a file: the engine named the request in ``finished_req_ids``. vLLM's
#: workers are told that a request ended, not why (DESIGN D21).
ENDED_BY_ENGINE = "finished or aborted"
#: The worker shut down while the request was still tracked: its last step ran, but the step
#: that would have named it ended never came (in-process engines stop after the last output).
ENDED_BY_SHUTDOWN = "engine shut down"

_SUFFIX = ".safetensors"
_RESERVED = frozenset({"hidden_states", "positions"})


class ExportStoppedError(OmniPrefixCacheUnmatchError):
    """The hidden-state export stopped after a failure; the engine must not go on.

    Raised by every hook after the first failure, with that failure as ``__cause__``. The
    cache was shut down when the failure happened, so nothing it held is served again; files
    already written are complete and stay; no further file is written.
    """

    def __init__(self, detail: str) -> None:
        self.detail = detail
        super().__init__(f"the omni-cache export stopped: {detail}")


@attrs.frozen
class RequestRows:
    """One request's rows as `load_request_rows` reads them back.

    Attributes:
        request_id: The id the engine's workers saw (vLLM's front end adds a suffix).
        hidden_states: ``[n, hidden]``: one row per computed position, in position order.
        positions: ``[n]`` int64: the position of each row (``0 .. n - 1``).
        mm_outputs: Per cached mm key, its rows like ``hidden_states``.
        ended: How the request ended, as far as the worker knows: ``"finished or aborted"``
            (the engine said so) or ``"engine shut down"`` (still tracked at shutdown).
        path: The file.
    """

    request_id: str
    hidden_states: torch.Tensor | None
    positions: torch.Tensor
    mm_outputs: dict[str, torch.Tensor]
    ended: str
    path: str


def request_file_name(req_id: str) -> str:
    """The file name of a request's rows: its id percent-encoded (letters, digits and ``_.-~``
    stay as they are), then ``.safetensors``."""
    return urllib.parse.quote(req_id, safe="") + _SUFFIX


def write_request_file(
    sink_dir: str,
    req_id: str,
    parts: Sequence[tuple[int, int, torch.Tensor | None, Mapping[str, torch.Tensor]]],
    *,
    ended: str,
) -> str | None:
    """Write one request's rows atomically; return the path, or None when it has no rows.

    The file is in the safetensors format (`load_request_rows`, or ``safetensors.safe_open``,
    reads it). It is written here rather than with ``safetensors.torch.save_file``, which
    concatenates and serializes under the interpreter lock: each part is written straight from
    its tensor's memory, and the lock is free while the bytes go out.

    Args:
        parts: ``(start, end, hidden rows, {mm key: rows})`` per materialize, in delivery order.
            Together they must cover positions ``0 .. end`` once each, in order.

    Raises:
        ValueError: The parts leave a gap or overlap (the export delivered out of order), or an
            mm key is named like one of the file's own tensors.
        OSError: The file could not be written; no partial file is left behind.
    """
    parts = [p for p in parts if p[1] > p[0]]
    if not parts:
        return None
    expected = 0
    for start, end, _, _ in parts:
        if start != expected:
            raise ValueError(
                f"request {req_id!r}: rows of positions [{start}, {end}) follow position "
                f"{expected}: delivered positions must be contiguous from 0"
            )
        expected = end
    columns: dict[str, list[torch.Tensor]] = {
        "positions": [torch.arange(expected, dtype=torch.int64)]
    }
    if parts[0][2] is not None:
        columns["hidden_states"] = [p[2] for p in parts if p[2] is not None]
    for name in parts[0][3]:
        if name in _RESERVED:
            raise ValueError(f"request {req_id!r}: mm key {name!r} clashes with a reserved name")
        columns[name] = [p[3][name] for p in parts]
    path = os.path.join(sink_dir, request_file_name(req_id))
    tmp = os.path.join(sink_dir, f".{request_file_name(req_id)}.{os.getpid()}.tmp")
    meta = {"request_id": req_id, "num_positions": str(expected), "ended": ended}
    try:
        _write_safetensors(tmp, columns, meta)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


# safetensors' dtype names.
_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def _write_safetensors(
    path: str, columns: Mapping[str, Sequence[torch.Tensor]], metadata: Mapping[str, str]
) -> None:
    """Write each column (its pieces stacked along dim 0) as one tensor of a safetensors file:
    an 8-byte little-endian header length, a JSON header, then the tensors' bytes."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    pieces: list[torch.Tensor] = []
    offset = 0
    for name, column in columns.items():
        first = column[0]
        if first.dtype not in _DTYPES:
            raise ValueError(f"tensor {name!r}: dtype {first.dtype} has no safetensors name")
        rows = sum(int(t.shape[0]) for t in column)
        size = sum(t.numel() * t.element_size() for t in column)
        header[name] = {
            "dtype": _DTYPES[first.dtype],
            "shape": [rows, *first.shape[1:]],
            "data_offsets": [offset, offset + size],
        }
        offset += size
        pieces.extend(t.detach().cpu().contiguous() for t in column)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for piece in pieces:
            f.write(piece.view(torch.uint8).numpy().data)


def load_request_rows(
    sink_dir: str | os.PathLike[str], request_id: str, *, timeout_s: float = 30.0
) -> RequestRows:
    """Read a request's rows from a ``sink_dir``, waiting for the file up to ``timeout_s``.

    ``request_id`` is the id the caller gave vLLM (``RequestOutput.request_id``) or the id the
    workers saw: vLLM's front end appends ``-`` and 8 characters to the caller's id, and the
    file is found under either. The file appears once the engine has told its workers that the
    request ended (a step later; in-process engines, at the next step or at shutdown).

    Raises:
        FileNotFoundError: No file within ``timeout_s``.
        ValueError: More than one file matches the id (two requests under one caller id).
    """
    from safetensors import safe_open

    folder = os.fspath(sink_dir)
    exact = os.path.join(folder, request_file_name(request_id))
    suffixed = os.path.join(
        glob.escape(folder), glob.escape(urllib.parse.quote(request_id, safe="")) + "-" + "?" * 8
    )
    deadline = time.monotonic() + timeout_s
    while True:
        found = [exact] if os.path.exists(exact) else glob.glob(suffixed + _SUFFIX)
        if len(found) > 1:
            raise ValueError(f"request {request_id!r}: several files match in {folder}: {found}")
        if found:
            break
        if time.monotonic() >= deadline:
            raise FileNotFoundError(
                f"no rows for request {request_id!r} in {folder} after {timeout_s} s"
            )
        time.sleep(0.02)
    path = found[0]
    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (not a dict)
    return RequestRows(
        request_id=meta.get("request_id", ""),
        hidden_states=tensors.pop("hidden_states", None),
        positions=tensors.pop("positions"),
        mm_outputs=tensors,
        ended=meta.get("ended", ""),
        path=path,
    )


# Queue entries of the output thread.
_STEP = "step"
_ENDED = "ended"
_CLOSE = "close"


class HiddenStatesExport:
    """The drop-in worker's cache, its output thread and its sinks.

    Engine thread: `step_begin` first in every ``execute_model`` (it materializes the steps
    saved before), `save` right after the forward, `close` at shutdown. The sinks run on the
    output thread.

    Args:
        cache: The worker's cache; the export shuts it down at `close` or on a failure.
        sink_dir: The folder for the request files (created if missing), or None.
        sink: Called on the output thread with each materialized step's `StageCacheOutputs`,
            or None. Its ``request_finished`` attribute, if any, is called with each ended
            request id.
        close_timeout_s: How long `close` waits for the output thread to write what it holds.
    """

    def __init__(
        self,
        cache: VllmPrefixCache,
        *,
        sink_dir: str | None,
        sink: Callable[[StageCacheOutputs], Any] | None,
        close_timeout_s: float = 60.0,
    ) -> None:
        if sink_dir is not None:
            os.makedirs(sink_dir, exist_ok=True)
        self.cache = cache
        self._sink_dir = sink_dir
        self._sink = sink
        self._on_finished: Callable[[str], Any] | None = getattr(sink, "request_finished", None)
        self._close_timeout_s = close_timeout_s
        self._queue: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._failure: BaseException | None = None
        # Engine thread: steps saved and not yet materialized (at most one step's worth), with
        # the token ids their sampler produced when the step had drafts (SPEC-2).
        self._saved: list[tuple[StepId, tuple[str, ...]]] = []
        self._sampled: dict[StepId, dict[str, Sequence[int]]] = {}
        self._closed = False
        # Output thread only: each tracked request's delivered parts, in delivery order.
        self._parts: dict[str, list[tuple[int, int, torch.Tensor | None, dict[str, Any]]]] = {}
        self._counts: dict[str, float] = {
            "steps_exported": 0,
            "files_written": 0,
            "requests_ended": 0,
            "output_thread_cpu_s": 0.0,
        }
        self._thread = threading.Thread(target=self._run, name="omni-cache-export", daemon=True)
        self._thread.start()

    # -----------------------------------------------------------------------------------------
    # Engine thread.

    def step_begin(self, scheduler_output: Any) -> None:
        """`VllmPrefixCache.step_begin` and the materialize of the steps saved before (first
        unless a drafted one lacks its sampled token ids); the rows and the requests this step
        ends go to the output thread, in that order."""
        self._raise_if_stopped()
        finished = scheduler_output.finished_req_ids
        ended: list[str] = []
        if finished:
            live = self.cache.live_requests()
            ended = [r for r in finished if r in live]
        # A drafted step is materialized before the records when its sampler's token ids are
        # known: the count it reports settles the drafts of requests these records end or
        # preempt (SPEC-5). Without them, after the records, which confirm the drafts of
        # requests still running (SPEC-2). Either way its rows reach the output thread before
        # the requests this step ends.
        reported = all(s in self._sampled or not self.cache.has_drafts(s) for s, _ in self._saved)
        if reported:
            self._materialize_saved()
        try:
            self.cache.step_begin(scheduler_output)
        except BaseException as exc:
            self._stop(exc, "step_begin")
            raise
        if not reported:
            self._materialize_saved()
        if ended:
            self._queue.put((_ENDED, ended))

    def save(
        self,
        hidden: torch.Tensor,
        *,
        req_ids: Sequence[str],
        num_tokens_unpadded: int,
        num_tokens_padded: int,
    ) -> StepId:
        """`VllmPrefixCache.save`; the step is materialized at the next `step_begin`."""
        self._raise_if_stopped()
        try:
            step_id = self.cache.save(
                hidden,
                None,
                req_ids=req_ids,
                num_tokens_unpadded=num_tokens_unpadded,
                num_tokens_padded=num_tokens_padded,
            )
        except BaseException as exc:
            self._stop(exc, "save")
            raise
        self._saved.append((step_id, tuple(req_ids)))
        return step_id

    def step_sampled(self, output: Any) -> None:
        """Keep the token ids the last saved step's sampler produced, when that step had drafts
        (``ModelRunnerOutput``: ``req_ids`` and ``sampled_token_ids``, read duck-typed): its
        materialize then hands out the accepted rows of requests that end before another
        step confirms them (SPEC-5)."""
        if not self._saved:
            return
        step_id = self._saved[-1][0]
        sampled = getattr(output, "sampled_token_ids", None)
        req_ids = getattr(output, "req_ids", None)
        if sampled is None or req_ids is None or not self.cache.has_drafts(step_id):
            return
        self._sampled[step_id] = dict(zip(req_ids, sampled, strict=False))

    def _materialize_saved(self) -> None:
        """Materialize the steps saved since the last call; their rows go to the output thread."""
        while self._saved:
            step_id, req_ids = self._saved.pop(0)
            try:
                out = self.cache.materialize(
                    step_id, req_ids, sampled_token_ids=self._sampled.pop(step_id, None)
                )
            except BaseException as exc:
                self._stop(exc, "materialize")
                raise
            self._queue.put((_STEP, out, req_ids))

    def close(self) -> None:
        """Write what the output thread holds, stop it and shut the cache down (idempotent).

        Requests still tracked at this point ran their last step but were never named ended
        (in-process engines stop after the last output): their files are written with
        ``ended = "engine shut down"``.
        """
        if self._closed:
            return
        self._closed = True
        if self._failure is None:
            try:
                self._materialize_saved()
            except BaseException:
                _log.exception("omni-cache export: the last steps could not be materialized")
        self._queue.put((_CLOSE,))
        self._thread.join(self._close_timeout_s)
        if self._thread.is_alive():
            _log.error(
                "omni-cache export: the output thread did not finish within %.0f s; "
                "files of requests still held are not written",
                self._close_timeout_s,
            )
        self.cache.shutdown()

    def counts(self) -> dict[str, Any]:
        """The cache's record counts, its stats and the export's own counts (a fresh dict)."""
        stats = self.cache.stats()
        return {
            **self.cache.counts(),
            **self._counts,
            "hit_rows": dict(stats.hit_rows),
            "steps_saved": stats.steps_saved,
            "steps_consumed": stats.steps_consumed,
            "failed": repr(self._failure) if self._failure is not None else None,
        }

    def _raise_if_stopped(self) -> None:
        failure = self._failure
        if failure is not None:
            self.cache.shutdown()  # a failure on the output thread is acted on here
            raise ExportStoppedError(f"after {failure!r}") from failure

    def _stop(self, exc: BaseException, where: str) -> None:
        """Record the first failure and, on the engine thread, shut the cache down: nothing it
        holds is served again. The output thread only records it (the cache is the engine
        thread's), and the engine thread's next hook shuts the cache down and raises."""
        if self._failure is None:
            self._failure = exc
            _log.error("omni-cache export stopped by a failure in %s", where, exc_info=exc)
        if threading.current_thread() is not self._thread:
            self.cache.shutdown()

    # -----------------------------------------------------------------------------------------
    # Output thread.

    def _run(self) -> None:
        while True:
            entry = self._queue.get()
            if self._failure is not None:
                return
            started = time.thread_time()
            try:
                if entry[0] == _STEP:
                    self._export_step(entry[1], entry[2])
                elif entry[0] == _ENDED:
                    for req_id in entry[1]:
                        self._finish(req_id, ENDED_BY_ENGINE)
                else:
                    for req_id in list(self._parts):
                        self._finish(req_id, ENDED_BY_SHUTDOWN)
                    return
            except BaseException as exc:
                self._stop(exc, "the output thread")
                return
            finally:
                self._counts["output_thread_cpu_s"] += time.thread_time() - started

    def _export_step(self, out: StageCacheOutputs, req_ids: tuple[str, ...]) -> None:
        self._counts["steps_exported"] += 1
        if self._sink is not None:
            self._sink(out)
        if self._sink_dir is None:
            return
        hidden = out.hidden_states
        cached = [
            name
            for name, rows in out.mm_outputs.items()
            if all(isinstance(rows.get(r), torch.Tensor) for r in req_ids)
        ]
        for req_id in req_ids:
            start, end = out.positions[req_id]
            if end > start:
                mm = {name: out.mm_outputs[name][req_id] for name in cached}
                part = (start, end, hidden[req_id] if hidden is not None else None, mm)
                self._parts.setdefault(req_id, []).append(part)

    def _finish(self, req_id: str, ended: str) -> None:
        self._counts["requests_ended"] += 1
        parts = self._parts.pop(req_id, [])
        if self._sink_dir is not None and parts:
            write_request_file(self._sink_dir, req_id, parts, ended=ended)
            self._counts["files_written"] += 1
        if self._on_finished is not None:
            self._on_finished(req_id)
