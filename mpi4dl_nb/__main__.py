"""``python -m mpi4dl_nb <command> ...`` and ``mpi4dl-nb``: the batch-job entry point (commands: cli/commands.py)."""
from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Sequence
from functools import partial

from .cli.commands import main as run_command
from .cli.commands import usage
from .cli.layout_cmd import EXIT_CONFIG
from .comm.context import abort_job
from .comm.device import bind_launcher_device, requested_device
from .errors import ConfigError
from .run.teardown import exit_watched

__doc__ = f"{__doc__}\n\n{usage()}"     # the commands as the table lists them (``--help`` prints the same)
BROKEN_PIPE_EXIT = 141    # 128 + SIGPIPE: what a shell reports for a program whose reader left (``... | head``)


def main(argv: Sequence[str] | None = None) -> int:
    """The one entry of ``python -m mpi4dl_nb`` and the ``mpi4dl-nb`` console script (pyproject.toml): the command
    of ``argv`` (default ``sys.argv``; cli/commands.py) with its end watched (run/teardown.py: a job's monitor
    listens on through MPI's teardown); output into a pipe its reader closed (``mpi4dl-nb --help | head -1``) ends
    quietly, exit code 141."""
    try:
        args = list(sys.argv[1:] if argv is None else argv)
        bind_launcher_device(requested_device(args))     # the rank's GPU current before MPI starts (comm/device.py)
        code = exit_watched(partial(run_command, args), args)
        sys.stdout.flush()           # a closed pipe shows here, not in the interpreter's last flush
    except BrokenPipeError:
        return quiet_broken_pipe()
    except ConfigError as err:    # one refused after MPI started (Context: --backend nccl on shared GPUs): one line
        print(f"mpi4dl_nb: configuration error: {err}", file=sys.stderr, flush=True)
        abort_other_ranks(EXIT_CONFIG, with_traceback=False)
        return EXIT_CONFIG
    except Exception:
        abort_other_ranks()
        raise
    return code


def abort_other_ranks(code: int = 1, with_traceback: bool = True) -> None:
    """An error no command turned into a message, on one rank of several: its traceback printed, then the whole
    world aborted (as ``python -m mpi4py`` does), so the other ranks do not wait for this one for ever in a
    collective or in MPI's finalize. The traceback goes out in one write and the abort waits for the launcher to
    forward it (an abort straight after it cut it to its first line, once in a CI run). Nothing when MPI was not
    started or the world is one process."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized() or mpi.COMM_WORLD.Get_size() == 1:
        return
    if with_traceback:
        sys.stderr.write(traceback.format_exc())     # one write, so the launcher forwards the traceback whole
    abort_job(mpi.COMM_WORLD, code)              # after the pause that lets it forward (comm/context.py)


def quiet_broken_pipe() -> int:
    """stdout pointed at the null device (the interpreter's last flush of the closed pipe would print a
    traceback), and the exit code of a program whose reader left."""
    try:
        out = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):    # stdout replaced by an object without a file
        return BROKEN_PIPE_EXIT
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, out)
    os.close(null)
    return BROKEN_PIPE_EXIT


if __name__ == "__main__":
    sys.exit(main())
