"""The zero-bubble split backward on 2 and 5 ranks: activation peaks against 1F1B's (zb1, zbv), W does the weight work,
no exchange.

See tests/mpi/engine_zero_bubble.py for what each named check measures.
"""

from __future__ import annotations

from tests.support.battery import shared_job

JOB = shared_job(2, "engine_zero_bubble", timeout=300)
SPATIAL_JOB = shared_job(5, "engine_zero_bubble", timeout=300)


def test_zb1_activation_peak_is_1f1b_peak(shared_launch):
    """Stage 0 within 5% of its 1F1B peak, the pipeline's peak within 5% of 1F1B's (counted saved bytes)."""
    shared_launch(JOB).require(["zb1 activation peak"])


def test_zbv_activation_peak_is_balanced_at_1f1b_first_stage(shared_launch):
    """Equal layers: every rank's zbv peak is 1F1B's stage-0 peak (+ one received stage input); 1F1B's stage 1 less."""
    shared_launch(JOB).require(["zbv activation peak"])


def test_zb1_weight_gradients_come_in_W(shared_launch):
    shared_launch(JOB).require(["zb1 W does the weight work"])


def test_zb1_spatial_W_makes_no_exchange(shared_launch):
    """Two SP stages (2 tiles each) + LP: the tile ranks' W actions call no exchange and no all-reduce; their I actions
    do; stage 1's split, stage 0's not."""
    shared_launch(SPATIAL_JOB).require(["zb1 spatial W exchanges nothing"])
