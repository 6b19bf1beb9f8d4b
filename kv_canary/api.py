"""The SGLang-compatible launch API on the default generated layer (kv_canary.generated).

The functions are generated from the launch table (codegen/launches.py) into generated/api.py, so
their signatures are exactly SGLang's plus `backend=` ('torch', 'cuda', 'emulated'; see
kv_canary.runtime for the default choice), with the keywords of schema-declared input fields only
when the schema declares them. Another schema's layer has the same module as `<layer>.api`.
"""
from __future__ import annotations

from .generated.api import *  # noqa: F401,F403
from .generated.api import __all__  # noqa: F401
