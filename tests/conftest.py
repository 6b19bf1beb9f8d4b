"""Shared fixtures: generated layers for the default schema and the example schemas (helpers in
tests/support/, which this directory's place on sys.path makes importable as `support`)."""
from __future__ import annotations

import pytest
from support.layers import DEFAULT_SCHEMA, EXAMPLE_SCHEMAS, generate_layer


@pytest.fixture(scope="session")
def default_layer():
    import kv_canary
    return kv_canary.generated


@pytest.fixture(scope="session", params=[DEFAULT_SCHEMA, *EXAMPLE_SCHEMAS], ids=lambda p: p.stem)
def any_layer(request):
    """The default schema's checked-in layer and every example schema's temporary one."""
    if request.param == DEFAULT_SCHEMA:
        import kv_canary
        return kv_canary.generated
    return generate_layer(request.param)
