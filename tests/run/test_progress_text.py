"""run/trainer.py's progress line: measure/progress.py's ProgressLine with the step, loss, speed and accuracy."""
from __future__ import annotations

import io

from mpi4dl_nb.measure.progress import ProgressLine
from mpi4dl_nb.run.trainer import progress_text


def test_training_progress_lines_when_not_a_terminal():
    out = io.StringIO()
    bar = ProgressLine(4, enabled=True, stream=out, width=8)
    bar.update(1, progress_text(1, 4, 2.5, 3.0, None))
    bar.update(4, progress_text(4, 4, 1.25, 3.5, 0.75))
    assert out.getvalue().splitlines() == ["[##......] step 1/4 loss 2.5000 3.00 img/s",
                                           "[########] step 4/4 loss 1.2500 3.50 img/s val_acc 0.750"]
