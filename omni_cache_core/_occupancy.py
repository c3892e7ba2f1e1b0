"""Per-key slot occupancy: owner and version, 8 bytes per (slot, key) (SLOT-1, SLOT-6, D3)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from omni_cache_core._values import SlotArray

__all__ = ["ABSENT", "COMMITTED", "UNKNOWN", "OccupancyTable"]

#: Owner codes. A positive owner is the tid of the write that holds the slot (IN_TRANSIT).
COMMITTED = 0
ABSENT = -1
UNKNOWN = -2

_OWNER_DTYPE = np.int32
_VERSION_DTYPE = np.uint32


class OccupancyTable:
    """Owner and version of every slot for one cached key.

    `owner` encodes the presence (D3): `> 0` IN_TRANSIT under that tid, `0` COMMITTED, `-1`
    ABSENT, `-2` UNKNOWN. `version` is bumped by every claim and every explicit absence and never
    by a commit, so a reader that recorded a version can tell whether the slot changed tenant.
    """

    __slots__ = ("_entries", "owner", "version")

    def __init__(self, num_slots: int) -> None:
        # One 8-byte entry per slot, owner then version, so the two live in the same cache line:
        # a claim reads and writes both, and on a large table scattered slots miss the cache.
        self._entries = np.zeros((num_slots, 2), dtype=_VERSION_DTYPE)
        self.owner: npt.NDArray[np.int32] = self._entries[:, 0].view(_OWNER_DTYPE)
        self.version: npt.NDArray[np.uint32] = self._entries[:, 1]
        self.owner[:] = UNKNOWN

    @property
    def metadata_bytes(self) -> int:
        """Bytes spent on this key's table."""
        return int(self._entries.nbytes)

    def take(
        self, slots: SlotArray, new_owner: int | npt.NDArray[np.int32]
    ) -> list[tuple[int, SlotArray]]:
        """Give `slots` to `new_owner` (a tid, or one per slot, or ABSENT); bump versions.

        A slot listed twice goes to the owner of its last occurrence (TASK-5: the last row wins).

        Returns the displaced in-flight owners with the slots each lost (SLOT-2), in tid order:
        earlier owners, and owners given a slot that a later row of the same claim took.
        """
        previous = self.owner[slots]
        self.version[slots] += _VERSION_DTYPE(1)
        if isinstance(new_owner, np.ndarray):
            # Fancy assignment leaves a repeated index's winner unspecified, so give each slot
            # its last row's owner explicitly; then every other owner of it has lost it.
            order = np.argsort(slots, kind="stable")
            ordered = slots[order]
            last = np.ones(len(slots), dtype=np.bool_)
            last[:-1] = ordered[1:] != ordered[:-1]
            self.owner[ordered[last]] = new_owner[order[last]]
            final = self.owner[slots]
            beaten = (new_owner > 0) & (new_owner != final)
            displaced = (previous > 0) & (previous != final)
            losers = np.concatenate([previous[displaced], new_owner[beaten]])
            lost_slots = np.concatenate([slots[displaced], slots[beaten]])
        else:
            self.owner[slots] = new_owner
            if not len(previous) or previous.max() <= 0:
                return []  # the usual claim: nothing was in flight there
            displaced = (previous > 0) & (previous != new_owner)
            losers = previous[displaced]
            lost_slots = slots[displaced]
        return _by_loser(losers, lost_slots)

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
        self.owner[still_owned] = ABSENT
        self.version[still_owned] += _VERSION_DTYPE(1)


def _by_loser(losers: npt.NDArray[np.int32], lost_slots: SlotArray) -> list[tuple[int, SlotArray]]:
    """Group lost slots by the write that lost them, in tid order."""
    if not len(losers):
        return []
    return [(int(tid), np.unique(lost_slots[losers == tid])) for tid in np.unique(losers).tolist()]
