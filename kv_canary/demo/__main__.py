"""`python -m kv_canary.demo`: the same as `kv-canary demo`."""
import sys

from . import main

sys.exit(main())
