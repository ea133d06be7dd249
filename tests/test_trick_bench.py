"""trick_bench.py: every trick is timed after its before/after pair is shown to compute the same thing; a
trick that changed the result is caught; bad input."""

import pytest
from conftest import assert_one_line_error, load_script, run_cli

TOOL = "tools/trick_bench"


def test_every_trick_checked_and_timed(tmp_path):
    bench = load_script(TOOL)
    out = tmp_path / "tricks.md"
    rows = bench.main(["--device", "cpu", "--iters", "2", "--out", str(out)])
    assert set(rows) == set(bench.TRICKS)
    assert all(before > 0 and after > 0 for before, after in rows.values())
    table = out.read_text().splitlines()
    assert [line.split(" | ")[0].lstrip("| ") for line in table[4:]] == list(bench.TRICKS)


def test_a_trick_that_changes_the_result_is_refused(monkeypatch):
    bench = load_script(TOOL)

    original = bench.lerp_targets

    def broken(device):
        before, after, results = original(device)

        def after_twice():  # two target updates where the plain side does one
            after()
            after()

        return before, after_twice, results

    monkeypatch.setitem(bench.TRICKS, "target update as one lerp_", broken)
    with pytest.raises(AssertionError, match="changes the result"):
        bench.main(["--device", "cpu", "--iters", "1"])


def test_bad_input():
    assert_one_line_error(run_cli(TOOL, "--iters", "0"), "--iters")
    assert_one_line_error(run_cli(TOOL, "--device", "nope"), "--device")
