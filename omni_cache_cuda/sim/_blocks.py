"""A paged KV block pool with prefix caching, as vLLM's block manager keeps it.

Blocks carry reference counts. An unreferenced block sits in the free queue, ordered by when it
was freed; it stays registered under its prefix hash (a later request may hit it) until it is
handed out again, which evicts the hash. Blocks are handed out least recently freed first, or,
with probability ``mru_p``, most recently freed first: a recycling order vLLM does not use, which
reuses slots whose writes or delayed reads are still pending, so a cache must hold under it too.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Iterable, Sequence

__all__ = ["BlockPool"]


class BlockPool:
    """KV blocks with reference counts, a free queue in reuse order and a prefix-hash table."""

    def __init__(
        self, num_blocks: int, *, rng: random.Random | None = None, mru_p: float = 0.0
    ) -> None:
        """Create ``num_blocks`` free, unregistered blocks.

        Args:
            num_blocks: Number of KV blocks.
            rng: Draws the recycling order of each allocation; None always takes the block freed
                longest ago.
            mru_p: With ``rng``, the chance an allocation takes the block freed last instead.
        """
        self.num_blocks = num_blocks
        self._rng = rng
        self._mru_p = mru_p
        self.ref = [0] * num_blocks
        # Insertion order is reuse order: the front is the block freed longest ago.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._key_block: dict[int, int] = {}
        self._block_key: dict[int, int] = {}
        self._written = [False] * num_blocks
        #: Blocks handed out.
        self.allocations = 0
        #: Registered blocks whose hash was dropped because the block was handed out again.
        self.evictions = 0
        #: Allocations of a block an earlier tenant wrote (slots recycled).
        self.recycled = 0

    @property
    def num_free(self) -> int:
        """Blocks with no reference, registered or not."""
        return len(self._free)

    def is_registered(self, key: int) -> bool:
        """Whether some block holds the prefix ending in hash ``key``."""
        return key in self._key_block

    def lookup(self, keys: Iterable[int]) -> list[int]:
        """Return the registered blocks of the longest prefix of ``keys`` that is registered."""
        found: list[int] = []
        for key in keys:
            block = self._key_block.get(key)
            if block is None:
                break
            found.append(block)
        return found

    def count_unreferenced(self, blocks: Sequence[int]) -> int:
        """Return how many of ``blocks`` sit in the free queue (touching them takes them out)."""
        return sum(1 for block in blocks if self.ref[block] == 0)

    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference on registered blocks a request hits."""
        for block in blocks:
            if self.ref[block] == 0:
                del self._free[block]
            self.ref[block] += 1

    def allocate(self, count: int) -> list[int]:
        """Hand out ``count`` free blocks in reuse order, evicting their hashes.

        Raises:
            RuntimeError: Fewer than ``count`` blocks are free; nothing is allocated.
        """
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} KV blocks, {len(self._free)} free")
        blocks: list[int] = []
        for _ in range(count):
            newest = self._rng is not None and self._rng.random() < self._mru_p
            block, _ = self._free.popitem(last=newest)
            old = self._block_key.pop(block, None)
            if old is not None:
                del self._key_block[old]
                self.evictions += 1
            if self._written[block]:
                self.recycled += 1
            self.ref[block] = 1
            self.allocations += 1
            blocks.append(block)
        return blocks

    def take(self, hit: Sequence[int], count: int) -> list[int] | None:
        """Touch the ``hit`` blocks and allocate ``count`` more, or None (nothing changes).

        Touching a hit block takes it out of the free queue, so it does not count as free for the
        new ones.
        """
        if count > len(self._free) - self.count_unreferenced(hit):
            return None
        self.touch(hit)
        return [*hit, *self.allocate(count)]

    def release(self, blocks: Iterable[int]) -> None:
        """Drop one reference on each block, in the order given; unreferenced ones join the queue."""
        for block in blocks:
            self.ref[block] -= 1
            if self.ref[block] == 0:
                self._free[block] = None

    def mark_written(self, block: int) -> None:
        """Record that the block's tenant wrote its slots (its next allocation recycles them)."""
        self._written[block] = True

    def register(self, block: int, key: int) -> bool:
        """Register a full block under the prefix hash ending it; False if either is taken.

        A duplicate (the same prefix computed twice) stays unregistered; the request's chain of
        blocks goes on regardless.
        """
        if key in self._key_block or block in self._block_key:
            return False
        self._key_block[key] = block
        self._block_key[block] = key
        return True

    def unregister(self, block: int, key: int) -> None:
        """Drop a registration again, if ``block`` still holds ``key`` (a step that failed)."""
        if self._key_block.get(key) == block:
            del self._key_block[key]
            del self._block_key[block]

    def check_invariants(self) -> None:
        """Assert that reference counts, the free queue and the hash table agree."""
        for block in range(self.num_blocks):
            assert self.ref[block] >= 0, block
            assert (self.ref[block] == 0) == (block in self._free), block
        for key, block in self._key_block.items():
            assert self._block_key[block] == key, block
        assert len(self._key_block) == len(self._block_key)
