"""CLI startup: commands load lazily, and a command imports only what it uses.

Each command runs in a fresh process on the empty embedded default (isolated_home's
XDG dirs) and reports the heavy modules left in ``sys.modules`` at exit.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from cachectl import __version__
from cachectl.cli import COMMANDS, GROUPS, CachectlGroup, cli

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("jax", "numpy", "ml_dtypes", "sqlalchemy", "pydantic", "rich", "fsspec")
NO_JAX = ("jax", "ml_dtypes")

_PROBE = f"""
import atexit, json, os, sys

def _report():
    with open(os.environ["CACHECTL_TEST_MODULES"], "w") as f:
        json.dump(sorted(m for m in sys.modules if m.split(".")[0] in {HEAVY!r}), f)

atexit.register(_report)
from cachectl.cli import main

sys.argv = ["cachectl", *sys.argv[1:]]
main()
"""


def run_fresh(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """``cachectl ARGS`` in a new interpreter: (the process, heavy top-level modules loaded)."""
    report = tmp_path / "modules.json"
    env = {
        **os.environ,
        "CACHECTL_TEST_MODULES": str(report),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    loaded = {m.split(".")[0] for m in json.loads(report.read_text())}
    return proc, loaded


def invoke(*args: str) -> str:
    result = CliRunner().invoke(cli, list(args))
    assert result.exit_code == 0, (result.output, result.exception)
    return result.output


# ----------------------------------------------------------------- the table


def test_command_table_short_help_is_each_commands_own() -> None:
    for name, (module, attribute, short) in COMMANDS.items():
        cmd = getattr(importlib.import_module(f"cachectl.cli.{module}"), attribute)
        assert cmd.name == name
        assert short == cmd.get_short_help_str(10**6), name
        stub = click.Command(name, help=short)
        for limit in range(10, 120):
            assert stub.get_short_help_str(limit) == cmd.get_short_help_str(limit), (name, limit)


def test_command_table_lists_every_registered_command() -> None:
    registered = click.Group()
    for path in sorted((ROOT / "cachectl" / "cli").glob("*_cmds.py")):
        importlib.import_module(f"cachectl.cli.{path.stem}").register(registered)
    assert sorted(registered.commands) == sorted(COMMANDS)
    for name, cmd in registered.commands.items():
        module, attribute, _ = COMMANDS[name]
        assert cmd is getattr(importlib.import_module(f"cachectl.cli.{module}"), attribute)


def test_every_command_is_in_one_help_section() -> None:
    grouped = [name for _, names in GROUPS for name in names]
    assert sorted(grouped) == sorted(COMMANDS)


def test_the_lazy_listing_is_the_loaded_one() -> None:
    def listing(group: click.Group) -> str:
        ctx = click.Context(group, info_name="cachectl")
        formatter = ctx.make_formatter()
        group.format_commands(ctx, formatter)
        return formatter.getvalue()

    loaded = CachectlGroup(commands={name: cli.get_command(None, name) for name in COMMANDS})  # type: ignore[arg-type]
    lazy = CachectlGroup(name="cachectl")
    assert lazy.commands == {}
    assert listing(lazy) == listing(loaded)
    assert lazy.commands == {}  # listing loaded none


# ----------------------------------------------------------------- imports


def test_help_imports_no_heavy_library(tmp_path) -> None:
    proc, loaded = run_fresh(tmp_path, "--help")
    assert proc.returncode == 0, proc.stderr
    for name in COMMANDS:
        assert f"\n  {name} " in proc.stdout
    assert loaded.isdisjoint(HEAVY), loaded


def test_version_is_cheap(tmp_path) -> None:
    proc, loaded = run_fresh(tmp_path, "--version")
    assert (proc.returncode, proc.stdout) == (0, f"cachectl {__version__}\n")
    assert loaded.isdisjoint(HEAVY), loaded


# (args, exit code, what to set up first in this process)
JAX_FREE = [
    (["ls"], 0, []),
    (["stats"], 0, []),
    (["cache", "list"], 0, []),
    (["cache", "add", "c2", "{tmp}/c2"], 0, []),
    (["cache", "set", "c2", "--max-size", "1GiB"], 0, [["cache", "add", "c2", "{tmp}/c2"]]),
    (["cache", "rm", "c2"], 0, [["cache", "add", "c2", "{tmp}/c2"]]),
    (["token", "list"], 0, []),
    (["token", "create", "--name", "t1", "--role", "reader"], 0, []),
    (["token", "revoke", "t1"], 0, [["token", "create", "--name", "t1", "--role", "reader"]]),
    (["prune", "--older-than", "30d", "--dry-run"], 0, []),
    (["gc", "--dry-run", "--max-size", "1GiB"], 0, []),
    (["verify"], 0, []),
    (["sync"], 0, []),
    (["db", "current"], 0, []),
    (["db", "upgrade"], 0, []),
    (["misses"], 0, []),
    (["advise", str(ROOT / "examples" / "manifest.yaml")], 0, []),
    (["bundle", "ls", "{tmp}/not-a-bundle"], 2, []),
    (["warm", "--help"], 0, []),
]


@pytest.mark.parametrize(
    ("args", "code", "setup"), JAX_FREE, ids=[" ".join(a) for a, _, _ in JAX_FREE]
)
def test_jax_free_commands_import_no_jax(tmp_path, args, code, setup) -> None:
    (tmp_path / "not-a-bundle").write_text("x")
    for step in setup:
        invoke(*(a.format(tmp=tmp_path) for a in step))
    proc, loaded = run_fresh(tmp_path, *(a.format(tmp=tmp_path) for a in args))
    assert proc.returncode == code, (proc.stdout, proc.stderr)
    assert loaded.isdisjoint(NO_JAX), loaded


# Commands that compile nothing: they read this machine's environment from the memo `cachectl
# exec` keeps (cachectl.core.probe), never from JAX in their own process.
NOTHING_COMPILED = [
    (["path"], 0),
    (["env"], 0),
    (["fingerprint", "--json"], 0),
    (["doctor", "--json"], 0),
    (["warm", "missing.yaml"], 2),
    (["token", "create", "--name", "t1", "--role", "reader"], 0),  # the stdlib driver writes it
]


def test_commands_that_compile_nothing_import_no_jax(tmp_path) -> None:
    """Once the environment is remembered and recorded, every one of them answers without JAX,
    NumPy, SQLAlchemy or pydantic in its own process (fast: BENCHMARKS.md, "Commands that compile
    nothing"), and the environment it names is this machine's."""
    from cachectl.core.fingerprint import current_environment

    # Set-up: the first run creates the embedded default's index and records this environment
    # in it (SQLAlchemy writes both), and has a child read the environment and remember it.
    first, _ = run_fresh(tmp_path, "path")
    assert first.returncode == 0, first.stderr
    for args, code in NOTHING_COMPILED:
        proc, loaded = run_fresh(tmp_path, *args)
        assert proc.returncode == code, (args, proc.stdout, proc.stderr)
        assert loaded.isdisjoint({*NO_JAX, "numpy", "sqlalchemy", "pydantic"}), (args, loaded)
        if args[0] == "fingerprint":
            digest = json.loads(proc.stdout)["digest"]
        if args[0] == "warm":
            assert f"{tmp_path}/missing.yaml (relative to the working directory" in proc.stderr
    memos = list((Path(os.environ["XDG_STATE_HOME"]) / "cachectl" / "environments").iterdir())
    assert len(memos) == 1, memos  # read once, then remembered
    # A remembered environment edited by hand is never registered: the index never recorded it.
    memo = json.loads(memos[0].read_text())
    memo["environment"]["device_kind"] = "made-up"
    memos[0].write_text(json.dumps(memo))
    proc, _ = run_fresh(tmp_path, "path")
    assert proc.returncode == 0 and "made-up" not in proc.stdout, proc.stdout
    assert "names an environment the index never recorded" in proc.stderr, proc.stderr
    # Last: importing JAX sets variables (TF_CPP_MIN_LOG_LEVEL) the memo's key includes.
    assert digest == current_environment().digest


def help_paths() -> list[tuple[str, ...]]:
    """Every command of the table and, walking each group, every subcommand under it."""
    paths: list[tuple[str, ...]] = []

    def walk(cmd: click.Command, path: tuple[str, ...]) -> None:
        paths.append(path)
        if isinstance(cmd, click.Group):
            for name in sorted(cmd.commands):
                walk(cmd.commands[name], (*path, name))

    for name, (module, attribute, _) in COMMANDS.items():
        walk(getattr(importlib.import_module(f"cachectl.cli.{module}"), attribute), (name,))
    return paths


HELP_PATHS = help_paths()


def test_help_paths_cover_every_command_and_subcommand() -> None:
    assert {p[0] for p in HELP_PATHS} == set(COMMANDS)
    for sub in (("cache", "list"), ("token", "create"), ("bundle", "create"), ("key", "generate")):
        assert sub in HELP_PATHS


# A command's help loads its module and cli.render, whose rich consoles are made on first print:
# every option's envvar, default and choices come from cheap modules (cachectl.core.config...).
@pytest.mark.parametrize("path", HELP_PATHS, ids=[" ".join(p) for p in HELP_PATHS])
def test_a_commands_help_imports_no_heavy_library(tmp_path, path) -> None:
    proc, loaded = run_fresh(tmp_path, *path, "--help")
    assert proc.returncode == 0, proc.stderr
    assert f"Usage: cachectl {' '.join(path)} " in proc.stdout, proc.stdout
    assert "--executor [thread|process]" in proc.stdout or path != ("warm",), proc.stdout
    assert loaded.isdisjoint(HEAVY), sorted(loaded & set(HEAVY))


def test_a_commands_help_builds_no_index(tmp_path) -> None:
    proc, loaded = run_fresh(tmp_path, "ls", "--help")
    assert proc.returncode == 0, proc.stderr
    assert not list(Path(os.environ["XDG_DATA_HOME"]).rglob("*.db"))


# ----------------------------------------------------------------- global options


def test_global_options_after_the_command(tmp_path) -> None:
    db = tmp_path / "after.db"
    invoke("cache", "list", "--db", f"sqlite:///{db}")
    assert db.exists()

    result = CliRunner().invoke(cli, ["stats", "--cache", "nosuch"])
    assert result.exit_code == 2 and "no cache named 'nosuch'" in result.output

    # A fresh index logs its migration at INFO: shown with -v only.
    quiet, _ = run_fresh(tmp_path, "cache", "list", "--db", f"sqlite:///{tmp_path}/quiet.db")
    loud, _ = run_fresh(tmp_path, "cache", "list", "-v", "--db", f"sqlite:///{tmp_path}/loud.db")
    assert quiet.returncode == loud.returncode == 0
    assert "INFO " not in quiet.stderr and "INFO " in loud.stderr

    warm = CliRunner().invoke(cli, ["warm", str(tmp_path / "missing.yaml"), "-v"])
    assert warm.exit_code == 2 and "No such option" not in warm.output
    assert "cannot read manifest" in warm.output


def test_verbose_counts_before_and_after_the_command() -> None:
    seen = {}

    @cli.command("probe-verbose", hidden=True)
    @click.pass_context
    def probe(ctx: click.Context) -> None:
        seen["verbose"] = ctx.find_root().params["verbose"]

    try:
        from cachectl.cli import accept_global_options

        accept_global_options(probe)
        assert CliRunner().invoke(cli, ["-v", "probe-verbose", "-v"]).exit_code == 0
        assert seen["verbose"] == 2
    finally:
        cli.commands.pop("probe-verbose")


def test_a_commands_own_option_wins_over_the_global_one() -> None:
    warm = cli.get_command(None, "warm")  # type: ignore[arg-type]
    assert warm is not None
    caches = [p for p in warm.params if "--cache" in p.opts]
    assert len(caches) == 1 and caches[0].expose_value  # warm's own --cache, no global one
    verbose = [p for p in warm.params if "-v" in p.opts]
    assert len(verbose) == 1 and not verbose[0].expose_value


def test_exec_passes_a_commands_own_v_to_it() -> None:
    exec_ = cli.get_command(None, "exec")  # type: ignore[arg-type]
    assert exec_ is not None
    with click.Context(cli, info_name="cachectl") as root:
        root.params = {"db": None, "cache_name": None, "verbose": 0}
        sub = exec_.make_context("exec", ["python", "-v", "--db", "x"], parent=root)
        assert sub.params["command"] == ("python", "-v", "--db", "x")
        assert root.params == {"db": None, "cache_name": None, "verbose": 0}
