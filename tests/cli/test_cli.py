"""CLI: every MPI4DL flag (and ours) reaches the engine/trainer; wrong input gets a clear error; runs under mpiexec."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import mpi4dl_nb.cli.layout_cmd as cli_layout
import mpi4dl_nb.comm.context as comm_context
import mpi4dl_nb.pipeline.engine as engine_module
import mpi4dl_nb.run.monitor as monitor_module
import mpi4dl_nb.run.trainer as train_module
from mpi4dl_nb.cli import train_cmd as cli
from mpi4dl_nb.cli.args import PARALLEL_FLAGS, config_from_args
from mpi4dl_nb.comm.handles import Group
from mpi4dl_nb.config import parse_balance
from mpi4dl_nb.data import Cifar10Dataset, IHCSampleDataset, SyntheticDataset, TileFolderDataset
from mpi4dl_nb.models.amoebanet import AmoebaCell

SMALL = ["--model", "resnet", "--resnet-version", "1", "--num-layers", "8", "--num-filters", "4",
         "--image-size", "32", "--batch-size", "2", "--num-samples", "8"]


class Captured(SystemExit):
    """Stops the CLI once the trainer is built, carrying what reached it."""


class FakeContext:
    def __init__(self, world_size: int) -> None:
        self.rank = 0
        self.world_size = world_size
        self.device = torch.device("cpu")

    def all_gather_object(self, obj):
        return [obj] * self.world_size

    def bcast_object(self, obj, root=0):
        return obj

    def new_group(self, ranks):
        """A group without communicators: the engine only keeps it until a step runs."""
        return Group(tuple(ranks))

    def abort(self, code):
        self.aborted = code


class RecordingEngine:
    def __init__(self, layers, cfg, ctx, *, loss_fn, optimizer, **options):
        self.layers, self.cfg, self.ctx = layers, cfg, ctx
        self.loss_fn, self.optimizer_factory = loss_fn, optimizer


@pytest.fixture
def launch(monkeypatch):
    """Run ``cli.main(argv)`` in-process as rank 0 of a job of the configuration's size."""
    def run(argv: list[str]) -> dict:
        seen: dict = {}
        parsed_cfg = config_from_args(cli.train_parser().parse_args(argv))
        size = parsed_cfg.world_size
        monkeypatch.setattr(cli_layout, "launched_world", lambda: (0, size, True))
        monkeypatch.setattr(comm_context, "init", lambda backend="auto", device="auto": FakeContext(size),
                            raising=False)
        monkeypatch.setattr(engine_module, "HybridEngine", RecordingEngine)
        monkeypatch.setattr(monitor_module.JobMonitor, "start",
                            classmethod(lambda cls, ctx, **options: cls(ctx, [], None)))

        def trainer(engine, batcher, ctx, settings, info, **state):
            seen.update(engine=engine, batcher=batcher, settings=settings, info=info)
            raise Captured(0)
        monkeypatch.setattr(train_module, "Trainer", trainer)
        with pytest.raises(Captured):
            cli.main(argv)
        return seen
    return run


# flag(s) -> ParallelConfig field and the value it must carry (defaults differ from these)
PARALLEL_CASES = [
    (["--split-size", "3"], "split_size", 3),
    (["--spatial-size", "0"], "spatial_size", 0),
    (["--num-spatial-parts", "2", "--slice-method", "vertical"], "num_spatial_parts", 2),
    (["--slice-method", "horizontal"], "slice_method", "horizontal"),
    (["--slice-method", '"vertical"'], "slice_method", "vertical"),
    (["--parts", "2", "--batch-size", "4"], "parts", 2),
    (["--times", "1", "--batch-size", "4"], "times", 1),
    (["--local-DP", "2", "--batch-size", "4"], "local_dp", 2),
    (["--halo-D2"], "halo_d2", True),
    (["--halo-D2", "--fused-layers", "2"], "fused_layers", 2),
    (["--balance", "2,3"], "balance", (2, 3)),
    (["--balance", "[1, 4]"], "balance", (1, 4)),
    (["--data-parallel", "2", "--batch-size", "4"], "data_parallel", 2),
    (["--schedule", "1f1b", "--parts", "2", "--batch-size", "4"], "schedule", "1f1b"),
    (["--schedule", "interleaved", "--virtual-stages", "2", "--split-size", "4", "--spatial-size", "0",
      "--parts", "2", "--batch-size", "4"], "virtual_stages", 2),
    (["--sync-batchnorm", "--data-parallel", "2", "--batch-size", "4"], "sync_batchnorm", True),
    (["--no-check-ops"], "check_ops", False),
    (["--checkpoint-activations"], "checkpoint_activations", "every"),
    (["--checkpoint-activations", "2"], "checkpoint_activations", 2),
    (["--precision", "bf16"], "precision", "bf16"),
    (["--grad-bucket-mb", "0.5", "--data-parallel", "2", "--batch-size", "4"], "grad_bucket_mb", 0.5),
    (["--grad-bucket-mb", "none", "--data-parallel", "2", "--batch-size", "4"], "grad_bucket_mb", None),
    (["--zero-stage", "2"], "zero_stage", 2),
]


def test_parallel_table_covers_every_flag():
    flags = {arg for argv, _, _ in PARALLEL_CASES for arg in argv if arg.startswith("--")}
    assert set(PARALLEL_FLAGS) <= flags


@pytest.mark.parametrize("argv,field,value", PARALLEL_CASES,
                         ids=[" ".join(c[0]) for c in PARALLEL_CASES])
def test_parallel_flag_reaches_engine(launch, argv, field, value):
    default = getattr(config_from_args(cli.train_parser().parse_args(SMALL)), field)
    assert default != value
    seen = launch(SMALL + argv)
    assert getattr(seen["engine"].cfg, field) == value
    assert seen["engine"].ctx.world_size == seen["engine"].cfg.world_size


def write_cifar(folder) -> None:
    records = np.zeros((4, 3073), np.uint8)
    records[:, 0] = [1, 2, 3, 4]
    (folder / "data_batch_1.bin").write_bytes(records.tobytes())


def test_workload_flags_reach_trainer(launch, tmp_path):
    base = ["--split-size", "1", "--spatial-size", "0"]
    seen = launch(base + ["--model", "resnet", "--resnet-version", "1", "--num-layers", "14",
                          "--num-filters", "8", "--num-classes", "7", "--image-size", "64",
                          "--batch-size", "4", "--num-epochs", "3", "--num-samples", "12",
                          "--app", "3", "-v", "--lr", "0.25", "--momentum", "0.5",
                          "--dtype", "float64", "--checkpoint-dir", str(tmp_path / "ck"),
                          "--checkpoint-every", "2", "--keep-checkpoints", "3", "--no-progress"])
    layers, batcher, settings = seen["engine"].layers, seen["batcher"], seen["settings"]
    assert len(layers) == 2 + 6                           # depth 14 = 6n+2, n=2
    assert layers[0].conv.out_channels == 8 and layers[-1].fc.out_features == 7
    assert all(p.dtype == torch.float64 for item in layers for p in item.parameters())
    assert isinstance(batcher.dataset, SyntheticDataset) and len(batcher.dataset) == 12
    assert batcher.dataset.image_size == 64 and batcher.batch_size == 4
    assert settings.steps == 3 * 3 and settings.verbose and not settings.progress
    assert settings.checkpoint_dir == tmp_path / "ck" and settings.checkpoint_every == 2
    assert settings.keep_checkpoints == 3 and settings.dtype == torch.float64
    opt = seen["engine"].optimizer_factory([torch.nn.Parameter(torch.zeros(1))])
    assert opt.defaults["lr"] == 0.25 and opt.defaults["momentum"] == 0.5
    assert seen["info"].model.num_layers == 14 and seen["info"].data.app == "synthetic"

    assert launch(base + ["--steps", "5"] + SMALL)["settings"].steps == 5
    amoeba = launch(base + ["--model", "amoebanet", "--num-layers", "3", "--num-filters", "8",
                            "--image-size", "32", "--batch-size", "2", "--num-samples", "4"])
    assert sum(isinstance(item, AmoebaCell) for item in amoeba["engine"].layers) == 3 + 4
    medical = launch(base + SMALL + ["--app", "medical", "--num-classes", "2"])
    assert isinstance(medical["batcher"].dataset, IHCSampleDataset)
    write_cifar(tmp_path)
    cifar = launch(base + SMALL + ["--app", "2", "--datapath", str(tmp_path)])
    assert isinstance(cifar["batcher"].dataset, Cifar10Dataset) and len(cifar["batcher"].dataset) == 4
    from PIL import Image

    tiles = tmp_path / "tiles"
    for i in range(2):
        (tiles / f"class{i}").mkdir(parents=True)
        Image.fromarray(np.full((40, 40, 3), 90 * i, np.uint8)).save(tiles / f"class{i}" / f"{i}.png")
    folder = launch(base + SMALL + ["--app", "1", "--datapath", str(tiles)])
    assert isinstance(folder["batcher"].dataset, TileFolderDataset)
    a = launch(base + SMALL + ["--seed", "1"])["engine"].layers[0].conv.weight
    b = launch(base + SMALL + ["--seed", "2"])["engine"].layers[0].conv.weight
    assert not torch.equal(a, b)


def test_balance_and_app_parsing(capsys):
    assert parse_balance("3, 4,5") == (3, 4, 5) and parse_balance("[2,2]") == (2, 2)
    assert parse_balance("None") is None
    parser = cli.train_parser()
    for bad in (["--balance", "a,b"], ["--app", "4"], ["--slice-method", "diagonal"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
    assert "argument --balance: 'a,b' is not a list of layer counts per stage" in capsys.readouterr().err


def test_clear_errors(capsys, monkeypatch, tmp_path):
    # wrong rank count: every rank refuses at once, naming the count needed
    monkeypatch.setattr(cli_layout, "launched_world", lambda: (0, 3, True))
    with pytest.raises(SystemExit) as stop:
        cli.main(SMALL)
    assert stop.value.code == 2
    assert "needs 5 ranks" in capsys.readouterr().err
    # set-up errors (missing path, too small tiles) are agreed on and reported once
    monkeypatch.setattr(cli_layout, "launched_world", lambda: (0, 1, True))
    monkeypatch.setattr(comm_context, "init", lambda backend="auto", device="auto": FakeContext(1), raising=False)
    serial = ["--split-size", "1", "--spatial-size", "0"]
    with pytest.raises(SystemExit):
        cli.main(serial + SMALL + ["--app", "medical", "--datapath", str(tmp_path / "nope")])
    assert "--datapath" in capsys.readouterr().err
    monkeypatch.setattr(cli_layout, "launched_world", lambda: (0, 5, True))
    monkeypatch.setattr(comm_context, "init", lambda backend="auto", device="auto": FakeContext(5), raising=False)
    # no monitor thread (none may outlive the test) and no grace period: the other ranks are not there
    monkeypatch.setattr(monitor_module.JobMonitor, "start", classmethod(lambda cls, ctx, **options: cls(ctx, [], None)))
    monkeypatch.setattr(monitor_module, "FAIL_GRACE_SECONDS", 0.0)
    with pytest.raises(SystemExit):      # a stage cut whose spatial stage runs past where the tiles fit
        cli.main(["--model", "amoebanet", "--num-layers", "3", "--num-filters", "8", "--balance", "8,1",
                  "--image-size", "64", "--slice-method", "vertical", "--batch-size", "2"])
    assert "use fewer spatial parts or a larger --image-size" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(SMALL + ["--image-size", "30"])
    assert "multiple of 4" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(SMALL + ["--batch-size", "3", "--parts", "2"])
    assert "--batch-size 3" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(SMALL + ["--resume", "latest"])
    assert "--checkpoint-dir" in capsys.readouterr().err


def test_main_dispatch_and_help(capsys):
    from mpi4dl_nb.cli.commands import main  # (__main__.main: the same, its end watched: tests/cli/test_entry.py)

    with pytest.raises(SystemExit) as stop:
        main(["train", "--help"])
    assert stop.value.code == 0
    text = capsys.readouterr().out
    for flag in ["--split-size", "--spatial-size", "--num-spatial-parts", "--slice-method",
                 "--parts", "--times", "--local-DP", "--halo-D2", "--fused-layers", "--balance",
                 "--image-size", "--batch-size", "--num-epochs", "--num-layers", "--num-filters",
                 "--num-classes", "--app", "--datapath", "-v", "--checkpoint-dir", "--resume",
                 "--steps", "--model"]:
        assert flag in text, flag
    assert main(["bogus"]) == 2
    assert main([]) == 2


def test_cli_runs_under_mpiexec(mpirun, tmp_path):
    """5 ranks (AmoebaNet SP+LP, the MPI4DL README example, small) on tiles of a whole-slide
    image: progress on rank 0 and one JSON line."""
    from mpi4dl_nb.data import ihc_image
    from tests.support.pyramid import write_pyramid

    image = np.full((512, 512, 3), 255, np.uint8)
    image[:384, :384] = ihc_image()[:384, :384]
    for name in ("a", "b"):                       # two classes (one would be refused)
        (tmp_path / "slides" / name).mkdir(parents=True)
        write_pyramid(tmp_path / "slides" / name / "slide.tif", image)
    result = mpirun(5, "mpi4dl_nb", "train", "--model", "amoebanet", "--num-layers", "3",
                    "--num-filters", "8", "--image-size", "64", "--num-spatial-parts", "4",
                    "--slice-method", "square", "--split-size", "2", "--spatial-size", "1",
                    "--batch-size", "2", "--steps", "3", "--app", "medical", "--datapath",
                    str(tmp_path / "slides"), "--num-classes", "2", module=True, timeout=300)
    from tests.support.summary import json_record

    assert result.stdout.count('{"model"') == 1, result.stdout      # one summary, from rank 0
    rec = json_record(result.stdout)
    assert rec["world_size"] == 5 and rec["steps"] == 3 and rec["images_per_s"] > 0
    assert rec["app"] == "medical" and all(np.isfinite(rec["losses"]))
    assert len(rec["peak_memory_bytes"]) == 5 and min(rec["peak_memory_bytes"]) > 0
    assert len(rec["comm_seconds"]) == 5 and all(c > 0 for c in rec["comm_seconds"])
    assert rec["config"]["num_spatial_parts"] == 4 and rec["config"]["split_size"] == 2
    assert result.stdout.count("step 3/3") == 1     # progress on rank 0 only
