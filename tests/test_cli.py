"""The core CLI: output contracts, bad input, permissions and config precedence."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest
from click.testing import CliRunner

from cachectl.cli import cli
from cachectl.core.config import load_settings


def run(*args: str, code: int = 0) -> str:
    result = CliRunner().invoke(cli, list(args))
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    return result.output


def cachectl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The installed entry point in a real process: what users and scripts see."""
    return subprocess.run(
        [sys.executable, "-m", "cachectl", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=120,
    )


def test_embedded_default_needs_no_setup(tmp_path) -> None:
    path = run("path").strip()
    assert path.startswith(os.environ["XDG_CACHE_HOME"])
    assert os.path.exists(os.path.join(path, "env.json"))
    assert os.path.exists(os.path.join(os.environ["XDG_DATA_HOME"], "cachectl", "index.db"))
    mode = stat.S_IMODE(os.stat(path).st_mode)
    assert not mode & stat.S_IWOTH and not mode & stat.S_IWGRP
    listing = json.loads(run("ls", "--json"))
    assert listing["cache"] == "default" and len(listing["environments"]) == 1


def test_fingerprint_json_and_env_formats() -> None:
    fp = json.loads(run("fingerprint", "--json"))
    assert {"digest", "namespace", "jax_version", "backend", "xla_flags", "compression"} <= set(fp)
    variables = json.loads(run("env", "--format", "json"))
    assert variables["JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES"] == "none"
    assert variables["JAX_COMPILATION_CACHE_MAX_SIZE"] == "-1"
    assert variables["JAX_COMPILATION_CACHE_DIR"].endswith(fp["namespace"])
    assert "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in variables
    sh = run("env")
    assert sh.startswith("export JAX_COMPILATION_CACHE_DIR=")
    ro = json.loads(run("env", "--format", "json", "--readonly"))
    assert float(ro["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]) >= 1e9
    dotenv = run("env", "--format", "dotenv")
    assert "JAX_COMPILATION_CACHE_DIR=" in dotenv.splitlines()[0]


def test_exec_runs_with_the_service_environment(tmp_path) -> None:
    proc = cachectl(
        "exec",
        "--",
        sys.executable,
        "-c",
        "import os; print(os.environ['JAX_COMPILATION_CACHE_DIR'])",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == cachectl("path").stdout.strip()


def test_cache_lifecycle(tmp_path) -> None:
    root = tmp_path / "team"
    out = json.loads(
        run(
            "cache",
            "add",
            "team",
            str(root),
            "--max-size",
            "50GiB",
            "--max-entry-size",
            "500MB",
            "--retention",
            "30d",
            "--json",
        )
    )
    assert out["max_size"] == 50 * 1024**3 and out["max_entry_size"] == 500 * 1000**2
    assert out["retention_seconds"] == 30 * 86400
    run("cache", "set", "team", "--max-size", "1GiB")
    caches = {c["name"]: c for c in json.loads(run("cache", "list", "--json"))}
    assert caches["team"]["max_size"] == 1024**3 and "default" in caches
    run("--cache", "team", "path")
    err = run("cache", "rm", "team", code=2)
    assert "--purge" in err
    namespaces = list(root.glob("jax-*"))
    assert namespaces
    dry = json.loads(run("cache", "rm", "team", "--purge", "--dry-run", "--json"))
    assert dry["environments"] == 1 and list(root.glob("jax-*"))
    run("cache", "rm", "team", "--purge")
    assert not list(root.glob("jax-*/*/*"))
    assert "team" not in {c["name"] for c in json.loads(run("cache", "list", "--json"))}


BAD_INPUT = [
    (["cache", "add", "x", "ftp://host/path"], "unsupported storage URL scheme"),
    (["cache", "add", "x", "/tmp/x", "--max-size", "lots"], "bad size"),
    (["cache", "add", "x", "/tmp/x", "--retention", "30 days"], "bad duration"),
    (["cache", "add", "bad name!", "/tmp/x"], "bad cache name"),
    (["--cache", "missing", "path"], "no cache named 'missing'"),
    (["--cache", "missing", "ls"], "no cache named 'missing'"),
    (["--db", "postgresql+psycopg://nobody@127.0.0.1:1/none", "ls"], "unreachable"),
    (["--db", "mysql://x/y", "ls"], "unsupported index database"),
    (["--db", "not a url", "ls"], "bad index URL"),
    (["ls", "--env", "zz"], "bad environment digest prefix"),
    (["ls", "--env", "0000000000000000000"], "no environment"),
    (["cache", "add", "x", "s3://"], "names no bucket"),
]


@pytest.mark.parametrize(("args", "message"), BAD_INPUT, ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_bad_input_is_one_line_exit_2(args: list[str], message: str) -> None:
    proc = cachectl(*args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not proc.stdout.strip()


def test_bad_input_writes_nothing(tmp_path) -> None:
    run("cache", "add", "x", str(tmp_path / "never"), "--max-size", "huge", code=2)
    assert not (tmp_path / "never").exists()
    assert "x" not in {c["name"] for c in json.loads(run("cache", "list", "--json"))}


def test_corrupt_env_json_is_bad_input(tmp_path) -> None:
    path = run("path").strip()
    with open(os.path.join(path, "env.json"), "w") as fh:
        fh.write("{not json")
    proc = cachectl("path")
    assert proc.returncode == 2 and "corrupt" in proc.stderr and "Traceback" not in proc.stderr
    with open(os.path.join(path, "env.json")) as fh:
        assert fh.read() == "{not json"  # left for a person to inspect


def test_writers_policy_refuses_others_with_exit_4(tmp_path) -> None:
    run("cache", "add", "locked", str(tmp_path / "locked"), "--writers", "alice,@nosuchgroup")
    proc = cachectl("--cache", "locked", "sync")
    assert proc.returncode == 4, proc.stderr
    assert "may not sync" in proc.stderr and "alice" in proc.stderr
    proc = cachectl("cache", "set", "locked", "--max-size", "1GiB")
    assert proc.returncode == 4
    import getpass

    run("cache", "add", "mine", str(tmp_path / "mine"), "--writers", getpass.getuser())
    run("--cache", "mine", "sync")


def test_group_shared_tree_is_setgid(tmp_path) -> None:
    import grp

    group = grp.getgrgid(os.getgid()).gr_name
    run("cache", "add", "shared", str(tmp_path / "shared"), "--group", group)
    path = run("--cache", "shared", "path").strip()
    for directory in (tmp_path / "shared", path):
        st = os.stat(directory)
        assert stat.S_IMODE(st.st_mode) == 0o2775, oct(st.st_mode)
        assert st.st_gid == grp.getgrnam(group).gr_gid
    run("cache", "add", "nogroup", str(tmp_path / "ng"), "--group", "no-such-group-xyz", code=2)


def test_db_commands(tmp_path) -> None:
    db = f"sqlite:///{tmp_path}/fresh.db"
    current = json.loads(run("--db", db, "db", "current", "--json"))
    assert current["current"] is None and not current["up_to_date"]
    run("--db", db, "db", "upgrade")
    current = json.loads(run("--db", db, "db", "current", "--json"))
    assert current["up_to_date"]


def test_config_precedence(tmp_path, monkeypatch) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text('db = "sqlite:///from-file.db"\ncache = "file-cache"\n')
    monkeypatch.setenv("CACHECTL_CONFIG", str(cfg))
    assert load_settings().cache == "file-cache"
    assert load_settings().db == "sqlite:///from-file.db"
    monkeypatch.setenv("CACHECTL_CACHE", "env-cache")
    assert load_settings().cache == "env-cache"
    assert load_settings(cache="flag-cache").cache == "flag-cache"
    cfg.write_text("nonsense = 1\n")
    proc = cachectl("ls")
    assert proc.returncode == 2 and "unknown key" in proc.stderr


def test_help_reads_well() -> None:
    out = run("--help")
    for command in ("cache", "db", "env", "exec", "fingerprint", "ls", "path", "stats", "sync"):
        assert command in out
    assert "Exit codes" in out
    proc = cachectl("--help")
    assert proc.returncode == 0


def test_stats_json() -> None:
    run("path")
    stats = json.loads(run("stats", "--json"))
    assert stats[0]["cache"]["name"] == "default" and stats[0]["environments"] == 1


def test_storage_options_never_hold_secrets(tmp_path) -> None:
    out = json.loads(
        run(
            "cache",
            "add",
            "opts",
            str(tmp_path / "o"),
            "--storage-option",
            "auto_mkdir=true",
            "--json",
        )
    )
    assert out["storage_options"] == {"auto_mkdir": True}
    err = run("cache", "add", "leaky", "s3://b/p", "--storage-option", "secret=hunter2", code=2)
    assert "credential" in err and "hunter2" not in json.dumps(
        json.loads(run("cache", "list", "--json"))
    )
    run("cache", "add", "bad", str(tmp_path / "b"), "--storage-option", "novalue", code=2)


# ------------------------------------------------------------ the newcomer's path (issue 14)


def test_env_takes_json_like_every_reporting_command() -> None:
    assert json.loads(run("env", "--json")) == json.loads(run("env", "--format", "json"))
    err = run("env", "--json", "--format", "sh", code=2)
    assert (
        err.startswith("cachectl: error: --json and --format sh contradict")
        and err.count("\n") == 1
    )


def test_warm_check_help_says_it_checks_not_fills() -> None:
    assert "Cache to check" in run("warm-check", "--help")
    assert "Cache to fill" not in run("warm-check", "--help")
    assert "Cache to fill" in run("warm", "--help")


def test_stats_since_without_telemetry_says_what_produces_it() -> None:
    run("path")
    out = run("stats", "--since", "24h")
    assert "no service telemetry in this window" in out and "cachectl.activate()" in out
    assert json.loads(run("stats", "--since", "24h", "--json"))["environments"] == []


def _bad_manifest(tmp_path, n_bad: int) -> str:
    args = "".join(f"      - {{shape: [1], dtype: bfloat6{i}}}\n" for i in range(n_bad))
    (tmp_path / "cm_cli_f.py").write_text("def f(*args):\n    return args\n")  # imports fine
    path = tmp_path / "bad.yaml"
    path.write_text(f"version: 1\nfunctions:\n  - fn: cm_cli_f:f\n    args:\n{args}")
    return str(path)


def test_manifest_validation_lists_every_problem(tmp_path) -> None:
    path = _bad_manifest(tmp_path, 3)
    proc = cachectl("warm", path, "--dry-run")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert [line.split(": ")[2] for line in lines] == [f"{path}:{n}" for n in (5, 6, 7)], lines
    assert all(line.startswith("cachectl: error: ") and "unknown dtype" in line for line in lines)
    assert not os.path.exists(
        os.path.join(os.environ["XDG_CACHE_HOME"], "cachectl")
    )  # nothing written


def test_manifest_validation_caps_the_list(tmp_path) -> None:
    from cachectl.manifest import MAX_PROBLEMS

    path = _bad_manifest(tmp_path, MAX_PROBLEMS + 5)
    result = CliRunner().invoke(cli, ["warm", path])
    assert result.exit_code == 2
    lines = result.output.splitlines()
    assert len(lines) == MAX_PROBLEMS + 1
    assert lines[-1] == f"cachectl: error: {path}: (and 5 more problems)"


def test_warm_dry_run_lists_every_kind_of_problem_at_once(tmp_path) -> None:
    (tmp_path / "cm_cli_models.py").write_text("def mlp_loss(x):\n    return x\n")
    path = tmp_path / "every.yaml"
    path.write_text(
        "version: 1\n"
        "functions:\n"
        "  - fn: cm_cli_models:mlp_los\n"
        "    args:\n"
        "      - {shape: [batch, seq], dtype: float23}\n"
        "    buckets:\n"
        "      batch: [1, 2]\n"
    )
    proc = cachectl("warm", str(path), "--dry-run")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines() == [
        f"cachectl: error: {path}:3: functions[0].fn: 'cm_cli_models' has no attribute "
        "'mlp_los'; did you mean 'mlp_loss'?",
        f"cachectl: error: {path}:5: functions[0].args[0].dtype: unknown dtype 'float23' "
        "(use a numpy/jax dtype name such as bfloat16, float32, int32)",
        f"cachectl: error: {path}:5: functions[0].args[0].shape[1]: unknown axis 'seq' "
        "(declared axes: batch)",
    ]
    assert proc.stdout == ""


FAILING_USER_MODULE = """
import jax
import jax.numpy as jnp


def params(batch):
    if batch > 2:
        raise ValueError(f"no weights for batch {batch}")
    return {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32)}


def step(p, x):
    return helper(p["w"], x)


def helper(w, x):
    return x @ w[:3]
"""

FAILING_USER_MANIFEST = """version: 1
functions:
  - fn: nw_bad:step
    args:
      - {pytree: nw_bad:params}
      - {shape: [batch, 8], dtype: float32}
    buckets: {batch: [1, 4]}
"""


def _failing_project(tmp_path) -> None:
    (tmp_path / "nw_bad.py").write_text(FAILING_USER_MODULE.lstrip("\n"))
    (tmp_path / "bad.yaml").write_text(FAILING_USER_MANIFEST)


def _in(tmp_path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cachectl", *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )


def _cache_files() -> list[str]:
    root = os.path.join(os.environ["XDG_CACHE_HOME"], "cachectl")
    return [f for _, _, files in os.walk(root) for f in files if f.endswith("-cache")]


def test_failed_bucket_names_the_user_line_and_v_prints_its_traceback(tmp_path) -> None:
    _failing_project(tmp_path)
    quiet = _in(tmp_path, "warm", "bad.yaml", "--json", "--jobs", "1")
    assert quiet.returncode == 1, quiet.stderr
    errors = [b["error"] for b in json.loads(quiet.stdout)["buckets"]]
    assert errors[0].startswith("TypeError: dot_general") and errors[0].endswith(
        "(at nw_bad.py:16)"
    )
    assert errors[1].endswith("raised ValueError: no weights for batch 4 (at nw_bad.py:7)")
    assert (
        "Traceback" not in quiet.stderr and "-v prints the traceback of your code" in quiet.stderr
    )

    loud = _in(tmp_path, "-v", "warm", "bad.yaml", "--json", "--jobs", "1")
    assert loud.returncode == 1
    assert "step[batch=1] failed:\nTraceback (your code only" in loud.stderr
    assert (
        'nw_bad.py", line 12, in step\n' in loud.stderr
        and 'nw_bad.py", line 16, in helper\n' in loud.stderr
    )
    assert 'nw_bad.py", line 7, in params\n' in loud.stderr
    assert "ValueError: no weights for batch 4\n" in loud.stderr
    frames = [line for line in loud.stderr.splitlines() if line.startswith('  File "')]
    assert frames and all("nw_bad.py" in line for line in frames), (
        frames
    )  # no cachectl or JAX frames


def test_dry_run_builds_pytrees_and_reports_their_errors_as_bad_input(tmp_path) -> None:
    _failing_project(tmp_path)
    proc = _in(tmp_path, "warm", "bad.yaml", "--dry-run")
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    # params(batch) varies with the buckets without leaf_axes: said once, before the error.
    lines = proc.stderr.splitlines()
    assert [line for line in lines if "declares no leaf_axes" not in line] == [
        "cachectl: error: bad.yaml:5: functions[0].args[0].pytree: nw_bad:params() raised "
        "ValueError: no weights for batch 4 (at nw_bad.py:7)"
    ], proc.stderr
    assert len(lines) <= 2
    assert _cache_files() == []
    (tmp_path / "bad.yaml").write_text(FAILING_USER_MANIFEST.replace("[1, 4]", "[1, 2]"))
    ok = _in(tmp_path, "warm", "bad.yaml", "--dry-run", "--json")  # builds, compiles nothing
    assert ok.returncode == 0, ok.stderr
    assert [b["status"] for b in json.loads(ok.stdout)["buckets"]] == ["planned", "planned"]
    assert _cache_files() == []


LOG_MODULE = """
def scale_rows_for_the_log_test(x):
    return x * 2


def other_function(x):
    return x + 1
"""

LOG_MANIFEST = """version: 1
functions:
  - fn: cm_log_tables:scale_rows_for_the_log_test
    args:
      - {shape: [batch, 4], dtype: float32}
    buckets: {batch: [1, 2]}
  - fn: cm_log_tables:other_function
    args:
      - {shape: [3], dtype: float32}
"""


def test_tables_in_a_pipe_keep_every_identifier_on_one_line(tmp_path) -> None:
    """Logs are read by grep: with stdout a pipe and no COLUMNS, or with --wide under a narrow
    COLUMNS, no key, digest, path, bucket label or cache name is wrapped, folded or cut."""
    (tmp_path / "cm_log_tables.py").write_text(LOG_MODULE.lstrip("\n"))
    (tmp_path / "m.yaml").write_text(LOG_MANIFEST)
    name = "team-cache-with-a-name-wider-than-the-terminal"
    root = tmp_path / "a-cache-root-whose-path-is-far-wider-than-forty-columns" / "team"

    def piped(*args: str, columns: str | None = None) -> str:
        env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
        proc = subprocess.run(
            [sys.executable, "-m", "cachectl", "--cache", name, *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
            env={**env, **({"COLUMNS": columns} if columns else {})},
        )
        assert proc.returncode == 0, (args, proc.stdout, proc.stderr)
        return proc.stdout

    piped("cache", "add", name, str(root))
    piped("warm", "m.yaml", "--jobs", "1")
    env = json.loads(piped("ls", "--json"))["environments"][0]
    entries = json.loads(piped("ls", "--env", env["digest"][:16], "--json"))["entries"]
    keys = sorted(e["key"] for e in entries if e["function"] == "scale_rows_for_the_log_test")
    assert len(keys) == 2 and all(len(k) > 40 for k in keys)
    namespace_path = f"{root}/{env['namespace']}"
    expected = {
        ("ls",): [name, str(root), env["digest"][:16]],
        ("ls", "--env", env["digest"][:16]): [
            name,
            env["namespace"],
            *keys,
            "batch=1",
            "batch=2",
            "scale_rows_for_the_log_test",
        ],
        ("stats",): [name, str(root)],
        ("warm-check", "m.yaml"): [
            namespace_path,
            "scale_rows_for_the_log_test",
            "batch=1",
            "batch=2",
            *(k.rsplit("-", 1)[-1][:12] for k in keys),
        ],
        ("prune", "--dry-run", "--older-than", "1s", "--function", "scale_rows_for_the_log_test"): [
            name,
            env["namespace"],
            *keys,
        ],
    }
    for args, identifiers in expected.items():
        for out in (piped(*args), piped(*args, "--wide", columns="40")):
            lines = out.splitlines()
            for identifier in identifiers:
                assert any(identifier in line for line in lines), (args, identifier, out)
