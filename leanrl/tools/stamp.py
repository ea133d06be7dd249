"""Stamp the shared blocks into every training script, or check that every copy is the same.

    python leanrl/tools/stamp.py [SCRIPT ...]           rewrite the scripts' blocks (default: every script)
    python leanrl/tools/stamp.py --check [SCRIPT ...]   exit 1, naming the scripts and blocks that differ

A block runs from its fence line to its end line, both included, and is copied as it is from its one source.
From leanrl/harness.py: every script has the run options (inside its Args) and the harness (at its end); the
torchrun block only the scripts that run data-parallel, which hold its fence lines. From
leanrl/ppo_continuous_action_gpu_mujoco.py: the MuJoCo Warp envs, in the scripts on them (each then adds how it
launches the physics, `Envs.simulate`); from its twin, the twins' `simulate`, which joins torch's capture. From the
TD3 pair on those envs, into the SAC pair: the replay buffer (the baseline's into the baseline, the twin's into the
twin) and the twin's captured training step.
"""

import argparse
import sys
from pathlib import Path

LEANRL = Path(__file__).resolve().parents[1]
HARNESS, WARP_ENVS = LEANRL / "harness.py", LEANRL / "ppo_continuous_action_gpu_mujoco.py"
WARP_TWIN = LEANRL / "ppo_continuous_action_gpu_mujoco_torchcompile.py"
TD3_GPU, TD3_GPU_TWIN = LEANRL / "td3_gpu_mujoco.py", LEANRL / "td3_gpu_mujoco_torchcompile.py"
# (name, first line's start, last line, required in every script, source)
BLOCKS = (
    ("run options", "    # ---- run options:", "    # ---- end of run options ----", True, HARNESS),
    ("torchrun", "# ======== torchrun:", "# ======== end of torchrun ========", False, HARNESS),
    ("harness", "# ======== harness:", "# ======== end of harness ========", True, HARNESS),
    ("MuJoCo Warp envs", "# ======== MuJoCo Warp envs:", "    # ======== end of MuJoCo Warp envs ========", False,
     WARP_ENVS),
    ("MuJoCo Warp in torch's capture", "    # ======== MuJoCo Warp in torch's capture:",
     "    # ======== end of MuJoCo Warp in torch's capture ========", False, WARP_TWIN),
    ("replay buffer", "# ======== replay buffer:", "# ======== end of replay buffer ========", False, TD3_GPU),
    ("replay buffer, graphs", "# ======== replay buffer, graphs:", "# ======== end of replay buffer, graphs ========",
     False, TD3_GPU_TWIN),
    ("training step, graphs", "# ======== training step, graphs:", "# ======== end of training step, graphs ========",
     False, TD3_GPU_TWIN),
)


def scripts():
    return sorted(path for path in LEANRL.glob("*.py") if path != HARNESS)


def span(lines, start, end):
    """(first, last) line index of the block, or None where the script has no such fence."""
    first = next((i for i, line in enumerate(lines) if line.startswith(start)), None)
    if first is None:
        return None
    last = next((i for i in range(first, len(lines)) if lines[i] == end), None)
    if last is None:
        raise SystemExit(f"error: a block opens with {start.strip()!r} and never ends")
    return first, last


def stamped(text, sources):
    """(the text with every block copied in from its source, the names of the blocks that differed); sources: the
    text of each source file."""
    lines, differ = text.split("\n"), []
    for name, start, end, required, source in BLOCKS:
        source_lines = sources[source].split("\n")
        where, block = span(lines, start, end), span(source_lines, start, end)
        if where is None:
            if required:
                differ.append(f"{name} (missing)")
            continue
        copy = source_lines[block[0] : block[1] + 1]
        if lines[where[0] : where[1] + 1] != copy:
            differ.append(name)
            lines[where[0] : where[1] + 1] = copy
    return "\n".join(lines), differ


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 where a copy differs")
    parser.add_argument("scripts", nargs="*", type=Path, help="the scripts (default: every one in leanrl/)")
    options = parser.parse_args(argv)
    check, drifted = options.check, []
    sources = {source: source.read_text() for source in {block[-1] for block in BLOCKS}}
    for path in options.scripts or scripts():
        text, differ = stamped(path.read_text(), sources)
        if differ:
            drifted.append(f"{path.name}: {', '.join(differ)}")
            if not check and not any(name.endswith("(missing)") for name in differ):
                path.write_text(text)
    for line in drifted:
        print(("differs from its source: " if check else "stamped: ") + line)
    missing = [line for line in drifted if "(missing)" in line]
    return 1 if (check and drifted) or missing else 0


if __name__ == "__main__":
    sys.exit(main())
