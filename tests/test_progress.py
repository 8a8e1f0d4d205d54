"""``util.progress``: long operations report to whatever display the CLI installed, and to
nothing (no output, no cost beyond a call) when none is."""

from __future__ import annotations

from contextlib import contextmanager

from tokenmill import util


def test_no_display_no_output(capsys):
    util.set_progress_display(None)
    with util.progress("quiet", 3) as advance:
        advance(1)
    assert list(util.tracked(range(3), "quiet")) == [0, 1, 2]
    assert capsys.readouterr() == ("", "")


def test_a_display_sees_every_step():
    seen = []

    @contextmanager
    def display(description, total, unit):
        seen.append(("start", description, total, unit))
        yield lambda n: seen.append(("advance", n))
        seen.append(("end", description))

    util.set_progress_display(display)
    try:
        assert list(util.tracked("ab", "letters", 2)) == ["a", "b"]
    finally:
        util.set_progress_display(None)
    assert seen == [("start", "letters", 2, "it"), ("advance", 1), ("advance", 1),
                    ("end", "letters")]


def test_the_terminal_bar_goes_to_stderr(capsys):
    with util.terminal_progress("work", 2, "steps") as advance:
        advance(2)
    out, err = capsys.readouterr()
    assert out == "" and "work" in err
