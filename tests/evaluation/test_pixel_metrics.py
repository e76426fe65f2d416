"""Segmentation metrics: Dice, IoU, pixel accuracy from integer counts; an image's tiles counted on several ranks
add up to the image."""

import numpy as np

from mpi4dl_nb.evaluation.pixel_metrics import PixelRecords, confusion_counts, merge_pixels, summarize_pixels


def records(index, confusion, classes=3):
    n = len(index)
    return PixelRecords(np.array(index, np.int64), np.ones((n, 1)), np.full((n, 1), 2.0), np.ones((n, classes)),
                        np.full((n, classes), 3.0), np.array(confusion, np.int64))


def test_confusion_counts_leave_ignored_pixels_out():
    label = np.array([[0, 1, 2], [255, 1, 1]])
    predicted = np.array([[0, 2, 2], [0, 1, 0]])
    assert confusion_counts(label, predicted, 3, 255).tolist() == [[1, 0, 0], [1, 1, 1], [0, 0, 1]]


def test_dice_iou_and_accuracy_from_the_totals():
    matrix = [[50, 10, 0], [5, 35, 0], [0, 0, 0]]          # class 2: never true, never predicted
    metrics = summarize_pixels(records([0], matrix), 0.5, 3, ("bg", "tumor", "stroma"))
    assert metrics.pixels == 100 and metrics.pixel_accuracy == 0.85 and metrics.accuracy == 0.85
    assert metrics.dice[0] == 2 * 50 / (2 * 50 + 5 + 10) and metrics.iou[1] == 35 / (35 + 5 + 10)
    assert metrics.dice[2] is None and metrics.iou[2] is None
    assert metrics.mean_dice == (metrics.dice[0] + metrics.dice[1]) / 2
    shown = metrics.as_dict("val_")
    assert shown["val_task"] == "segmentation" and shown["val_dice_by_class"]["tumor"] == metrics.dice[1]
    assert shown["val_confusion_matrix"] == matrix and shown["val_loss"] == 0.5
    assert [name for name, _ in metrics.headline()] == ["val_loss", "val_pixel_accuracy", "val_mean_dice",
                                                        "val_mean_iou"]


def test_merging_adds_an_images_tiles_and_every_count():
    first = records([3, 1], [[1, 0, 0], [0, 2, 0], [0, 0, 0]])
    second = records([1], [[0, 0, 0], [0, 1, 0], [0, 0, 4]])
    merged = merge_pixels([first, second, records([], np.zeros((3, 3)))], 3)
    assert merged.index.tolist() == [1, 3]
    assert merged.nll[:, 0].tolist() == [2.0, 1.0] and merged.overlap[0].tolist() == [2.0, 2.0, 2.0]
    assert merged.confusion.tolist() == [[1, 0, 0], [0, 3, 0], [0, 0, 4]]
