"""Host storage allocation: zeroed, and large pools backed by transparent huge pages."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from omni_cache_cuda._storage import advise_huge_pages, alloc_host

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    """The selected mode (``always``, ``madvise``, ``never``), or None off Linux."""
    if not sys.platform.startswith("linux") or not _THP.exists():
        return None
    found = re.search(r"\[(\w+)\]", _THP.read_text())
    return found.group(1) if found else None


def _thp_eligible(address: int) -> bool | None:
    """Whether the mapping holding ``address`` may get huge pages (``THPeligible`` in smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            inside = int(head.group(1), 16) <= address < int(head.group(2), 16)
        elif inside and line.startswith("THPeligible:"):
            return line.split()[1] == "1"
    return None


def test_alloc_host_returns_zeroed_memory_of_the_shape() -> None:
    rows = alloc_host((4096, 2048), torch.bfloat16, pin=False)
    assert rows.shape == (4096, 2048) and rows.dtype == torch.bfloat16
    assert int(rows.count_nonzero()) == 0


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason="no transparent huge pages")
def test_a_large_pool_is_advised_huge_pages_and_a_small_one_is_not() -> None:
    """A pool of 32 MiB lies in a mapping eligible for huge pages once advised; 1 MiB is left."""
    large = torch.empty((8192, 2048), dtype=torch.bfloat16)
    assert advise_huge_pages(large)
    assert _thp_eligible(large.data_ptr() + (4 << 20)) is True
    small = torch.empty((256, 2048), dtype=torch.bfloat16)
    assert not advise_huge_pages(small)


@pytest.mark.skipif(_thp_mode() != "madvise", reason="huge pages only on request under madvise")
def test_alloc_host_advises_before_the_first_touch() -> None:
    """Under ``madvise`` a mapping is eligible only if advised: alloc_host's pool is."""
    pool = alloc_host((8192, 2048), torch.bfloat16, pin=False)
    assert _thp_eligible(pool.data_ptr() + (4 << 20)) is True
