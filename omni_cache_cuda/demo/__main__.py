"""Run the demo: ``python -m omni_cache_cuda.demo [options]``."""

from . import main

raise SystemExit(main())
