"""Writers killed with kill -9 leave files; a lease-aware sweep finds and removes them, never a
live writer's: a real `cachectl serve` killed mid-upload, a real store write killed mid-copy."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from support import infra
from support.lifecycle import cachectl, fake_env, setup_cache, write_entries
from support.server_kit import MAIN, entry_key, seed

from cachectl.core import temps


def _serve(db: str, port: int, log: Path, spool: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cachectl", "serve", "--db", db, "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "TMPDIR": str(spool)},  # the server spools uploads here
        )
    deadline = time.monotonic() + 60
    while not infra.port_open(port):
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    return proc


def _spooled(spool: Path) -> list[Path]:
    return sorted(p for p in spool.iterdir() if p.name.startswith(temps.SPOOL_PREFIX))


def test_a_server_killed_mid_upload_leaves_no_spool_file_past_its_restart(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path}/index.db"
    s = seed(db, str(tmp_path / "main"), str(tmp_path / "other"))
    spool = tmp_path / "spool"
    spool.mkdir()
    log = tmp_path / "server.log"
    port = infra.free_port()
    server = _serve(db, port, log, spool)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.putrequest(
            "PUT", f"/api/v1/caches/{MAIN}/environments/{s.digest}/entries/{entry_key('jit_up', 9)}"
        )
        conn.putheader("authorization", f"Bearer {s.tokens['writer']}")
        conn.putheader("content-length", str(8 << 20))
        conn.endheaders()
        conn.send(os.urandom(1 << 20))  # an eighth of the body, then the server dies
        deadline = time.monotonic() + 30
        while not [p for p in _spooled(spool) if p.stat().st_size > 0]:
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.01)
        server.kill()
        server.wait()
        conn.close()
        (dead,) = _spooled(spool)
        # Another server on this host is uploading right now: its spool file must survive.
        live = spool / (temps.prefix(temps.SPOOL_PREFIX) + "live")
        live.write_bytes(b"half an upload")

        server = _serve(db, port, log, spool)
        assert not dead.exists(), "the restarted server left the dead upload's spool file"
        assert _spooled(spool) == [live]
        assert "removed 1 spool file(s)" in log.read_text()
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(30)


def test_a_write_killed_mid_copy_leaves_a_temp_that_verify_reports_and_removes(
    tmp_path: Path, sqlite_url: str
) -> None:
    """Store.write_file copies from a FIFO nobody writes to: its .tmp-* file exists while it waits,
    when it is killed with kill -9. verify reports it; --quarantine (repair) removes it; a live
    writer's temporary is neither reported nor removed."""
    root = str(tmp_path / "root")
    index, store = setup_cache(sqlite_url, root)
    written = write_entries(index, store, fake_env("0.10.2"), 3)
    ns = Path(store.url_for(written.env.namespace))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    code = (
        "import sys\nfrom cachectl.storage.store import Store\n"
        "Store(sys.argv[1]).write_file(sys.argv[2], sys.argv[3])\n"
    )
    target = f"{written.env.namespace}/jit_new-{'e' * 64}-cache"
    writer = subprocess.Popen([sys.executable, "-c", code, root, target, str(fifo)])
    deadline = time.monotonic() + 60
    while not list(ns.glob(".tmp-*")):
        assert writer.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    writer.kill()
    writer.wait()
    (dead,) = ns.glob(".tmp-*")
    live = ns / (temps.prefix(temps.TEMP_PREFIX) + "live")
    live.write_bytes(b"being written")

    found = cachectl(sqlite_url, "verify", "--json")
    assert found.exit_code == 1, found.output
    findings = json.loads(found.stdout)["plan"]["findings"]
    rel = f"{written.env.namespace}/{dead.name}"
    assert [(f["kind"], f["path"]) for f in findings] == [("stale-temp", rel)], findings
    assert "is gone" in findings[0]["detail"]

    fixed = cachectl(sqlite_url, "verify", "--quarantine", "--json")
    assert json.loads(fixed.stdout)["temps_removed"] == 1, fixed.output
    assert not dead.exists() and live.exists()
    assert cachectl(sqlite_url, "verify").exit_code == 0
