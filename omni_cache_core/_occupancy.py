"""Per-key slot occupancy: owner and version, 8 bytes per (slot, key) (SLOT-1, SLOT-6, D3).

`OccupancyTable` is one key's table; `SlotTables` holds the table of every cached key seen so
far, plus the spare tables allocated ahead of a key's first save (`reserve_tables`). This unit
decides who owns each (slot, key) and at which version; it does not know what a write task or a
read is: a claim reports the owners it displaced, and the caller tombstones them.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, KeysView, Mapping
from types import MappingProxyType
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from omni_cache_core._contract import TensorName
from omni_cache_core._errors import InvariantError
from omni_cache_core._values import SlotArray

__all__ = ["ABSENT", "COMMITTED", "UNKNOWN", "OccupancyTable", "SlotTables", "any_true", "concat"]

#: Owner codes. A positive owner is the tid of the write that holds the slot (IN_TRANSIT).
COMMITTED = 0
ABSENT = -1
UNKNOWN = -2

# An entry is one uint64: the version in the high word, the owner (as uint32) in the low word.
# A version is the number of the table's claim that last gave the slot a new tenant (claims
# are counted from 1; a slot never claimed has version 0), so a claim writes one constant into
# every slot it takes, with no read first.
_LOW: int = 0xFFFF_FFFF
_OWNER_WORD = 0 if np.little_endian else 1


_EMPTY_SLOTS: Final = np.zeros(0, dtype=np.int64)


def concat(chunks: list[SlotArray]) -> SlotArray:
    """The chunks of one key's slots as one array."""
    if not chunks:
        return _EMPTY_SLOTS
    return chunks[0] if len(chunks) == 1 else np.concatenate(chunks)


def any_true(mask: npt.NDArray[np.bool_]) -> bool:
    """`mask.any()` for a 1-d bool array, without the ufunc reduction's fixed cost.

    `argmax` stops at the first True and costs a fraction of `any()` on the short arrays a
    step has, which matters when a step makes dozens of such checks.
    """
    return len(mask) > 0 and bool(mask[mask.argmax()])


def _max(values: npt.NDArray[np.int32]) -> int:
    return int(values[values.argmax()]) if len(values) else UNKNOWN


class OccupancyTable:
    """Owner and version of every slot for one cached key.

    `owner` encodes the presence (D3): `> 0` IN_TRANSIT under that tid, `0` COMMITTED, `-1`
    ABSENT, `-2` UNKNOWN. `version` is the number of the table's last claim (or explicit absence,
    or forgotten write) that changed the slot, never changed by a commit, so a reader that recorded
    a version can tell whether the slot changed tenant. `owner` and `version` are views of the one
    8-byte entry per slot.
    """

    __slots__ = ("_entries", "claims", "owner", "version")

    def __init__(self, num_slots: int) -> None:
        # One entry per slot holds both fields, so they share a cache line: on a large table
        # scattered slots miss the cache, and a claim needs both.
        self._attach(np.full(num_slots, UNKNOWN & _LOW, dtype=np.uint64), 0)

    def _attach(self, entries: npt.NDArray[np.uint64], claims: int) -> None:
        self._entries = entries
        #: Claims made so far; the next one stamps its slots with version ``claims + 1``.
        self.claims = claims
        words = entries.view(np.uint32)
        self.owner: npt.NDArray[np.int32] = words[_OWNER_WORD::2].view(np.int32)
        self.version: npt.NDArray[np.uint32] = words[1 - _OWNER_WORD :: 2]

    def __reduce__(self) -> tuple[object, tuple[npt.NDArray[np.uint64], int]]:
        # Copies (deepcopy, pickle) must keep `owner` and `version` views of the copied entries.
        return (_table_of, (self._entries, self.claims))

    @property
    def metadata_bytes(self) -> int:
        """Bytes spent on this key's table."""
        return int(self._entries.nbytes)

    def take(
        self,
        slots: SlotArray,
        new_owner: int | npt.NDArray[np.int32],
        *,
        writes_in_flight: bool = True,
    ) -> list[tuple[int, SlotArray]]:
        """Give `slots` to `new_owner` (a tid, or one per slot, or ABSENT) with a new version.

        A slot listed twice goes to the owner of its last occurrence (TASK-5: the last row wins).
        `writes_in_flight=False`: the caller knows no write owns any slot of this table, so no
        earlier owner is looked for.

        Returns the displaced in-flight owners with the slots each lost (SLOT-2), in tid order:
        earlier owners, and owners given a slot that a later row of the same claim took.
        """
        previous = self.owner[slots] if writes_in_flight else None
        if previous is not None and _max(previous) <= 0:
            previous = None  # the usual claim: nothing was in flight there
        high = self._next_version()
        if not isinstance(new_owner, np.ndarray):
            self._entries[slots] = high | (new_owner & _LOW)
            if previous is None:
                return []
            displaced = (previous > 0) & (previous != new_owner)
            return _by_loser(previous[displaced], slots[displaced])
        entries = new_owner.astype(np.uint32).astype(np.uint64)
        entries |= high
        # Fancy assignment leaves a repeated index's winner unspecified, so give each slot its
        # last row's entry explicitly; then every other owner of it has lost it.
        order = np.argsort(slots, kind="stable")
        ordered = slots[order]
        last = np.ones(len(slots), dtype=np.bool_)
        last[:-1] = ordered[1:] != ordered[:-1]
        self._entries[ordered[last]] = entries[order[last]]
        final = self.owner[slots]
        beaten = (new_owner > 0) & (new_owner != final)
        if previous is None:
            return _by_loser(new_owner[beaten], slots[beaten])
        displaced = (previous > 0) & (previous != final)
        losers = np.concatenate([previous[displaced], new_owner[beaten]])
        return _by_loser(losers, np.concatenate([slots[displaced], slots[beaten]]))

    def commit(self, tid: int, slots: SlotArray, *, intact: bool = False) -> None:
        """Mark the slots `tid` still owns COMMITTED (SLOT-3); versions are unchanged.

        `intact`: the caller knows `tid` lost none of `slots`, so they are marked without
        checking who owns them.
        """
        if intact:
            self.owner[slots] = COMMITTED
            return
        still_owned = slots[self.owner[slots] == tid]
        self.owner[still_owned] = COMMITTED

    def forget(self, tid: int, slots: SlotArray) -> None:
        """A failed write's slots become ABSENT with a new version: their rows are lost."""
        still_owned = slots[self.owner[slots] == tid]
        self._entries[still_owned] = self._next_version() | (ABSENT & _LOW)

    def _next_version(self) -> int:
        """Count a claim; return its version, shifted into an entry's high word.

        A uint32 version wraps after 2**32 claims of the table; a reader that planned on a slot
        would need the slot reclaimed exactly that many claims later to miss the change.
        """
        self.claims += 1
        return (self.claims & _LOW) << 32


def _table_of(entries: npt.NDArray[np.uint64], claims: int) -> OccupancyTable:
    table = OccupancyTable.__new__(OccupancyTable)
    table._attach(entries, claims)
    return table


def _by_loser(losers: npt.NDArray[np.int32], lost_slots: SlotArray) -> list[tuple[int, SlotArray]]:
    """Group lost slots by the write that lost them, in tid order."""
    if not len(losers):
        return []
    return [(int(tid), np.unique(lost_slots[losers == tid])) for tid in np.unique(losers).tolist()]


class SlotTables:
    """The occupancy table of every cached key, in first-seen order, and the spare ones.

    Args:
        num_slots: Slots per table.
    """

    __slots__ = ("_allocated", "_spare", "by_key", "num_slots")

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        #: The tables in use by key, first seen first; callers only read it (hot paths index it
        #: directly: a property or a method costs a call per key and report).
        self.by_key: dict[TensorName, OccupancyTable] = {}
        #: Tables allocated ahead of a key's first save: an allocation cache, not state.
        self._spare: dict[TensorName, OccupancyTable] = {}
        self._allocated = 0

    @property
    def tables(self) -> Mapping[TensorName, OccupancyTable]:
        """The tables in use by key, first seen first (a read-only view)."""
        return MappingProxyType(self.by_key)

    @property
    def spare(self) -> Mapping[TensorName, OccupancyTable]:
        """The spare tables by key (a read-only view)."""
        return MappingProxyType(self._spare)

    @property
    def allocated(self) -> int:
        """How many tables were allocated so far, in use or spare (an allocation count)."""
        return self._allocated

    def seen_keys(self) -> KeysView[TensorName]:
        """The cached keys seen so far, first seen first."""
        return self.by_key.keys()

    def get(self, key: TensorName) -> OccupancyTable | None:
        """The key's table, or None for a key never saved."""
        return self.by_key.get(key)

    def metadata_bytes(self) -> int:
        """Bytes of every table, spare tables included (SLOT-6)."""
        return sum(t.metadata_bytes for t in (*self.by_key.values(), *self._spare.values()))

    def reserve(self, keys: Iterable[TensorName]) -> None:
        """Allocate the tables of keys not seen yet; all or none (a MemoryError keeps none)."""
        new = {
            key: OccupancyTable(self.num_slots)
            for key in dict.fromkeys(keys)
            if key not in self.by_key and key not in self._spare
        }
        self._spare.update(new)
        self._allocated += len(new)

    def install(self, keys: Iterable[TensorName]) -> None:
        """Give each key not seen yet its table: its spare one, or a new one."""
        for key in keys:
            if key not in self.by_key:
                spare = self._spare.pop(key, None)
                if spare is None:
                    spare = OccupancyTable(self.num_slots)
                    self._allocated += 1
                self.by_key[key] = spare

    def commit_write(
        self,
        tid: int,
        slots: Mapping[TensorName, list[SlotArray]],
        lost_keys: Container[TensorName],
    ) -> None:
        """SLOT-3: a landed write's slots, per key, become COMMITTED where it still owns them.

        `lost_keys`: the keys the write lost slots of. A slot leaves a write only through a
        claim or an absence, which tombstone it (SLOT-2): for any other key the write still
        owns every slot it claimed, and they are marked without looking.
        """
        tables = self.by_key
        for key, chunks in slots.items():
            claimed = chunks[0] if len(chunks) == 1 else concat(chunks)
            if key in lost_keys:
                tables[key].commit(tid, claimed)
            else:
                tables[key].owner[claimed] = COMMITTED

    def forget_write(self, tid: int, slots: Mapping[TensorName, list[SlotArray]]) -> None:
        """A failed write's slots, per key, become ABSENT where it still owns them."""
        for key, chunks in slots.items():
            self.by_key[key].forget(tid, concat(chunks))

    def owners_at(
        self, key: TensorName, slots: SlotArray
    ) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.uint32]]:
        """Owner and version of `slots` for `key` (UNKNOWN, version 0 for a key never seen)."""
        table = self.by_key.get(key)
        if table is None:
            return (
                np.full(len(slots), UNKNOWN, dtype=np.int32),
                np.zeros(len(slots), dtype=np.uint32),
            )
        return table.owner[slots], table.version[slots]

    def snapshot(self) -> tuple[Any, ...]:
        """A canonical, hashable value of the tables in use (spare tables are not state)."""
        return tuple(
            (k, t.claims, t.owner.tobytes(), t.version.tobytes()) for k, t in self.by_key.items()
        )

    def check_invariants(self) -> None:
        """Check owner codes, versions and that spare tables are fresh.

        Raises:
            InvariantError: One does not hold (a bug in this library).
        """
        for key, table in self.by_key.items():
            if not bool((table.owner >= UNKNOWN).all()):
                raise InvariantError(f"key {key}: bad owner code")
            if table.claims < 2**32 and int(table.version.max()) > table.claims:
                raise InvariantError(
                    f"key {key}: a version above the table's {table.claims} claims"
                )
        for key, table in self._spare.items():
            if key in self.by_key:
                raise InvariantError(f"key {key}: a spare table beside the one in use")
            if table.claims != 0 or not bool((table.owner == UNKNOWN).all()):
                raise InvariantError(f"key {key}: a spare table that is not fresh")
