"""Volumes in the viewers: a slice through a 3-D tile grid, a tile's halo faces, the rank layout of a DxRxC grid."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mpi4dl_nb import ParallelConfig, viz
from mpi4dl_nb.models.unet3d import unet3d
from mpi4dl_nb.notebook.widgets import HaloViewer, WindowedLayer, windowed_layers
from mpi4dl_nb.spatial.geometry import KernelAxis, LayerHalo, TileGrid


def conv_halo(grid: TileGrid, sizes: tuple[int, int, int], kernel: int = 5) -> LayerHalo:
    pad = kernel // 2
    return LayerHalo.for_axis_windows(grid, sizes, [KernelAxis(kernel, 1, 1, pad, pad)] * 3, f"conv k{kernel}")


def halo_gids(figure) -> set[str]:
    return {a.get_gid() for a in viz.find_artists(figure, "halo:")}


def test_a_slice_shows_the_tiles_owning_it_and_a_tiles_bands_or_face_by_where_the_slice_lies():
    volume = torch.arange(32 ** 3, dtype=torch.float64).reshape(1, 32, 32, 32)     # (C, D, H, W)
    grid = TileGrid(2, 2, depth=2)
    halo = conv_halo(grid, (16, 16, 16))           # the layer's map is half the volume's size: drawn scaled 2x
    inside = viz.draw_tiles_and_halos(volume, grid, halo, depth_index=4, tiles=[0])   # feature slice 2
    assert sorted(int(a.get_gid().split(":")[1]) for a in viz.find_artists(inside, "tile:")) == [0, 1, 2, 3]
    image = viz.find_artists(inside, "image")[0].get_array()
    assert np.array_equal(image, volume[0, 4].numpy())       # the slice itself is the picture, one channel: grey
    assert viz.find_artists(inside, "image")[0].get_cmap().name == "gray"
    assert halo_gids(inside) == {"halo:tile0:bottom", "halo:tile0:right", "halo:tile0:bottom_right_corner"}
    bottom = viz.find_artists(inside, "halo:tile0:bottom")[0]
    assert (bottom.get_y(), bottom.get_height(), bottom.get_width()) == (16, 4, 16)   # 2 rows of 8, scaled 2x
    title = inside.axes[0].get_title()
    assert "slice 4 of 32 (feature slice 2 of 16)\non 2x2x2 tiles" in title
    assert "front 2, back 2, top 2, bottom 2, left 2, right 2" in title   # padding on the border faces too

    face = viz.draw_tiles_and_halos(volume, grid, halo, depth_index=18, tiles=[0])   # feature slice 9
    assert sorted(int(a.get_gid().split(":")[1]) for a in viz.find_artists(face, "tile:")) == [4, 5, 6, 7]
    assert halo_gids(face) == {"halo:tile0:back", "halo:tile0:back_bottom", "halo:tile0:back_right",
                               "halo:tile0:back_bottom_right_corner"}
    back = viz.find_artists(face, "halo:tile0:back")[0]
    assert (back.get_x(), back.get_y(), back.get_width(), back.get_height()) == (0, 0, 16, 16)   # owned 8x8, 2x
    assert viz.find_artists(face, "halo:tile0:back_bottom")[0].get_hatch() == "//"   # edges: later phases
    beyond = viz.draw_tiles_and_halos(volume, grid, halo, depth_index=20, tiles=[0])  # feature slice 10
    assert halo_gids(beyond) == set()             # outside tile 0's 2-slice depth halo

    everyone = viz.draw_tiles_and_halos(volume, grid, halo, depth_index=18)
    owners = {gid.split(":")[1] for gid in halo_gids(everyone)}
    assert owners == {f"tile{t}" for t in range(8)}     # slice 9: tiles 4-7 own it, it is 0-3's back face
    arrows = [a for a in viz.find_artists(everyone, "msg:") if "label" not in a.get_gid()]
    in_plane = [m for m in halo.messages() if m.phase != "depth" and m.depth[0] <= 9 < m.depth[1]
                and {m.src, m.dst} <= {4, 5, 6, 7}]
    assert len(arrows) == len(in_plane) == 8      # rows and cols messages among the slice's four tiles


def test_face_halos_name_six_faces_and_refuse_an_image_tile():
    halo = conv_halo(TileGrid(1, 1, depth=3), (9, 4, 4), kernel=3)
    assert viz.face_halos(halo.tile(1)) == {"front": 1, "back": 1, "top": 1, "bottom": 1, "left": 1, "right": 1}
    with pytest.raises(ValueError, match="four sides"):
        viz.face_halos(TileGrid(2, 2).layer_halo(8, 8).tile(0))
    with pytest.raises(ValueError, match="depth_index 0 needs a volume's grid"):
        viz.draw_tiles_and_halos(np.zeros((4, 8, 8)), TileGrid(2, 2), depth_index=0)
    with pytest.raises(ValueError, match="outside a volume of 4 slices"):
        viz.volume_slice(np.zeros((4, 8, 8)), 4)


def test_the_volume_viewers_old_names_are_refused_naming_the_one_viewer():
    with pytest.raises(AttributeError, match=r"now viz\.draw_tiles_and_halos\(volume, grid, halo, depth_index"):
        viz.draw_volume_tiles_and_halos(np.zeros((4, 8, 8)), TileGrid(2, 2, depth=2))
    with pytest.raises(ImportError, match=r"now HaloViewer\(volume, layers, slice_method='2x2x2'"):
        from mpi4dl_nb.notebook.widgets import VolumeHaloViewer  # noqa: F401
    with pytest.raises(TypeError, match=r"WindowedLayer\(name, \(height, width\), kernel"):
        WindowedLayer("wide", 16, 16, (9, 9))   # the old spelling: height, width


def test_rank_layout_of_a_volume_grid_puts_depth_slices_side_by_side():
    cfg = ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=8, slice_method="2x2x2")
    fig = viz.draw_rank_layout(cfg)
    boxes = {int(a.get_gid().split(":")[1]): a for a in viz.find_artists(fig, "rank:")}
    assert len(boxes) == 9
    assert boxes[4].get_x() > boxes[1].get_x() > boxes[0].get_x()        # depth slice 1 right of slice 0
    assert boxes[2].get_x() == boxes[0].get_x() and boxes[2].get_y() < boxes[0].get_y()
    labels = {a.get_gid(): a.get_text() for a in viz.find_artists(fig, "rank-label:")}
    assert labels["rank-label:5"] == "r5\nt5\nd1" and "(2x2x2)" in fig.axes[0].get_title()


def test_volume_halo_viewer_follows_layer_grid_tile_and_slice():
    volume = np.random.default_rng(0).random((16, 16, 16))
    viewer = HaloViewer(volume, unet3d(2, 4, 2), slice_method="2x2x2", depth_index=3)
    assert [layer.sizes[0] for layer in viewer.layers] == [16, 16, 16, 8, 8, 8, 4, 4, 8, 8, 16, 16]
    assert viewer.layers[2].kernel == (2, 2, 2) and viewer.layers[2].stride == (2, 2, 2)   # the max pool
    assert viewer.halo.message_count == 24          # 8 tiles, 3 phases, 1 neighbour along each axis
    viewer.tile_choice.value = 0
    assert halo_gids(viewer.view.figure) == {"halo:tile0:bottom", "halo:tile0:right",
                                             "halo:tile0:bottom_right_corner"}
    viewer.depth_slider.value = 8                  # tile 0's back face (its depth neighbour's first slice)
    assert "halo:tile0:back" in halo_gids(viewer.view.figure)
    assert "halo per face: front 1, back 1" in viewer.info.value and "voxels) to tile 4" in viewer.info.value
    viewer.messages_box.value = False
    assert not viz.find_artists(viewer.view.figure, "msg:")

    viewer.slice_choice.value = "1x1x4"
    assert viewer.grid.shape == (1, 1, 4) and len(viewer.tile_choice.options) == 5
    assert {gid.split(":")[2] for gid in halo_gids(viewer.view.figure)} == {"right"}   # tile 0: left-most strip

    wide = WindowedLayer("wide", (8, 8, 8), (9, 9, 9), padding=(4, 4, 4))
    narrow = HaloViewer(volume, [wide], slice_method="4x1x1")      # 2-slice tiles, 4-slice halo
    assert narrow.halo is None and "halo is wider than a tile" in narrow.error
    narrow.slice_choice.value = "2x1x1"
    assert narrow.halo is not None and narrow.error is None
    assert viz.face_halos(narrow.halo.tile(0))["back"] == 4
    assert windowed_layers(unet3d(2, 4, 2), (16, 8, 8))[0].sizes == (16, 8, 8)
