"""The soak (`python -m omni_cache_cuda.soak`): a short run passes, and its checks can fail.

CI runs a one-minute soak after the tests (.ci/run); these tests only prove the command works
end to end on a few hundred steps, that every fault kind fired and ended in its error, and that
the oracle, the leak checks and the fault accounting each fail the run when broken.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from omni_cache_cuda import OmniPrefixCacheManager, soak
from omni_cache_cuda._consume_path import ConsumePath
from omni_cache_cuda._faults import FAULT_ERRORS
from omni_cache_cuda._storage import HostPool


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    status = soak.main(["--steps", "300", "--seed", "7", *args])
    return status, capsys.readouterr().out


def test_a_short_soak_passes_with_every_fault_kind(capsys: pytest.CaptureFixture[str]) -> None:
    """300 steps: rows checked, none wrong, every fault kind fired and ended in its error."""
    status, out = _run(capsys)
    assert status == 0, out
    assert "wrong rows: 0" in out
    assert "unexpected errors: 0" in out
    assert "verdict: PASS" in out
    rows = int(re.search(r"rows checked: (\d+)", out).group(1))  # type: ignore[union-attr]
    assert rows > 1000
    for kind, error in FAULT_ERRORS.items():
        line = re.search(rf"^  {kind} +{error.__name__} +(\d+) +(\d+) +(\d+)", out, re.MULTILINE)
        assert line is not None, kind
        episodes, fired, raised = map(int, line.groups())
        assert episodes >= 1 and fired == episodes and raised == fired, (kind, line.group(0))


def test_the_soak_catches_a_wrong_row(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hit row off by one fails the run with the row named."""
    gather = ConsumePath.gather_rows

    def off_by_one(self: ConsumePath, out: Any, *args: Any) -> None:
        gather(self, out, *args)
        out[-1:] += 1

    monkeypatch.setattr(ConsumePath, "gather_rows", off_by_one)
    status, out = _run(capsys)
    assert status == 1
    assert "  WRONG step" in out
    assert "verdict: FAIL: wrong rows" in out


def test_the_soak_catches_a_lost_position(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A materialize that drops a request's last position fails the exactly-once check."""
    materialize = OmniPrefixCacheManager.materialize

    def drop_last(self: OmniPrefixCacheManager, step_id: Any, req_ids: Any) -> Any:
        out = materialize(self, step_id, req_ids)
        positions = out.positions
        for req in list(positions)[:1]:
            start, end = positions[req]
            if end > start:
                positions._built()[req] = (start, end - 1)
                out.hidden_states[req] = out.hidden_states[req][:-1]
                for rows in out.mm_outputs.values():
                    rows[req] = rows[req][:-1]
        return out

    monkeypatch.setattr(OmniPrefixCacheManager, "materialize", drop_last)
    status, out = _run(capsys)
    assert status == 1
    assert "never delivered" in out or "passed over" in out


def test_the_soak_catches_a_swallowed_fault(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gather fault turned into zeros instead of an error fails the fault accounting."""
    gather = ConsumePath.gather

    def swallow(self: ConsumePath, out: Any, *args: Any) -> None:
        try:
            gather(self, out, *args)
        except Exception:
            out.zero_()

    monkeypatch.setattr(ConsumePath, "gather", swallow)
    status, out = _run(capsys)
    assert status == 1
    assert "no HitUnreadableError was seen" in out


def test_the_soak_catches_storage_kept_after_shutdown(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shutdown that keeps the host pool fails the leak check."""
    monkeypatch.setattr(HostPool, "release", lambda self: None)
    status, out = _run(capsys)
    assert status == 1
    assert "host storage held after shutdown" in out
