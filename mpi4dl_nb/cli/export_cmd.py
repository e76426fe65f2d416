"""``python -m mpi4dl_nb export``: a checkpoint's trained model written as a plain state dict under the model's own
keys (timm's, torchvision's, your module's; a layer-list model's are those of ``nn.Sequential(*layers)``), as
``.safetensors`` or ``.pt``, and for a named model the input it expects beside it (``FILE.config.json``: timm's
``pretrained_cfg`` fields mean, std, input_size, crop_pct); one JSON line last on stdout."""
from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING

from ..checkpoint.files import CheckpointChoice
from ..console import to_stderr
from ..errors import ConfigError
from ..models.model_args import MLP_LAYERS, ModelArgs
from ..schema import build_job, flag, world_rank_from_env
from .job_flags import job_parser, keyword_values
from .parser import CommandParser

if TYPE_CHECKING:
    import torch

    from ..checkpoint.record import RunRecord

PROG = "python -m mpi4dl_nb export"
EXIT_REFUSED = 2
GROUP = "export"
OUTPUT_OPTION = "--output-file"
CONFIG_SUFFIX = ".config.json"   # beside FILE.safetensors: FILE.config.json, the preprocessing the weights expect
DESCRIPTION = ("Write the model of a checkpoint of 'train' as a state dict under the model's own keys: "
               "timm.create_model(NAME, num_classes=K).load_state_dict(...) (or torchvision's, or your module's) "
               "loads it strictly. The package's own layer-list models (resnet, amoebanet, unet, ...) have no other "
               "keys: theirs are those of nn.Sequential(*layers). A named model's preprocessing (mean, std, input "
               "size: timm's pretrained_cfg fields) is written beside it, FILE.config.json. One process; prints one "
               "JSON line last.")


class ExportFormat(Enum):
    """The file formats ``export`` writes, by the output's suffix."""

    SAFETENSORS = ".safetensors"
    TORCH = ".pt"

    @classmethod
    def of(cls, path: Path) -> ExportFormat:
        """The format of ``path``'s suffix; ConfigError naming the two suffixes for any other."""
        for member in cls:
            if path.suffix == member.value:
                return member
        raise ConfigError(OUTPUT_OPTION, f"{path}: write FILE.safetensors or FILE.pt (the suffix chooses the format)")


@dataclass(frozen=True)
class ExportJob:
    """What ``export`` is asked: the checkpoint, the file to write, and whether it may replace one."""

    source: CheckpointChoice
    output_file: str = flag(OUTPUT_OPTION, "the file to write: FILE.safetensors (safetensors.torch.load_file reads "
                                           "it) or FILE.pt (torch.load)", metavar="FILE", group=GROUP)
    force: bool = flag("--force", "replace the output file if it exists", False, switch=True, group=GROUP)
    merge_lora: bool = flag("--merge-lora", "fold a LoRA run's adapters into the weights (W + alpha/rank B A): the "
                                            "plain model's keys, which the original model loads strictly (without "
                                            "it the adapters' lora_a, lora_b keys are written beside the frozen "
                                            "weights)", False, switch=True, group=GROUP)

    def check(self) -> CheckedExport:
        """The checkpoint file found and the output checked before anything is read or written (ConfigError naming
        the flag and the way out)."""
        output = Path(self.output_file).expanduser()
        kind = ExportFormat.of(output)
        if kind is ExportFormat.SAFETENSORS and find_spec("safetensors") is None:
            raise ConfigError(OUTPUT_OPTION, f"{output}: .safetensors needs the package safetensors (pip install "
                                             f"safetensors; timm brings it), or write FILE.pt")
        if output.is_dir():
            raise ConfigError(OUTPUT_OPTION, f"{output} is a directory; name a file in it")
        for existing in (output, config_path(output)):
            if existing.exists() and not self.force:
                raise ConfigError(OUTPUT_OPTION, f"{existing} exists; pass --force to replace it, or name another "
                                                 f"file")
        if not output.parent.is_dir():
            raise ConfigError(OUTPUT_OPTION, f"{output.parent} does not exist; create it first")
        return CheckedExport(self.source.path(), output, kind, self.merge_lora)


@dataclass(frozen=True)
class CheckedExport:
    """A checked export: the checkpoint file, the output and its format."""

    checkpoint: Path
    output: Path
    kind: ExportFormat
    merge_lora: bool = False


@dataclass(frozen=True)
class Exported:
    """What ``export`` wrote: the model, how many tensors, whether the keys are the model's own, the file."""

    model: str
    keys: int
    own_keys: bool
    bytes: int
    output: Path
    checkpoint: Path
    preprocessing: Path | None = None     # FILE.config.json: the input the weights expect (None: a layer list's)

    def as_dict(self) -> dict[str, object]:
        written = {} if self.preprocessing is None else {"preprocessing": str(self.preprocessing)}
        return {"model": self.model, "keys": self.keys, "own_keys": self.own_keys, "bytes": self.bytes,
                "output": str(self.output), "checkpoint": str(self.checkpoint), **written}


def config_path(output: Path) -> Path:
    """Where the preprocessing goes beside ``output``: ``model.safetensors`` -> ``model.config.json``."""
    return output.with_name(output.stem + CONFIG_SUFFIX)


def model_config(record: RunRecord) -> dict[str, object] | None:
    """What a timm user needs to feed the exported weights: the architecture, classes and timm's ``pretrained_cfg``
    fields (``mean``, ``std``, ``input_size`` (C, H, W), ``crop_pct``: 1, the run fed whole tiles), and the card
    it came from; None for a layer-list model (pixels in [0, 1], no keys of its own). A model without normalisation
    takes pixels in [0, 1]: mean 0, std 1. Pass ``pretrained_cfg`` to ``timm.create_model(...,
    pretrained_cfg_overlay=...)``, then ``timm.data.resolve_data_config(model=model)`` reads it."""
    spec = record.model
    if not spec.family.named:
        return None
    channels, card, normal = spec.in_channels, spec.preprocessing, spec.normalize
    side = spec.image_size or (card.input_size if card is not None else record.data.image_size)
    mean = list(normal.mean) if normal is not None else [0.0] * channels
    std = list(normal.std) if normal is not None else [1.0] * channels
    return {"model": spec.label, "architecture": spec.source, "num_classes": spec.num_classes,
            "model_args": timm_model_args(spec.model_args),
            "pretrained_cfg": {"mean": mean, "std": std, "input_size": [channels, side, side], "crop_pct": 1.0},
            "card": None if card is None else card.to_dict()}


def timm_model_args(args: ModelArgs) -> dict[str, object]:
    """The constructor's keywords as a JSON object for timm's ``create_model(..., **model_args)``: ``act_layer`` and
    ``norm_layer`` by the names timm resolves, ``mlp_layer`` by its class's name in ``timm.layers`` (timm's ViT takes
    only the class: the documented reload turns the name into it)."""
    return {k: MLP_LAYERS.get(str(v).lower(), v) if k == "mlp_layer" else v for k, v in args.to_dict().items()}


def write_config(config: dict[str, object], path: Path) -> Path:
    """``config`` as JSON at ``path``, through a temporary file beside it."""
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        partial.write_text(json.dumps(config, indent=2) + "\n")
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def export_parser() -> CommandParser:
    """The ``export`` parser: a flag for every field of ExportJob."""
    return job_parser(PROG, DESCRIPTION, ExportJob)


def separate(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor its own contiguous copy (no storage shared, none memory-mapped from the checkpoint)."""
    return {key: value.detach().contiguous().clone() for key, value in state.items()}


def write_state(state: Mapping[str, torch.Tensor], checked: CheckedExport, model: str) -> None:
    """``state`` into the output, through a temporary file beside it (a failed write leaves no partial file)."""
    import torch

    partial = checked.output.with_name(f".{checked.output.name}.partial-{os.getpid()}")
    try:
        if checked.kind is ExportFormat.SAFETENSORS:
            from safetensors.torch import save_file

            save_file(dict(state), str(partial), metadata={"format": "pt", "model": model})
        else:
            torch.save(dict(state), partial)
        os.replace(partial, checked.output)
    finally:
        partial.unlink(missing_ok=True)


def export(checked: CheckedExport) -> Exported:
    """The checkpoint's model rebuilt from its record, its weights under the model's own keys, written."""
    from ..checkpoint.record import read_checkpoint
    from ..infer.model import rebuilt
    from ..models.pieces import is_cut, original_state_dict

    try:
        checkpoint = read_checkpoint(checked.checkpoint, lazy=True)
    except ValueError as err:
        raise ConfigError("--checkpoint", str(err)) from None
    spec = checkpoint.record.model
    try:
        layers = rebuilt(spec)
    except ConfigError:
        raise ConfigError("--checkpoint", f"{checked.checkpoint} holds {spec.describe()}, a model built in Python: "
                                          f"export it from Python, dl.model_state_dict(path, model=<the model>)") \
            from None
    state = checkpoint.model_state
    if checked.merge_lora:
        if spec.lora is None:
            raise ConfigError("--merge-lora", f"{checked.checkpoint} holds {spec.describe()}, without LoRA adapters: "
                                              f"drop --merge-lora")
        from ..models.lora import merged_state

        state = merged_state(state, spec.lora)
    elif spec.lora is not None:
        to_stderr(f"mpi4dl_nb export: {spec.label} was trained with LoRA adapters: their lora_a, lora_b keys are "
                  f"written beside the frozen weights, which timm's own model does not load (strict); pass "
                  f"--merge-lora to fold them into the weights")
    state = separate(original_state_dict(layers, state))
    write_state(state, checked, spec.label)
    config = model_config(checkpoint.record)
    written = None if config is None else write_config(config, config_path(checked.output))
    return Exported(spec.label, len(state), is_cut(layers), checked.output.stat().st_size, checked.output,
                    checked.checkpoint, written)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m mpi4dl_nb export``: a refused job exits 2 with one line before anything is read;
    under a launcher only rank 0 writes."""
    args = export_parser().parse_args(argv)
    speaks = world_rank_from_env() in (None, 0)
    try:
        checked = build_job(ExportJob, keyword_values(args, ExportJob), "export").check()
        if not speaks:
            return 0
        done = export(checked)
    except ConfigError as err:
        if speaks:
            to_stderr(f"mpi4dl_nb export: error: {err}")
        return EXIT_REFUSED
    if not done.own_keys:
        to_stderr(f"mpi4dl_nb export: {done.model} is a layer list of this package with no keys of its own: the "
                  f"keys are those of nn.Sequential(*layers) (models.build_model builds it)")
    print(json.dumps(done.as_dict()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
