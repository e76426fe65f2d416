"""LoRA (--lora-rank): low-rank adapters on the linear layers of a cut ViT's blocks, the rest frozen; merged on request.

Each adapted ``nn.Linear`` becomes a ``LoraLinear`` (a subclass, same module path): its frozen ``weight`` and
``bias`` keep their keys, ``lora_a`` (rank x in, drawn as ``nn.Linear`` draws a weight: Kaiming-uniform) and
``lora_b`` (out x rank, zeros) are new, so the adapted network starts equal to the plain one. Its forward is
``x W^T + b + (alpha / rank) (x A^T) B^T`` (the full-size weight never formed), and reading ``.weight`` gives the
adapted ``W + (alpha / rank) B A`` (timm's Eva attention reads ``qkv.weight`` itself), so every caller sees the same
network; ``state_dict`` and ``named_parameters`` hold the frozen base weight under ``weight``. Only the adapters and
the head piece (final norm, pool, classifier) train. ``merged`` folds the adapters into plain ``nn.Linear`` layers
(``export --merge-lora``): the keys are then the model's own.

Why not peft: peft wraps each layer (keys under ``base_layer``, ``lora_A.default``) and adapts the forward only, so
code reading ``.weight`` (Eva, the token tiles' guard) would see the unadapted weight.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from .pieces import Piece
from .vit import blocks_of, is_cut_vit

DEFAULT_ALPHA = 8.0          # peft's LoraConfig default (lora_alpha=8), whatever the rank
TARGETS = {"qkv": "attn.qkv", "proj": "attn.proj", "fc1": "mlp.fc1", "fc2": "mlp.fc2"}   # timm's names in a block
DEFAULT_TARGETS = tuple(TARGETS)
ADAPTER_KEYS = ("lora_a", "lora_b")


def parse_targets(text: str) -> tuple[str, ...]:
    """``--lora-targets``: ``qkv,proj,fc1,fc2`` (any of them) or paths inside each block (``mlp.fc1_g``); ValueError
    naming the names."""
    names = tuple(part.strip() for part in str(text).split(",") if part.strip())
    if not names:
        raise ValueError(f"name linear layers of the blocks: {', '.join(TARGETS)} (or a path inside each block, "
                         f"such as mlp.fc1_g)")
    for name in names:
        if name not in TARGETS and ("." not in name or not all(p.isidentifier() or p.isdigit()
                                                                for p in name.split("."))):
            raise ValueError(f"{name!r} is not one of {', '.join(TARGETS)} nor a path inside a block (attn.qkv)")
    if len(set(names)) != len(names):
        raise ValueError("a layer is named twice")
    return names


@dataclass(frozen=True)
class LoraSpec:
    """Low-rank adapters of ``rank`` on the ``targets`` of every block, scaled by ``alpha / rank``."""

    rank: int
    alpha: float = DEFAULT_ALPHA
    targets: tuple[str, ...] = DEFAULT_TARGETS

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ConfigError("--lora-rank", f"must be a whole number >= 1, got {self.rank!r}")
        if not math.isfinite(self.alpha) or self.alpha <= 0:
            raise ConfigError("--lora-alpha", f"must be a number > 0, got {self.alpha:g}")
        object.__setattr__(self, "targets", tuple(self.targets))
        if not self.targets:
            raise ConfigError("--lora-targets", f"name at least one of {', '.join(TARGETS)}")

    @property
    def scale(self) -> float:
        """The adapters' factor, ``alpha / rank`` (peft's, without rsLoRA)."""
        return self.alpha / self.rank

    @property
    def paths(self) -> tuple[str, ...]:
        """The targets as paths inside a block (``qkv`` -> ``attn.qkv``)."""
        return tuple(TARGETS.get(name, name) for name in self.targets)

    def describe(self) -> str:
        """``LoRA rank 4, alpha 8 on qkv,proj,fc1,fc2``."""
        return f"LoRA rank {self.rank}, alpha {self.alpha:g} on {','.join(self.targets)}"

    def to_dict(self) -> dict[str, object]:
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets)}

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> LoraSpec:
        """The spec ``to_dict`` wrote; ValueError naming a bad field."""
        rank, alpha, targets = data.get("rank"), data.get("alpha", DEFAULT_ALPHA), data.get("targets",
                                                                                          list(DEFAULT_TARGETS))
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise ValueError(f"lora field 'rank': expected an integer, got {rank!r}")
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
            raise ValueError(f"lora field 'alpha': expected a number, got {alpha!r}")
        if not isinstance(targets, (list, tuple)) or not all(isinstance(t, str) for t in targets):
            raise ValueError(f"lora field 'targets': expected a list of names, got {targets!r}")
        return cls(rank, float(alpha), tuple(targets))


class LoraLinear(nn.Linear):
    """An ``nn.Linear`` with a low-rank adapter: ``weight`` (frozen) and ``bias`` as they were, ``lora_a``,
    ``lora_b``; ``.weight`` reads the adapted weight (module docstring)."""

    scale: float

    @classmethod
    def adapting(cls, linear: nn.Linear, rank: int, scale: float) -> LoraLinear:
        """``linear`` adapted (its parameters kept, frozen; the adapter drawn from torch's current seed)."""
        adapted = cls.__new__(cls)
        adapted.__dict__.update({k: (type(v)(v) if isinstance(v, dict) else v) for k, v in linear.__dict__.items()})
        base = adapted._parameters["weight"]
        assert base is not None
        a = torch.empty(rank, linear.in_features, device=base.device, dtype=base.dtype)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5))       # as nn.Linear draws its weight (peft's default)
        adapted.register_parameter("lora_a", nn.Parameter(a))
        b = torch.zeros(linear.out_features, rank, device=base.device, dtype=base.dtype)
        adapted.register_parameter("lora_b", nn.Parameter(b))
        adapted.scale = scale
        for name, p in adapted._parameters.items():
            if p is not None and name not in ADAPTER_KEYS:
                p.requires_grad_(False)
        return adapted

    @property       # the adapted weight, read; the base weight stays the parameter 'weight' (its key)
    def weight(self) -> torch.Tensor:  # type: ignore[override]
        """The adapted weight ``W + scale B A`` (for code that reads the weight rather than calling the layer)."""
        base, a, b = self._parameters["weight"], self._parameters["lora_a"], self._parameters["lora_b"]
        assert base is not None and a is not None and b is not None
        return base + self.scale * (b @ a)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base, a, b = self._parameters["weight"], self._parameters["lora_a"], self._parameters["lora_b"]
        assert base is not None and a is not None and b is not None
        return F.linear(x, base, self.bias) + F.linear(F.linear(x, a), b) * self.scale

    def merged(self) -> nn.Linear:
        """A plain ``nn.Linear`` holding the adapted weight."""
        base = self._parameters["weight"]
        assert base is not None
        plain = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        with torch.no_grad():
            plain.weight = nn.Parameter(self.weight.detach().clone())
            if self.bias is not None:
                plain.bias = nn.Parameter(self.bias.detach().clone())
        return plain

    def extra_repr(self) -> str:
        a = self._parameters["lora_a"]
        return f"{super().extra_repr()}, lora rank={0 if a is None else a.shape[0]}, scale={self.scale:g}"


def _refuse_unless_vit(layers: Sequence[nn.Module], label: str) -> list[int]:
    blocks = blocks_of(layers)
    if not is_cut_vit(layers) or not blocks:
        raise ConfigError("--lora-rank", f"puts adapters on a vision transformer's blocks; {label} has none (a timm "
                                         f"ViT: --model timm:vit_small_patch16_224): drop --lora-rank, or choose a "
                                         f"ViT")
    return blocks


def add_adapters(layers: Sequence[nn.Module], spec: LoraSpec, label: str) -> str:
    """Adapters on ``spec``'s targets of every block of a cut ViT, every other parameter frozen but the head
    piece's; the line saying what trains. ConfigError naming the fix for a model without blocks or a target that is
    not a linear layer of each block."""
    blocks = _refuse_unless_vit(layers, label)
    for layer in layers[:-1]:
        for p in layer.parameters():
            p.requires_grad_(False)
    for index in blocks:
        piece = layers[index]
        for path in spec.paths:
            parent_path, _, name = path.rpartition(".")
            block_path = piece.paths[0] if isinstance(piece, Piece) else ""     # a block piece: one path
            owner = piece.get_submodule(f"{block_path}.{parent_path}" if parent_path else block_path)
            found = getattr(owner, name, None)
            if type(found) is not nn.Linear:
                linears = sorted(n for n, m in piece.get_submodule(block_path).named_modules()
                                 if type(m) is nn.Linear)
                raise ConfigError("--lora-targets", f"{path}: {block_path} of {label} has no linear layer there "
                                                    f"({type(found).__name__ if found is not None else 'nothing'}); "
                                                    f"its linear layers: {', '.join(linears) or 'none'}")
            setattr(owner, name, LoraLinear.adapting(found, spec.rank, spec.scale))
    trained = sum(p.numel() for layer in layers for p in layer.parameters() if p.requires_grad)
    frozen = sum(p.numel() for layer in layers for p in layer.parameters() if not p.requires_grad)
    return (f"--lora-rank {spec.rank}: {spec.describe()} in the {len(blocks)} blocks of {label}; training the "
            f"adapters and the head (final norm, classifier): {trained:,} parameters, {frozen:,} frozen")


def merge_adapters(layers: Sequence[nn.Module]) -> int:
    """Every ``LoraLinear`` of ``layers`` replaced by the plain ``nn.Linear`` of its adapted weight, in place; how
    many (the state dict's keys are then the model's own)."""
    count = 0
    for layer in layers:
        for name, module in list(layer.named_modules()):
            if isinstance(module, LoraLinear):
                parent, _, child = name.rpartition(".")
                setattr(layer.get_submodule(parent) if parent else layer, child, module.merged())
                count += 1
    return count


def merged_state(state: Mapping[str, torch.Tensor], spec: LoraSpec) -> dict[str, torch.Tensor]:
    """A state dict with adapters (``<layer>.lora_a``, ``<layer>.lora_b`` beside ``<layer>.weight``) folded into the
    weights, ``W + (alpha / rank) B A``, the adapters' keys gone: the plain model's state dict."""
    merged = {key: value for key, value in state.items() if not key.endswith(tuple(f".{k}" for k in ADAPTER_KEYS))}
    for key, a in state.items():
        if key.endswith(".lora_a"):
            prefix = key.removesuffix(".lora_a")
            base, b = state[f"{prefix}.weight"], state[f"{prefix}.lora_b"]
            merged[f"{prefix}.weight"] = base + spec.scale * (b.to(base.dtype) @ a.to(base.dtype))
    return merged
