"""Learning curves of a segmentation run: the validation pixel accuracy and mean Dice in the right panel, only the
figures a run logged."""
from __future__ import annotations

import mpi4dl_nb as dl
from mpi4dl_nb.evaluation.log import MetricsLog


def test_a_segmentation_run_draws_its_dice_curve(tmp_path):
    log = MetricsLog(tmp_path / "seg", "seg", tensorboard=False)
    for step in (1, 2, 3, 4):
        log.write("train", step, {"loss": 1.0 / step})
        if step % 2 == 0:
            log.write("eval", step, {"val_loss": 1.2 / step, "val_pixel_accuracy": 0.4 * step / 2,
                                     "val_mean_dice": 0.3 * step / 2, "val_dice": [0.5, 0.1 * step]})
    log.close()
    fig = dl.plot_learning_curves(tmp_path / "seg", labels=["unet"])
    loss_ax, right = fig.axes
    lines = {line.get_label(): line for line in right.lines}
    assert sorted(lines) == ["unet Dice", "unet pixel accuracy"]          # no empty classifier series
    assert list(lines["unet Dice"].get_xdata()) == [2, 4] and list(lines["unet Dice"].get_ydata()) == [0.3, 0.6]
    assert "Dice" in right.get_title()
