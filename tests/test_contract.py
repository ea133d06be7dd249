"""What every training script shares (docs/contract.md): it imports the harness and the env modules and no other
file of the project; its algorithm comes first, a network or env class early in the file, its entry point last; Args
documented; the twin keeping the baseline's algorithm parts."""

import ast
import json
import re
import os
import subprocess
import sys

import pytest
from helpers import MODULES, ROOT
from helpers import SCRIPTS as LEANRL

SCRIPTS = sorted(path for path in LEANRL.glob("*.py") if path.stem not in MODULES)
BASELINES = (
    "dqn", "ppo_atari_envpool", "ppo_classic_control_gpu", "ppo_continuous_action", "ppo_continuous_action_gpu_mujoco",
    "pqn_atari_envpool", "pqn_classic_control_gpu", "sac_continuous_action", "sac_gpu_mujoco", "td3_continuous_action",
    "td3_gpu_mujoco",
)  # fmt: skip


def top_level(path):
    """{name: source text} of the module-level functions, classes and assignments."""
    source = path.read_text()
    parts = {}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            parts[node.name] = ast.get_source_segment(source, node)
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            parts[node.targets[0].id] = ast.get_source_segment(source, node)
    return parts


def args_fields(path):
    """{field: (annotation, default, docstring)} of the script's Args dataclass, from its source."""
    args = next(n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef) and n.name == "Args")
    fields, body = {}, args.body
    for node, after in zip(body, body[1:] + [None]):
        if isinstance(node, ast.AnnAssign):
            doc = after.value.value if isinstance(after, ast.Expr) else None
            fields[node.target.id] = (ast.unparse(node.annotation), ast.unparse(node.value), doc)
    return fields


def test_every_baseline_has_its_twin():
    pairs = [stem for base in BASELINES for stem in (base, base + "_torchcompile")]
    assert sorted(path.stem for path in SCRIPTS) == sorted(pairs)


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.stem)
def test_algorithm_first(path):
    """Imports, Args, the algorithm (a network or env class within the first 100 lines), then the entry point."""
    lines = path.read_text().splitlines()
    first_class = next(i for i, line in enumerate(lines) if line.startswith("class ") and "Args" not in line)
    assert first_class < 100, f"{path.name}: the first network or env class is at line {first_class + 1}"
    assert list(top_level(path))[-1] == "main" and lines[-2:] == ['if __name__ == "__main__":',
                                                                 "    sys.exit(exit_code(main()))"]  # fmt: skip
    assert {"check_args", "train", "evaluate"} <= set(top_level(path))


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.stem)
def test_imports_only_packages_and_the_shared_modules(path):
    """A script imports third-party packages, the standard library and the project's shared modules, nothing else."""
    project = {p.stem for p in LEANRL.glob("*.py")} | {"harness", "tools"}
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module.split(".")[0])
    assert imported & project <= set(MODULES), imported & project


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.stem)
def test_args_documented_and_twin_flags(path):
    fields = args_fields(path)
    undocumented = [name for name, (_, _, doc) in fields.items() if not doc]
    assert not undocumented, f"{path.name}: fields without a docstring: {undocumented}"
    twin = path.stem.endswith("_torchcompile")
    assert ("compile" in fields and "cudagraphs" in fields) == twin, path.name


@pytest.mark.parametrize("base", [p for p in SCRIPTS if not p.stem.endswith("_torchcompile")], ids=lambda p: p.stem)
def test_twin_keeps_the_baseline_algorithm_parts(base):
    """What no trick touches stays identical in the twin: Args' algorithm fields, the networks, the checks, the
    evaluation (so that a test of the baseline's evaluation, its video, covers the twin's)."""
    twin = base.with_name(base.stem + "_torchcompile.py")
    # fused_rollout: the GPU classic-control twin's kernel; compile_cache: the twin's compiled code (and, in both
    # scripts on MuJoCo Warp, Warp's kernels)
    twin_only = ("compile", "cudagraphs", "fused_rollout", "compile_cache")
    assert {k: v for k, v in args_fields(twin).items() if k not in twin_only} == {
        k: v for k, v in args_fields(base).items() if k != "compile_cache"}
    assert "compile_cache" in args_fields(twin) and ("compile_cache" in args_fields(base)) == ("gpu_mujoco" in base.stem)
    parts_base, parts_twin = top_level(base), top_level(twin)
    for name in ("check_args", "evaluate", "layer_init", "SoftQNetwork", "QNetwork", "linear_schedule", "STATS",
                 "WARMUP_STEPS", "WARMUP_ITERATIONS"):  # fmt: skip
        if name in parts_base:
            assert parts_twin.get(name) == parts_base[name], f"{name} differs between {base.stem} and its twin"


def trick_labels():
    """{number: (label, [scripts])} from docs/tricks.md's table of labels."""
    table = {}
    for line in (LEANRL.parent / "docs" / "tricks.md").read_text().splitlines():
        if cells := re.fullmatch(r"\| (\d+) \| ([^|]+) \| ([^|]*) \|", line):
            number, label, scripts = cells.groups()
            table[int(number)] = (label.strip(), re.findall(r"`(\w+)`", scripts))
    return table


def labels_in(path):
    """{trick number: label text} of the `# trick N: ...` comments of a script."""
    found = {}
    for number, text in re.findall(r"# trick (\d+): ([^#\n]+)", path.read_text()):
        found.setdefault(int(number), []).append(text.strip())
    return found


@pytest.mark.parametrize("path", [p for p in SCRIPTS if p.stem.endswith("_torchcompile")], ids=lambda p: p.stem)
def test_every_twin_labels_its_tricks(path):
    """A twin's places that differ from its baseline say which trick of docs/tricks.md they are, by number and label;
    tricks.md lists each script that carries a label under that trick, and no other."""
    table, labels = trick_labels(), labels_in(path)
    assert labels, f"{path.name} cites no trick"
    for number, texts in labels.items():
        assert number in table, f"{path.name}: trick {number} is not in docs/tricks.md"
        wrong = [text for text in texts if not text.startswith(table[number][0])]
        assert not wrong, f"{path.name}: trick {number} is '{table[number][0]}', not {wrong}"
    listed = {number for number, (_, scripts) in table.items() if path.stem in scripts}
    assert listed == set(labels), f"docs/tricks.md lists {path.stem} under {sorted(listed)}, it labels {sorted(labels)}"


def test_tricks_table_numbers_every_trick():
    headings = re.findall(r"^## (\d+)\. ", (LEANRL.parent / "docs" / "tricks.md").read_text(), flags=re.MULTILINE)
    assert sorted(trick_labels()) == sorted(map(int, headings)) == list(range(1, len(headings) + 1))
    assert {s for _, scripts in trick_labels().values() for s in scripts} <= {p.stem for p in SCRIPTS}


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.stem)
def test_loop_exits_are_visible(path):
    """A stop (signal, divergence) ends a loop through `if not run.proceed(step): break` in the loop's own body; no
    other harness call ends it (run.unit, which raised, is gone)."""
    tree = ast.parse(path.read_text())
    proceeds = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func) == "run.proceed"]
    assert proceeds, f"{path.name} never calls run.proceed"
    visible = []
    for loop in [n for n in ast.walk(tree) if isinstance(n, (ast.For, ast.While))]:
        for node in loop.body:
            if (isinstance(node, ast.If) and ast.unparse(node.test).startswith("not run.proceed(")
                    and [type(s) for s in node.body] == [ast.Break]):  # fmt: skip
                visible.append(node.test.operand)
    assert sorted(map(id, visible)) == sorted(map(id, proceeds)), f"{path.name}: run.proceed outside `if not`/`break`"
    assert "run.unit(" not in path.read_text()


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.stem)
def test_harness_names_imported(path):
    """A script imports few harness names: at most 9 under torchrun (its all-reduce and the world), else fewer."""
    tree = ast.parse(path.read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "harness" for a in n.names]
    assert len(names) <= 9 and len(set(names)) == len(names), names


def test_a_script_runs_as_a_module_too(tmp_path):
    """`python -m leanrl.dqn` as well as `python leanrl/dqn.py`, and a tool (`python -m leanrl.tools.scaling_bench`):
    the package puts the modules the scripts and tools import on the path. From a scratch folder, the repository on
    PYTHONPATH (as its root is when run from there)."""
    proc = subprocess.run([sys.executable, "-m", "leanrl.dqn", "--total-timesteps", "300", "--learning-starts", "100",
                           "--no-tensorboard"], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["total_timesteps"] == 300
    tool = subprocess.run([sys.executable, "-m", "leanrl.tools.scaling_bench", "--help"], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=600)
    assert tool.returncode == 0 and "usage: scaling_bench.py" in tool.stdout, tool.stderr  # benchkit found beside it
