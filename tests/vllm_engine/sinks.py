"""A callable sink for the tests: what vLLM-Omni's next stage would do with each step's rows.

`record` runs in the engine's worker process (the spawned one too). It keeps every step's rows
per request and, when the request ends, saves them with `torch.save` under the folder named by
the ``OMNI_CACHE_TEST_SINK`` environment variable (the spawned process inherits it), so the test
can check them against the oracle. It puts the steps' rows together itself, from the positions
each materialize reports, without the export's own file writer.
"""

from __future__ import annotations

import os
import threading
import urllib.parse
from typing import Any

import torch

from omni_cache_cuda import StageCacheOutputs

FOLDER_ENV = "OMNI_CACHE_TEST_SINK"


class _Recorder:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._parts: dict[str, list[tuple[int, int, torch.Tensor]]] = {}
        self.steps = 0

    def __call__(self, out: StageCacheOutputs) -> None:
        assert out.hidden_states is not None
        with self._lock:
            self.steps += 1
            for req_id, (start, end) in out.positions.items():
                rows = out.hidden_states[req_id]
                assert rows.shape[0] == end - start, (req_id, rows.shape, start, end)
                self._parts.setdefault(req_id, []).append((start, end, rows.clone()))

    def request_finished(self, req_id: str) -> None:
        with self._lock:
            parts = self._parts.pop(req_id, [])
        record: dict[str, Any] = {
            "spans": [(start, end) for start, end, _ in parts],
            "rows": torch.cat([rows for _, _, rows in parts]) if parts else None,
        }
        name = urllib.parse.quote(req_id, safe="") + ".pt"
        folder = os.environ[FOLDER_ENV]
        torch.save(record, os.path.join(folder, f".{name}.tmp"))
        os.replace(os.path.join(folder, f".{name}.tmp"), os.path.join(folder, name))


record = _Recorder()


class _FailingSink:
    """Raises at its ``OMNI_CACHE_TEST_FAIL_AT``-th step: a sink that breaks mid-run."""

    def __init__(self) -> None:
        self.steps = 0

    def __call__(self, out: StageCacheOutputs) -> None:
        self.steps += 1
        if self.steps == int(os.environ.get("OMNI_CACHE_TEST_FAIL_AT", "1")):
            raise RuntimeError(f"the test sink fails at step {self.steps}")


failing = _FailingSink()
