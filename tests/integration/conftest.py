"""Shared fixtures for integration tests: a real `foresight serve` process.

`live_server` (session-scoped) starts the server once on a free loopback port with the default model,
waits for GET /health to answer 200, and stops it (SIGTERM, then SIGKILL) after the session.

It yields a `LiveServer`: a `str` equal to the base URL (so `f"{live_server}/v1/models"` works) that
also carries `.base_url`, `.port`, `.process` (the `subprocess.Popen`), `.log_path` and `.log()`.

Environment knobs:
- FORESIGHT_TEST_SERVER_ARGS: extra `serve` flags, e.g. "--mode pipelined --block-size 6".
- FORESIGHT_TEST_SERVER_TIMEOUT: seconds to wait for /health (default 300).
- FORESIGHT_TEST_DTYPE (or pytest's --dtype): the server's --dtype (default auto).
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from support.suite_dtype import suite_dtype

REPO_ROOT = Path(__file__).resolve().parents[2]
SERVER_MODULE = "foresight.cli"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_status(url: str, timeout: float = 5.0) -> int | None:
    """The HTTP status of GET url, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return None


class LiveServer(str):
    """The base URL of a running server, with the process and its log attached."""

    base_url: str
    port: int
    process: subprocess.Popen
    log_path: Path
    cmd: list[str]

    def __new__(cls, base_url: str, port: int, process: subprocess.Popen, log_path: Path) -> "LiveServer":
        self = super().__new__(cls, base_url)
        self.base_url, self.port, self.process, self.log_path = base_url, port, process, log_path
        return self

    def log(self, tail_chars: int = 20000) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return text[-tail_chars:]


def _stop(process: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM (the server drains and stops its workers), then SIGKILL its process group."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    # The server runs in its own session: kill whatever of that group is left (workers included).
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait(timeout=10)


def spawn_server(log_dir: Path, extra_args: list[str] | None = None, port: int | None = None) -> LiveServer:
    """Start `foresight serve` on `port` (default: a free one) in its own session, logging to
    <log_dir>/server.log; it is not waited for."""
    if importlib.util.find_spec(SERVER_MODULE) is None:
        pytest.skip(f"{SERVER_MODULE} does not exist yet: no `foresight serve` to test")
    port = port or free_port()
    log_path = log_dir / "server.log"
    cmd = [sys.executable, "-m", SERVER_MODULE, "serve", "--port", str(port), "--host", "127.0.0.1",
           "--dtype", suite_dtype()]
    cmd += list(extra_args or []) + shlex.split(os.environ.get("FORESIGHT_TEST_SERVER_ARGS", ""))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    with open(log_path, "wb") as log:
        process = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
    server = LiveServer(f"http://127.0.0.1:{port}", port, process, log_path)
    server.cmd = cmd
    return server


@contextlib.contextmanager
def start_server(log_dir: Path, extra_args: list[str] | None = None, port: int | None = None):
    """Start `foresight serve` on `port` (default: a free one), wait for /health 200, yield a LiveServer, stop it."""
    server = spawn_server(log_dir, extra_args, port)
    process, cmd = server.process, server.cmd
    timeout_s = float(os.environ.get("FORESIGHT_TEST_SERVER_TIMEOUT", "1200"))
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if process.poll() is not None:
                pytest.fail(f"server exited with code {process.returncode} before /health answered 200;"
                            f" command: {shlex.join(cmd)}\n--- server log ---\n{server.log()}")
            if http_status(server + "/health") == 200:
                break
            if time.monotonic() > deadline:
                pytest.fail(f"server did not answer 200 on /health within {timeout_s:.0f} s;"
                            f" command: {shlex.join(cmd)}\n--- server log ---\n{server.log()}")
            time.sleep(0.5)
        yield server
    finally:
        _stop(process)


@pytest.fixture(scope="session")
def live_server(tmp_path_factory) -> LiveServer:
    with start_server(tmp_path_factory.mktemp("live_server")) as server:
        yield server


@pytest.fixture
def server_factory(tmp_path):
    """`with server_factory("--flag", ..., name="a", port=None) as server:` starts a private server for one test,
    logging to <tmp_path>/<name>/server.log (several at once need names of their own)."""
    def factory(*args: str, name: str = "", port: int | None = None):
        folder = tmp_path / name
        folder.mkdir(exist_ok=True)
        return start_server(folder, list(args), port=port)
    return factory


@pytest.fixture
def server_spawner(tmp_path):
    """`server_spawner("--flag", ...)` starts `foresight serve` without waiting for it (to test its start-up);
    whatever is left of it is stopped at the end of the test."""
    spawned = []

    def spawn(*args: str) -> LiveServer:
        spawned.append(spawn_server(tmp_path, list(args)))
        return spawned[-1]
    yield spawn
    for server in spawned:
        _stop(server.process)


@pytest.fixture(scope="module")
def module_server_factory(tmp_path_factory):
    """`server_factory` for a module's fixtures: each server a folder of its own."""
    return lambda *args: start_server(tmp_path_factory.mktemp("server"), list(args))
