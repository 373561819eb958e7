"""`cachectl serve` says where it listens: the API's URL with the port really bound, the
dashboard's, and the command that makes the reader token its sign-in asks for."""

from __future__ import annotations

import os
import queue
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from support import infra


def _banner(proc: subprocess.Popen[str], log: Path, timeout: float = 120) -> list[str]:
    """The server's stdout lines up to the token command (its logs go to ``log``), read on a
    thread: a server that prints nothing fails the test at the deadline, never hangs it."""
    assert proc.stdout is not None
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout or ()], daemon=True).start()
    got: list[str] = []
    deadline = time.monotonic() + timeout
    while not got or not got[-1].startswith("a reader token:"):
        try:
            got.append(lines.get(timeout=max(0.1, deadline - time.monotonic())).rstrip("\n"))
        except queue.Empty:
            raise AssertionError((got, proc.poll(), log.read_text())) from None
    return got


def test_serve_prints_its_url_the_dashboards_and_the_token_command(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'served.db'}"
    port = infra.free_port()
    log = tmp_path / "serve.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cachectl", "serve", "--db", db, "--host", "127.0.0.1"]
            + ["--port", str(port)],
            stdout=subprocess.PIPE,
            stderr=err,
            stdin=subprocess.DEVNULL,
            text=True,
            cwd=tmp_path,
        )
    try:
        base = f"http://127.0.0.1:{port}"
        listening, dashboard, token = _banner(proc, log)
        assert listening == f"cachectl server listening on {base} (API {base}/api/v1)"
        assert dashboard == f"dashboard: {base}/ (sign in at {base}/login with a reader token)"
        # Another index than a plain command opens: the command names it.
        command = token.removeprefix("a reader token: ")
        assert command == f"cachectl token create --name NAME --role reader --db '{db}'"
        assert httpx.get(f"{base}/login", timeout=30).status_code == 200
        # The printed command, as a user pastes it, makes a token this server takes.
        argv = shlex.split(command.replace("NAME", "pasted"))
        made = infra.run_cachectl(tmp_path, *argv[1:])
        assert made.returncode == 0, made.stderr
        secret = made.stdout.split()[-1]
        caches = httpx.get(
            f"{base}/api/v1/caches", headers={"Authorization": f"Bearer {secret}"}, timeout=30
        )
        assert caches.status_code == 200, caches.text
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        assert proc.stdout is not None
        proc.stdout.close()
    assert os.path.exists(tmp_path / "served.db")
