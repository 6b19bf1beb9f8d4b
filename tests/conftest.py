"""Shared fixtures: generated trees for the default schema and the example schemas (helpers in
tests/support/, which this directory's place on sys.path makes importable as `support`)."""
from __future__ import annotations

import pytest
from support.trees import DEFAULT_SCHEMA, EXAMPLE_SCHEMAS, generate_tree


@pytest.fixture(scope="session")
def default_tree():
    import kv_canary
    return kv_canary.generated


@pytest.fixture(scope="session", params=[DEFAULT_SCHEMA, *EXAMPLE_SCHEMAS], ids=lambda p: p.stem)
def any_tree(request):
    """The default schema's checked-in tree and every example schema's temporary one."""
    if request.param == DEFAULT_SCHEMA:
        import kv_canary
        return kv_canary.generated
    return generate_tree(request.param)
