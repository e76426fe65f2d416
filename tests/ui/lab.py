"""JupyterLab from this venv on a copy of notebooks/, driven by Playwright in the system Chromium."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mpi4dl_nb.notebook import tutorials

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = tutorials.DIRECTORY
# `make lab` puts this directory on JUPYTER_CONFIG_PATH: its labconfig turns autosave off.
LAB_CONFIG = NOTEBOOKS / ".lab"
# Lab 4 renders a widget view as an output with no data-mime-type holding the widget's DOM.
WIDGET_VIEW = ".jp-OutputArea-output:has(> .jupyter-widgets)"
UNTYPED_OUTPUT = ".jp-OutputArea-output:not([data-mime-type])"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
VIEWPORT = {"width": 1366, "height": 768}


def chromium_binary() -> str | None:
    """The system Chromium (Debian's ``chromium`` package), or None."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


def missing_requirements() -> list[str]:
    """What a browser test needs and this machine lacks (empty: it can run)."""
    missing = []
    if chromium_binary() is None:
        missing.append("the chromium browser (apt: chromium)")
    if shutil.which("fc-list") is None:
        missing.append("fc-list (apt: fontconfig)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing.append("the playwright Python package (pip: playwright)")
    if shutil.which("jupyter-lab", path=str(Path(sys.executable).parent)) is None:
        missing.append("jupyterlab in this environment")
    return missing


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Lab:
    """A running JupyterLab server (REST helpers) serving ``root``, with its own settings and a process marker.

    Every process it starts (kernels, MPI launchers, ipyparallel engines) inherits ``MPI4DL_UI_MARK=<marker>``
    in its environment, so the test can find the ones left over after a kernel shutdown.
    """

    def __init__(self, root: Path, scratch: Path) -> None:
        self.root = root
        self.port = free_port()
        self.token = secrets.token_hex(16)
        self.marker = secrets.token_hex(8)
        self.url = f"http://127.0.0.1:{self.port}"
        self.tmp = scratch / "tmp"                  # the kernels' TMPDIR, so a test can see what they leave there
        self.tmp.mkdir()
        env = dict(os.environ)
        env.update({
            "JUPYTER_CONFIG_PATH": os.pathsep.join(filter(None, [str(LAB_CONFIG), env.get("JUPYTER_CONFIG_PATH")])),
            "JUPYTERLAB_SETTINGS_DIR": str(scratch / "user-settings"),     # never the user's own settings
            "JUPYTERLAB_WORKSPACES_DIR": str(scratch / "workspaces"),
            "JUPYTER_RUNTIME_DIR": str(scratch / "runtime"),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
            "MPI4DL_UI_MARK": self.marker,
            "TMPDIR": str(self.tmp),
        })
        self.log = open(scratch / "lab.log", "w")   # noqa: SIM115 - closed in stop()
        command = [str(Path(sys.executable).parent / "jupyter-lab"), "--no-browser", f"--port={self.port}",
                   "--ip=127.0.0.1", f"--ServerApp.token={self.token}", "--ServerApp.allow_root=True",
                   f"--ServerApp.root_dir={root}", "--MappingKernelManager.default_kernel_name=mpi4dl-nb",
                   "--LabApp.news_url=", "--LabApp.expose_app_in_browser=True",
                   "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
        self.process = subprocess.Popen(command, cwd=root, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        deadline = time.monotonic() + 90
        while True:
            try:
                self.get("/api/status")
                break
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"JupyterLab did not start; see {self.log.name}") from None
                time.sleep(0.3)

    # ------------------------------------------------------------------ REST
    def request(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Authorization": f"token {self.token}",
                                                  "Content-Type": "application/json"})
        for attempt in range(5):
            try:
                with urllib.request.urlopen(request, timeout=30) as response:
                    text = response.read().decode()
                return json.loads(text) if text else None
            except urllib.error.HTTPError as error:     # a busy server answers 500 now and then: ask again
                if error.code < 500 or attempt == 4:
                    raise
                time.sleep(0.5)
        return None

    def get(self, path: str) -> Any:
        return self.request("GET", path)

    def setting(self, plugin: str) -> dict[str, Any]:
        """The effective settings of a Lab plugin: schema defaults (with overrides applied) updated by user settings."""
        reply = self.get(f"/lab/api/settings/{plugin}")
        effective = {key: spec.get("default") for key, spec in reply["schema"].get("properties", {}).items()}
        effective.update(reply.get("settings") or {})
        return effective

    def set_user_setting(self, plugin: str, values: dict[str, Any]) -> None:
        self.request("PUT", f"/lab/api/settings/{plugin}", {"raw": json.dumps(values)})

    def kernels(self) -> list[dict[str, Any]]:
        return self.get("/api/kernels")

    def shutdown_kernels(self) -> None:
        for kernel in self.kernels():
            self.request("DELETE", f"/api/kernels/{kernel['id']}")

    def lab_url(self, notebook: str) -> str:
        return f"{self.url}/lab/tree/{notebook}?token={self.token}&reset"

    # ------------------------------------------------------------- processes
    def marked_processes(self, words: tuple[str, ...] = ("ipyparallel", "ipengine", "mpiexec", "hydra_pmi_proxy",
                                                          "ipcontroller")) -> list[tuple[int, str]]:
        """Live processes started under this Lab whose command line names an engine/launcher."""
        found = []
        needle = f"MPI4DL_UI_MARK={self.marker}".encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if needle not in (entry / "environ").read_bytes().split(b"\0"):
                    continue
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z" and any(word in cmdline for word in words):
                found.append((int(entry.name), cmdline.strip()))
        return found

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        for pid, _ in self.marked_processes(("",)):      # anything left behind (a failed test)
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self.log.close()


@contextmanager
def running_lab() -> Iterator[Lab]:
    """Lab on a scratch copy of notebooks/ (the tracked files are never opened), windowing off so every cell renders."""
    scratch = Path(tempfile.mkdtemp(prefix="mpi4dl-ui-"))
    root = scratch / "notebooks"
    shutil.copytree(NOTEBOOKS, root, ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
    lab = Lab(root, scratch)
    try:
        lab.set_user_setting("@jupyterlab/notebook-extension:tracker", {"windowingMode": "none"})
        # Autosave stays at the project's default (off, from LAB_CONFIG); were it on, it would write within 1 s.
        lab.set_user_setting("@jupyterlab/docmanager-extension:plugin", {"autosaveInterval": 1})
        lab.set_user_setting("@jupyterlab/apputils-extension:notification", {"fetchNews": "false"})
        yield lab
    finally:
        lab.stop()
        shutil.rmtree(scratch, ignore_errors=True)
