"""A notebook engine's start (``python -m mpi4dl_nb.notebook.engine_main``): its rank's GPU made current, then
ipyparallel's engine, which starts MPI (an MPI that opens a CUDA context at init opens it there, not on GPU 0)."""

from __future__ import annotations

from ..comm.device import bind_launcher_device


def main() -> None:
    bind_launcher_device()
    from ipyparallel.engine.app import main as engine

    engine()


if __name__ == "__main__":
    main()
