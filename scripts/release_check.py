"""The release check: build cachectl as a user gets it, install it outside the checkout, use it.

    scripts/test --release          # sets up PostgreSQL first, then runs this
    .venv/bin/python scripts/release_check.py [--pg-url URL] [--keep]

Every test of the suite runs an editable install of the checkout, so none of them can see
a package that the wheel leaves out, a template that is not package data, or a module
that imports only from the source tree. This check:

1. builds the sdist, and the wheel from that sdist (``python -m build``), and checks the
   wheel with check-wheel-contents and against the source tree (every module and data
   file of the three import roots is in it);
2. installs the wheel with the README's service install line (``pip install NAME``, the
   project from the wheel alone), base install only (no extras), into a fresh venv, and from a
   directory outside the checkout: ``cachectl --version`` and ``--help``; ``import cachectl;
   cachectl.activate()`` without FastAPI, uvicorn or psycopg present; the main job
   (``cachectl warm`` of the example manifest, copied out) into a fresh embedded default;
   ``cachectl.serving`` over what it warmed (the example's serving loop: zero compiles);
   ``cachectl db upgrade`` on a fresh SQLite file from the wheel's migrations;
3. installs the sdist with the ``server`` and ``postgres`` extras into a second fresh venv:
   ``cachectl db upgrade`` on a fresh PostgreSQL database; ``cachectl serve``, then the
   dashboard, the login page and the health check over HTTP.

Exit 0 when every step passed; otherwise 1, naming the step and showing its output.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The import roots and the folders they are built from (setup.py).
ROOTS = {"cachectl": "cachectl", "cachectl_server": "server", "cachectl_migrations": "migrations"}
DATA_SUFFIXES = (".py", ".html", ".mako", ".typed")


class StepFailed(Exception):
    pass


def log(message: str) -> None:
    print(f"release-check: {message}", flush=True)


def run(
    step: str, cmd: list[str], *, cwd: Path, env: dict[str, str] | None = None, timeout: float = 900
) -> str:
    """Run one step; its output is shown only when it fails."""
    started = time.monotonic()
    proc = subprocess.run(
        cmd,
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    took = time.monotonic() - started
    if proc.returncode != 0:
        raise StepFailed(
            f"{step}: exit {proc.returncode} after {took:.0f}s: {' '.join(cmd)}\n"
            f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
        )
    log(f"ok   {step} ({took:.1f}s)")
    return proc.stdout


def user_env(home: Path, venv: Path) -> dict[str, str]:
    """A user's environment: a fresh HOME (so a fresh embedded default), the venv first on PATH."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("CACHECTL_", "PYTHON", "VIRTUAL_ENV", "XDG_", "JAX_"))
    }
    env.update(
        HOME=str(home),
        PATH=f"{venv / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}",
        PIP_DISABLE_PIP_VERSION_CHECK="1",
    )
    home.mkdir(parents=True, exist_ok=True)
    return env


def build(out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True)
    run(
        "build sdist, then the wheel from the sdist",
        [sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)],
        cwd=out,
    )
    (sdist,), (wheel,) = sorted(out.glob("*.tar.gz")), sorted(out.glob("*.whl"))
    run(
        "check-wheel-contents",
        [
            sys.executable,
            "-m",
            "check_wheel_contents",
            "--config",
            str(ROOT / "pyproject.toml"),
            str(wheel),
        ],
        cwd=out,
    )
    check_wheel_has_the_tree(wheel)
    return sdist, wheel


def check_wheel_has_the_tree(wheel: Path) -> None:
    """Every module and data file under the three roots is in the wheel, under its import name."""
    shipped = set(zipfile.ZipFile(wheel).namelist())
    missing = []
    for name, folder in ROOTS.items():
        for path in sorted((ROOT / folder).rglob("*")):
            if (
                path.is_file()
                and path.name.endswith(DATA_SUFFIXES)
                and "__pycache__" not in path.parts
            ):
                member = f"{name}/{path.relative_to(ROOT / folder).as_posix()}"
                if member not in shipped:
                    missing.append(member)
    if missing:
        raise StepFailed(
            f"the wheel lacks {len(missing)} file(s) of the source tree: {', '.join(missing[:20])}"
        )
    log(f"ok   the wheel holds every module and data file of {', '.join(ROOTS)}")


def make_venv(step: str, venv: Path, requirement: str, work: Path) -> None:
    run(f"{step}: python -m venv", [sys.executable, "-m", "venv", str(venv)], cwd=work)
    run(
        f"{step}: pip install {Path(requirement.split(' @ ')[-1]).name}",
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", requirement],
        cwd=work,
    )


# The README's service install line: what a user types, and so what the base install runs.
README_INSTALL = re.compile(r"a service needs only\s+`pip install ([A-Za-z0-9._-]+)[^`]*`")


def readme_install_name(readme: Path = ROOT / "README.md") -> str:
    """The distribution the README tells a service to install (``pip install NAME``)."""
    found = README_INSTALL.search(readme.read_text(encoding="utf-8"))
    if found is None:
        raise StepFailed(
            "README.md has no service install line (a service needs only `pip install NAME`)"
        )
    return found.group(1)


def readme_install(step: str, venv: Path, wheel: Path, work: Path) -> None:
    """``pip install NAME`` as the README says, the project itself from the built wheel only:
    first with no index and no dependencies (the wheel must answer to the README's name; a
    project of that name on the index cannot stand in), then its dependencies from the index."""
    name = readme_install_name()
    run(f"{step}: python -m venv", [sys.executable, "-m", "venv", str(venv)], cwd=work)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    links = ["--find-links", str(wheel.parent)]
    run(
        f"{step}: pip install {name} (the README's line) from the wheel alone",
        [*pip, "--no-index", "--no-deps", *links, name],
        cwd=work,
    )
    run(f"{step}: pip install {name}, its dependencies", [*pip, *links, name], cwd=work)


def base_install(wheel: Path, work: Path) -> None:
    venv, home, job = work / "base-venv", work / "base-home", work / "job"
    readme_install("base install (wheel, no extras)", venv, wheel, work)
    env = user_env(home, venv)
    py = str(venv / "bin" / "python")
    shutil.copytree(
        ROOT / "examples", job / "examples", ignore=shutil.ignore_patterns("__pycache__")
    )

    version = run("cachectl --version", ["cachectl", "--version"], cwd=job, env=env).strip()
    if not version.startswith("cachectl"):
        raise StepFailed(f"cachectl --version printed {version!r}")
    run("cachectl --help", ["cachectl", "--help"], cwd=job, env=env)
    run(
        "import cachectl; activate() with the base install only",
        [
            py,
            "-c",
            (
                "import importlib.util, sys, cachectl\n"
                "extras = [m for m in ('fastapi', 'uvicorn', 'psycopg') if importlib.util.find_spec(m)]\n"
                "assert not extras, f'the base install pulled in {extras}'\n"
                "assert cachectl.__file__.startswith(sys.prefix), cachectl.__file__\n"
                "act = cachectl.activate()\n"
                "import jax\n"
                "assert jax.config.jax_compilation_cache_dir, 'activate() set no cache dir'\n"
                "print(act)\n"
            ),
        ],
        cwd=job,
        env=env,
    )
    out = run(
        "the main job: cachectl warm examples/manifest.yaml",
        ["cachectl", "warm", "examples/manifest.yaml"],
        cwd=job,
        env=env,
    )
    log(f"     {out.strip().splitlines()[-1] if out.strip() else '(no output)'}")
    report = json.loads(
        run(
            "cachectl.serving over the warmed cache (examples/serve.py)",
            [py, "examples/serve.py", "--requests", "3", "--json"],
            cwd=job,
            env=env,
        )
    )
    functions = report["functions"]
    if not functions or any(f["fallback"] or f["aot"] != f["calls"] for f in functions.values()):
        raise StepFailed(
            f"examples/serve.py did not serve every call from a stored executable: {functions}"
        )
    log(
        f"     served {sum(f['calls'] for f in functions.values())} calls, every one from a stored executable"
    )
    db = job / "fresh.db"
    run(
        "cachectl db upgrade on a fresh SQLite file",
        ["cachectl", "--db", f"sqlite:///{db}", "db", "upgrade"],
        cwd=job,
        env=env,
    )
    run(
        "cachectl db current on it",
        ["cachectl", "--db", f"sqlite:///{db}", "db", "current"],
        cwd=job,
        env=env,
    )


@contextlib.contextmanager
def fresh_pg_database(pg_url: str) -> Iterator[str]:
    """A new, empty database on the server pg_url names; dropped afterwards."""
    import psycopg
    from sqlalchemy.engine import make_url

    url = make_url(pg_url)
    name = f"cachectl_release_{uuid.uuid4().hex[:8]}"
    dsn = url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield url.set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=10) as resp:  # noqa: S310 (loopback only)
        return resp.status, resp.read().decode()


def server_install(sdist: Path, work: Path, pg_url: str | None) -> None:
    venv, home, job = work / "server-venv", work / "server-home", work / "server-job"
    make_venv(
        "server install (sdist, [server,postgres])",
        venv,
        f"{readme_install_name()}[server,postgres] @ {sdist.as_uri()}",
        work,
    )
    env = user_env(home, venv)
    job.mkdir()
    if pg_url:
        with fresh_pg_database(pg_url) as url:
            run(
                "cachectl db upgrade on a fresh PostgreSQL database",
                ["cachectl", "--db", url, "db", "upgrade"],
                cwd=job,
                env=env,
            )
            run(
                "cachectl db current on it",
                ["cachectl", "--db", url, "db", "current"],
                cwd=job,
                env=env,
            )
    else:
        log(
            "skip cachectl db upgrade on PostgreSQL: no --pg-url (scripts/test --release sets one up)"
        )

    db = f"sqlite:///{job / 'server.db'}"
    run(
        "cachectl db upgrade for the server",
        ["cachectl", "--db", db, "db", "upgrade"],
        cwd=job,
        env=env,
    )
    port = free_port()
    server_log = open(job / "serve.log", "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        ["cachectl", "--db", db, "serve", "--port", str(port), "--public-dashboard"],
        cwd=job,
        env=env,
        stdout=server_log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                status, _ = get(f"{base}/healthz")
                if status == 200:
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise StepFailed(
                    f"cachectl serve did not answer /healthz: {(job / 'serve.log').read_text()[-4000:]}"
                )
            time.sleep(0.3)
        log("ok   cachectl serve answers /healthz")
        for path, needle in (("/", "cachectl"), ("/login", "<form")):
            status, body = get(base + path)
            if status != 200 or needle not in body:
                raise StepFailed(f"GET {path}: status {status}, {needle!r} not in the page")
            log(f"ok   GET {path}: {status}, {len(body)} bytes of the packaged template")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        server_log.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--pg-url",
        default=os.environ.get("CACHECTL_TEST_PG_URL"),
        help="a PostgreSQL server to create a fresh database on [env: CACHECTL_TEST_PG_URL]",
    )
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="cachectl-release-"))
    started = time.monotonic()
    log(f"work directory {work} (outside the checkout {ROOT})")
    try:
        sdist, wheel = build(work / "dist")
        # The two installs share nothing but the build: side by side, as two users would (most
        # of each is pip fetching and unpacking dependencies, about 100 s apiece).
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            done = [
                pool.submit(base_install, wheel, work),
                pool.submit(server_install, sdist, work, args.pg_url),
            ]
        for future in done:
            future.result()
    except (StepFailed, subprocess.TimeoutExpired) as exc:
        log(f"FAILED {exc}")
        log(f"work directory kept: {work}")
        return 1
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    log(f"passed in {time.monotonic() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
