"""An engine's repository made from the installed wheel (issue 23): `kv-canary init`, the generated
package imported as the engine's own and run, and the GitHub Action's script on a compatible and
on a breaking pull request."""
from __future__ import annotations

import subprocess
from pathlib import Path

import kv_canary.generated
import pytest
from support.wheel_env import TIMEOUT, install_wheel, run, session_dir
from test_diff import RENAME

# Files of one generated tree: its __init__.py and every file whose hash it lists.
TREE_FILES = 1 + len(kv_canary.generated.FILE_SHA256)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    return install_wheel(tmp_path_factory.mktemp("wheel"), session_dir(tmp_path_factory))


ENGINE_STEP = """
import json, torch
import myengine._canary as canary                      # the generated package, imported as the engine's own
from myengine._canary.allocators import VerifyPlan, WritePlan, allocate_context   # a module (schema-change.md)
from kv_canary.engine.violations import ViolationDecoder

api = canary.api
ctx = allocate_context(num_slots=64, ring_capacity=16, device="cpu", kernel_kind=canary.CanaryLaunchTag.TAIL_K_FULL)
write_plan = WritePlan.allocate(write_req_capacity=4, device="cpu")
verify_plan = VerifyPlan.allocate(verify_capacity=128, device="cpu")
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
    assert "wrote kv-canary.yaml" in out and f"myengine/_canary: {TREE_FILES} files, {TREE_FILES} written" in out
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
    assert (site / "kv_canary" / "workflow" / "report.schema.json").is_file()

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
    proc, outs = pr(original.replace(*RENAME))
    assert proc.returncode == 2 and outs["verdict"] == "breaking-without-bump"
    text = summary.read_text()
    assert text == Path(outs["report"]).read_text() + "\n"
    assert "| **BREAKING** | field renamed | `violation.stored_token` | stored_token | token_stored |" in text
    assert "+| 3 | `token_stored` | stored_token |" in text and "bump `abi_version` in canary.yaml (to 2)" in text
