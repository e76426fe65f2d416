"""Issue 91 item 4: a command's refusals name its flags, also those the library's layers raise with their Python
keywords (the square-slicing refusal: ``--num-spatial-parts``/``--slice-method``, not ``num_spatial_parts``); the
Python API's own message keeps the keywords; a message already naming flags is left as it is."""
from __future__ import annotations

import re

import pytest

import mpi4dl_nb as dl
from mpi4dl_nb.cli import layout_cmd, train_cmd
from mpi4dl_nb.cli.flag_names import as_flags, names_as_flags
from tests.support.train_in_process import run_command

PYTHON_NAME = re.compile(r"(?<![\w.-])[a-z]+_[a-z0-9_]+(?![\w])")      # num_spatial_parts, slice_method ...
SQUARE = ["--split-size", "2", "--spatial-size", "1", "--num-spatial-parts", "3", "--slice-method", "square"]


@pytest.mark.parametrize("command", [layout_cmd.main, train_cmd.main])
def test_the_square_slicing_refusal_names_the_flags(command, capsys):
    code, _, err = run_command(command, SQUARE, capsys)
    assert code == 2
    (line,) = err.strip().splitlines()
    assert line == ("mpi4dl_nb: configuration error: --num-spatial-parts: --slice-method square needs a perfect "
                    "square number of parts, got 3; use --num-spatial-parts 4 or --slice-method vertical/horizontal")
    with pytest.raises(dl.ConfigError, match="use num_spatial_parts=4 or slice_method='vertical'"):
        dl.ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=3)


def test_the_wrong_rank_count_and_a_batch_refusal_name_flags(capsys):
    code, _, err = run_command(train_cmd.main, ["--split-size", "2", "--spatial-size", "1"], capsys)
    assert code == 2 and "(--spatial-size 1 x --num-spatial-parts 4 + (--split-size 2 - --spatial-size 1) x " \
                         "--local-DP 1 = 4 + 1) but 1 were launched" in err, err
    code, _, err = run_command(train_cmd.main, ["--split-size", "1", "--spatial-size", "0", "--batch-size", "3",
                                                "--parts", "2"], capsys)
    assert code == 2 and not PYTHON_NAME.findall(err.split("error: ", 1)[1]), err
    assert "--batch-size 3 does not split evenly into --parts 2 = 2 pieces" in err, err


@pytest.mark.parametrize("message, said", [
    ("fused_layers: fused_layers=2 only applies with halo_d2=True; set halo_d2=True or fused_layers=1",
     "--fused-layers: --fused-layers 2 only applies with --halo-D2; set --halo-D2 or --fused-layers 1"),
    ("check_ops: with check_ops=False the guard is off", "--no-check-ops: with --no-check-ops the guard is off"),
    ("times: GEMS (times >= 1) needs split_size >= 2; use times=0", "--times: GEMS (--times >= 1) needs "
                                                                    "--split-size >= 2; use --times 0"),
    ("max_grad_norm: must be > 0", "--clip-grad-norm: must be > 0"),
    ("--resume: image_size 64 -> 32 (--image-size); pass --allow-config-change image_size",     # flags already
     "--resume: image_size 64 -> 32 (--image-size); pass --allow-config-change image_size"),
    ("world_size: needs 5 ranks", "world_size: needs 5 ranks"),                                # no flag: as it is
])
def test_python_names_become_flags_only_in_a_refusal_of_a_python_knob(message, said):
    assert as_flags(message) == said


def test_every_knob_of_the_configuration_has_a_flag_the_translation_knows():
    for name in ("split_size", "spatial_size", "num_spatial_parts", "slice_method", "parts", "times", "local_dp",
                 "halo_d2", "fused_layers", "balance", "data_parallel", "schedule", "precision",
                 "checkpoint_activations", "virtual_stages", "grad_bucket_mb", "sync_batchnorm", "batch_size",
                 "image_size", "zero_stage"):
        assert names_as_flags(f"{name}=2").startswith("--"), name
