"""Forensics of the engine job's launcher: each rank's lines of the rank-tagged log, which ranks died first and how,
the launcher's exit code."""

from __future__ import annotations

import re
import signal
from typing import TYPE_CHECKING

if TYPE_CHECKING:     # ipyparallel loads when a cluster starts (it carries no type information)
    from ipyparallel.cluster.launcher import BaseLauncher

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def strip_ansi(text: str) -> str:
    """Text without terminal colour codes (IPython colours remote tracebacks)."""
    return _ANSI.sub("", text)


def rank_lines(output: str, rank: int) -> str:
    """Lines of a rank-tagged launcher log that belong to ``rank`` (MPICH or Open MPI tags)."""
    mine = []
    mpich = re.compile(r"^\[(\d+)\]\s?")
    ompi = re.compile(r"^\[\d+,(\d+)\]<\w+>:?\s?")
    for line in output.splitlines():
        for pattern in (mpich, ompi):
            match = pattern.match(line)
            if match:
                if int(match.group(1)) == rank:
                    mine.append(line[match.end():])
                break
    return "\n".join(mine)


_MPICH_EXIT = re.compile(r"EXIT CODE: (\d+)")
_MPICH_EXIT_STRING = re.compile(r"EXIT STRING: ([^\n]+)")
_OMPI_SIGNAL = re.compile(r"process rank (\d+) with PID \d+ on node \S+ exited on signal (\d+)")
_OMPI_CODE = re.compile(r"Process name: \[\[\d+,\d+\],(\d+)\]\s*\n\s*Exit code:\s*(\d+)")
# an engine's nanny logs the moment its engine's pipe closes (MPICH prefixes the MPI rank)
_NANNY_SAW_EXIT = re.compile(r"^\[(\d+)\] \d{4}-\d\d-\d\d (\d\d):(\d\d):(\d\d\.\d+) \[KernelNanny\.\d+\] "
                             r"(?:Pipe closed|Parent \d+ exited)", re.M)
FIRST_DEATH_WINDOW = 0.005   # seconds: engines ending later were ended by the launcher's clean-up


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def deaths_in_log(output: str) -> dict[int, str]:
    """Ranks that died first, with how (exit code or signal), from the engine job's log.

    Open MPI names the rank. MPICH ends every other rank when one dies and reports the exit
    status but not reliably which rank, so the rank comes from the engines' nannies: each
    logs when its engine ended, and those ending first died on their own (``NANNIES_CAVEAT``:
    under load a victim's nanny can log after a rank the clean-up ended; MPICH's
    ``-print-all-exitcodes`` does not tell them apart either, it gives the notebook cluster's
    ranks 9 each).
    """
    found: dict[int, str] = {}
    for match in _OMPI_SIGNAL.finditer(output):
        number = int(match.group(2))
        found[int(match.group(1))] = f"killed by signal {number} ({signal_name(number)})"
    for match in _OMPI_CODE.finditer(output):
        found.setdefault(int(match.group(1)), f"exit code {match.group(2)}")
    if found:
        return found
    ended = nanny_end_times(output)
    if not ended:
        return {}
    code = _MPICH_EXIT.search(output)
    text = _MPICH_EXIT_STRING.search(output)
    if code is None:
        how = "exited"
    elif text is not None and "signal" in text.group(1).lower():
        how = f"killed by signal {code.group(1)} ({signal_name(int(code.group(1)))})"
    else:
        how = f"exit code {code.group(1)}"
    first = min(ended.values())
    return {rank: how for rank, when in sorted(ended.items()) if when - first <= FIRST_DEATH_WINDOW}


NANNIES_CAVEAT = ("MPICH does not say which rank died: named by the engines' nannies, the first to log its engine's "
                  "end (a loaded machine can delay a nanny, and then names a rank MPICH's clean-up ended)")


def named_by_nannies(output: str) -> bool:
    """Whether ``deaths_in_log`` names the ranks of ``output`` by the nannies' log times (MPICH), not the launcher."""
    return not (_OMPI_SIGNAL.search(output) or _OMPI_CODE.search(output)) and bool(_NANNY_SAW_EXIT.search(output))


def nanny_end_times(output: str) -> dict[int, float]:
    """Rank -> seconds of the day its nanny first logged its engine's end (the evidence ``deaths_in_log`` reads)."""
    ended: dict[int, float] = {}
    for match in _NANNY_SAW_EXIT.finditer(output):
        hours, minutes, seconds = int(match.group(2)), int(match.group(3)), float(match.group(4))
        ended.setdefault(int(match.group(1)), hours * 3600 + minutes * 60 + seconds)
    return ended


def launcher_exit_code(launcher: BaseLauncher) -> int | None:
    """Exit code of a launcher's local process (mpiexec), None while it runs or if it has none here."""
    popen = getattr(launcher, "_popen_process", None)
    if popen is None:
        return None
    try:
        return popen.poll()
    except Exception:
        return None

