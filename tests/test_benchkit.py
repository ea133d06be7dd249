"""benchkit.py, the helpers the tools in leanrl/tools share: counts as 4096 or 2^12, the timed calls after the warm-up,
a module that does not import, a size that runs out of memory, the markdown tables, argparse's errors as one line."""

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from helpers import SCRIPTS, assert_one_line_error

# The tools import benchkit from beside them, where Python finds it when they run as leanrl/tools/<tool>.py.
sys.path.insert(0, str(SCRIPTS / "tools"))

import benchkit  # noqa: E402

CPU = torch.device("cpu")


def refused(capsys, call, *args):
    """call(*args) refused as bad input: (exit code, stderr)."""
    with pytest.raises(SystemExit) as exit_info:
        call(*args)
    return SimpleNamespace(returncode=exit_info.value.code, stderr=capsys.readouterr().err)


def test_count(capsys):
    parse = benchkit.count("--envs")
    assert parse("4096") == 4096 and parse("2^12") == 4096 and parse("1") == 1
    assert_one_line_error(refused(capsys, parse, "0"), "--envs 0 must be positive")
    assert_one_line_error(refused(capsys, parse, "2^x"), "--envs '2^x' is not a whole number")
    assert_one_line_error(refused(capsys, parse, "2^-1"), "--envs 2^-1 must be positive (a power: not negative)")
    assert_one_line_error(refused(capsys, parse, "2^100000"), "--envs 2^100000 is over 2^40")
    assert parse("2^0") == 1 and parse("2^40") == 2**40


def test_output_paths_are_checked_before_measuring(tmp_path, capsys):
    """A folder or file a tool writes at its end: an empty name, a file where a folder goes, a folder where a file
    goes, are refused at the start, not after the measuring."""
    (tmp_path / "a_file").write_text("")
    assert_one_line_error(refused(capsys, benchkit.writable_folder, "--out", ""), "--out '': an empty name")
    assert_one_line_error(refused(capsys, benchkit.writable_folder, "--out", tmp_path / "a_file"),
                          "is a file: it names a folder")  # fmt: skip
    assert_one_line_error(refused(capsys, benchkit.writable_file, "--out", tmp_path), "is a folder: it names a file")
    assert_one_line_error(refused(capsys, benchkit.writable_file, "--out", tmp_path / "a_file" / "t.md"),
                          "is a file: it names a folder")  # fmt: skip
    benchkit.writable_file("--out", tmp_path / "new" / "t.md")
    assert (tmp_path / "new").is_dir()


def test_parser_errors_are_one_line(capsys):
    parser = benchkit.Parser(prog="tool.py")
    parser.add_argument("--out", required=True)
    assert_one_line_error(refused(capsys, parser.parse_args, []), "--out", "(see tool.py --help)")


def test_measure_warms_up_then_times_at_least_min_calls_and_min_seconds():
    calls, syncs = [], []
    warmup, timed, seconds = benchkit.measure(lambda: calls.append(len(syncs)), lambda: syncs.append(None), 2, 3)
    assert timed == 3 and calls == [0, 0, 1, 1, 1] and len(syncs) == 2 and warmup >= 0 and seconds >= 0
    _, timed, seconds = benchkit.measure(lambda: None, lambda: None, 0, min_seconds=0.02)
    assert timed >= 1 and seconds >= 0.02


def test_load():
    module, why = benchkit.load("json")
    assert module.__name__ == "json" and why is None
    module, why = benchkit.load("no_such_module_here")
    assert module is None
    assert why == "`import no_such_module_here` failed: ModuleNotFoundError: No module named 'no_such_module_here'"


def test_unless_out_of_memory():
    def run_out():
        raise torch.OutOfMemoryError("CUDA out of memory")

    assert benchkit.unless_out_of_memory(run_out, CPU) is None
    assert benchkit.unless_out_of_memory(lambda: torch.empty(2**62, dtype=torch.uint8), CPU) is None  # the host's
    assert benchkit.unless_out_of_memory(lambda: 7, CPU) == 7
    with pytest.raises(ValueError):
        benchkit.unless_out_of_memory(lambda: int("x"), CPU)


def test_markdown_table():
    assert benchkit.markdown_table(["", "a", "b"], [["x", 1, 2.5], ["y", "", "–"]]) == [
        "| | a | b |",
        "|---|---|---|",
        "| x | 1 | 2.5 |",
        "| y | | – |",
    ]


def test_run_as_a_command_it_names_the_tools():
    """benchkit.py is no tool: run (with --help or not), it says so in one line and names the tools."""
    proc = subprocess.run([sys.executable, benchkit.__file__, "--help"], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr.startswith("error: benchkit.py is the module the tools share, not a tool: run one of")
    assert "scaling_bench.py" in proc.stderr and proc.stderr.count("\n") == 1
