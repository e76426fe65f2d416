"""Every variant of timm's Swin family on 2x2 simulated tiles: runs (the classes tests/mpi/swin_exact.py checks exact)
or stops naming its module (issue 53: "every other timm model of these families is exact or refused").

One process, four simulated ranks on ``meta`` (``FakeWorld``), one model per variant (``swin_*``, ``swinv2_*`` with
``swinv2_cr_*``, ``swin_s3_*``; the others differ in widths and depths only) built with two blocks per stage (a
shifted block in every stage), run at its own input size. ``MPI4DL_FAMILY_SWEEP=1`` runs every model timm lists.
"""

from __future__ import annotations

import re

import pytest

from mpi4dl_nb.spatial.guard_frames import TILE_FAILURE
from tests.spatial.test_attention_families import FULL_SWEEP, NAMED, _on_simulated_tiles
from tests.support.requirements import MODELS_EXTRA, missing_modules, require_or_skip

MISSING = missing_modules("timm")
FAMILIES = ("swin_*", "swinv2_*", "swin_s3_*")
RAN = "ran"
# SwinTransformerV2Cr has no tile conversion: refused at spatialize, naming the model's class
CR_EMBED = "layer '<root>' (SwinTransformerV2Cr): timm's Swin-V2 'cr' models"
# one model per variant: what it does on 2x2 tiles at its own input size
VARIANTS = {
    "swin_tiny_patch4_window7_224": RAN,            # windows 7: stage 4 one window over all tiles
    "swin_base_patch4_window12_384": RAN,           # windows 12 at 384 px: stage 4 one 12 x 12 window
    "swin_s3_tiny_224": RAN,                        # windows 7, 7, 14, 7
    "swinv2_tiny_window8_256": RAN,                 # continuous position bias, windows 8
    "swinv2_tiny_window16_256": RAN,                # windows 16, clamped to the 8 x 8 last stage
    "swinv2_base_window12_192": RAN,                # windows 12 at 192 px
    "swinv2_base_window12to16_192to256": RAN,       # pretrained window 12 scales the bias table of window 16
    "swinv2_base_window12to24_192to384": RAN,       # window 24 from 12: stage 3 one window, stage 4 clamped
    "swinv2_cr_tiny_224": CR_EMBED,
    "swinv2_cr_tiny_ns_224": CR_EMBED,
    "swinv2_cr_tiny_384": CR_EMBED,
    "swinv2_cr_small_ns_256": CR_EMBED,
}
# the classes that run on tiles: timm's SwinTransformer (swin_*, swin_s3_*) and SwinTransformerV2 (swinv2_* but _cr_),
# checked exact under MPI at windows 7, 8 and 7/14 (tests/mpi/swin_exact.py); the window size is geometry only
EXACT_VARIANTS = re.compile(r"swin_(tiny|small|base|large)_patch4_window\d+_\d+|swin_s3_\w+|"
                            r"swinv2_(?!cr_)\w+_window\d+(to\d+)?_\d+(to\d+)?")


def _outcome(name: str) -> str:
    """'ran', a ConfigError's message, or the model's own error stopped on a tile (its note names the layer)."""
    try:
        return _on_simulated_tiles(name)   # a ConfigError's message is its outcome
    except Exception as error:   # only a failure the guard attributed to a layer counts; anything else fails
        message = "\n".join([str(error), *getattr(error, "__notes__", [])])
        if TILE_FAILURE not in message:
            raise
        return message


def _family_models() -> list[str]:
    import timm

    return sorted({name for pattern in FAMILIES for name in timm.list_models(pattern)})


def test_each_swin_variant_runs_or_is_refused_naming_its_module():
    require_or_skip(MISSING, "the timm Swin family", MODELS_EXTRA)
    outcomes = {name: _outcome(name) for name in VARIANTS}
    assert {name: outcome[:300] for name, outcome in outcomes.items() if VARIANTS[name] not in outcome} == {}
    assert all(EXACT_VARIANTS.fullmatch(name) for name, outcome in outcomes.items() if outcome == RAN)
    assert all(NAMED.search(outcome) for outcome in outcomes.values() if outcome != RAN)


def test_the_variant_table_covers_every_variant_timm_lists():
    """Every Swin model timm lists is one of the variants above but for its width, depth or pretrained tag."""
    require_or_skip(MISSING, "the timm Swin family", MODELS_EXTRA)
    size = re.compile(r"_(tiny|small|base|large|huge|giant)")
    assert {size.sub("_*", name) for name in _family_models()} - {size.sub("_*", name) for name in VARIANTS} == set()


@pytest.mark.skipif(not FULL_SWEEP, reason="every timm Swin model takes a minute: MPI4DL_FAMILY_SWEEP=1")
def test_every_swin_model_runs_or_is_refused_naming_its_module():
    outcomes = {name: _outcome(name) for name in _family_models()}
    assert {name for name, outcome in outcomes.items() if outcome == RAN and not EXACT_VARIANTS.fullmatch(name)} \
        == set()
    assert {name: outcome[:200] for name, outcome in outcomes.items() if outcome != RAN and
            not NAMED.search(outcome)} == {}
