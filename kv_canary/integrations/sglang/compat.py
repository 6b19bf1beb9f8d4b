"""What the plugin refuses: an SGLang it was not tested against, a tree whose bytes are not SGLang's."""
from __future__ import annotations

# The SGLang releases whose canary runtime the plugin was checked against (tests/integrations/sglang).
TESTED_SGLANG = ("0.5.23",)


def installed_sglang_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("sglang")
    except PackageNotFoundError:
        raise ImportError("kv-canary: KV_CANARY_SGLANG=1 but the sglang distribution is not installed") from None


def check_sglang_version(found: str | None = None) -> str:
    found = installed_sglang_version() if found is None else found
    if found not in TESTED_SGLANG:
        raise ValueError(f"kv-canary: the SGLang plugin is tested with sglang {', '.join(TESTED_SGLANG)}, got sglang "
                         f"{found}; install a tested release (pip install 'kv-canary[sglang]') or unset "
                         f"KV_CANARY_SGLANG to run SGLang's own canary kernels")
    return found


def layout_differences(layout, sglang_consts, sglang_tags) -> list[str]:
    """Where `layout` (a generated tree's layout tables) is not byte-compatible with SGLang's records."""
    diffs = []
    ours = lambda name: getattr(layout, name, None)  # noqa: E731  (another schema may lack a name)

    def same(what, ours, theirs):
        if ours != theirs:
            diffs.append(f"{what}: tree {ours!r}, SGLang {theirs!r}")
    same("record bytes (CANARY_RECORD_BYTES)", ours("CANARY_RECORD_BYTES"), sglang_consts.CANARY_FIELDS_PER_SLOT * 8)
    same("slot stride (slot_stride_bytes)", ours("CANARY_SLOT_STRIDE_BYTES"), sglang_consts.CANARY_FIELDS_PER_SLOT * 8)
    for role, theirs in (("TOKEN", "TOKEN"), ("POSITION", "POSITION"), ("CHAIN_LINK", "PREV_HASH"),
                         ("KV_FINGERPRINT", "REAL_KV_HASH")):
        same(f"record word of {theirs}", ours(f"CANARY_{role}_WORD"),
             getattr(sglang_consts, f"CANARY_FIELD_{theirs}"))
    same("violation row fields", ours("VIOLATION_FIELDS"), sglang_consts.VIOLATION_FIELDS)
    for name in [n for n in dir(sglang_consts) if n.startswith("VIOLATION_FIELD_")]:
        same(name, ours(name), getattr(sglang_consts, name))
    same("chain anchor", ours("CANARY_CHAIN_ANCHOR"), sglang_consts.CANARY_CHAIN_ANCHOR)
    same("MAX_REAL_KV_SOURCES", ours("MAX_REAL_KV_SOURCES"), sglang_consts.MAX_REAL_KV_SOURCES)
    same("input fields (docs/semantics.md §8)", tuple(f.name for f in layout.INPUT_FIELDS), ())
    for ours_enum, theirs_enum in ((layout.CanaryLaunchTag, sglang_tags), (layout.RealKvHashMode,
                                                                           sglang_consts.RealKvHashMode)):
        same(ours_enum.__name__, {m.name: int(m) for m in ours_enum}, {m.name: int(m) for m in theirs_enum})
    theirs = {m.name: int(m) for m in sglang_consts.FailReason}
    same("FailReason (SGLang's bits)", {k: v for k, v in ((m.name, int(m)) for m in layout.FailReason) if k in theirs},
         theirs)
    return diffs


# kv-canary's launch data classes and the SGLang classes the plugin rewraps into them, field by field.
_DATA_CLASSES = {"RealKvSource": "verify", "VerifyOrWriteContext": "verify", "VerifyPlan": "verify",
                 "WritePlan": "write"}
# kv-canary's extensions, with defaults the rewrapped objects keep: per-reason totals (None: counts
# nothing) and RealKvSource's layout fields (their defaults are SGLang's packed rows).
_OURS_ONLY = {"violation_reason_counts", "token_stride_bytes", "num_heads", "head_stride_bytes", "chunk_bytes",
              "chunk_stride_bytes", "token_group_size", "token_group_stride_bytes", "chunk_group_size",
              "chunk_group_stride_bytes"}


def data_class_differences(ours, theirs) -> list[str]:
    """Fields of kv-canary's launch data classes (`ours`: name -> class) that SGLang's lack."""
    import dataclasses

    diffs = []
    for name, cls in ours.items():
        missing = {f.name for f in dataclasses.fields(cls)} - _OURS_ONLY - {
            f.name for f in dataclasses.fields(theirs[name])}
        if missing:
            diffs.append(f"SGLang's {name} lacks {', '.join(sorted(missing))}")
    return diffs


def check_tree(layout=None):
    """The tree whose launchers replace SGLang's (the default, kv_canary.generated) must write SGLang's bytes."""
    from sglang.kernels.ops.kv_canary import consts
    from sglang.kernels.ops.kv_canary.verify import CanaryLaunchTag

    import kv_canary

    layout = kv_canary.generated.layout if layout is None else layout
    diffs = layout_differences(layout, consts, CanaryLaunchTag)
    if layout is kv_canary.generated.layout:   # the classes the plugin rewraps SGLang's into
        import importlib
        theirs = {name: getattr(importlib.import_module(f"sglang.kernels.ops.kv_canary.{module}"), name)
                  for name, module in _DATA_CLASSES.items()}
        diffs += data_class_differences({name: getattr(kv_canary, name) for name in _DATA_CLASSES}, theirs)
    if diffs:
        raise ValueError("kv-canary: the generated tree is not byte-compatible with SGLang's 32-byte canary "
                         "records, so SGLang's runtime cannot run on it: " + "; ".join(diffs)
                         + ". Restore SGLang's layout in kernels.yaml (then make generate) or unset KV_CANARY_SGLANG")
    return layout


def metrics_port(raw: str) -> int:
    try:
        port = int(raw)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise ValueError(f"kv-canary: KV_CANARY_SGLANG_METRICS_PORT must be a port in [0, 65535] (0 = any free "
                         f"port), got {raw!r}")
    return port
