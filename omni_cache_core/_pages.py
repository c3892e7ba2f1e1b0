"""Staging pages: who holds each of the `staging_depth` pages (PAGE-1..3, D5).

A page is a set of holders, each a `Holder` of one kind:

========  =====================================================  ==============================
kind      held from                                              let go at
========  =====================================================  ==============================
SAVE      the save's page claim (`save_proceed`)                 its commit or abort
STEP      the step's commit                                      its consume end or discard
TASK      the step write's registration, before it is visible    the write's WRITTEN or FAILED
========  =====================================================  ==============================

A page is free iff it has no holder. This unit decides which page is free and keeps the holder
sets; it does not decide when a holder comes or goes: the save, the steps and the write tasks
do, and the core routes their moves here.
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple

from omni_cache_core._errors import InvariantError

__all__ = ["Holder", "HolderKind", "PageHolders"]


class HolderKind(enum.IntEnum):
    """What holds a staging page (ordered, so holder sets sort in snapshots)."""

    #: The save in progress, from its page claim to its commit or abort.
    SAVE = 0
    #: A saved step, until its consume ends (D5).
    STEP = 1
    #: A step write, until WRITTEN or FAILED (PAGE-3).
    TASK = 2

    def __repr__(self) -> str:
        return f"HolderKind.{self.name}"


class Holder(NamedTuple):
    """One holder of a page: its kind and the id of the thing (a step id, a tid; 0 for SAVE).

    Equal to the plain ``(kind, ident)`` pair `PageHolders` stores.
    """

    kind: HolderKind
    ident: int


class PageHolders:
    """The holders of every staging page.

    A holder is stored as the plain ``(kind, ident)`` pair a `Holder` equals (building the
    named tuple costs several times more, at every save, report and consume).
    """

    __slots__ = ("_pages",)

    def __init__(self, depth: int) -> None:
        self._pages: list[set[tuple[HolderKind, int]]] = [set() for _ in range(depth)]

    def hold(self, page: int, kind: HolderKind, ident: int = 0) -> None:
        """Add the holder `(kind, ident)` to `page`."""
        self._pages[page].add((kind, ident))

    def let_go(self, page: int, kind: HolderKind, ident: int = 0) -> None:
        """Remove the holder `(kind, ident)` from `page` (nothing if it does not hold it)."""
        self._pages[page].discard((kind, ident))

    def holds(self, page: int, kind: HolderKind, ident: int = 0) -> bool:
        """Whether the holder `(kind, ident)` holds `page`."""
        return (kind, ident) in self._pages[page]

    def lowest_free(self) -> int | None:
        """The lowest page with no holder, or None."""
        for page, holders in enumerate(self._pages):
            if not holders:
                return page
        return None

    def claim_free(self, kind: HolderKind, ident: int = 0) -> int | None:
        """Hold the lowest page with no holder for `(kind, ident)`; None if none is free (PAGE-2)."""
        page = self.lowest_free()
        if page is not None:
            self._pages[page].add((kind, ident))
        return page

    def claim(self, page: int, kind: HolderKind, ident: int = 0) -> None:
        """Hold `page`, which must be free, for `(kind, ident)` (PAGE-7).

        Raises:
            InvariantError: The page has a holder (a bug in this library); nothing changes.
        """
        holders = self._pages[page]
        if holders:
            raise InvariantError(f"page {page} was to be free for the save but is held: {holders}")
        holders.add((kind, ident))

    def publish(self, page: int, step_id: int, tid: int | None) -> None:
        """A commit: the save lets go of `page`, which its step and its step write now hold.

        One call for the three moves of every commit (PAGE-3: the write holds the page before
        the commit returns, so before the write is visible).
        """
        holders = self._pages[page]
        holders.discard((HolderKind.SAVE, 0))
        holders.add((HolderKind.STEP, step_id))
        if tid is not None:
            holders.add((HolderKind.TASK, tid))

    @property
    def in_use(self) -> int:
        """Pages with at least one holder."""
        return sum(1 for holders in self._pages if holders)

    def holders(self) -> list[tuple[int, Holder]]:
        """Every (page, holder) pair, page by page."""
        return [(page, Holder(*h)) for page, holders in enumerate(self._pages) for h in holders]

    def snapshot(self) -> tuple[Any, ...]:
        """A canonical, hashable value of the holders."""
        return tuple(tuple(sorted(holders)) for holders in self._pages)

    def check_invariants(self) -> None:
        """Check that holders are well formed and the save holds at most one page.

        Raises:
            InvariantError: One does not hold (a bug in this library).
        """
        seen: set[Holder] = set()
        for page, holders in enumerate(self._pages):
            for kind, ident in holders:
                holder = Holder(kind, ident)
                if not isinstance(kind, HolderKind) or type(ident) is not int:
                    raise InvariantError(f"page {page} has a stray holder {holder!r}")
                if holder in seen:
                    raise InvariantError(f"{holder!r} holds two pages")
                seen.add(holder)
