"""open_index (cachectl/index/open.py): the one choice of index driver, from a table of dotted paths."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.infra import run_py  # noqa: E402

from cachectl.core.config import Settings
from cachectl.core.errors import BadInput
from cachectl.index import open as index_open
from cachectl.index import open_index
from cachectl.index.stdlib import StdlibReads


def _settings(tmp_path: Path, server: str | None = None) -> Settings:
    return Settings(
        db=f"sqlite:///{tmp_path}/i.db", cache="svc", default_root=str(tmp_path), server=server
    )


def test_a_plain_sqlite_index_opens_the_stdlib_driver_and_writes_through_sqlalchemy(
    tmp_path: Path,
) -> None:
    settings = _settings(tmp_path)
    first = open_index(settings)  # no file yet: the SQLAlchemy driver creates and migrates it
    assert type(first).__name__ == "Index"
    first.add_cache("svc", str(tmp_path / "root"))
    first.close()
    index = open_index(settings, "service")
    try:
        assert isinstance(index, StdlibReads)
        assert index.get_cache("svc").root_url == str(tmp_path / "root")
        assert index.ensure_cache("other", str(tmp_path / "o")).name == "other"  # the SQL driver's
        assert [c.name for c in index.list_caches()] == ["other", "svc"]
    finally:
        index.close()


def test_an_unknown_driver_or_role_is_bad_input(tmp_path: Path, monkeypatch) -> None:
    with pytest.raises(BadInput, match="unknown index driver 'nope': use one of http, sqlalchemy"):
        index_open.driver("nope")
    with pytest.raises(BadInput, match="unknown index role 'admin'"):
        open_index(_settings(tmp_path), "admin")  # type: ignore[call-overload]
    monkeypatch.setitem(index_open.DRIVERS, "broken", "cachectl_no_such_module:Driver")
    with pytest.raises(BadInput, match="index driver 'broken' cannot load"):
        index_open.driver("broken")


def test_server_mode_opens_the_http_driver_without_touching_the_file(tmp_path: Path) -> None:
    index = open_index(_settings(tmp_path, server="http://127.0.0.1:9"), "service")
    try:
        assert index.dialect == "remote"
        assert not (tmp_path / "i.db").exists()
    finally:
        index.close()


def test_opening_the_stdlib_driver_imports_neither_sqlalchemy_nor_httpx(tmp_path: Path) -> None:
    open_index(_settings(tmp_path)).close()  # create the file at the current schema
    proc = run_py(
        f"""
        import sys
        from cachectl.core.config import Settings
        from cachectl.index import open_index
        index = open_index(Settings(db="sqlite:///{tmp_path}/i.db", cache="svc", default_root="/"))
        print(type(index).__name__, sorted(m for m in ("sqlalchemy", "httpx") if m in sys.modules))
        """,
        check=True,
    )
    assert proc.stdout.split() == ["StdlibReads", "[]"], proc.stdout


def test_activation_holds_its_index_for_its_own_process_only(tmp_path: Path) -> None:
    """activate() keeps the index it opened (Activation.index); a forked child never gets the
    parent's connection (SQLite's rule), so it opens its own."""
    settings = _settings(tmp_path)
    index = open_index(settings)
    index.add_cache("svc", str(tmp_path / "root"))
    index.close()
    proc = run_py(
        f"""
        import os, cachectl
        a = cachectl.activate("svc", db={settings.db!r}, telemetry=False)
        pid = os.fork()
        if pid == 0:
            print("child", type(a.index).__name__, flush=True)
            os._exit(0)
        os.waitpid(pid, 0)
        print("parent", type(a.index).__name__, a.indexed, flush=True)
        """,
        check=True,
    )
    assert sorted(proc.stdout.split("\n")[:2]) == ["child NoneType", "parent StdlibReads True"], (
        proc.stdout + proc.stderr
    )


def test_each_index_read_is_written_once_per_side() -> None:
    """A cache's and an environment's reads: the SQL text once (index/reads.py, both SQL
    drivers), the http driver's call and the server's route; nowhere else."""
    import ast

    root = Path(__file__).resolve().parent.parent
    found: dict[str, list[str]] = {}
    for pkg in ("cachectl", "server"):
        for path in sorted((root / pkg).rglob("*.py")):
            if path.name == "protocol.py":  # the interface, not an implementation
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef):
                    found.setdefault(node.name, []).append(str(path.relative_to(root)))
    for name in ("get_cache", "list_caches", "environment_stats", "find_environment"):
        assert len(found[name]) <= 3, (name, found[name])
    assert found["get_cache"] == [
        "cachectl/client/remote.py",
        "cachectl/index/reads.py",
        "server/api.py",
    ]
