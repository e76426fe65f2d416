"""Small float64 models, one per spatial layer type, plus a ResNet-style stack (shared by MPI tests),
and one per op family of torchvision/timm CNNs (``family_models``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class ResidualBlock(nn.Module):
    """BasicBlock: conv-bn-relu-conv-bn, plus identity or a 1x1 stride-s downsample branch."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                            nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ElementwiseMix(nn.Module):
    """Element-wise ops in a custom forward: products, residual add, sigmoid gate."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.gate = nn.Conv2d(c, c, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.conv(x)) * torch.sigmoid(self.gate(x))
        return x + 0.5 * y - x * y


def resnet_stack(c: int = 3, classes: int | None = None) -> nn.Module:
    """Stem, then stages at strides 1, 2, 2 with BatchNorm and downsample branches."""
    layers: list[nn.Module] = [nn.Conv2d(c, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                               ResidualBlock(8, 8), ResidualBlock(8, 12, 2),
                               ResidualBlock(12, 12), ResidualBlock(12, 16, 2)]
    if classes is not None:
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, classes)]
    return nn.Sequential(*layers)


def layer_models(c: int = 3) -> dict[str, Callable[[], nn.Module]]:
    """Name -> builder of a model exercising one spatial layer type."""
    return {
        "conv3x3": lambda: nn.Conv2d(c, 4, 3, padding=1),
        "conv_valid": lambda: nn.Conv2d(c, 4, 3),
        "conv1x7_7x1": lambda: nn.Sequential(nn.Conv2d(c, 4, (1, 7), padding=(0, 3)),
                                             nn.Conv2d(4, 4, (7, 1), padding=(3, 0))),
        "conv5x5_s2": lambda: nn.Conv2d(c, 4, 5, stride=2, padding=2),
        "conv3x3_s2": lambda: nn.Conv2d(c, 4, 3, stride=2, padding=1),
        "conv1x1_s2": lambda: nn.Conv2d(c, 4, 1, stride=2),
        "conv_dilated": lambda: nn.Conv2d(c, 4, 3, padding=2, dilation=2),
        "conv_groups": lambda: nn.Sequential(nn.Conv2d(c, 4, 3, padding=1),
                                             nn.Conv2d(4, 6, 3, padding=1, groups=2)),
        "conv_same_even": lambda: nn.Conv2d(c, 4, 4, padding="same", bias=False),
        "conv_s3_k4": lambda: nn.Conv2d(c, 4, 4, stride=3, padding=1),
        "maxpool3_s2_p1": lambda: nn.MaxPool2d(3, 2, 1),
        "maxpool2": lambda: nn.MaxPool2d(2),
        "maxpool3_s1_dil2": lambda: nn.MaxPool2d(3, 1, 1, dilation=2),
        "avgpool3_s2_incl": lambda: nn.AvgPool2d(3, 2, 1, count_include_pad=True),
        "avgpool3_s2_excl": lambda: nn.AvgPool2d(3, 2, 1, count_include_pad=False),
        "avgpool_k3_s1_excl": lambda: nn.AvgPool2d(3, 1, 1, count_include_pad=False),
        "avgpool2": lambda: nn.AvgPool2d(2),
        "avgpool_divisor": lambda: nn.AvgPool2d(3, 2, 1, divisor_override=5),
        "batchnorm": lambda: nn.Sequential(nn.Conv2d(c, 4, 3, padding=1, bias=False),
                                           nn.BatchNorm2d(4)),
        "batchnorm_cumulative": lambda: nn.BatchNorm2d(c, momentum=None),
        "batchnorm_no_affine": lambda: nn.BatchNorm2d(c, affine=False),
        "global_avgpool": lambda: nn.Sequential(nn.Conv2d(c, 4, 3, padding=1),
                                                nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                                nn.Linear(4, 3)),
        "elementwise_residual": lambda: nn.Sequential(nn.Conv2d(c, 4, 3, padding=1),
                                                      ElementwiseMix(4), nn.LeakyReLU(0.1),
                                                      nn.GELU()),
        "resnet_stack": lambda: resnet_stack(c),
        "resnet_classifier": lambda: resnet_stack(c, classes=5),
    }


# --------------------------------------------------------------------------------------------------
# Op families of torchvision and timm CNNs (issue 34): small float64 models, one per handler family.
class Permute(nn.Module):
    """torchvision.ops.misc.Permute's spelling: ``torch.permute(x, dims)``."""

    def __init__(self, dims: list[int]) -> None:
        super().__init__()
        self.dims = dims

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.permute(x, self.dims)


class ConvNeXtBlock(nn.Module):
    """torchvision's CNBlock: depthwise 7x7, then channels-last LayerNorm, Linear, GELU, Linear,
    layer scale, stochastic depth ("row": one draw per sample), residual add."""

    def __init__(self, c: int, drop: float = 0.5) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Conv2d(c, c, 7, padding=3, groups=c), Permute([0, 2, 3, 1]),
                                   nn.LayerNorm(c, eps=1e-6), nn.Linear(c, 2 * c), nn.GELU(),
                                   nn.Linear(2 * c, c), Permute([0, 3, 1, 2]))
        self.layer_scale = nn.Parameter(torch.linspace(0.5, 1.5, c).view(c, 1, 1))
        self.drop = drop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layer_scale * self.block(x)
        if self.training and self.drop:
            keep = torch.empty([x.shape[0], 1, 1, 1], dtype=x.dtype).bernoulli_(1 - self.drop)
            out = out * keep.div_(1 - self.drop)
        out += x
        return out


class LayerNorm2d(nn.LayerNorm):
    """timm's LayerNorm2d: F.layer_norm on the channels-last permutation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class ChannelsLastOps(nn.Module):
    """More per-pixel work on a channels-last tile: transpose/movedim spellings, a channel softmax and
    mean, dropout, a channel slice joined back, flattening the rows and columns and back."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.fc = nn.Linear(c, c)
        self.norm = nn.LayerNorm(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c, h, w = x.shape
        y = x.movedim(1, -1)                                    # (N, H, W, C)
        y = self.norm(y) * torch.softmax(y, dim=-1) + y.mean(-1, keepdim=True)
        y = F.dropout(self.fc(y), 0.25, training=self.training)
        first, rest = y.split([1, c - 1], dim=-1)
        y = torch.cat([first * 2, rest], dim=-1)
        z = x.flatten(2).transpose(1, 2)                        # (N, H*W, C): rows and columns flattened
        z = F.layer_norm(z, (c,)) + F.dropout(z, 0.2, training=self.training)
        back = z.transpose(1, 2).reshape(n, c, h, w)
        return y.transpose(1, 3).transpose(2, 3) + back


class BatchNormAct2d(nn.BatchNorm2d):
    """timm's BatchNormAct2d: a BatchNorm2d subclass calling F.batch_norm, then drop path and activation."""

    def __init__(self, c: int, momentum: float | None = 0.1, drop_path: float = 0.0) -> None:
        super().__init__(c, momentum=momentum)
        self.act = nn.SiLU()
        self.drop_path = drop_path

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        x = F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, self.training,
                         factor, self.eps)
        if self.training and self.drop_path:   # timm's DropPath: one draw per sample
            keep = x.new_empty((x.shape[0], 1, 1, 1)).bernoulli_(1 - self.drop_path)
            x = x * keep / (1 - self.drop_path)
        return self.act(x)


class InceptionPools(nn.Module):
    """torchvision's Inception blocks: functional pools inside the forward, branches concatenated."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.branch = nn.Conv2d(c, c, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = self.branch(F.avg_pool2d(x, kernel_size=3, stride=1, padding=1))
        x = torch.cat([x, pooled, F.max_pool2d(x, 3, stride=1, padding=1)], dim=1)
        return F.max_pool2d(x, kernel_size=3, stride=2, ceil_mode=True) + F.avg_pool2d(
            x, 3, 2, padding=1, count_include_pad=False)


class PoolFormerBlock(nn.Module):
    """timm's PoolFormer token mixer with its GroupNorm1 (``F.group_norm`` with one group), then a functional
    instance norm with running statistics."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, c))
        self.bias = nn.Parameter(torch.linspace(-0.2, 0.2, c))
        self.pool = nn.AvgPool2d(3, 1, 1, count_include_pad=False)
        self.register_buffer("running_mean", torch.zeros(c))
        self.register_buffer("running_var", torch.ones(c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.group_norm(x, 1, self.weight, self.bias, 1e-5)
        x = x + self.pool(y) - y
        return F.instance_norm(x, self.running_mean, self.running_var, self.weight, None,
                               use_input_stats=True, momentum=0.2)


class GlobalGates(nn.Module):
    """Reductions over the whole image in every spelling, each gating the tile again (SE/ECA/CBAM)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.fc = nn.Conv2d(c, c, 1)
        self.tiles_first = nn.Parameter(torch.linspace(0.5, 1.5, c).view(1, c, 1, 1))
        self.pooled_first = nn.Parameter(torch.linspace(1.5, 0.5, c).view(1, c, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * self.tiles_first                                              # parameters used on tiles
        se = torch.sigmoid(self.fc(x.mean((2, 3), keepdim=True)) * self.tiles_first * self.pooled_first)
        x = x + self.pooled_first                                             # ... and on pooled values
        a = x.sum((-1, -2))[..., None, None] / 100                            # negative dims, no keepdim
        b = torch.amax(x, dim=(3, 2), keepdim=True) - x.amin((2, 3), keepdim=True)
        c = F.adaptive_avg_pool2d(x, 1) + F.adaptive_max_pool2d(x, (1, 1))
        d = x.flatten(2).mean(-1)[..., None, None]                            # flatten, then mean
        e = x.var((2, 3), keepdim=True) + x.std(dim=(2, 3), keepdim=True, correction=0)
        f = x.norm(2, (2, 3), keepdim=True) / 10 + x.max() - x.min() + x.mean()
        g = x.permute(0, 2, 3, 1).mean((1, 2))[..., None, None]               # channels-last mean
        g = g + x.permute(0, 2, 3, 1).reshape(x.shape[0], -1, x.shape[1]).amax(1)[..., None, None]
        steps = x + (torch.round(x * 2) / 2 - x).detach()   # ties across tiles; gradients pass straight
        h = steps.amax((2, 3), keepdim=True) * 3 + F.adaptive_max_pool2d(steps, 1) * 5
        return x * se + x * torch.tanh(a + b + c + d + e + f + g) + x * h


class ChannelShuffle(nn.Module):
    """ShuffleNetV2's unit: chunk along channels, a branch, concatenation, channel shuffle by view/transpose."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.branch = nn.Sequential(nn.Conv2d(c // 2, c // 2, 3, padding=1), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        left, right = x.chunk(2, dim=1)
        a, b = torch.split(right, [1, right.shape[1] - 1], dim=1)
        x = torch.cat([left, self.branch(torch.cat([b, a], 1))], dim=1)
        n, c, h, w = x.size()
        x = x.view(n, 2, c // 2, h, w)
        return torch.transpose(x, 1, 2).contiguous().view(n, -1, h, w)


class DropoutHead(nn.Module):
    """torchvision's FCN/DeepLab heads: conv, BN, ReLU, nn.Dropout on tiles; channel dropout; dropout
    of a pooled (replicated) vector."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.head = nn.Sequential(nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c),
                                  nn.ReLU(), nn.Dropout(0.3), nn.Conv2d(c, c, 1), nn.Dropout2d(0.5))
        self.pool = nn.AdaptiveAvgPool2d(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.head(x)
        gate = F.dropout(self.pool(y), 0.5, training=self.training)
        return F.dropout(y, 0.1, training=self.training, inplace=True) * torch.sigmoid(gate)


class SizedResample(nn.Module):
    """torchvision's LR-ASPP and DeepLabV3 heads: F.interpolate to a size read from another tile, and a
    pooled (replicated) branch resampled to the tile's size, then concatenated."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.low = nn.Conv2d(c, c, 3, padding=1)
        self.high = nn.Sequential(nn.Conv2d(c, c, 3, stride=2, padding=1), nn.ReLU())
        self.pooled = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(c, c, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size = x.shape[-2:]
        low = self.low(x)
        high = F.interpolate(self.high(x), size=low.shape[-2:], mode="bilinear", align_corners=False)
        pooled = F.interpolate(self.pooled(x), size=size, mode="bilinear", align_corners=False)
        return torch.cat([low + high, pooled], dim=1)


def family_models(c: int = 4) -> dict[str, Callable[[], nn.Module]]:
    """Name -> builder of a model exercising one op family of torchvision/timm CNNs on tiles."""
    return {
        "channel LayerNorm (permute + nn.LayerNorm)": lambda: nn.Sequential(
            nn.Conv2d(3, c, 3, padding=1), ConvNeXtBlock(c), ConvNeXtBlock(c, drop=0.0)),
        "channel LayerNorm (LayerNorm2d: F.layer_norm)": lambda: nn.Sequential(
            nn.Conv2d(3, c, 3, stride=2, padding=1), LayerNorm2d(c), nn.Conv2d(c, c, 3, padding=1)),
        "channels-last and flattened ops": lambda: nn.Sequential(
            nn.Conv2d(3, c, 3, padding=1), ChannelsLastOps(c)),
        "BatchNormAct2d (F.batch_norm, drop path)": lambda: nn.Sequential(
            nn.Conv2d(3, c, 3, padding=1, bias=False), BatchNormAct2d(c, drop_path=0.5),
            nn.Conv2d(c, c, 3, stride=2, padding=1), BatchNormAct2d(c, momentum=None)),
        "functional pools (Inception)": lambda: nn.Sequential(
            nn.Conv2d(3, c, 3, padding=1), InceptionPools(c), nn.Conv2d(3 * c, c, 3, padding=1)),
        "functional norms (F.group_norm, F.instance_norm)": lambda: nn.Sequential(
            nn.Conv2d(3, c, 3, padding=1), PoolFormerBlock(c), PoolFormerBlock(c)),
        "global reductions (mean, sum, amax/amin, adaptive pools, var, norm)": lambda: nn.Sequential(
            nn.Conv2d(3, c, 3, padding=1), GlobalGates(c), nn.AdaptiveMaxPool2d(1)),
        "channel shuffle, chunk, split": lambda: nn.Sequential(
            nn.Conv2d(3, c, 3, padding=1), ChannelShuffle(c), ChannelShuffle(c)),
        "dropout on tiles (nn.Dropout, dropout2d, pooled)": lambda: nn.Sequential(
            nn.Conv2d(3, c, 3, padding=1), DropoutHead(c)),
        "interpolate to another tile's size": lambda: nn.Sequential(
            nn.Conv2d(3, c, 3, padding=1), SizedResample(c)),
    }


# --------------------------------------------------------------------------------------------------
# Feature trunks of torchvision and timm CNNs (random init, no downloads; torchvision/timm imported
# only when a builder runs).
class Features(nn.Module):
    """A timm model's ``forward_features``: everything before the global pool and classifier."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.forward_features(x)   # type: ignore[operator]


class SegmentationOut(nn.Module):
    """A torchvision segmentation model's ``out`` map (its forward returns a dict)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)["out"]


def torchvision_trunk(name: str) -> nn.Module:
    """The feature trunk of ``torchvision.models.<name>(weights=None)``: ``features``, or the children
    before the global pool (ResNet family)."""
    import torchvision.models as models

    model = getattr(models, name)(weights=None)
    if hasattr(model, "features"):
        return model.features
    head = {"avgpool", "fc", "classifier", "dropout", "aux1", "aux2", "AuxLogits"}
    return nn.Sequential(*(child for child_name, child in model.named_children() if child_name not in head))


def torchvision_segmentation(name: str, classes: int = 3) -> nn.Module:
    import torchvision.models.segmentation as segmentation

    return SegmentationOut(getattr(segmentation, name)(weights=None, weights_backbone=None,
                                                       num_classes=classes))


def timm_trunk(name: str) -> nn.Module:
    import timm

    return Features(timm.create_model(name, pretrained=False))


# issue 34's acceptance: name -> builder (image 64 x 64: every trunk keeps a 2 x 2 map at stride 32)
TRUNKS: dict[str, Callable[[], nn.Module]] = {
    "torchvision convnext_tiny": lambda: torchvision_trunk("convnext_tiny"),
    "torchvision efficientnet_b0": lambda: torchvision_trunk("efficientnet_b0"),
    "torchvision densenet121": lambda: torchvision_trunk("densenet121"),
    "torchvision resnet50": lambda: torchvision_trunk("resnet50"),
    "timm efficientnet_b0": lambda: timm_trunk("efficientnet_b0"),
    "timm cspresnet50": lambda: timm_trunk("cspresnet50"),
    "timm convnext_atto": lambda: timm_trunk("convnext_atto"),
    "timm seresnext26d_32x4d": lambda: timm_trunk("seresnext26d_32x4d"),
    "timm regnety_002": lambda: timm_trunk("regnety_002"),
    "torchvision deeplabv3_mobilenet_v3_large (whole model)": lambda: torchvision_segmentation(
        "deeplabv3_mobilenet_v3_large"),
}


def initialized(build: Callable[[], nn.Module], seed: int) -> nn.Module:
    """``build()`` made on the meta device (its own initialisation skipped: ConvNeXt-T's takes seconds),
    then given seeded random float64 weights (He-scaled uniform matrices and filters, vectors around 1,
    or 0 for biases; cut from one random pool at random offsets, which is quick) and fresh BatchNorm
    statistics: the same model on every rank."""
    with torch.device("meta"):
        model = build()
    model = model.to_empty(device="cpu").to(torch.float64)
    generator = torch.Generator().manual_seed(seed)
    pool = torch.rand(1 << 20, generator=generator, dtype=torch.float64) * 2 - 1   # uniform in [-1, 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            start = int(torch.randint(0, pool.numel(), (1,), generator=generator))
            values = pool[start:start + p.numel()]
            if values.numel() < p.numel():   # wrap around the pool
                values = torch.cat([values, pool.repeat(p.numel() // pool.numel() + 1)])[:p.numel()]
            if p.numel() == p.shape[0]:   # a vector (also layer scales shaped (C, 1, 1))
                values = values * 0.1 if name.endswith("bias") else 1 + values * 0.5
            else:
                values = values * (6.0 / p[0].numel()) ** 0.5
            p.copy_(values.view(p.shape))
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._NormBase):
            module.reset_running_stats()
        elif any(True for _ in module.buffers(recurse=False)):
            raise ValueError(f"{type(module).__name__} has buffers initialized() does not know how to set")
    return model
