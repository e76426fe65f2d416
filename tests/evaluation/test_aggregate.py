"""evaluation/aggregate.py: tile probabilities per slide and per patient, and the figures of each level."""
from __future__ import annotations

import numpy as np
import pytest

from mpi4dl_nb.errors import ConfigError
from mpi4dl_nb.evaluation.aggregate import (
    AggregateKind,
    Aggregation,
    by_patient,
    by_slide,
    level_metrics,
    softmax,
)
from mpi4dl_nb.evaluation.metrics import Records

PROBS = np.array([[0.9, 0.1], [0.6, 0.4], [0.2, 0.8]])


def test_rules_parse_and_aggregate_per_class():
    assert Aggregation.parse("mean").kind is AggregateKind.MEAN
    assert Aggregation.parse("top-k") == Aggregation(AggregateKind.TOP_K, 5)
    assert Aggregation.parse("TOP-2").describe() == "top-2"
    np.testing.assert_allclose(Aggregation.parse("mean").apply(PROBS), [1.7 / 3, 1.3 / 3])
    np.testing.assert_allclose(Aggregation.parse("max").apply(PROBS), [0.9, 0.8])
    np.testing.assert_allclose(Aggregation.parse("top-2").apply(PROBS), [0.75, 0.6])
    for bad in ("median", "top-0", "top-x"):
        with pytest.raises(ConfigError, match="--aggregate"):
            Aggregation.parse(bad)


def test_slides_and_patients_aggregate_their_tiles_and_score():
    logits = np.log(np.array([[0.9, 0.1], [0.7, 0.3], [0.2, 0.8], [0.4, 0.6], [0.3, 0.7]]))
    records = Records(np.arange(5), np.array([0, 0, 1, 1, 1]), np.zeros(5), logits)
    np.testing.assert_allclose(softmax(logits), np.exp(logits))
    slides = by_slide(records, ["a", "a", "b", "b", "c"], ["P1", "P1", "P2", "P2", "P2"], Aggregation())
    assert [(s.name, s.patient, s.label, s.tiles) for s in slides] == [("a", "P1", 0, 2), ("b", "P2", 1, 2),
                                                                       ("c", "P2", 1, 1)]
    np.testing.assert_allclose(slides[1].probabilities, [0.3, 0.7])
    patients = by_patient(slides, Aggregation())
    assert [(p.name, p.label, p.tiles) for p in patients] == [("P1", 0, 2), ("P2", 1, 3)]
    np.testing.assert_allclose(patients[1].probabilities, [0.3, 0.7])
    figures = level_metrics("slide", slides, 2)
    assert figures.count == 3 and figures.accuracy == 1.0 and figures.roc_auc == 1.0
    assert figures.confusion_matrix == [[1, 0], [0, 2]]


def test_three_classes_score_the_macro_one_vs_rest_auc_of_the_aggregated_probabilities():
    probabilities = np.array([[0.7, 0.2, 0.1], [0.5, 0.1, 0.4], [0.1, 0.6, 0.3], [0.3, 0.3, 0.4], [0.2, 0.2, 0.6]])
    records = Records(np.arange(5), np.array([0, 0, 1, 2, 2]), np.zeros(5), np.log(probabilities))
    slides = by_slide(records, ["a", "b", "c", "d", "e"], ["P1", "P2", "P3", "P4", "P5"], Aggregation())
    figures = level_metrics("slide", slides, 3)
    # class 0 ranks both its slides above the other three (1.0); class 1 its one slide above all (1.0); class 2:
    # d (0.4) and e (0.6) against a (0.1), b (0.4: a tie, half), c (0.3): (3 + 2.5) / 6
    assert figures.roc_auc == pytest.approx((1.0 + 1.0 + 5.5 / 6) / 3)
    missing = level_metrics("slide", slides[:3], 3)     # no slide of class 2: no macro AUC, as sklearn refuses it
    assert missing.roc_auc is None and missing.accuracy == 1.0
