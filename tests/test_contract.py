"""What every training script shares (docs/contract.md): the stamped blocks of leanrl/harness.py, word for word; the
algorithm first, a network or env class early in the file; Args documented; the twin keeping the baseline's
algorithm parts; and each script running when copied alone."""

import ast
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

LEANRL = Path(__file__).resolve().parents[1] / "leanrl"
SCRIPTS = sorted(path for path in LEANRL.glob("*.py") if path.stem != "harness")
BASELINES = (
    "dqn", "ppo_atari_envpool", "ppo_atari_envpool_multigpu", "ppo_classic_control_gpu", "ppo_continuous_action",
    "ppo_continuous_action_gpu_mujoco", "sac_continuous_action", "sac_gpu_mujoco", "td3_continuous_action",
    "td3_gpu_mujoco",
)  # fmt: skip
# The scripts that run data-parallel under torchrun carry the torchrun block too.
TORCHRUN = ("ppo_atari_envpool_multigpu", "ppo_classic_control_gpu")


def stamp_tool():
    spec = importlib.util.spec_from_file_location("stamp", LEANRL / "tools" / "stamp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


def test_ten_baselines_and_their_twins():
    pairs = [stem for base in BASELINES for stem in (base, base + "_torchcompile")]
    assert sorted(path.stem for path in SCRIPTS) == sorted(pairs)


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.stem)
def test_stamped_blocks_are_the_harness(path, capsys):
    """The run options, the harness and (torchrun scripts) the torchrun block are leanrl/harness.py's, word for word."""
    assert stamp_tool().main(["--check", str(path)]) == 0, capsys.readouterr().out
    has_torchrun = "# ======== torchrun:" in path.read_text()
    assert has_torchrun == path.stem.startswith(TORCHRUN)


def test_the_check_fails_where_a_copy_drifted(tmp_path, capsys):
    """The stamp tool's --check names a script whose harness was edited, and stamping puts it back."""
    source = (LEANRL / "harness.py").read_text()
    copy = tmp_path / "script.py"
    copy.write_text(source.replace('"""Bad input: one line', '"""Bad input, edited: one line'))
    tool = stamp_tool()
    assert tool.main(["--check", str(copy)]) == 1
    assert "script.py: harness" in capsys.readouterr().out
    assert tool.main([str(copy)]) == 0 and copy.read_text() == source


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.stem)
def test_algorithm_first(path):
    """Imports, Args, the algorithm (a network or env class within the first 150 lines), then the harness, last."""
    lines = path.read_text().splitlines()
    first_class = next(i for i, line in enumerate(lines) if line.startswith("class ") and "Args" not in line)
    assert first_class < 150, f"{path.name}: the first network or env class is at line {first_class + 1}"
    fence = next(i for i, line in enumerate(lines) if line.startswith(("# ======== torchrun:", "# ======== harness:")))
    names = [name for name in top_level(path) if name in ("train", "evaluate", "check_args")]
    assert sorted(names) == ["check_args", "evaluate", "train"]
    source = path.read_text()
    assert all(source.index(f"\ndef {name}(") < source.index(lines[fence]) for name in names)


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.stem)
def test_args_documented_and_twin_flags(path):
    fields = args_fields(path)
    undocumented = [name for name, (_, _, doc) in fields.items() if not doc]
    assert not undocumented, f"{path.name}: fields without a docstring: {undocumented}"
    twin = path.stem.endswith("_torchcompile")
    assert ("compile" in fields and "cudagraphs" in fields) == twin, path.name


@pytest.mark.parametrize("base", [p for p in SCRIPTS if not p.stem.endswith("_torchcompile")], ids=lambda p: p.stem)
def test_twin_keeps_the_baseline_algorithm_parts(base):
    """What no trick touches stays identical in the twin: Args' algorithm fields, the networks, the checks."""
    twin = base.with_name(base.stem + "_torchcompile.py")
    twin_only = ("compile", "cudagraphs", "fused_rollout")  # fused_rollout: the GPU classic-control twin's kernel
    assert {k: v for k, v in args_fields(twin).items() if k not in twin_only} == args_fields(base)
    parts_base, parts_twin = top_level(base), top_level(twin)
    for name in ("check_args", "layer_init", "SoftQNetwork", "QNetwork", "linear_schedule", "STATS", "WARMUP_STEPS",
                 "WARMUP_ITERATIONS"):  # fmt: skip
        if name in parts_base:
            assert parts_twin.get(name) == parts_base[name], f"{name} differs between {base.stem} and its twin"


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.stem)
def test_runs_when_copied_alone(path, tmp_path):
    """A script imports no file of the project: copied alone into an empty folder, it runs (its --help)."""
    shutil.copy(path, tmp_path / path.name)
    proc = subprocess.run([sys.executable, path.name, "--help"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0 and "--save-dir" in proc.stdout, proc.stderr
    assert ("--capture-video" in proc.stdout) == ("capture_video" in args_fields(path))
