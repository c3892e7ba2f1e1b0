"""End-to-end demo: a small transformer served through a paged KV cache with prefix caching.

``main`` runs a shared-prefix workload twice (full recompute, then KV prefix caching with the omni
prefix cache) and checks that the second stage received the same full-prompt hidden states. Run it
with ``omni-cache demo`` or ``python -m omni_cache_cuda.demo``.
"""

from ._run import main

__all__ = ["main"]
