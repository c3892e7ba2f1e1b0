"""The prefix-hash oracle: what a model computes at a position is a function of its token prefix.

A deterministic model's output at position ``p`` depends only on ``tokens[:p + 1]``. The oracle
gives every position a 64-bit hash of that prefix (`prefix_hashes`), and every value derived from
it is a pure function of the hash: the rows a position must hold (`float_rows`, `int_rows`) and,
for simulated runners that generate, the token sampled after it (`next_token`). So a hit on
another request's blocks, a resume and a full recompute must all give the same rows, and a
recycled block's old tenant (other tokens) gives different ones.

The same hash keys the simulated scheduler's prefix cache: a full block is registered under the
hash of the position that ends it, which chains on every block before it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["ROOT_HASH", "extend_hash", "float_rows", "int_rows", "next_token", "prefix_hashes"]

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
#: The hash of the empty prefix.
ROOT_HASH = 0x243F6A8885A308D3


def _mix(h: int) -> int:
    h = (h ^ (h >> 31)) * _GOLDEN & _MASK
    h = (h ^ (h >> 29)) * 0xBF58476D1CE4E5B9 & _MASK
    return h ^ (h >> 32)


def extend_hash(parent: int, token: int) -> int:
    """Return the hash of a prefix one token longer than the prefix hashed ``parent``."""
    return _mix(parent * 1_000_003 + token + 1)


def prefix_hashes(tokens: Sequence[int], parent: int = ROOT_HASH) -> list[int]:
    """Return ``H[p]``, a hash of ``tokens[:p + 1]`` for every position ``p`` (in [0, 2**64))."""
    out: list[int] = []
    h = parent
    for token in tokens:
        h = extend_hash(h, token)
        out.append(h)
    return out


def next_token(h: int, vocab: int) -> int:
    """Return the token in ``[1, vocab)`` a generating model samples after the prefix hashed ``h``."""
    return 1 + (_mix(h ^ 0x5851F42D4C957F2D) % (vocab - 1))


def float_rows(
    hashes: Sequence[int] | np.ndarray, width: int, *, first_lane: int = 0
) -> torch.Tensor:
    """Return float32 rows of ``width`` values per hash, each exact (24-bit fractions in [0, 1)).

    Lanes ``first_lane .. first_lane + width - 1`` of one hash are independent, so two keys cut
    from distinct lane ranges of the same positions hold unrelated values.
    """
    h = np.asarray(hashes, dtype=np.uint64).reshape(-1, 1)
    lanes = np.arange(first_lane + 1, first_lane + width + 1, dtype=np.uint64) * np.uint64(_GOLDEN)
    with np.errstate(over="ignore"):
        x = h * lanes
        x ^= x >> np.uint64(29)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(32)
    values = (x >> np.uint64(40)).astype(np.float32) / np.float32(1 << 24)
    return torch.from_numpy(values)


def int_rows(hashes: Sequence[int] | np.ndarray) -> torch.Tensor:
    """Return int64 rows of two codes per hash: the hash (as a signed integer) and a variant."""
    h = torch.from_numpy(np.asarray(hashes, dtype=np.uint64).view(np.int64).copy())
    return torch.stack((h, h ^ 0x2545F491), dim=1)
