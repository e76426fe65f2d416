"""measure/progress.py: one line per update off a terminal, redrawn on one, nothing on other ranks."""

from __future__ import annotations

import io

from mpi4dl_nb.measure.progress import ProgressLine


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_off_a_terminal_every_update_is_a_line() -> None:
    out = io.StringIO()
    line = ProgressLine(4, True, out, width=4)
    line.update(1, "step 1/4")
    line.update(4, "step 4/4")
    assert out.getvalue() == "[#...] step 1/4\n[####] step 4/4\n"


def test_on_a_terminal_the_bar_is_redrawn_and_the_last_update_ends_the_line() -> None:
    out = Terminal()
    line = ProgressLine(2, True, out, width=2)
    line.update(1, "a")
    line.note("evaluation: accuracy 0.9")
    line.update(2, "b")
    assert out.getvalue() == "\r[#.] a\nevaluation: accuracy 0.9\n\r[##] b\n"


def test_disabled_prints_nothing_and_overshoot_is_clamped() -> None:
    out = io.StringIO()
    ProgressLine(3, False, out).update(3, "x")
    assert out.getvalue() == ""
    assert ProgressLine(2, True, out, width=4).bar(5) == "[####]"
