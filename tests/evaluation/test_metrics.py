"""Metric arithmetic (pure): ROC AUC by ranks equals pairwise counting, recall/balanced accuracy, exact merge."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from mpi4dl_nb.evaluation.metrics import MetricName, Records, average_ranks, merge, roc_auc, summarize


def pairwise_auc(score, positive) -> float:
    """P(score of a positive > score of a negative), ties half: the definition, by brute force."""
    pos = [s for s, p in zip(score, positive) if p]
    neg = [s for s, p in zip(score, positive) if not p]
    wins = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a, b in itertools.product(pos, neg))
    return wins / (len(pos) * len(neg))


def test_roc_auc_equals_pairwise_definition_with_ties():
    rng = np.random.default_rng(0)
    for _ in range(20):
        score = rng.integers(0, 5, 30).astype(float)        # many ties
        positive = rng.random(30) < 0.4
        assert roc_auc(score, positive) == pytest.approx(pairwise_auc(score, positive), abs=1e-15)
    assert roc_auc(np.array([0.1, 0.9]), np.array([False, True])) == 1.0
    assert roc_auc(np.array([0.1, 0.9]), np.array([True, True])) is None


def test_average_ranks_share_ties():
    assert average_ranks(np.array([3.0, 1.0, 3.0, 2.0])).tolist() == [3.5, 1.0, 3.5, 2.0]


def records(labels, logits, losses=None, start=0) -> Records:
    labels = np.array(labels)
    return Records(np.arange(start, start + len(labels)), labels,
                   np.array(losses if losses is not None else [1.0] * len(labels), dtype=float),
                   np.array(logits, dtype=float))


def test_summary_counts_over_all_samples():
    # true 0,0,0,1 ; predicted 0,1,0,1 -> recall 2/3 and 1, accuracy 3/4
    r = records([0, 0, 0, 1], [[1, 0], [0, 1], [2, 0], [0, 3]], losses=[1, 2, 3, 6])
    m = summarize(r, 2)
    assert m.count == 4 and m.loss == 3.0 and m.accuracy == 0.75
    assert m.per_class_recall == [2 / 3, 1.0] and m.balanced_accuracy == pytest.approx(5 / 6)
    assert m.confusion_matrix == [[2, 1], [0, 1]] and m.roc_auc == 1.0
    # a class without samples has no recall and does not enter the balanced accuracy; nor a macro AUC (undefined)
    m3 = summarize(records([0, 2], [[1, 0, 0], [0, 0, 1]]), 3)
    assert m3.per_class_recall == [1.0, None, 1.0] and m3.balanced_accuracy == 1.0 and m3.roc_auc is None
    assert m3.per_class_roc_auc == [1.0, None, 1.0]
    named = m.as_dict("val_")       # the names summaries and logs use, in the summary's order
    assert list(named)[:3] == ["val_count", "val_loss", "val_accuracy"] and named["val_loss"] == 3.0


def test_merge_is_a_sum_not_an_average_of_averages():
    """Two ranks with 1 and 3 samples: the merged loss is the mean over the 4, in sample order."""
    a = records([0], [[1, 0]], losses=[4.0], start=3)
    b = records([1, 1, 0], [[0, 1], [1, 0], [1, 0]], losses=[0.0, 0.0, 0.0], start=0)
    merged = merge([a, b], 2)
    assert merged.index.tolist() == [0, 1, 2, 3] and merged.loss.tolist() == [0, 0, 0, 4]
    assert summarize(merged, 2).loss == 1.0               # average of averages would say 2.0
    with pytest.raises(ValueError, match="twice"):
        merge([a, a], 2)
    assert len(merge([], 2)) == 0


def test_class_names_name_the_recalls_and_metric_directions():
    records = Records(np.arange(4), np.array([0, 0, 1, 1]), np.array([0.1, 0.2, 0.3, 0.4]),
                      np.array([[2.0, 0.0], [0.0, 1.0], [0.0, 3.0], [0.0, 2.0]]))
    named = summarize(records, 2, ("benign", "tumour")).as_dict("val_")
    assert named["val_classes"] == ["benign", "tumour"]
    assert named["val_recall_by_class"] == {"benign": 0.5, "tumour": 1.0}
    assert "val_classes" not in summarize(records, 2).as_dict("val_")      # no names, no extra keys
    metrics = summarize(records, 2)
    assert MetricName.VAL_LOSS.of(metrics) == pytest.approx(0.25) and MetricName.VAL_ACCURACY.of(metrics) == 0.75
    assert MetricName.VAL_LOSS.lower_is_better and not MetricName.VAL_ROC_AUC.lower_is_better
    assert MetricName.VAL_LOSS.better(0.2, 0.25) and not MetricName.VAL_LOSS.better(0.25, 0.25)
    assert MetricName.VAL_ACCURACY.better(0.8, 0.75) and MetricName.VAL_ACCURACY.better(0.1, None)
    three = summarize(Records(np.arange(3), np.array([0, 1, 2]), np.zeros(3), np.eye(3)), 3)
    assert MetricName.VAL_ROC_AUC.of(three) == 1.0                         # one-vs-rest, macro
    assert summarize(records, 2, ("benign", "tumour")).as_dict()["roc_auc_by_class"] == {"benign": 1.0, "tumour": 1.0}


def direct_one_vs_rest(logits, labels) -> list[float]:
    """Each class's AUC against the rest on the softmax probabilities sklearn would be given (each row's sum taken
    exactly, so equal probabilities tie), by pairwise counting."""
    import math

    exps = [[math.exp(v) for v in row] for row in logits]
    probabilities = [[e / math.fsum(row) for e in row] for row in exps]
    return [pairwise_auc([p[c] for p in probabilities], [label == c for label in labels])
            for c in range(len(logits[0]))]


def test_one_vs_rest_macro_auc_equals_pairwise_counting_with_ties():
    """Past two classes ``roc_auc`` is the macro mean of the classes' one-vs-rest AUCs, as sklearn's
    ``roc_auc_score(multi_class='ovr', average='macro')`` gives it; binary stays the second class's AUC."""
    rng = np.random.default_rng(3)
    for classes in (3, 4):
        for _ in range(10):
            labels = np.concatenate([np.arange(classes), rng.integers(0, classes, 25)])   # every class present
            palette = rng.normal(0.0, 2.0, (5, classes))          # rows drawn from 5: many ties, none by rounding
            logits = palette[rng.integers(0, 5, len(labels))]
            m = summarize(records(labels, logits), classes)
            expected = direct_one_vs_rest(logits.tolist(), labels.tolist())
            assert m.per_class_roc_auc == pytest.approx(expected, abs=1e-12)
            assert m.roc_auc == pytest.approx(sum(expected) / classes, abs=1e-12)
    saturated = np.array([[0.0, 40.0, 0.0], [0.0, 50.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    assert summarize(records([0, 1, 2, 0], saturated), 3).per_class_roc_auc[1] == 1.0   # not a 1.0 == 1.0 tie
    binary = records([0, 1, 1, 0], [[0.0, 1.0], [0.0, 2.0], [1.0, 0.0], [3.0, 0.0]])
    m2 = summarize(binary, 2)
    assert m2.roc_auc == roc_auc(np.array([1.0, 2.0, -1.0, -3.0]), np.array([False, True, True, False]))
    assert m2.per_class_roc_auc == [m2.roc_auc, m2.roc_auc]
