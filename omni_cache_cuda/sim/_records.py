"""The scheduler's lifecycle calls as the cache's request records, queued for the next step."""

from __future__ import annotations

from collections.abc import Sequence

from omni_cache_core import PrefixCacheEventKind, PrefixCacheRequestEvent

__all__ = ["RecordQueue"]


class RecordQueue:
    """A `RequestListener` that queues one `PrefixCacheRequestEvent` per call in `events`.

    Users that keep more per request (the soak's admissions, the tests' slot oracle) extend the
    calls and call these first; whoever starts the step takes `events` and empties it.
    """

    def __init__(self) -> None:
        self.events: list[PrefixCacheRequestEvent] = []

    def start(
        self,
        req: str,
        blocks: Sequence[int],
        *,
        hit_end: int = 0,
        tokens: Sequence[int] | None = None,
    ) -> None:
        """Queue a STARTED record (``tokens`` are for extensions that model the rows)."""
        self.events.append(
            PrefixCacheRequestEvent(
                req_id=req,
                kind=PrefixCacheEventKind.STARTED,
                hit_end=hit_end,
                block_ids=tuple(blocks),
            )
        )

    def finish(self, req: str, *, abort: bool = False) -> None:
        """Queue a FINISHED record, or ABORTED with ``abort``."""
        kind = PrefixCacheEventKind.ABORTED if abort else PrefixCacheEventKind.FINISHED
        self.events.append(PrefixCacheRequestEvent(req_id=req, kind=kind))

    def preempt(self, req: str) -> None:
        """Queue a PREEMPTED record."""
        self.events.append(PrefixCacheRequestEvent(req_id=req, kind=PrefixCacheEventKind.PREEMPTED))

    def resume(self, req: str, blocks: Sequence[int], *, hit_end: int = 0) -> None:
        """Queue a RESUMED record."""
        self.events.append(
            PrefixCacheRequestEvent(
                req_id=req,
                kind=PrefixCacheEventKind.RESUMED,
                hit_end=hit_end,
                block_ids=tuple(blocks),
            )
        )
