"""A notebook's side of a cluster across test hosts, run on the head: ``dl.cluster.start(n, hosts=[...])``, an exact
spatial step on the engines, what an intruder on another host would need, then waiting to be ended like a kernel.

Usage: python -m tests.multihost.cluster_driver OUT_DIR MPIEXEC HOST [HOST ...]. Writes OUT_DIR/cluster.json (the
engines' hosts, the spatial step's errors, the connection files copied for the intruder and their modes, the
engines' identities), waits for OUT_DIR/intruders-done, writes OUT_DIR/after.json (the engines registered
then), and sleeps until killed: the cluster is left to the watcher, as when a notebook's kernel goes away.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
import time
from pathlib import Path

from ipyparallel import interactive


@interactive
def spatial_step() -> tuple[int, int, str, float, float]:
    """One float64 training step of a conv on 2 tiles vs the same step in this process alone (on every engine):
    rank, world size, host, largest output and weight-gradient differences."""
    import socket

    import torch
    from torch import nn

    import mpi4dl_nb as dl

    ctx = dl.init()
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3, padding=1).double()
    x = torch.randn(1, 3, 16, 16, dtype=torch.float64)
    reference = conv(x)
    reference.square().sum().backward()
    ref_grad = conv.weight.grad.clone()
    conv.zero_grad()
    grid = dl.TileGrid(1, 2)
    tile_out = dl.spatialize(conv, grid, ctx)(dl.scatter_tiles(x, grid, ctx))
    tile_out.square().sum().backward()
    grad = conv.weight.grad.clone()
    ctx.all_reduce(grad)
    full = dl.gather_tiles(tile_out.detach(), grid, ctx)
    return (ctx.rank, ctx.world_size, socket.gethostname(), float((full - reference).abs().max()),
            float((grad - ref_grad).abs().max()))


def main(out: Path, mpiexec: str, hosts: list[str]) -> None:
    import mpi4dl_nb as dl

    cluster = dl.cluster.start(n=len(hosts), hosts=hosts, mpiexec=mpiexec, start_timeout=180)
    steps = cluster.run(spatial_step, timeout=180)
    security = Path(cluster.profile_dir or "") / "security"
    files = {}
    for kind in ("client", "engine"):
        (found,) = security.glob(f"ipcontroller-*-{kind}.json")
        files[kind] = str(shutil.copy(found, out / f"stolen-{kind}.json"))    # all but the key is known to an intruder
    assert cluster.client is not None
    report = {"steps": steps, "files": files, "uuids": list(cluster.client._engines.values()),
              "modes": {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in security.glob("ipcontroller-*.json")},
              "profile": cluster.profile_dir,
              "profile_mode": oct(stat.S_IMODE(Path(cluster.profile_dir or "").stat().st_mode)),
              "pids": {info.host: info.pid for info in cluster.ranks}}
    (out / "cluster.json.tmp").write_text(json.dumps(report))
    os.replace(out / "cluster.json.tmp", out / "cluster.json")
    while not (out / "intruders-done").exists():
        time.sleep(0.1)
    (out / "after.json").write_text(json.dumps({"engines": len(cluster.client.ids)}))
    time.sleep(3600)          # ended by the test, like a kernel: the watcher must take the cluster down


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3:])
