"""A whole-slide model on one slide: its canvas placed as training placed it, the network on the canvas's tiles (one per
rank) or whole (one process), the slide's class probabilities and, for attention and max heads, the map of where it
looked, gathered on rank 0; a head with a slide encoder, and a ViT trunk's head, run on the gathered cells (a ViT's: its
patch tokens), as on training's layer rank, and a slide encoder gives the class token's attention over them too."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from ..checkpoint.record import RunRecord
from ..comm.agreement import agreed
from ..config import ConfigError
from ..data.canvas import SlideCanvases
from ..models.canvas import check_canvas
from ..models.head import ClassifierHead
from ..models.named_pool import PooledMap
from ..models.pieces import Piece
from ..models.pools import PoolKind
from ..models.slide_encoder import SlideEncoder
from ..models.token_grid import TokenGridHead
from ..models.vit import TokenEmbedding, is_cut_vit
from ..spatial.geometry import TileGrid
from .attention_map import (
    attention_weights,
    canvas_positions,
    class_attention_cells,
    first_maxima,
    looks,
    max_shares,
    tile_extrema,
)
from .model import ModelDescription, load_trained

if TYPE_CHECKING:
    from ..comm.protocol import Comm


@dataclass(frozen=True)
class WholeSlideModel:
    """A trained whole-slide network (eval mode) and what its record says of its canvases."""

    layers: tuple[nn.Module, ...]
    description: ModelDescription
    record: RunRecord

    @property
    def pool(self) -> PoolKind:
        return self.record.model.pool

    @property
    def classes(self) -> tuple[str, ...]:
        return self.record.class_names

    @property
    def image_size(self) -> int:
        return self.record.data.image_size

    @property
    def pool_module(self) -> nn.Module | None:
        """The module that pools the trunk's cells (see ``slide_pool``)."""
        return slide_pool(self.layers[-1])

    @property
    def encoder(self) -> SlideEncoder | None:
        """The slide encoder before the pool (``--slide-encoder``), None without one."""
        return slide_encoder(self.layers[-1])

    @property
    def head_on_cells(self) -> bool:
        """Whether the head runs on the whole canvas's cells gathered from the tiles rather than on tiles: a slide
        encoder's head, and a ViT's head piece (its token tiles joined as training's hand-off joins them)."""
        return self.encoder is not None or is_cut_vit(self.layers)


def classifier_of(last: nn.Module) -> ClassifierHead | None:
    """The built-in ClassifierHead of a whole-slide network's last layer: the layer itself (after a CNN trunk) or the
    one after a ViT's token grid (``models/token_grid.py``); None: neither."""
    if isinstance(last, TokenGridHead):
        return last.classifier
    return last if isinstance(last, ClassifierHead) else None


def slide_encoder(last: nn.Module) -> SlideEncoder | None:
    """The slide encoder of a whole-slide network's last layer (a built-in ClassifierHead's), None without one."""
    head = classifier_of(last)
    return head.encoder if head is not None else None


def slide_pool(last: nn.Module) -> nn.Module | None:
    """The pooling module in a whole-slide network's last layer: a built-in ClassifierHead's pool, or the pool
    ``--pool`` put in place of a torchvision/timm model's average pool (models/named_pool.py); None: neither."""
    head = classifier_of(last)
    if head is not None:
        return head.pool if isinstance(head.pool, nn.Module) else None
    steps = last.steps() if isinstance(last, Piece) else []
    return steps[0][1].pool if steps and isinstance(steps[0][1], PooledMap) else None


def load_whole_slide(checkpoint: str | Path, dtype: torch.dtype, check: bool = True) -> WholeSlideModel:
    """The checkpoint's whole-slide network in ``dtype``; ConfigError when it is not one."""
    layers, description, record = load_trained(checkpoint, None, dtype, check=check)
    if not record.data.whole_slide:
        raise ConfigError("--checkpoint", f"{description.path} was not trained with --whole-slide: slide-level "
                                          f"inference needs a whole-slide model; run it with --slide/--slides and "
                                          f"{{slide}} outputs (maps of tiles) instead")
    if record.model.pool.multiple_instance and slide_pool(layers[-1]) is None:
        raise ConfigError("--checkpoint", f"{description.path}: its record says --pool {record.model.pool} but its "
                                          f"last layer ({type(layers[-1]).__name__}) holds no such pool")
    if (record.model.slide_encoder is None) != (slide_encoder(layers[-1]) is None):
        raise ConfigError("--checkpoint", f"{description.path}: its record and its last layer disagree on the slide "
                                          f"encoder ({record.model.slide_encoder}); the file is not what train wrote")
    return WholeSlideModel(tuple(layers), description, record)


@dataclass(frozen=True)
class TilePart:
    """One rank's share of the map: its tile's cell count and either its attention logits or its channel maxima."""

    tile: int
    shape: tuple[int, int]
    scores: np.ndarray | None = None                       # (h, w) attention logits
    extrema: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None   # per channel: max, its first position, min


@dataclass(frozen=True)
class SlidePrediction:
    """A slide's class probabilities and (attention/max heads) the map over its canvas's trunk cells."""

    probabilities: np.ndarray        # (classes,) float64
    cells: np.ndarray | None         # (H', W') float64, or None for a head without a map
    class_cells: np.ndarray | None = None   # (H', W') the slide encoder's class-token attention, None without one


class CanvasNetwork:
    """The network on canvases: spatialized over ``grid`` when it has several tiles (one per rank of ``ctx``), with
    hooks on the head that keep what the map needs of this rank's tile. A head with a slide encoder or after a ViT is
    kept whole: it runs on the trunk's cells (tokens) gathered from the tiles, on every rank (training runs it on a
    layer rank)."""

    def __init__(self, model: WholeSlideModel, grid: TileGrid, ctx: Comm, dtype: torch.dtype) -> None:
        from ..spatial.convert import spatialize

        self.model, self.grid, self.ctx, self.dtype = model, grid, ctx, dtype
        if ctx.world_size != grid.num_tiles:
            raise ConfigError("--num-spatial-parts", f"{grid.num_tiles} ranks share each canvas ({grid.rows} x "
                                                     f"{grid.cols}) but {ctx.world_size} were launched; run with "
                                                     f"mpiexec -n {grid.num_tiles}")
        size = model.image_size
        if grid.num_tiles > 1:
            try:
                check_canvas(size, grid, model.record.model.image_multiple)
            except ConfigError as err:
                raise ConfigError("--num-spatial-parts", f"the checkpoint's canvas does not cut into these tiles "
                                                         f"({err.detail}); the canvas size is the checkpoint's, so "
                                                         f"choose a grid that divides it (the one it trained on) "
                                                         f"or run one process") from None
        layers = list(model.layers)
        head = layers.pop() if model.head_on_cells else None
        net: nn.Module = nn.Sequential(*layers)
        if grid.num_tiles > 1:
            net = spatialize(net, grid, ctx, image_size=(size, size))
        self.net = net.to(ctx.device).eval()
        self.head = head.to(ctx.device).eval() if head is not None else None
        self.kept: list[torch.Tensor] = []
        self.class_kept: list[torch.Tensor] = []
        self.encoded_shape: tuple[int, int] = (0, 0)    # the cells (H', W') the slide encoder saw last
        self.keep_maps(self.head if self.head is not None else list(self.net.children())[-1])

    def keep_maps(self, last: nn.Module) -> None:
        """Hooks on the head's pool (attention logits, or the max pool's input) and its slide encoder's class-token
        attention, keeping what the maps need."""
        pool = slide_pool(last)
        if self.model.pool is PoolKind.ATTENTION and pool is not None:
            score = pool.get_submodule("w")        # AttentionMILPool's last 1x1 conv: the logits per cell
            score.register_forward_hook(lambda module, inputs, output: self.kept.append(output.detach()))
        elif self.model.pool is PoolKind.MAX and pool is not None:
            pool.register_forward_pre_hook(lambda module, inputs: self.kept.append(inputs[0].detach()))
        encoder = slide_encoder(last)
        if encoder is not None:
            encoder.register_forward_pre_hook(lambda module, inputs: self.see_cells(inputs[0]))
            encoder.last_class_attention().register_forward_hook(
                lambda module, inputs, output: self.class_kept.append(output.detach()))

    def see_cells(self, cells: torch.Tensor) -> None:
        self.encoded_shape = (int(cells.shape[-2]), int(cells.shape[-1]))

    def box(self) -> tuple[int, int, int, int] | None:
        """This rank's box of the canvas (None: the whole canvas, one process)."""
        size = self.model.image_size
        return self.grid.tile_box(self.ctx.rank, size, size) if self.grid.num_tiles > 1 else None

    def predict(self, canvases: SlideCanvases, index: int) -> SlidePrediction | None:
        """Collective: canvas ``index`` through the network; the prediction on rank 0, None on the other ranks."""
        box = self.box()
        image = agreed(self.ctx, lambda: canvases.read(index, box)).to(self.dtype)   # a failed read stops all
        self.kept.clear()
        self.class_kept.clear()
        with torch.no_grad():
            logits = self.forward(image[None].to(self.ctx.device))
        probabilities = torch.softmax(logits.to(torch.float64), 1)[0].cpu().numpy()
        if self.head is not None:          # the head saw the whole canvas's cells on every rank
            if self.ctx.rank != 0:
                return None
            return SlidePrediction(probabilities, self.assemble([self.part()]), self.class_cells())
        parts = self.ctx.gather_object(self.part(), root=0)
        if parts is None:
            return None
        return SlidePrediction(probabilities, self.assemble(parts))

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        """The logits of ``image`` (this rank's tile, or the whole canvas): a head kept whole (``head_on_cells``) on
        the cells gathered from every tile."""
        out = self.net(image)
        if self.head is None:
            return out
        logits: torch.Tensor = self.head(self.gathered(out) if self.grid.num_tiles > 1 else out)
        return logits

    def gathered(self, out: torch.Tensor) -> torch.Tensor:
        """The whole canvas's trunk output on every rank from this rank's tile of it: a CNN's map of cells, or a
        ViT's tokens (its class/register tokens on tile 0), joined as training's hand-off to a layer rank joins
        them (``TokenEmbedding.token_tiling``)."""
        embedding = self.model.layers[0]
        if isinstance(embedding, TokenEmbedding):
            tiles = self.ctx.all_gather_object(out.cpu())
            return embedding.token_tiling(self.grid).join([tile.to(out.device) for tile in tiles])
        from ..spatial.tiles import gather_tiles

        return gather_tiles(out, self.grid, self.ctx)

    def class_cells(self) -> np.ndarray | None:
        """The slide encoder's class-token attention over the canvas's cells (last block, mean over heads)."""
        if not self.class_kept:
            return None
        return class_attention_cells(self.class_kept[-1][0].cpu(), self.encoded_shape)

    def part(self) -> TilePart | None:
        """What this rank's tile gives the map (None: the head has no map)."""
        if not looks(self.model.pool):
            return None
        found = self.kept[-1][0].cpu()
        shape = (int(found.shape[-2]), int(found.shape[-1]))
        if self.model.pool is PoolKind.ATTENTION:
            return TilePart(self.ctx.rank, shape, scores=found[0].to(torch.float64).numpy())
        return TilePart(self.ctx.rank, shape, extrema=tile_extrema(found))

    def assemble(self, parts: list[TilePart | None]) -> np.ndarray | None:
        """Rank 0: the map over the whole canvas from every tile's part."""
        tiles = [p for p in parts if p is not None]
        if not tiles:
            return None
        tiles.sort(key=lambda p: p.tile)
        height, width = self.grid.full_size([p.shape for p in tiles]) if len(tiles) > 1 else tiles[0].shape
        boxes = [self.grid.tile_box(p.tile, height, width) if len(tiles) > 1 else (0, height, 0, width)
                 for p in tiles]
        if self.model.pool is PoolKind.ATTENTION:
            scores = np.empty((height, width))
            for (r0, r1, c0, c1), p in zip(boxes, tiles):
                assert p.scores is not None
                scores[r0:r1, c0:c1] = p.scores
            return attention_weights(torch.from_numpy(scores))
        extrema = [(box, p.extrema) for box, p in zip(boxes, tiles) if p.extrema is not None]
        values = np.stack([found[0] for _, found in extrema])
        positions = np.stack([canvas_positions(found[1], box, width) for box, found in extrema])
        informative = values.max(axis=0) > np.stack([found[2] for _, found in extrema]).min(axis=0)
        return max_shares(first_maxima(values, positions), informative, (height, width))
