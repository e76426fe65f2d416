"""Every multi-rank exactness family also runs on the torch plane (gloo), the code path NCCL takes.

On this plane every exchange is one ``batch_isend_irecv`` group and messages match by posting
order (tag 0 everywhere, as NCCL ignores tags), so these runs check the ordering rule as well
as exactness. Representative subsets (the full families run on the mpi plane elsewhere):

=====================  =========================================================  ===========
family (tests/mpi/)    cases on gloo                                              where
=====================  =========================================================  ===========
spatial_exactness      2x2: resnet_classifier, avgpool3_s2_excl x 3 sizes        spatial/test_spatial.py
halo_adjoint           3x3: every layer geometry, adjoint, resnet on a group     spatial/test_halo.py
engine_exact           2 ranks gems_pp, pp2_gpipe_m4 (pipeline/test_engine_      here and
                       exact.py); 3 ranks gems3_1f1b_m2 (payloads arrive ahead    pipeline/
                       of their receive), lp3; 5 ranks sp_lp_square, sp_gems_pp  test_engine_
                                                                                 exact.py
models_exact           5 ranks, smallest size of each family: SP+LP, LP+PP+GEMS,  here
                       fused spatial stage
spatial_correctness    2x2: SE ResNet, U-Net+GroupNorm, bilinear up-sampling,     here
                       per-pixel loss, 4 fuzzed CNNs
infer_exact            4 ranks: both checks (command 2x2, infer_slide 1x4)        infer/test_
                                                                                 infer_mpi.py
engine_misc            3 ranks: hook order, manual stepping, kept grads, timeline here
models_regions         5 ranks: region reads equal serial on whole tiles          here
train CLI              3 ranks SP+LP+PP float64: --backend gloo loss == --backend mpi here
=====================  =========================================================  ===========
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.mpi import engine_misc, models_exact, spatial_correctness
from tests.mpi.models_regions import LOSS, READS
from tests.support.battery import shared_job
from tests.support.planes import backend_flag
from tests.support.summary import json_record

GLOO = backend_flag("gloo")
ENGINE_CASES = {3: ["gems3_1f1b_m2", "lp3"], 5: ["sp_lp_square", "sp_gems_pp"]}
ENGINE = {n: shared_job(n, "engine_exact", GLOO, *cases, plane="gloo", timeout=400)
          for n, cases in ENGINE_CASES.items()}
MODELS = shared_job(5, "models_exact", GLOO, "--smallest", plane="gloo", timeout=600)


@pytest.mark.parametrize("nprocs", sorted(ENGINE_CASES))
def test_engine_exact_on_the_torch_plane(shared_launch, nprocs):
    shared_launch(ENGINE[nprocs]).require_clean(ENGINE_CASES[nprocs])


def test_models_exact_on_the_torch_plane(shared_launch):
    names = models_exact.check_names(smallest=True)
    assert len(names) == 3 + 3 + 3
    shared_launch(MODELS).require_clean(names)


CORRECTNESS_MODELS = ["se_resnet", "unet_groupnorm", "upsample_bilinear"]
CORRECTNESS_FUZZ = 4
CORRECTNESS = shared_job(4, "spatial_correctness", 2, 2, f"--fuzz={CORRECTNESS_FUZZ}", GLOO,
                         "--only=" + ",".join([*CORRECTNESS_MODELS, "loss"]), plane="gloo", timeout=400)
MISC = shared_job(3, "engine_misc", GLOO, plane="gloo", timeout=300)
REGIONS = shared_job(5, "models_regions", GLOO, plane="gloo")


def test_spatial_correctness_on_the_torch_plane(shared_launch):
    names = [spatial_correctness.exact_name(model, size) for size in spatial_correctness.sizes(2, 2)
             for model in CORRECTNESS_MODELS]
    names += [spatial_correctness.LOSS, *spatial_correctness.fuzz_case_names(2, 2, CORRECTNESS_FUZZ, None)]
    shared_launch(CORRECTNESS).require_clean(names)


def test_engine_misc_on_the_torch_plane(shared_launch):
    shared_launch(MISC).require_clean(engine_misc.CHECKS)


def test_region_reads_on_the_torch_plane(shared_launch):
    pytest.importorskip("tifffile")
    shared_launch(REGIONS).require_clean([READS, LOSS])


TRAIN = ["train", "--model", "resnet", "--resnet-version", "1", "--num-layers", "8",
         "--num-filters", "4", "--image-size", "32", "--batch-size", "4", "--num-samples", "8",
         "--split-size", "2", "--spatial-size", "1", "--num-spatial-parts", "2", "--slice-method", "vertical",
         "--parts", "2",
         "--steps", "2", "--dtype", "float64", "--no-progress"]


def test_train_cli_gloo_gives_the_mpi_loss(mpirun):
    """--backend gloo and --backend mpi train the same float64 model to the same losses."""
    records = {backend: json_record(mpirun(3, "mpi4dl_nb", *TRAIN, "--backend", backend,
                                           module=True, timeout=300).stdout)
               for backend in ("mpi", "gloo")}
    mpi, gloo = records["mpi"]["losses"], records["gloo"]["losses"]
    assert len(mpi) == 2 and all(np.isfinite(mpi))
    assert max(abs(a - b) / abs(b) for a, b in zip(gloo, mpi)) <= 1e-12, (gloo, mpi)
