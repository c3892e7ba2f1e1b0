"""A simulated vLLM-style engine side: the scheduler the demo, the soak and the tests drive.

`Scheduler` keeps requests, a paged KV `BlockPool` with hash-chained prefix blocks (least
recently freed blocks reused first), chunked prefill, preemption, aborts and request ids used
again, and tells a `RequestListener` every lifecycle record (`RecordQueue` turns them into the
cache's request records). The prefix-hash oracle
(`prefix_hashes`, `float_rows`, `int_rows`, `next_token`) says which rows a position must hold:
a pure function of the tokens up to it. The soak's run and its checks (`_soak`, `_soak_checks`)
sit beside them; `python -m omni_cache_cuda.soak` is the command.

It lives in the package, not under ``tests/``, because the shipped demo and soak run it; it is
not part of the library's API.
"""

from ._blocks import BlockPool
from ._oracle import ROOT_HASH, extend_hash, float_rows, int_rows, next_token, prefix_hashes
from ._records import RecordQueue
from ._scheduler import Knobs, RequestListener, Scheduler, SchedulerCounts, SimRequest, StepPlan

__all__ = [
    "ROOT_HASH",
    "BlockPool",
    "Knobs",
    "RecordQueue",
    "RequestListener",
    "Scheduler",
    "SchedulerCounts",
    "SimRequest",
    "StepPlan",
    "extend_hash",
    "float_rows",
    "int_rows",
    "next_token",
    "prefix_hashes",
]
