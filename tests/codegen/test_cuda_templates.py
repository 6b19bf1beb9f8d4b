"""The CUDA templates are small holes over the hand-written device headers (kv_canary/csrc/): they
render the schema's constants, tables and entry points from a typed context, one template per
launch shape where the shapes' device code differs."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from kv_canary.codegen.cuda_context import typed_context
from kv_canary.codegen.load import load_schema
from kv_canary.codegen.operations import KERNEL_TEMPLATES
from kv_canary.codegen.outputs import KERNEL_SOURCE_TEMPLATES
from kv_canary.codegen.render import TEMPLATE_DIR, output_plan
from support.trees import DEFAULT_SCHEMA, EXAMPLE_SCHEMAS

from kv_canary.trees.csrc import csrc_headers

# Device code: a function body or a statement that branches or loops.
DEVICE_CODE = re.compile(r"__device__ __forceinline__|^\s*(for|while|if|switch) \(|__shared__", re.M)


@pytest.mark.parametrize("path", sorted((TEMPLATE_DIR / "cuda").iterdir()), ids=lambda p: p.name)
def test_cuda_templates_hold_no_device_code(path: Path):
    match = DEVICE_CODE.search(path.read_text(encoding="utf-8"))
    assert match is None, f"{path.name} holds device code ({match.group()!r}): it belongs in kv_canary/csrc/"


def test_every_launch_shape_of_every_kernel_template_has_a_source_template():
    for name, spec in KERNEL_TEMPLATES.items():
        templates = KERNEL_SOURCE_TEMPLATES[name]
        if isinstance(templates, dict):
            assert set(templates) == set(spec.shapes), name
        for template in templates.values() if isinstance(templates, dict) else [templates]:
            assert (TEMPLATE_DIR / template).is_file(), template


@pytest.mark.parametrize("schema_path", [DEFAULT_SCHEMA, *EXAMPLE_SCHEMAS], ids=lambda p: p.stem)
def test_cuda_and_emulation_templates_get_a_frozen_typed_context(schema_path):
    schema = load_schema(schema_path)
    typed = [(template, typed_context(template, schema, extra.get("kernel")))
             for template, _, extra in output_plan(schema) if template.startswith(("cuda/", "emulation/"))]
    assert len(typed) == 2 + len(schema.kernels)  # the layout header, the launchers, one source per kernel
    for template, ctx in typed:
        assert dataclasses.is_dataclass(ctx) and type(ctx).__dataclass_params__.frozen, template


def test_generated_sources_include_only_existing_csrc_headers(any_tree):
    from kv_canary.trees.sources import kernel_abi, read_source
    abi = kernel_abi(any_tree)
    headers = csrc_headers()
    for relative in [abi.HEADER, *(k.source for k in abi.KERNELS.values())]:
        for include in re.findall(r'#include "([^"]+)"', read_source(any_tree, relative)):
            assert include == "kv_canary_layout.cuh" or include in headers, (relative, include)
