"""The package as users get it: a built wheel, installed (not editable) into a fresh virtual
environment, run from a directory outside the checkout.

The fresh environment reuses this environment's third-party packages (torch, numpy, jinja2, ...)
through a path file, so nothing is downloaded; kv-canary itself comes only from the wheel, and no
top-level `codegen` package exists there.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 300


def run(cmd: list[str], *, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv python, venv bin dir, a working directory outside the checkout, environment)."""
    base = tmp_path_factory.mktemp("wheel")
    dist = base / "dist"
    # No PYTHONPATH anywhere: a checkout on the path would make pip think kv-canary is installed.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KV_CANARY_BACKEND")}
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
         "-w", str(dist), str(ROOT)], cwd=ROOT, env=env)
    wheel = next(dist.glob("kv_canary-*.whl"))
    venv = base / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=base, env=env)
    python = venv / "bin" / "python"
    site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                    cwd=base, env=env).stdout.strip())
    # Third-party dependencies from this environment (its .pth files, e.g. an editable kv-canary,
    # are not processed from a path entry, so kv_canary can only come from the wheel).
    (site / "_kv_canary_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n", encoding="utf-8")
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q",
         str(wheel)], cwd=base, env=env)
    work = base / "elsewhere"
    work.mkdir()
    env["KV_CANARY_CACHE_DIR"] = str(base / "cache")
    # The native signer this session built (conftest) serves the wheel too: its cache entry is named
    # by the source's content, which the wheel ships unchanged, so the wheel finds it by that name
    # instead of spending seconds on the same build (test_the_native_signer_builds_from_the_wheel).
    from kv_canary.cache import cache_root
    if (cache_root() / "native").is_dir():
        shutil.copytree(cache_root() / "native", base / "cache" / "native",
                        ignore=shutil.ignore_patterns("*.lock", "*.tmp"))
    return python, venv / "bin", work, env


PROBE = """
import importlib.util as u, json
import kv_canary, kv_canary.codegen
from kv_canary import native
print(json.dumps({
    "top_level_codegen": u.find_spec("codegen") is not None,
    "files": [kv_canary.__file__, kv_canary.codegen.__file__],
    "modules": [u.find_spec(name).origin for name in ("kv_canary.distributed", "kv_canary.distributed.fleet",
                                                      "kv_canary.distributed.local", "kv_canary.metrics",
                                                      "kv_canary.demo.fleet")],
    "signer": native.status(), "signer_source": str(native.SOURCE),
}))
"""


@pytest.fixture(scope="module")
def probe(installed):
    """What the installed package holds, from one interpreter outside the checkout (one torch import
    for every check below); the native signer is required there (KV_CANARY_NATIVE=1)."""
    import json
    python, _, work, env = installed
    return json.loads(run([str(python), "-c", PROBE], cwd=work, env={**env, "KV_CANARY_NATIVE": "1"}).stdout)


def test_no_top_level_codegen_package(probe):
    assert probe["top_level_codegen"] is False
    assert all("site-packages" in p and str(ROOT) not in p for p in probe["files"])


def test_the_native_signer_ships_and_loads_from_the_wheel(probe):
    """signing.cpp ships as package data, and the wheel's loader finds, loads and self-checks the
    build of that source outside the checkout (KV_CANARY_NATIVE=1: any failure is an error)."""
    assert probe["signer"].startswith("native (signing.cpp")
    assert "site-packages" in probe["signer_source"] and str(ROOT) not in probe["signer_source"]


def test_the_fleet_and_metrics_modules_ship_in_the_wheel(probe):
    assert len(probe["modules"]) == 5 and all("site-packages" in p and str(ROOT) not in p for p in probe["modules"])


def test_describe_outside_a_checkout_prints_the_installed_layout(installed):
    _, bin_dir, work, env = installed
    out = run([str(bin_dir / "kv-canary"), "describe"], cwd=work, env=env).stdout
    shipped = (ROOT / "generated" / "LAYOUT.md").read_text(encoding="utf-8")
    assert out and out in shipped and "DO NOT EDIT" not in out


def test_generate_and_check_a_schema_outside_the_checkout(installed):
    _, bin_dir, work, env = installed
    schema = work / "mine.yaml"
    shutil.copy(ROOT / "kv_canary" / "schemas" / "wide_stride.yaml", schema)
    run([str(bin_dir / "kv-canary"), "generate", "--schema", "mine.yaml", "--out", "gen"], cwd=work, env=env)
    assert (work / "gen" / "layout.py").is_file() and (work / "gen" / "cuda" / "kv_canary_layout.cuh").is_file()
    out = run([str(bin_dir / "kv-canary"), "check", "--schema", "mine.yaml", "--out", "gen"], cwd=work, env=env).stdout
    assert "up to date" in out


def test_short_demo_runs_from_the_wheel(installed):
    """The owner_epoch scenario generates the shipped example schema at run time."""
    _, bin_dir, work, env = installed
    proc = run([str(bin_dir / "kv-canary"), "demo", "--steps", "12", "--only", "stale_transfer/owner_epoch",
                "--out", "report"], cwd=work, env={**env, "KV_CANARY_BACKEND": "torch"})
    assert "all scenarios behaved as documented" in proc.stdout
    assert (work / "report" / "report.md").is_file()


# -- an engine's repository made from the wheel (issue 23) -------------------------------------
ENGINE_STEP = """
import json, torch
import myengine._canary as canary                      # the generated package, imported as the engine's own
from kv_canary.violations import ViolationDecoder

alloc, api = canary.allocators, canary.api
ctx = alloc.allocate_context(num_slots=64, ring_capacity=16, device="cpu", kernel_kind=canary.CanaryLaunchTag.TAIL_K_FULL)
write_plan = alloc.WritePlan.allocate(write_req_capacity=4, device="cpu")
verify_plan = alloc.VerifyPlan.allocate(verify_capacity=128, device="cpu")
req_to_token = torch.zeros((4, 32), dtype=torch.int32)
req_to_token[1, :6] = torch.arange(10, 16)

def step(prefix, extend, tokens):
    api.launch_canary_plan_kernels(
        verify_plan_out=verify_plan, write_plan_out=write_plan, req_pool_indices=torch.tensor([1]),
        prefix_lens=torch.tensor([prefix]), extend_seq_lens=torch.tensor([extend]), req_to_token=req_to_token,
        swa_window_size=0, full_to_swa_index_mapping=None, verify_capacity=128)
    api.launch_canary_verify_kernel(context=ctx, plan=verify_plan, check_verify_expected_token=False)
    api.launch_canary_write_kernel(
        context=ctx, plan=write_plan, input_ids=torch.tensor(tokens), positions=torch.arange(prefix, prefix + extend),
        out_cache_loc=req_to_token[1, prefix:prefix + extend].long(), enable_write_input_assert=False,
        expected_input_tokens=None, expected_input_positions=None)
    return int(ctx.violation_write_index[0])

clean = step(0, 4, [7, 8, 9, 10])
ctx.canary_buf.view(torch.int64)[11, canary.CANARY_FIELD_TOKEN] = 99   # a bug overwrites slot 11's record
caught = step(4, 2, [11, 12])
decoder = ViolationDecoder(canary.layout)
rows = [decoder.decode_row(r).log_line() for r in ctx.violation_ring[:caught].tolist()]
print(json.dumps({"clean": clean, "caught": caught, "rows": rows, "module": canary.__name__,
                  "regenerate": canary.REGENERATE_COMMAND}))
"""


def _git(repo: Path, *args: str) -> str:
    return run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args], cwd=repo).stdout


def test_an_engine_repository_from_the_wheel(installed, tmp_path):
    """`kv-canary init` from the wheel, the generated package imported as myengine._canary and run (a
    write and a verify that catches an overwritten record), then the action's script on a compatible
    and on a breaking pull request."""
    import json
    python, bin_dir, _, env = installed
    kv = str(bin_dir / "kv-canary")
    repo = tmp_path / "engine"
    (repo / "myengine").mkdir(parents=True)
    (repo / "myengine" / "__init__.py").write_text("")
    _git(repo, "init", "-q", "-b", "main")
    out = run([kv, "init", "--package", "myengine/_canary"], cwd=repo, env=env).stdout
    assert "wrote kv-canary.yaml" in out and "myengine/_canary: 13 files, 13 written" in out
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "kv-canary init")
    assert "up to date with canary.yaml" in run([kv, "check"], cwd=repo, env=env).stdout
    layout = repo / "myengine" / "_canary" / "layout.py"
    layout.write_text(layout.read_text() + "# a hand edit\n")
    edited = subprocess.run([kv, "check", "--quiet"], cwd=repo, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert edited.returncode == 1 and ("    fix: make the change in canary.yaml, then run `kv-canary generate` (it "
                                       "overwrites this file)\n") in edited.stderr
    assert "codegen" not in edited.stderr and "make generate" not in edited.stderr
    _git(repo, "checkout", "--", "myengine/_canary/layout.py")
    result = json.loads(run([str(python), "-c", ENGINE_STEP], cwd=repo,
                            env={**env, "PYTHONPATH": str(repo), "KV_CANARY_BACKEND": "torch"}).stdout)
    assert result["module"] == "myengine._canary" and result["clean"] == 0 and result["caught"] >= 1
    assert "fail_reason=verify_chain_hash slot_idx=12" in result["rows"][0]
    assert result["regenerate"] == "kv-canary generate"
    site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=repo,
                    env=env).stdout.strip())
    assert (site / "kv_canary" / "codegen" / "diff.schema.json").is_file()  # the documented JSON shapes ship
    assert (site / "kv_canary" / "codegen" / "check.schema.json").is_file()

    _git(repo, "checkout", "-q", "-b", "feature")
    summary, output, runner = tmp_path / "summary.md", tmp_path / "output", tmp_path / "runner"
    runner.mkdir()
    gh = {**env, "GITHUB_STEP_SUMMARY": str(summary), "GITHUB_OUTPUT": str(output), "RUNNER_TEMP": str(runner),
          "GITHUB_BASE_REF": "main"}
    schema = repo / "canary.yaml"

    def pr(text: str) -> tuple[subprocess.CompletedProcess, dict]:
        schema.write_text(text)
        run([kv, "generate"], cwd=repo, env=env)
        summary.write_text("")
        output.write_text("")
        proc = subprocess.run([kv, "pr-report"], cwd=repo, env=gh, capture_output=True, text=True, timeout=TIMEOUT)
        return proc, dict(line.split("=", 1) for line in output.read_text().splitlines())

    original = schema.read_text()
    proc, outs = pr(original.replace('"{name} must be contiguous"', '"{name} is not contiguous"'))
    assert proc.returncode == 0 and outs["verdict"] == "compatible", proc.stderr
    assert "| compatible | message text changed | `messages.not_contiguous` |" in summary.read_text()
    proc, outs = pr(original.replace("slot_stride_bytes: 32", "slot_stride_bytes: 64"))
    assert proc.returncode == 2 and outs["verdict"] == "breaking-without-bump"
    text = summary.read_text()
    assert text == Path(outs["report"]).read_text() + "\n"
    assert "| **BREAKING** | slot stride changed | `canary` | 32 bytes | 64 bytes |" in text
    assert "+Slot stride 64 bytes" in text and "bump `abi_version` in canary.yaml (to 2)" in text
