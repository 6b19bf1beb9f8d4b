"""Import a generated tree as a Python package (the default one is `kv_canary.generated`; trees of
other schemas load side by side under unique module names), and find the generator and its workflow:
a wheel carries `generated/`, `codegen/` and `workflow/` inside kv_canary/, a source checkout at its
root, imported under their `kv_canary.` names either way.
"""
from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

PACKAGE_DIR = Path(__file__).resolve().parent.parent  # kv_canary/
CODEGEN_PACKAGE = "kv_canary.codegen"
# The PR workflow beside the generator (abi-check, pr-report, init); it imports kv_canary.codegen.
WORKFLOW_PACKAGE = "kv_canary.workflow"


def default_generated_dir() -> Path:
    """kv_canary/generated in an installed wheel, <checkout root>/generated in a source checkout."""
    installed = PACKAGE_DIR / "generated"
    return installed if (installed / "__init__.py").is_file() else PACKAGE_DIR.parent / "generated"


def _import_package(path: Path, module_name: str) -> ModuleType:
    init = path / "__init__.py"
    spec = importlib.util.spec_from_file_location(module_name, init, submodule_search_locations=[str(path)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def register_codegen() -> None:
    """Make `kv_canary.codegen` and `kv_canary.workflow` importable from a source checkout (cheap: their
    __init__ modules import nothing)."""
    for module_name in (CODEGEN_PACKAGE, WORKFLOW_PACKAGE):
        folder = module_name.rpartition(".")[2]
        if module_name in sys.modules or (PACKAGE_DIR / folder / "__init__.py").is_file():
            continue
        path = PACKAGE_DIR.parent / folder  # a source checkout's
        if (path / "__init__.py").is_file():
            _import_package(path, module_name)


def regenerate_command(tree) -> str:
    """What regenerates a generated tree, for messages about it (the tree records it:
    `make generate` in kv-canary's checkout, `kv-canary generate` in an engine's repository)."""
    return getattr(tree, "REGENERATE_COMMAND", None) or "make generate"


def load_generated(path: Path | str, module_name: str | None = None) -> ModuleType:
    """Import the generated package at `path` (cached per module name); its first launch takes its
    runtime from kv_canary.runtime_for."""
    path = Path(path).resolve()
    if not (path / "__init__.py").is_file():
        raise ImportError(f"kv-canary: no generated package at {path} (run `make generate`)")
    if module_name is None:
        module_name = "kv_canary_generated_" + hashlib.sha256(str(path).encode()).hexdigest()[:12]
    if module_name in sys.modules:
        return sys.modules[module_name]
    return _import_package(path, module_name)


DEFAULT_MODULE = "kv_canary.generated"


def default_tree() -> ModuleType:
    """The default generated tree, `kv_canary.generated` (kernels.yaml's tree)."""
    return sys.modules.get(DEFAULT_MODULE) or load_generated(default_generated_dir(), DEFAULT_MODULE)
