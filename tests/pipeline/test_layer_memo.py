"""The memo of shape-only probes: answers kept for the same unchanged layers, probed afresh otherwise."""

import gc
import weakref

import torch
from torch import nn

from mpi4dl_nb.config import ParallelConfig
from mpi4dl_nb.pipeline.layer_memo import LayerMemo
from mpi4dl_nb.pipeline.tile_fit import tile_reach


def test_a_memo_answers_the_same_layers_once_per_key_and_probes_changed_or_other_layers_afresh():
    memo: LayerMemo[int] = LayerMemo(lists=2)
    probes: list[str] = []

    def probe(name: str, answer: int):
        return lambda: probes.append(name) or answer
    layers = [nn.Conv2d(3, 4, 3), nn.ReLU()]
    assert memo.get(layers, "a", probe("first", 1)) == 1
    assert memo.get(layers, "a", probe("again", 2)) == 1          # kept
    assert memo.get(layers, "b", probe("other key", 3)) == 3
    assert memo.get(list(layers), "a", probe("a copy of the list", 4)) == 1   # the same layer objects
    layers[0].weight = nn.Parameter(torch.zeros(4, 3, 3, 3, dtype=torch.float64))   # changed in place: dtype
    assert memo.get(layers, "a", probe("changed", 5)) == 5
    other = [nn.Conv2d(3, 4, 3), nn.ReLU()]                       # same shapes, other objects
    assert memo.get(other, "a", probe("other layers", 6)) == 6
    assert probes == ["first", "other key", "changed", "other layers"]
    third = [nn.Linear(2, 2)]
    memo.get(third, "a", probe("third", 7))                         # two lists kept: the oldest goes
    assert memo.get(layers, "a", probe("evicted", 8)) == 8


def test_a_setting_or_a_module_changed_in_place_is_probed_afresh():
    memo: LayerMemo[int] = LayerMemo()
    block = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    layers = [block]
    assert memo.get(layers, "a", lambda: 1) == 1
    block[0].stride = (2, 2)                       # a setting: the same weights, other shapes downstream
    assert memo.get(layers, "a", lambda: 2) == 2
    block[1] = nn.GELU()                           # a module swapped inside the same layer object
    assert memo.get(layers, "a", lambda: 3) == 3
    assert memo.get(layers, "a", lambda: 4) == 3


def test_a_memo_holds_its_layers_weakly_and_bounds_its_answers():
    memo: LayerMemo[int] = LayerMemo(answers=3)
    layers = [nn.Conv2d(1, 1, 1)]
    for key in range(5):
        memo.get(layers, key, lambda key=key: key)
    calls = []
    assert memo.get(layers, 4, lambda: calls.append(4) or -1) == 4
    assert memo.get(layers, 0, lambda: calls.append(0) or -1) == -1   # the oldest keys went
    ref = weakref.ref(layers[0])
    del layers
    gc.collect()
    assert ref() is None


def test_tile_reach_is_scanned_once_per_model_grid_and_size():
    layers = [nn.Conv2d(3, 4, 7, padding=3), nn.Conv2d(4, 4, 7, padding=3)]
    columns = ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=8, slice_method="vertical")   # 1x8
    first = tile_reach(layers, columns, 16)
    assert first is not None and first.layers == 0 and first.refusal is not None   # 2-px tiles, 3-px halos
    assert tile_reach(layers, columns, 16) is first
    wider = tile_reach(layers, columns.with_(num_spatial_parts=2), 16)
    assert wider is not None and wider is not first and wider.layers == 2 and wider.refusal is None
