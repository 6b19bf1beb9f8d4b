"""`python -m kv_canary ...`: the same commands as the `kv-canary` console script."""
import sys

from .cli import main

sys.exit(main())
