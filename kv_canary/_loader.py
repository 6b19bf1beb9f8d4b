"""Import a generated tree (generated/) as a Python package.

The default tree is `kv_canary.generated`; tests and tools load trees generated from other
schemas (into temporary directories) side by side under unique module names.
"""
from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

PACKAGE_DIR = Path(__file__).resolve().parent


def default_generated_dir() -> Path:
    """Installed wheels carry kv_canary/generated; a source checkout has generated/ at its root."""
    installed = PACKAGE_DIR / "generated"
    if (installed / "__init__.py").is_file():
        return installed
    return PACKAGE_DIR.parent / "generated"


def load_generated(path: Path | str, module_name: str | None = None) -> ModuleType:
    """Import the generated package at `path` (cached per module name)."""
    path = Path(path).resolve()
    init = path / "__init__.py"
    if not init.is_file():
        raise ImportError(f"kv-canary: no generated package at {path} (run `make generate`)")
    if module_name is None:
        module_name = "kv_canary_generated_" + hashlib.sha256(str(path).encode()).hexdigest()[:12]
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, init, submodule_search_locations=[str(path)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module
