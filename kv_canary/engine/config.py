"""CanaryConfig: SGLang's canary options, from its CLI flags and environment variables (docs/semantics.md §9).

The names, values and defaults are SGLang's; every bad value is a ValueError naming the flag,
variable or field. The environment is read once; `CanaryManager.from_config` maps a config onto a manager.
"""
from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Optional

from ..trees.loader import default_tree

MODES = ("none", "log", "raise")
MODE_SYNONYMS = {"off": "none"}   # SGLang's older spelling of "none"
# --kv-canary-real-data values: the RealKvHashMode members lower-cased (partial reads the first
# REAL_KV_PARTIAL_READ_BYTES bytes of a slot, all the whole slot).
REAL_KV_DATA = tuple(m.name.lower() for m in default_tree().layout.RealKvHashMode)

FLAG_MODE = "--kv-canary"
FLAG_REAL_KV_DATA = "--kv-canary-real-data"
FLAG_SWEEP_INTERVAL = "--kv-canary-sweep-interval"

# The config's int fields and their least values; then the fields read from the environment, and
# their variables (an int field parses as an integer, a bool field as a boolean).
MINIMUMS = {"sweep_interval": 0, "ring_capacity": 1, "stats_print_every_n_steps": 0}
ENV_VARS = {"ring_capacity": "SGLANG_KV_CANARY_RING_CAPACITY",
            "stats_print_every_n_steps": "SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS",
            "enable_write_input_assert": "SGLANG_KV_CANARY_ENABLE_WRITE_INPUT_ASSERT",
            "enable_verify_token_assert": "SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT",
            "enable_mha_v": "SGLANG_KV_CANARY_ENABLE_MHA_V"}

# SGLang's own text, which its test harnesses match.
SWEEP_NEEDS_MODE = f"{FLAG_SWEEP_INTERVAL} requires {FLAG_MODE} in {{log, raise}}"

TRUE_WORDS = ("1", "true", "yes", "y", "on")
FALSE_WORDS = ("0", "false", "no", "n", "off")


@dataclass(frozen=True)
class CanaryConfig:
    """The canary options of one engine, SGLang's defaults (docs/semantics.md §9)."""
    mode: str = "none"                      # --kv-canary: none (no canary), log or raise; "off" = "none"
    real_kv_data: str = "none"              # --kv-canary-real-data: none, partial or all
    sweep_interval: int = 0                 # --kv-canary-sweep-interval: steps between sweeps, 0 = no sweep
    ring_capacity: int = 1024               # SGLANG_KV_CANARY_RING_CAPACITY
    stats_print_every_n_steps: int = 100    # SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS, 0 = never
    enable_write_input_assert: bool = False     # SGLANG_KV_CANARY_ENABLE_WRITE_INPUT_ASSERT
    enable_verify_token_assert: bool = False    # SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT
    enable_mha_v: bool = False                  # SGLANG_KV_CANARY_ENABLE_MHA_V: check the V buffers too

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise in place once
        set_(self, "mode", parse_mode(self.mode, "CanaryConfig.mode"))
        set_(self, "real_kv_data", parse_real_kv_data(self.real_kv_data, "CanaryConfig.real_kv_data"))
        for name, low in MINIMUMS.items():
            check_count(f"CanaryConfig.{name}", getattr(self, name), low)
        for name in ("enable_write_input_assert", "enable_verify_token_assert", "enable_mha_v"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"kv-canary: CanaryConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.sweep_interval > 0 and self.mode == "none":
            raise ValueError(SWEEP_NEEDS_MODE)

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    # -- building one ---------------------------------------------------------------------------
    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None, *, base: Optional["CanaryConfig"] = None,
                 mode: Optional[str] = None, real_kv_data: Optional[str] = None,
                 sweep_interval: Optional[int] = None) -> "CanaryConfig":
        """The SGLANG_KV_CANARY_* variables set in `environ` (default os.environ) and the CLI-level
        options given here, over `base` (default: SGLang's defaults) for everything not set."""
        env = os.environ if environ is None else environ
        base = cls() if base is None else base
        given = {"mode": mode, "real_kv_data": real_kv_data, "sweep_interval": sweep_interval}
        read = {name: env_int(env, var, getattr(base, name), minimum=MINIMUMS[name]) if name in MINIMUMS
                else env_bool(env, var, getattr(base, name)) for name, var in ENV_VARS.items()}
        return replace(base, **{k: v for k, v in given.items() if v is not None}, **read)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, defaults: Optional["CanaryConfig"] = None) -> None:
        """Add SGLang's three flags (`--kv-canary`, `--kv-canary-real-data`, `--kv-canary-sweep-interval`),
        defaulting to `defaults`' values (default: SGLang's)."""
        d = CanaryConfig() if defaults is None else defaults
        group = parser.add_argument_group("kv-canary", "SGLang's canary flags; the other options are "
                                                       "SGLANG_KV_CANARY_* environment variables")
        group.add_argument(FLAG_MODE, type=_cli(parse_mode, FLAG_MODE), choices=MODES, default=d.mode,
                           metavar="{" + ",".join(MODES) + "}",
                           help="none: no canary ('off' is the same), log: log every violation, raise: raise "
                                "on the first drain that finds one (default: %(default)s)")
        group.add_argument(FLAG_REAL_KV_DATA, type=_cli(parse_real_kv_data, FLAG_REAL_KV_DATA), choices=REAL_KV_DATA,
                           default=d.real_kv_data, metavar="{" + ",".join(REAL_KV_DATA) + "}",
                           help=f"fingerprint the real K/V bytes: none, partial (the first "
                                f"{default_tree().layout.REAL_KV_PARTIAL_READ_BYTES} bytes of a slot) or all "
                                f"(default: %(default)s)")
        group.add_argument(FLAG_SWEEP_INTERVAL, type=_cli(parse_int, FLAG_SWEEP_INTERVAL),
                           default=d.sweep_interval, metavar="N",
                           help=f"verify every cached slot every N steps, 0 = never (default: %(default)s); "
                                f"needs {FLAG_MODE} log or raise")

    @classmethod
    def from_args(cls, args: argparse.Namespace, environ: Optional[Mapping[str, str]] = None,
                  base: Optional["CanaryConfig"] = None) -> "CanaryConfig":
        """A config from parsed `add_cli_args` flags plus the environment variables (over `base`)."""
        return cls.from_env(environ, base=base, mode=parse_mode(args.kv_canary, FLAG_MODE),
                            real_kv_data=parse_real_kv_data(args.kv_canary_real_data, FLAG_REAL_KV_DATA),
                            sweep_interval=parse_int(args.kv_canary_sweep_interval, FLAG_SWEEP_INTERVAL))

    # -- what a CanaryManager takes ---------------------------------------------------------------
    def manager_options(self) -> dict:
        """The CanaryManager keyword arguments this config sets (see CanaryManager.from_config): every
        field, two of them under the manager's names."""
        options = asdict(self)
        options["real_kv_hash_mode"] = options.pop("real_kv_data").upper()
        options["check_verify_expected_token"] = options.pop("enable_verify_token_assert")
        return options


# -- value parsers, each naming where the value came from -------------------------------------------
def check_count(name: str, value, low: int) -> int:
    """An int option >= `low` (a bool is not one): the config's and the manager's counts."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"kv-canary: {name} must be an int >= {low}, got {value!r}")
    return value


def parse_mode(value, where: str) -> str:
    word = value.strip().lower() if isinstance(value, str) else value
    word = MODE_SYNONYMS.get(word, word)
    if word not in MODES:
        raise ValueError(f"kv-canary: {where} must be one of {', '.join(MODES)} ('off' = 'none'), got {value!r}")
    return word


def parse_real_kv_data(value, where: str) -> str:
    word = value.strip().lower() if isinstance(value, str) else value
    if word not in REAL_KV_DATA:
        raise ValueError(f"kv-canary: {where} must be one of {', '.join(REAL_KV_DATA)}, got {value!r}")
    return word


def env_int(env: Mapping[str, str], name: str, default: int, *, minimum: int) -> int:
    raw = env.get(name)
    return default if raw is None or raw.strip() == "" else parse_int(raw, name, minimum)


def env_bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    word = raw.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError(f"kv-canary: {name} must be a boolean ({'/'.join(TRUE_WORDS)} or {'/'.join(FALSE_WORDS)}), "
                     f"got {raw!r}")


def parse_int(value, where: str, minimum: int = 0) -> int:
    """An int, or a string of one, >= `minimum` (flags and environment variables)."""
    parsed = value if isinstance(value, int) and not isinstance(value, bool) else None
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            parsed = int(value.strip())
    if parsed is None or parsed < minimum:
        raise ValueError(f"kv-canary: {where} must be an integer >= {minimum}, got {value!r}")
    return parsed


def _cli(parse, flag: str):
    """An argparse `type` from a parser: argparse reports its message as the flag's error."""
    def convert(text: str):
        try:
            return parse(text, flag)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    convert.__name__ = flag  # argparse names the type in some messages
    return convert


# -- the CanaryManager's own options (engine side, not SGLang's) -------------------------------------
def parse_hash_mode(layout, value):
    """A RealKvHashMode of `layout`, given as the member, its value or its name (any case)."""
    if isinstance(value, str):
        names = [m.name for m in layout.RealKvHashMode]
        if value.upper() not in names:
            raise ValueError(f"kv-canary: real_kv_hash_mode must be one of {', '.join(names)}, got {value!r}")
        value = layout.RealKvHashMode[value.upper()]
    return layout.RealKvHashMode(value)


def check_caller_tables(layout, value) -> dict:
    """{field: {group: tensor}} for the schema's `caller_table` input fields (checked at attach)."""
    wanted = [f.name for f in layout.INPUT_FIELDS if f.source == "caller_table"]
    value = {} if value is None else value
    if not isinstance(value, Mapping) or set(value) != set(wanted) or \
            not all(isinstance(v, Mapping) for v in value.values()):
        want = ", ".join(wanted) if wanted else "none (the schema declares no caller_table field)"
        raise ValueError(f"kv-canary: caller_tables must map exactly the schema's caller_table input fields "
                         f"({want}) to {{group: int64 [num_slots] tensor}}, got {value!r}")
    return {name: dict(tables) for name, tables in value.items()}


def check_fingerprint_layers(layout, value) -> dict:
    """{group: layer indices} as given (groups left out get the default: the first layers)."""
    if value is None:
        return {}
    cap = layout.MAX_REAL_KV_SOURCES
    want = f"a mapping of group ({', '.join(layout.LAUNCH_GROUPS)}) to 1..{cap} distinct layer indices >= 0"
    if not isinstance(value, Mapping):
        raise ValueError(f"kv-canary: fingerprint_layers must be {want}, got {value!r}")
    out = {}
    for name, layers in value.items():
        ok = isinstance(layers, Sequence) and not isinstance(layers, (str, bytes)) and 1 <= len(layers) <= cap \
            and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers) \
            and len(set(layers)) == len(layers)
        if name not in layout.LAUNCH_GROUPS or not ok:
            raise ValueError(f"kv-canary: fingerprint_layers must be {want}, got {name!r}: {layers!r}")
        out[name] = tuple(layers)
    return out
