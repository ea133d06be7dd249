"""Stamp the shared blocks of leanrl/harness.py into every training script, or check that every copy is the same.

    python leanrl/tools/stamp.py [SCRIPT ...]           rewrite the scripts' blocks (default: every script)
    python leanrl/tools/stamp.py --check [SCRIPT ...]   exit 1, naming the scripts and blocks that differ

A block runs from its fence line to its end line, both included, and is copied as it is. Every script has the
run options (inside its Args) and the harness (at its end); the torchrun block only the scripts that run
data-parallel, which hold its fence lines.
"""

import argparse
import sys
from pathlib import Path

LEANRL = Path(__file__).resolve().parents[1]
SOURCE = LEANRL / "harness.py"
# (name, first line's start, last line, required in every script)
BLOCKS = (
    ("run options", "    # ---- run options:", "    # ---- end of run options ----", True),
    ("torchrun", "# ======== torchrun:", "# ======== end of torchrun ========", False),
    ("harness", "# ======== harness:", "# ======== end of harness ========", True),
)


def scripts():
    return sorted(path for path in LEANRL.glob("*.py") if path != SOURCE)


def span(lines, start, end):
    """(first, last) line index of the block, or None where the script has no such fence."""
    first = next((i for i, line in enumerate(lines) if line.startswith(start)), None)
    if first is None:
        return None
    last = next((i for i in range(first, len(lines)) if lines[i] == end), None)
    if last is None:
        raise SystemExit(f"error: a block opens with {start.strip()!r} and never ends")
    return first, last


def stamped(text, source):
    """(the text with every block of the source copied in, the names of the blocks that differed)."""
    lines, source_lines, differ = text.split("\n"), source.split("\n"), []
    for name, start, end, required in BLOCKS:
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
    check, source, drifted = options.check, SOURCE.read_text(), []
    for path in options.scripts or scripts():
        text, differ = stamped(path.read_text(), source)
        if differ:
            drifted.append(f"{path.name}: {', '.join(differ)}")
            if not check and not any(name.endswith("(missing)") for name in differ):
                path.write_text(text)
    for line in drifted:
        print(("differs from leanrl/harness.py: " if check else "stamped: ") + line)
    missing = [line for line in drifted if "(missing)" in line]
    return 1 if (check and drifted) or missing else 0


if __name__ == "__main__":
    sys.exit(main())
