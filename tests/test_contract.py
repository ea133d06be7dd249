"""The parts every training script shares are word for word the same in each (docs/contract.md), and the
baseline-to-twin diff of each pair touches only what the twin makes fast."""

import ast
import difflib
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parents[1] / "leanrl").glob("*.py"))
BASELINES = (
    "dqn", "ppo_atari_envpool", "ppo_atari_envpool_multigpu", "ppo_classic_control_gpu", "ppo_continuous_action",
    "sac_continuous_action", "td3_continuous_action",
)  # fmt: skip
SHARED_DEFS = (
    "fail", "flag", "wandb_credentials", "checkpoint_file", "open_checkpoint", "rng_states", "restore_rng_states",
    "Meter", "main",
)  # fmt: skip
SHARED_CONSTANTS = ("PROGRESS_SECONDS", "CONSOLE_SECONDS", "QUIET_WARNINGS", "CHECKPOINT_FORMAT", "RESUMABLE_ARGS")
# The pairs that run data-parallel under torchrun, and the parts of it they share: average_gradients is the same in
# their baselines and the same in their twins (each gives the twin's flat buffer or the baseline's parameters).
DISTRIBUTED = ("ppo_atari_envpool_multigpu", "ppo_classic_control_gpu")
DISTRIBUTED_DEFS = (
    "DIST_TIMEOUT_SECONDS", "world", "leave_process_group", "fail_on_every_rank", "digests_differ",
    "setup_distributed", "stop_together", "agree", "broadcast_parameters", "check_ranks_agree",
)  # fmt: skip
COMMON_FIELDS = (
    "cuda", "torch_threads", "track", "wandb_project_name", "wandb_entity", "tensorboard", "speed_log",
    "profile_dir", "save_dir", "save_every", "resume", "eval_checkpoint", "eval_episodes", "capture_video",
)  # fmt: skip


def top_level(path):
    """{name: source text} of the module-level functions, classes, assignments and the __main__ block."""
    source = path.read_text()
    tree = ast.parse(source)
    parts = {}
    for node in tree.body:
        text = ast.get_source_segment(source, node)
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            parts[node.name] = text
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            parts[node.targets[0].id] = text
        elif isinstance(node, ast.If):
            parts["__main__"] = text
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


def test_seven_baselines_and_their_twins():
    """The scripts are exactly these baselines and, for each, its _torchcompile twin."""
    pairs = [stem for base in BASELINES for stem in (base, base + "_torchcompile")]
    assert sorted(path.stem for path in SCRIPTS) == sorted(pairs)


def assert_same_in(name, paths):
    """The top-level part `name` is in every script of `paths`, the same text in each."""
    texts = {path.name: top_level(path).get(name) for path in paths}
    missing = [script for script, text in texts.items() if text is None]
    assert not missing, f"{name} is missing in {missing}"
    reference = texts[paths[0].name]
    for script, text in texts.items():
        diff = "\n".join(difflib.unified_diff(reference.splitlines(), text.splitlines(), lineterm="", n=0))
        assert text == reference, f"{name} in {script} differs from {paths[0].name}:\n{diff}"


@pytest.mark.parametrize("name", SHARED_DEFS + SHARED_CONSTANTS + ("__main__",))
def test_shared_parts_are_word_for_word_the_same(name):
    assert_same_in(name, SCRIPTS)


@pytest.mark.parametrize("name", DISTRIBUTED_DEFS + ("average_gradients",))
def test_distributed_parts_are_word_for_word_the_same(name):
    """In every script that runs under torchrun; average_gradients among the baselines, and among the twins."""
    paths = [path for path in SCRIPTS if path.stem.startswith(DISTRIBUTED)]
    assert len(paths) == 2 * len(DISTRIBUTED)
    if name == "average_gradients":
        for twins in (False, True):
            assert_same_in(name, [path for path in paths if path.stem.endswith("_torchcompile") == twins])
    else:
        assert_same_in(name, paths)


def test_common_args_are_the_same_and_documented():
    reference = {name: args_fields(SCRIPTS[0])[name] for name in COMMON_FIELDS}
    for path in SCRIPTS:
        fields = args_fields(path)
        assert {name: fields.get(name) for name in COMMON_FIELDS} == reference, path.name
        undocumented = [name for name, (_, _, doc) in fields.items() if not doc]
        assert not undocumented, f"{path.name}: fields without a docstring: {undocumented}"
        twin = path.stem.endswith("_torchcompile")
        assert ("compile" in fields and "cudagraphs" in fields) == twin, path.name


def test_every_script_names_its_statistics():
    for path in SCRIPTS:
        parts = top_level(path)
        assert "STATS" in parts, path.name
        stats = ast.literal_eval(parts["STATS"].split("=", 1)[1].strip())
        assert len(stats) == len(set(stats)) > 0, path.name


@pytest.mark.parametrize("base", [p for p in SCRIPTS if not p.stem.endswith("_torchcompile")], ids=lambda p: p.stem)
def test_twin_keeps_the_baseline_algorithm_parts(base):
    """What no trick touches stays identical in the twin: the networks' definitions and Args' algorithm fields."""
    twin = base.with_name(base.stem + "_torchcompile.py")
    fields_base, fields_twin = args_fields(base), args_fields(twin)
    twin_only = ("compile", "cudagraphs", "fused_rollout")  # fused_rollout: the GPU classic-control twin's kernel
    assert {k: v for k, v in fields_twin.items() if k not in twin_only} == fields_base
    parts_base, parts_twin = top_level(base), top_level(twin)
    for name in ("check_args", "layer_init", "SoftQNetwork", "QNetwork", "linear_schedule", "STATS", "WARMUP_STEPS",
                 "WARMUP_ITERATIONS"):  # fmt: skip
        if name in parts_base:
            assert parts_twin.get(name) == parts_base[name], f"{name} differs between {base.stem} and its twin"

