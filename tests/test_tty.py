"""Every human output on a real pseudo-terminal, as a user types the commands.

The CLI runs in a fresh process whose stdin, stdout and stderr are a pty of 80, 100 or 120
columns (the stdlib ``pty`` module; no COLUMNS in its environment, so the width comes from
the terminal itself). Each command must exit as it does when piped, print no crash dump
or traceback, and print no line wider than the terminal. The example manifest is warmed
once, on the pty, and every other command reads that cache.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from rich.cells import cell_len

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = str(ROOT / "examples" / "manifest.yaml")
CRASH = ("Traceback (most recent call last)", "Fatal Python error", "object repr", "lost sys.")
# CSI (colours, cursor moves, erase), OSC (titles, links) and the two-byte escapes.
ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")


class Session:
    """A fresh HOME and XDG directories shared by one module's commands."""

    def __init__(self, base: Path) -> None:
        self.base = base
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("CACHECTL_", "JAX_")) and k not in ("COLUMNS", "LINES")
        }
        for var, sub in (
            ("HOME", "home"),
            ("XDG_DATA_HOME", "data"),
            ("XDG_CACHE_HOME", "cache"),
            ("XDG_CONFIG_HOME", "config"),
            ("XDG_STATE_HOME", "state"),
        ):
            (base / sub).mkdir()
            env[var] = str(base / sub)
        env["TERM"] = "xterm-256color"
        self.env = env

    def tty(self, cols: int, *args: str, timeout: float = 240) -> tuple[int, str]:
        """``cachectl ARGS`` on a pty ``cols`` wide: its exit status and everything it showed."""
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, cols, 0, 0))
        proc = subprocess.Popen(
            [sys.executable, "-m", "cachectl", *args],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            cwd=self.base,
            env=self.env,
            start_new_session=True,
        )
        os.close(slave)
        chunks: list[bytes] = []
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if select.select([master], [], [], 0.5)[0]:
                    try:
                        data = os.read(master, 65536)
                    except OSError:  # EIO: every writer has closed the terminal
                        break
                    if not data:
                        break
                    chunks.append(data)
            else:
                proc.kill()
        finally:
            os.close(master)
        return proc.wait(timeout=30), b"".join(chunks).decode("utf-8", "replace")

    def piped(
        self, *args: str, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "cachectl", *args],
            capture_output=True,
            text=True,
            cwd=self.base,
            env={**self.env, **(env or {})},
            timeout=240,
        )


def screen_lines(raw: str) -> list[str]:
    """What the terminal showed, line by line: escapes removed, and each stretch between
    carriage returns (a progress bar's redraws) a line of its own."""
    text = ESCAPES.sub("", raw)
    return [seg for line in text.split("\n") for seg in line.split("\r") if seg.strip()]


def check_screen(raw: str, cols: int, what: Sequence[str]) -> list[str]:
    """No crash dump; no line wider than ``cols`` (JSON's, for programs, as long as it needs)."""
    for marker in CRASH:
        assert marker not in raw, (what, raw[-3000:])
    lines = screen_lines(raw)
    wide = [line for line in lines if cell_len(line) > cols and "--json" not in what]
    assert not wide, (what, cols, wide)
    return lines


def shown(session: Session, cols: int, *args: str, code: int = 0) -> list[str]:
    """``args`` on the pty exits ``code``, as it does piped (every other test runs them
    piped); the screen's lines, checked."""
    status, raw = session.tty(cols, *args)
    assert status == code, (args, status, raw[-3000:])
    return check_screen(raw, cols, args)


class Warmed(NamedTuple):
    session: Session
    raw: str  # what the warm showed on its terminal
    env: dict[str, Any]  # the environment `ls --json` lists afterwards


@pytest.fixture(scope="module")
def warmed(tmp_path_factory: pytest.TempPathFactory) -> Warmed:
    """The example warmed once on a 100-column pty (the README's main command)."""
    session = Session(tmp_path_factory.mktemp("tty"))
    code, raw = session.tty(100, "warm", MANIFEST)
    check_screen(raw, 100, ["warm"])
    assert code == 0, raw[-3000:]
    (env,) = json.loads(session.piped("ls", "--json").stdout)["environments"]
    return Warmed(session, raw, env)


def test_warm_on_a_terminal_compiles_and_shows_each_bucket_once(warmed: Warmed) -> None:
    session, raw, env = warmed
    assert "━" in raw and "/11" in raw, raw[-2000:]  # the transient bar was drawn
    lines = screen_lines(raw)
    assert "11 bucket(s): 11 compiled, 0 cached, 0 failed" in " ".join(" ".join(lines).split())
    entries = json.loads(session.piped("ls", "--env", env["digest"][:12], "--json").stdout)
    for e in entries["entries"]:  # the table after the bar: each bucket's key, unbroken
        assert any(e["key"].rsplit("-", 1)[-1][:12] in line for line in lines), (e, lines)
    # Again, through a pipe: a line per bucket on stderr, no table on stdout; with --json
    # on the pty, the same exit.
    again = session.piped("warm", MANIFEST)
    assert again.returncode == 0, again.stderr
    progress = [line for line in again.stderr.splitlines() if line.startswith("warm ")]
    assert len(progress) == 11 and all(" cached " in line for line in progress), again.stderr
    assert "batch=1,seq=32" not in again.stdout, again.stdout
    assert "11 bucket(s): 0 compiled, 11 cached" in again.stdout
    code, raw = session.tty(80, "warm", MANIFEST, "--json")
    check_screen(raw, 80, ["warm", "--json"])
    assert code == 0 and '"compiled": 0' in raw, raw[-2000:]


@pytest.mark.parametrize("cols", [80, 100, 120])
def test_tables_fit_the_terminal(warmed: Warmed, cols: int) -> None:
    session, _, env = warmed
    short = env["digest"][:12]
    listing = shown(session, cols, "ls")
    assert any(short in line for line in listing), listing  # the digest prefix, unbroken
    assert not any(env["digest"][:13] in line for line in listing), listing
    entries = json.loads(session.piped("ls", "--env", short, "--json").stdout)["entries"]
    assert len(entries) == 11
    listed = shown(session, cols, "ls", "--env", short)
    for e in entries:  # each key's short form on one line
        assert any(e["key"].rsplit("-", 1)[-1][:12] in line for line in listed), (e, listed)
    shown(session, cols, "stats")


def test_piped_tables_honour_columns_and_wide_keeps_values_whole(warmed: Warmed) -> None:
    session, _, env = warmed
    for args in (("stats",), ("ls",), ("ls", "--env", env["digest"][:12])):
        narrow = session.piped(*args, env={"COLUMNS": "100"})
        assert narrow.returncode == 0, narrow.stderr
        assert max(cell_len(line) for line in narrow.stdout.splitlines()) <= 100, narrow.stdout
    wide = session.piped("ls", "--wide", env={"COLUMNS": "100"})
    assert env["digest"] in wide.stdout, wide.stdout
    whole = session.piped("ls")  # a log with no COLUMNS: whole values, for grep
    assert env["digest"] in whole.stdout, whole.stdout


def test_other_commands_on_a_terminal(warmed: Warmed, tmp_path: Path) -> None:
    session, _, env = warmed
    check = shown(session, 100, "warm-check", MANIFEST)
    text = " ".join(" ".join(check).split())
    assert "coverage: 11/11 buckets hit" in text, check
    assert "not proven" in text and "canary not run (--canary not given)" in text, check
    assert f"to prove it: cachectl warm-check {MANIFEST} --canary" in text, check

    doctor = shown(session, 80, "doctor")
    fixes = [f["fix"] for f in json.loads(session.piped("doctor", "--json").stdout)["findings"]]
    said = " ".join(" ".join(doctor).split())
    for fix in filter(None, fixes):  # brackets included: pip install 'cachectl-jax[tpu]'
        assert "fix: " + " ".join(fix.split()) in said, (fix, doctor)
    shown(session, 80, "verify")
    shown(session, 100, "misses", "--manifest", MANIFEST)
    service = "import cachectl, jax; cachectl.activate(); jax.jit(lambda x: x + 1)(1.0)"
    ran = subprocess.run([sys.executable, "-c", service], env=session.env, cwd=session.base)
    assert ran.returncode == 0  # telemetry for the usage tables
    usage = shown(session, 80, "stats", "--since", "1h", "--explain")
    assert any("jit__lambda" in line for line in usage), usage
    bundle = str(tmp_path / "b.tar.zst")
    shown(session, 80, "bundle", "create", "-o", bundle, "--env", env["digest"][:12])
    shown(session, 80, "bundle", "install", bundle)
    # The service above held the compile lease for its program, so JAX wrote it however fast it
    # compiled; a service's write is in its owner's record, not the index: pull copies the 11
    # indexed entries, refuses that one by name and exits 1.
    pulled = shown(session, 100, "pull", "--to", str(tmp_path / "mirror"), code=1)
    said = " ".join(" ".join(pulled).split())
    assert "refused (not copied)" in said and "copied 11 entries" in said, pulled
    assert "1 refused" in said, pulled


def test_help_on_a_terminal(warmed: Warmed) -> None:
    session, _, _ = warmed
    lines = shown(session, 80, "--help")
    assert not [line for line in lines if line.rstrip().endswith("...")], lines
    for section in ("Set up", "Warm", "Inspect", "Lifecycle", "Ship", "Serve"):
        assert f"{section} commands:" in lines, lines
    for typo, said in (
        (["wram"], "no command 'wram': did you mean warm?"),
        (["bundle", "craete"], "no command 'craete' in cachectl bundle: did you mean create?"),
    ):
        code, raw = session.tty(80, *typo)
        assert (code, screen_lines(raw)) == (2, [f"cachectl: error: {said}"]), raw
    assert "Usage: cachectl warm [OPTIONS] MANIFEST" in shown(session, 80, "help", "warm")
    assert "Usage: cachectl [OPTIONS] COMMAND [ARGS...]" in shown(session, 80, "help")
