"""The held-out data flags: HeldOutSpec (``--val-fraction``, ``--val-datapath``, ``--group-by``, ``--folds``,
``--fold``: which images are held out; train and evaluate) and ValidationSpec (train's: when to evaluate them and
where to log), each checked on construction."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ..schema import Bounds, check_bounds, flag, number, whole_number
from .flag_groups import EVALUATION as GROUP


@dataclass(frozen=True)
class HeldOutSpec:
    """The held-out images: a seeded share of the data's groups, another folder, or one fold of K."""

    val_fraction: float | None = flag("--val-fraction", "hold out this share of the patients (slides, tiles) of each "
                                                        "class for validation: whole groups on one side, seeded by "
                                                        "--seed, stratified by label", None, parse=number,
                                      metavar="F", group=GROUP)
    val_datapath: str | None = flag("--val-datapath", "validation images from another folder/slide(s) (same layout "
                                                      "as --datapath)", None, metavar="DIR", group=GROUP)
    group_by: str | None = flag("--group-by", "tile folders: the slide of each tile file, the first group of REGEX on "
                                              "its name (default: TCGA slide ids, grouped by patient, and "
                                              "<slide>_<x>_<y> names); a slide's tiles stay on one side; 'slide': "
                                              "TCGA slides each on its own, not by patient", None, metavar="REGEX",
                                group=GROUP)
    folds: int | None = flag("--folds", "K-fold cross-validation by patient (slide, image), stratified by label, "
                                        "seeded; a cohort's fold column when it has one", None, parse=whole_number,
                             metavar="K", group=GROUP)
    fold: int | None = flag("--fold", "the fold held out (0..K-1); train without it runs every fold in turn, each in "
                                      "<checkpoint-dir>/fold-I", None, parse=whole_number, metavar="I", group=GROUP)

    def __post_init__(self) -> None:
        fraction = self.val_fraction
        if fraction is not None and not (0.0 < fraction < 1.0):
            raise ConfigError("--val-fraction", f"must lie strictly between 0 and 1, got {fraction:g}")
        self._check_folds()
        if fraction is not None and self.val_datapath is not None:
            raise ConfigError("--val-fraction", "give --val-fraction (held out of --datapath) or --val-datapath "
                                                "(another folder), not both")

    def _check_folds(self) -> None:
        """``--folds K`` (>= 2, instead of --val-fraction/--val-datapath) and ``--fold I`` (0..K-1, with --folds)."""
        folds, fold = self.folds, self.fold
        if fold is not None and folds is None:
            raise ConfigError("--fold", "picks one of --folds K; add --folds")
        if folds is None:
            return
        if folds < 2:
            raise ConfigError("--folds", f"must be >= 2, got {folds}")
        if fold is not None and not 0 <= fold < folds:
            raise ConfigError("--fold", f"must be one of 0..{folds - 1} for --folds {folds}, got {fold}")
        if self.val_fraction is not None or self.val_datapath is not None:
            raise ConfigError("--folds", "holds out each fold in turn; drop --val-fraction/--val-datapath")

    @property
    def given(self) -> bool:
        return self.val_fraction is not None or self.val_datapath is not None or self.folds is not None

    @property
    def every_fold(self) -> bool:
        """``--folds K`` without ``--fold``: K runs, fold by fold."""
        return self.folds is not None and self.fold is None


@dataclass(frozen=True)
class ValidationSpec(HeldOutSpec):
    """``train``'s held-out images, when to evaluate them, and where to log the metrics."""

    eval_every: int = flag("--eval-every", "evaluate every N steps (always at each epoch end and at the end of the "
                                           "run)", 0, parse=whole_number, metavar="N", bounds=Bounds(0), group=GROUP)
    log_dir: str | None = flag("--log-dir", "write metrics.jsonl (one line per step and per evaluation) and, with "
                                            "tensorboard installed, TensorBoard events here", None, metavar="DIR",
                               group=GROUP)

    def __post_init__(self) -> None:
        check_bounds(self)
        super().__post_init__()
        if self.eval_every and not self.given:
            raise ConfigError("--eval-every", "needs validation data: add --val-fraction F or --val-datapath DIR")
