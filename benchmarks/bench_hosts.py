"""Halo traffic over slow links: one host against several, at several link rates, on test hosts (engines/hosts).

    sudo .venv/bin/python benchmarks/bench_hosts.py --rates unlimited,10gbit,1gbit --size 1024 --rounds 3

The driver (root, outside MPI) brings up test hosts h1..h4 of its own (always taken down at the end) and, for
each link rate, sets every link to it (``hosts.sh rate``: a tc token bucket each way; ``unlimited``: none)
and runs one 6-rank job (``--job``) over the hosts: ranks 0-2 on h1 ("one host": shared memory between
them), ranks 3, 4, 5 on h2, h3, h4 ("hosts": every rank on its own host, messages over the links). In the
job both groups run the same work, taking turns round after round while the others wait asleep, on the
mpi data plane, float32, tiles side by side (1 x 2 grid):

(a) a 3x3 conv's halo exchange (tile 16 x size x size/2) against posting the same messages on ready
    buffers (raw, tests' bench_halo.raw_exchange), the strips alone, and forward + adjoint backward with
    the extended tile;
(b) a 3-layer 16-channel conv stack forward + backward, halo overlap (``spatial.conv.HALO_OVERLAP``) off
    and on;
(c) a 4-layer conv chain forward + backward, a halo exchange per layer against one fused exchange
    (``halo_d2``, ``fused_layers=4``);
(d) SP: the body of a ResNet-8 (v1, 16 filters: stem and 3 blocks, BatchNorm over the whole image) forward +
    backward at ``--image-size`` on 2 tiles;
(e) SP+LP: a training step of that ResNet-8 with its head (HybridEngine, split 2, spatial 1): 2 tiles and a
    layer stage (3 ranks).

A figure is the median over ``--rounds`` (after a warm-up round) of the group's seconds per call, the group
meeting at a barrier before and after (so the slowest rank's). Each table has a row per link rate and
placement, the link rate in every row; ``hosts/one`` is the ratio of the two placements.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from support.launch import last_json
from support.machine import REPO, Footer
from support.tables import Table

from mpi4dl_nb.comm.launcher import Launcher, MPIFlavor, rank_environment

HOSTS_SH = REPO / "engines" / "hosts" / "hosts.sh"
SLOTS = ["h1", "h1", "h1", "h2", "h3", "h4"]          # one host (ranks 0-2), hosts (ranks 3, 4, 5)
SIDES = ("one host", "hosts")
HALO = ("raw", "strips", "fwd+adjoint")


# ------------------------------------------------------------------------------------------------ the job
def timed_runs(world, runs: dict[str, tuple[object, Callable[[], object], int]], rounds: int) -> dict[str, float]:
    """Median seconds per call of each run (``name -> (group context or None here, call, calls per turn)``),
    the slowest rank's, on rank 0 (collective)."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for index in range(rounds + 1):
        for name, (group, call, calls) in runs.items():
            world.barrier()
            if group is None:
                continue
            group.barrier()
            start = time.perf_counter()
            for _ in range(calls):
                call()
            group.barrier()
            if index:
                times[name].append((time.perf_counter() - start) / calls)
    mine = {name: statistics.median(found) for name, found in times.items() if found}
    gathered = world.gather_object(mine)
    if gathered is None:
        return {}
    return {name: max(part[name] for part in gathered if name in part) for name in runs}


def job(args: argparse.Namespace) -> None:
    import torch
    from bench_halo import raw_exchange
    from mpi4py import MPI
    from support.models import conv_stack
    from support.world import require_world
    from torch import nn

    import mpi4dl_nb as dl
    from mpi4dl_nb.comm.context import Context
    from mpi4dl_nb.models import build_model
    from mpi4dl_nb.spatial import conv as spatial_conv
    from mpi4dl_nb.spatial.halo import HaloExchange

    torch.set_num_threads(1)
    world = dl.init(backend="mpi")
    require_world(world, len(SLOTS), "bench_hosts --job")
    side = SIDES[world.rank // 3]
    trio = Context(comm=MPI.COMM_WORLD.Split(world.rank // 3, world.rank))
    in_pair = world.rank % 3 < 2
    pair_comm = MPI.COMM_WORLD.Split(world.rank // 3 if in_pair else MPI.UNDEFINED, world.rank)
    pair = Context(comm=pair_comm) if in_pair else None
    grid = dl.TileGrid(1, 2)
    size, channels = args.size, 16
    runs: dict[str, tuple[object, Callable[[], object], int]] = {}

    def add(name: str, group: object, call: Callable[[], object], calls: int = 1) -> None:
        for label in SIDES:          # every rank lists every run, in the same order; only its side's are its own
            runs[f"{label}: {name}"] = (group, call, calls) if label == side else (None, call, calls)

    torch.manual_seed(0)
    image = torch.randn(1, 3, size, size)
    halo_bytes = 0
    if pair is not None:
        exchange = HaloExchange(grid.layer_halo(size, size, 3, 1, 1), pair.rank, [0, 1], pair)
        height, width = grid.tile_of_size(pair.rank, size, size)
        x = torch.randn(1, channels, height, width)
        halo_bytes = height * channels * x.element_size()
        raw = raw_exchange(pair, exchange, x.dtype, channels)
        halo_calls = {"raw": raw, "strips": lambda: exchange.exchange_strips(x),
                      "fwd+adjoint": lambda: exchange.backward_tensor(exchange.forward_tensor(x))}
        tile = dl.scatter_tiles(image, grid, pair)
        stack = dl.spatialize(conv_stack(channels, 3), grid, pair)
        chains = {"per layer": dl.spatialize(conv_stack(channels, 4), grid, pair),
                  "fused": dl.spatialize(conv_stack(channels, 4), grid, pair, image_size=(size, size),
                                         halo_d2=True, fused_layers=4)}
    for what in HALO:
        add(f"halo {what}", pair, halo_calls[what] if pair is not None else lambda: None, args.halo_calls)

    def backward(net: nn.Module) -> Callable[[], None]:
        def step() -> None:
            net.zero_grad(set_to_none=True)
            net(tile).sum().backward()
        return step

    def overlapped(flag: bool) -> Callable[[], None]:
        def step() -> None:
            spatial_conv.HALO_OVERLAP = flag
            try:
                backward(stack)()
            finally:
                spatial_conv.HALO_OVERLAP = False
        return step

    for flag in (False, True):
        add(f"overlap {'on' if flag else 'off'}", pair, overlapped(flag) if pair is not None else lambda: None)
    for label in ("per layer", "fused"):
        add(f"chain {label}", pair, backward(chains[label]) if pair is not None else lambda: None)

    def resnet() -> list[nn.Module]:
        torch.manual_seed(0)
        return build_model("resnet", num_layers=8, num_filters=16, version=1, image_size=args.image_size)

    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    if pair is not None:
        body = dl.spatialize(nn.Sequential(*resnet()[:-1]), grid, pair)      # all but the classifier head
        body_tile = dl.scatter_tiles(images, grid, pair)

        def body_step() -> None:
            body.zero_grad(set_to_none=True)
            body(body_tile).sum().backward()
    add("SP step", pair, body_step if pair is not None else lambda: None)
    sp_lp = dl.ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=2, slice_method="vertical")
    engine = dl.HybridEngine(resnet(), sp_lp, trio, loss_fn=nn.CrossEntropyLoss(),
                             optimizer=lambda params: torch.optim.SGD(params, lr=0.01))
    labels = torch.randint(0, 10, (args.batch_size,))
    add("SP+LP step", trio, lambda: engine.train_step(images, labels))
    found = timed_runs(world, runs, args.rounds)
    hosts = world.all_gather_object(os.uname().nodename)
    if world.rank == 0:
        print(json.dumps({"rate": args.rate, "seconds": found, "hosts": hosts, "halo_bytes": halo_bytes}),
              flush=True)


# --------------------------------------------------------------------------------------------- the driver
def hosts_script(env: dict[str, str], *args: str) -> str:
    done = subprocess.run(["bash", str(HOSTS_SH), *args], env=env, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"hosts.sh {' '.join(args)}: {done.stdout}{done.stderr}")
    return done.stdout


def run_rates(args: argparse.Namespace) -> tuple[list[dict], dict[str, str]]:
    """One job per link rate on test hosts of this run's own: the results, and the rates whose job failed (why)."""
    if os.geteuid() != 0:
        raise SystemExit("bench_hosts: test hosts need root (network namespaces); run it with sudo")
    folder = Path(tempfile.mkdtemp(prefix="mpi4dl-bench-hosts-"))
    env = dict(os.environ, MPI4DL_HOSTS_DIR=str(folder), MPI4DL_HOSTS_PREFIX=f"m4b{os.getpid()}",
               MPI4DL_MPIEXEC=Launcher.find().executable,
               MPI4DL_HOSTS_OWNER=str(os.getpid()))      # killed before its teardown: the hosts go anyway
    launcher = Launcher(str(REPO / "engines" / "hosts" / "mpiexec"), MPIFlavor.MPICH)
    argv = [sys.executable, "-m", "mpi4py", str(Path(__file__).resolve()), "--job", "--size", str(args.size),
            "--rounds", str(args.rounds), "--halo-calls", str(args.halo_calls), "--image-size", str(args.image_size),
            "--batch-size", str(args.batch_size)]
    results, failed = [], {}
    try:
        hosts_script(env, "up", str(len(set(SLOTS))))
        for rate in args.rates.split(","):
            hosts_script(env, "rate", rate)
            print(f"link rate {rate}: running the job ...", file=sys.stderr, flush=True)
            command = launcher.command(len(SLOTS), [*argv, "--rate", rate], hosts=SLOTS, tag_output=False)
            done = subprocess.run(command, env=rank_environment(len(SLOTS), env, hosts=SLOTS), capture_output=True,
                                  text=True, timeout=args.timeout, cwd=REPO)
            if done.returncode == 0:
                results.append(last_json(done.stdout))
            else:
                failed[rate] = f"exit {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
                print(f"link rate {rate}: the job failed ({failed[rate]})", file=sys.stderr, flush=True)
    finally:
        print(hosts_script(env, "down").strip(), file=sys.stderr, flush=True)
    return results, failed


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def tables(results: list[dict], args: argparse.Namespace) -> list[tuple[str, Table]]:
    """The five tables (title, table) of the results."""
    halo = Table(["link rate", "placement", ">raw ms", ">strips ms", ">strips/raw", ">fwd+adjoint ms",
                  ">fwd+adjoint / 2 raw"])
    overlap = Table(["link rate", "placement", ">overlap off s", ">overlap on s", ">on/off"])
    chain = Table(["link rate", "placement", ">per-layer halos s", ">fused (halo_d2) s", ">fused/per-layer"])
    steps = {name: Table(["link rate", ">one host s/step", ">hosts s/step", ">hosts/one"])
             for name in ("SP step", "SP+LP step")}
    for result in results:
        rate, seconds = result["rate"], result["seconds"]
        for side in SIDES:
            got = {name.split(": ", 1)[1]: value for name, value in seconds.items() if name.startswith(side)}
            raw, strips, both = (got[f"halo {what}"] for what in HALO)
            halo.add(rate, side, ms(raw), ms(strips), f"{strips / raw:.2f}", ms(both), f"{both / (2 * raw):.2f}")
            off, on = got["overlap off"], got["overlap on"]
            overlap.add(rate, side, f"{off:.3f}", f"{on:.3f}", f"{on / off:.2f}")
            per_layer, fused = got["chain per layer"], got["chain fused"]
            chain.add(rate, side, f"{per_layer:.3f}", f"{fused:.3f}", f"{fused / per_layer:.2f}")
        for name, table in steps.items():
            one, spread = seconds[f"one host: {name}"], seconds[f"hosts: {name}"]
            table.add(rate, f"{one:.3f}", f"{spread:.3f}", f"{spread / one:.2f}")
    kib = results[0]["halo_bytes"] / 1024 if results else 0
    size = f"{args.size}x{args.size}"
    return [
        (f"(a) 3x3 halo exchange vs raw messages of the same bytes: tile 16x{size} split in 2, {kib:.0f} KiB per "
         f"message, {args.halo_calls} calls per turn", halo),
        (f"(b) 3-layer conv stack fwd+bwd on 2 tiles, {size}, halo overlap off/on", overlap),
        (f"(c) 4-layer conv chain fwd+bwd on 2 tiles, {size}: a halo per layer vs one fused exchange", chain),
        (f"(d) SP: ResNet-8 v1 body (stem + 3 blocks) fwd+bwd, {args.image_size}px, batch {args.batch_size}, 2 tiles",
         steps["SP step"]),
        ("(e) SP+LP: ResNet-8 training step, 2 tiles + a layer stage (3 ranks; 'hosts': each rank its own host)",
         steps["SP+LP step"]),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="unlimited,10gbit,1gbit", help="link rates, one job each (tc syntax)")
    parser.add_argument("--size", type=int, default=1024,
                        help="image side of (a)-(c) (2048: ~3 GB per rank, 6 ranks on this machine)")
    parser.add_argument("--image-size", type=int, default=256, help="image side of (d), (e)")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--halo-calls", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per job")
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)   # the MPI side
    parser.add_argument("--rate", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        job(args)
        return
    footer = Footer()
    results, failed = run_rates(args)
    for title, table in tables(results, args):
        print(f"\n{title}\n\n{table.markdown()}")
    print("\nplacements: one host = ranks on h1 (shared memory); hosts = each rank on its own test host, "
          "messages over veth links through a bridge (tc tbf at the rate); all hosts share this machine's cores")
    footer.print()
    if failed:
        raise SystemExit(f"bench_hosts: the job failed at {', '.join(failed)} (its output above, on stderr)")


if __name__ == "__main__":
    main()
