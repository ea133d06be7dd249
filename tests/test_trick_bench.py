"""trick_bench.py: every trick is timed after its before/after pair is shown to compute the same thing; a
trick that changed the result is caught; bad input."""


import pytest
from helpers import assert_one_line_error, load_script, run_cli

TOOL = "tools/trick_bench"


def test_every_trick_checked_and_timed(tmp_path, monkeypatch):
    """For each trick in turn: its two sides are checked to agree, then each is timed over at least --iters calls.
    The table (printed and written) has one row per trick, in order, with the times returned and the difference."""
    bench = load_script(TOOL)
    events = []
    check_same, per_call_us = bench.check_same, bench.per_call_us

    def recording_check_same(name, before, after):
        events.append(("checked", name))
        return check_same(name, before, after)

    def recording_per_call_us(fn, iters, device):
        calls = []

        def counted():
            calls.append(None)
            return fn()

        us = per_call_us(counted, iters, device)
        events.append(("timed", len(calls) >= iters))
        return us

    monkeypatch.setattr(bench, "check_same", recording_check_same)
    monkeypatch.setattr(bench, "per_call_us", recording_per_call_us)
    out = tmp_path / "tricks.md"
    rows = bench.main(["--device", "cpu", "--iters", "3", "--out", str(out)])
    assert list(rows) == list(bench.TRICKS)
    checked_then_timed = [[("checked", trick), ("timed", True), ("timed", True)] for trick in bench.TRICKS]
    assert events == [event for events_of_trick in checked_then_timed for event in events_of_trick]
    table = out.read_text().splitlines()
    assert table[0].startswith("Eager, CPU,") and "3 calls per side" in table[0]
    assert table[2] == "| trick | before | after | saved per call |"
    cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in table[4:]]
    assert [row[0] for row in cells] == list(bench.TRICKS)
    for (trick, before, after, saved), (b, a) in zip(cells, rows.values(), strict=True):
        assert (before, after, saved) == (f"{b:.1f}", f"{a:.1f}", f"{b - a:.1f}"), trick


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


def test_bad_input(tmp_path):
    assert_one_line_error(run_cli(TOOL, "--iters", "0"), "--iters")
    assert_one_line_error(run_cli(TOOL, "--device", "nope"), "--device")
    assert_one_line_error(run_cli(TOOL, "--iters", "1", "--out", tmp_path), "is a folder: it names a file")  # at once
