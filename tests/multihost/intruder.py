"""On another host than the notebook: a client and an engine holding a cluster's connection files with a wrong key.

Usage: python -m tests.multihost.intruder OUT_DIR (after tests/multihost/cluster_driver.py wrote OUT_DIR/cluster.json).
Writes OUT_DIR/intruder.json:

* ``wrong_key_markers``: files written by code sent straight to each engine (the controller's mux, the engines'
  identities known) with a wrong key: none expected; ``right_key_markers``: the same code with the right key, the
  control (it must run on every engine, so the path itself works);
* ``client``: what ``ipyparallel.Client`` with a wrong key got (refused: an error);
* ``engine``: exit code and last words of ``ipengine`` with a wrong key (it never registers).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

WRONG_KEY = "not-the-cluster-key"


def send_code(info: dict[str, object], connection: dict[str, str], key: str, marker: Path) -> None:
    """An execute request for every engine, signed with ``key``, that creates ``marker``-<host>."""
    import zmq
    from jupyter_client.session import Session

    session = Session(key=key.encode(), signature_scheme=connection["signature_scheme"], username="intruder")
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.connect(f"{connection['interface']}:{connection['mux']}")
    code = f"open({str(marker)!r} + '-' + __import__('socket').gethostname(), 'w').close()"
    uuids = info["uuids"]
    assert isinstance(uuids, list)
    for uuid in uuids:
        session.send(socket, "execute_request", content={"code": code, "silent": False, "user_expressions": {}},
                     ident=[str(uuid).encode()])


def markers(folder: Path, prefix: str) -> list[str]:
    return sorted(p.name for p in folder.glob(f"{prefix}-*"))


def main(out: Path) -> None:
    import ipyparallel as ipp

    info = json.loads((out / "cluster.json").read_text())
    files = info["files"]
    client = json.loads(Path(files["client"]).read_text())
    send_code(info, client, WRONG_KEY, out / "wrong")
    send_code(info, client, client["key"], out / "right")        # after the wrong one, on the same route
    deadline = time.monotonic() + 60
    while len(markers(out, "right")) < len(info["uuids"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    report: dict[str, object] = {"right_key_markers": markers(out, "right"),
                                 "wrong_key_markers": markers(out, "wrong")}
    bad_client = out / "wrong-key-client.json"
    bad_client.write_text(json.dumps(dict(client, key=WRONG_KEY)))
    try:
        ipp.Client(str(bad_client), timeout=3).close()
        report["client"] = "connected"
    except Exception as error:          # what the refusal looks like to the intruder
        report["client"] = f"{type(error).__name__}: {error}"
    bad_engine = out / "wrong-key-engine.json"
    bad_engine.write_text(json.dumps(dict(json.loads(Path(files["engine"]).read_text()), key=WRONG_KEY)))
    engine = subprocess.run([sys.executable, "-m", "ipyparallel.engine", f"--file={bad_engine}", "--timeout=3",
                             "--log-level=40"], capture_output=True, text=True, timeout=120)
    report["engine"] = {"code": engine.returncode, "said": engine.stderr[-400:]}
    (out / "intruder.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
