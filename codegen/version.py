"""The version of the kv-canary that runs: what `kv-canary --version` prints and every JSON output
driven by kv-canary.yaml records (a repository pins one version: its hooks and CI must agree)."""
from __future__ import annotations

import functools

# pyproject.toml's version, for a bare checkout on sys.path (no installed distribution to ask).
CHECKOUT_VERSION = "0.1.0"


@functools.cache
def kv_canary_version() -> str:
    """The installed distribution's version, else the checkout's."""
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover - Python < 3.8
        return CHECKOUT_VERSION
    try:
        return version("kv-canary")
    except PackageNotFoundError:
        return CHECKOUT_VERSION


def version_line(prog: str = "kv-canary") -> str:
    """`kv-canary 0.1.0 (generator 1a2b3c4d5e6f)`: the release and the hash of the generator that
    made a tree's files (its generated __init__.py records the same hash in full)."""
    from .render import generator_sha256
    return f"{prog} {kv_canary_version()} (generator {generator_sha256()[:12]})"


def add_version_option(parser, prog: str = "kv-canary") -> None:
    """`--version`: prints version_line and exits 0 (the line is computed only then)."""
    import argparse

    class _Version(argparse.Action):
        def __init__(self, option_strings, dest, **kwargs):
            super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

        def __call__(self, parser, namespace, values, option_string=None):
            import sys
            sys.stdout.write(version_line(prog) + "\n")   # stdout, as argparse's own version action
            parser.exit(0)

    parser.add_argument("--version", action=_Version, help="print the kv-canary version and the generator's hash")
