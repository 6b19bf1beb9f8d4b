"""CanaryConfig (docs/semantics.md §9): SGLang's option names, values and defaults, from flags and the
environment, every bad value's error, and how a config maps onto a CanaryManager."""
from __future__ import annotations

import argparse

import pytest

from kv_canary.engine.config import CanaryConfig
from kv_canary.engine.manager import CanaryManager

SWEEP_NEEDS_MODE = "--kv-canary-sweep-interval requires --kv-canary in {log, raise}"   # §9, verbatim
ENV = {"ring": "SGLANG_KV_CANARY_RING_CAPACITY", "stats": "SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS",
       "write": "SGLANG_KV_CANARY_ENABLE_WRITE_INPUT_ASSERT", "verify": "SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT",
       "mha_v": "SGLANG_KV_CANARY_ENABLE_MHA_V"}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="engine")
    CanaryConfig.add_cli_args(p)
    return p


def test_defaults_are_sglangs():
    c = CanaryConfig.from_env({})
    assert (c.mode, c.real_kv_data, c.sweep_interval, c.ring_capacity, c.stats_print_every_n_steps) == \
        ("none", "none", 0, 1024, 100)
    assert not (c.enable_write_input_assert or c.enable_verify_token_assert or c.enable_mha_v)
    assert not c.enabled and c == CanaryConfig()


def test_every_environment_variable_is_read():
    env = {ENV["ring"]: "64", ENV["stats"]: " 7 ", ENV["write"]: "TRUE", ENV["verify"]: "yes", ENV["mha_v"]: "1"}
    c = CanaryConfig.from_env(env, mode="log")
    assert (c.ring_capacity, c.stats_print_every_n_steps) == (64, 7)
    assert c.enable_write_input_assert and c.enable_verify_token_assert and c.enable_mha_v
    off = CanaryConfig.from_env({ENV["write"]: "0", ENV["verify"]: "No", ENV["mha_v"]: "off", ENV["stats"]: "0"})
    assert not (off.enable_write_input_assert or off.enable_verify_token_assert or off.enable_mha_v)
    assert off.stats_print_every_n_steps == 0
    assert CanaryConfig.from_env({ENV["ring"]: ""}).ring_capacity == 1024   # empty = unset


def test_os_environ_is_the_default_source(monkeypatch):
    monkeypatch.setenv(ENV["ring"], "32")
    monkeypatch.setenv(ENV["mha_v"], "true")
    c = CanaryConfig.from_env()
    assert c.ring_capacity == 32 and c.enable_mha_v


@pytest.mark.parametrize("name, raw, expected", [
    (ENV["ring"], "abc", "an integer >= 1"),
    (ENV["ring"], "0", "an integer >= 1"),
    (ENV["ring"], "1.5", "an integer >= 1"),
    (ENV["stats"], "-1", "an integer >= 0"),
    (ENV["stats"], "often", "an integer >= 0"),
    (ENV["write"], "maybe", "a boolean (1/true/yes/y/on or 0/false/no/n/off)"),
    (ENV["verify"], "2", "a boolean (1/true/yes/y/on or 0/false/no/n/off)"),
    (ENV["mha_v"], "enabled", "a boolean (1/true/yes/y/on or 0/false/no/n/off)"),
])
def test_bad_environment_values_name_the_variable(name, raw, expected):
    with pytest.raises(ValueError) as info:
        CanaryConfig.from_env({name: raw})
    assert str(info.value) == f"kv-canary: {name} must be {expected}, got {raw!r}"


def test_cli_flags_parse_into_a_config():
    args = parser().parse_args(["--kv-canary", "raise", "--kv-canary-real-data", "partial",
                                "--kv-canary-sweep-interval", "4"])
    c = CanaryConfig.from_args(args, environ={ENV["ring"]: "16"})
    assert (c.mode, c.real_kv_data, c.sweep_interval, c.ring_capacity) == ("raise", "partial", 4, 16)
    d = CanaryConfig.from_args(parser().parse_args([]), environ={})
    assert d == CanaryConfig()


def test_off_is_none():
    assert parser().parse_args(["--kv-canary", "off"]).kv_canary == "none"
    assert CanaryConfig(mode="OFF").mode == "none" and not CanaryConfig(mode="off").enabled
    args = parser().parse_args(["--kv-canary", "Log", "--kv-canary-real-data", "PARTIAL"])
    assert (args.kv_canary, args.kv_canary_real_data) == ("log", "partial")


def test_other_sglang_variables_are_not_read():
    env = {"SGLANG_KV_CANARY_PERTURB_REQ_TO_TOKEN_PROB": "0.5", "SGLANG_KV_CANARY_JITTER_ENABLED": "1",
           "SGLANG_KV_CANARY_INPUT_CHECK": "nonsense"}
    assert CanaryConfig.from_env(env) == CanaryConfig()


@pytest.mark.parametrize("argv, message", [
    (["--kv-canary", "loud"], "--kv-canary must be one of none, log, raise ('off' = 'none'), got 'loud'"),
    (["--kv-canary-real-data", "half"], "--kv-canary-real-data must be one of none, partial, all, got 'half'"),
    (["--kv-canary-sweep-interval", "-2"], "--kv-canary-sweep-interval must be an integer >= 0, got '-2'"),
    (["--kv-canary-sweep-interval", "x"], "--kv-canary-sweep-interval must be an integer >= 0, got 'x'"),
])
def test_bad_flags_are_usage_errors_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        parser().parse_args(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_sweep_interval_needs_a_mode():
    args = parser().parse_args(["--kv-canary-sweep-interval", "8"])
    with pytest.raises(ValueError) as info:
        CanaryConfig.from_args(args, environ={})
    assert str(info.value) == SWEEP_NEEDS_MODE
    with pytest.raises(ValueError) as info:
        CanaryConfig(mode="off", sweep_interval=1)
    assert str(info.value) == SWEEP_NEEDS_MODE
    assert CanaryConfig(mode="log", sweep_interval=8).sweep_interval == 8


@pytest.mark.parametrize("kwargs, message", [
    (dict(mode=3), "CanaryConfig.mode must be one of none, log, raise ('off' = 'none'), got 3"),
    (dict(real_kv_data="bits"), "CanaryConfig.real_kv_data must be one of none, partial, all, got 'bits'"),
    (dict(ring_capacity=0), "CanaryConfig.ring_capacity must be an int >= 1, got 0"),
    (dict(stats_print_every_n_steps=True), "CanaryConfig.stats_print_every_n_steps must be an int >= 0, got True"),
    (dict(sweep_interval=-1), "CanaryConfig.sweep_interval must be an int >= 0, got -1"),
    (dict(enable_mha_v="yes"), "CanaryConfig.enable_mha_v must be a bool, got 'yes'"),
])
def test_bad_fields_name_the_field(kwargs, message):
    with pytest.raises(ValueError) as info:
        CanaryConfig(**kwargs)
    assert str(info.value) == "kv-canary: " + message


def test_base_config_fills_what_is_not_given():
    base = CanaryConfig(mode="log", real_kv_data="all", sweep_interval=6, stats_print_every_n_steps=0,
                        enable_verify_token_assert=True, enable_mha_v=True)
    p = argparse.ArgumentParser()
    CanaryConfig.add_cli_args(p, base)
    assert CanaryConfig.from_args(p.parse_args([]), environ={}, base=base) == base
    c = CanaryConfig.from_args(p.parse_args(["--kv-canary-real-data", "none"]), environ={ENV["mha_v"]: "0"}, base=base)
    assert (c.mode, c.real_kv_data, c.sweep_interval, c.enable_mha_v, c.enable_verify_token_assert) == \
        ("log", "none", 6, False, True)


def test_from_config_maps_every_option_onto_the_manager():
    c = CanaryConfig(mode="raise", real_kv_data="partial", sweep_interval=4, ring_capacity=64,
                     stats_print_every_n_steps=7, enable_write_input_assert=True, enable_verify_token_assert=True,
                     enable_mha_v=False)
    m = CanaryManager.from_config(c, keep_violations=10)
    assert (m.mode, m.real_kv_hash_mode.name, m.sweep_interval, m.ring_capacity, m.stats_print_every_n_steps) == \
        ("raise", "PARTIAL", 4, 64, 7)
    assert m.enable_write_input_assert and m.check_verify_expected_token and not m.enable_mha_v
    assert m.halves == ("k",) and m.keep_violations == 10
    sglang = CanaryManager.from_config(CanaryConfig(mode="log"))
    assert (sglang.real_kv_hash_mode.name, sglang.sweep_interval, sglang.stats_print_every_n_steps) == ("NONE", 0, 100)
    assert not (sglang.check_verify_expected_token or sglang.enable_mha_v or sglang.enable_write_input_assert)
    assert not CanaryManager.from_config(CanaryConfig()).enabled


def test_from_config_refuses_options_that_belong_to_the_config():
    with pytest.raises(ValueError, match="from_config takes mode, sweep_interval from the CanaryConfig"):
        CanaryManager.from_config(CanaryConfig(), sweep_interval=3, mode="log")
    with pytest.raises(ValueError) as info:
        CanaryManager.from_config({"mode": "log"})
    assert str(info.value) == "kv-canary: from_config needs a CanaryConfig, got {'mode': 'log'}"


def test_plain_constructor_keeps_its_checking_defaults():
    # docs/sglang-compat.md (Runtime surface): the constructor checks everything by default; only
    # CanaryConfig / from_config start from SGLang's defaults.
    m = CanaryManager()
    assert (m.mode, m.real_kv_hash_mode.name, m.sweep_interval, m.ring_capacity, m.stats_print_every_n_steps) == \
        ("log", "ALL", 8, 1024, 0)
    assert m.check_verify_expected_token and m.enable_mha_v and not m.enable_write_input_assert
    assert CanaryManager(mode="none").mode == CanaryManager(mode="off").mode == "none"
