"""Tests of the test infrastructure itself: the fixtures talk to real servers.

Also pins docs/jax-facts.md fact 3: JAX writes its persistent cache to s3:// on
moto and gs:// on gcp-storage-emulator through etils epath, with only the
environment the s3_env / gcs_env fixtures set. Measured (jax 0.10.2, etils
1.15, moto 5.2.5, gcp-storage-emulator 2026.7.19): it works for both, about
3 s per fresh process; the object is "<bucket>/x/jit__lambda-<64 hex>-cache".
For gs:// the subprocess must have GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false
(else a 60 s gRPC probe per bucket); it inherits that from os.environ.
"""

from __future__ import annotations

import os
import re
import sys

import pytest
from support.infra import LOOPBACK, run_py

PROBES = ("CACHECTL_INFRA_PROBE", "JAX_INFRA_PROBE")


@pytest.fixture(scope="class")
def leaked_env():
    # Class scope: set up before the function-scoped isolated_home runs,
    # like a variable exported in the shell that started pytest.
    for var in PROBES:
        os.environ[var] = "leaked"
    yield
    for var in PROBES:
        os.environ.pop(var, None)


@pytest.mark.usefixtures("leaked_env")
class TestIsolatedHome:
    def test_hides_cachectl_and_jax_vars_and_isolates_xdg(self, isolated_home):
        for var, sub in (
            ("XDG_DATA_HOME", "data"),
            ("XDG_CACHE_HOME", "cache"),
            ("XDG_CONFIG_HOME", "config"),
            ("XDG_STATE_HOME", "state"),
        ):
            assert os.environ[var] == str(isolated_home / sub)
            assert os.path.isdir(os.environ[var])
        leaked = [v for v in os.environ if v.startswith(("CACHECTL_", "JAX_"))]
        assert leaked == []
        platformdirs = pytest.importorskip("platformdirs")
        assert platformdirs.user_cache_dir("cachectl").startswith(str(isolated_home))
        assert platformdirs.user_config_dir("cachectl").startswith(str(isolated_home))


def test_run_py_gets_env_overrides_and_removals(isolated_home, monkeypatch):
    monkeypatch.setenv("CACHECTL_INFRA_SET", "from-parent")
    proc = run_py(
        """
        import os, sys
        print(sys.executable)
        print(os.environ["XDG_CACHE_HOME"])
        print(os.environ.get("CACHECTL_INFRA_SET"), os.environ.get("CACHECTL_INFRA_NEW"))
        """,
        env={"CACHECTL_INFRA_SET": None, "CACHECTL_INFRA_NEW": "x"},
        check=True,
    )
    exe, cache_home, pair = proc.stdout.splitlines()
    assert exe == sys.executable
    assert cache_home == str(isolated_home / "cache")
    assert pair == "None x"
    failed = run_py("raise SystemExit(3)")
    assert failed.returncode == 3


def test_servers_listen_on_loopback(moto_server, gcs_server):
    for server in (moto_server, gcs_server):
        assert server.host == LOOPBACK == "127.0.0.1"
        assert server.url.startswith("http://127.0.0.1:")
        assert server.process.poll() is None


def test_s3fs_roundtrip_on_moto(s3_bucket, s3_env):
    import s3fs

    assert os.environ["AWS_ENDPOINT_URL"] == s3_env["AWS_ENDPOINT_URL"]
    # No endpoint argument: botocore reads AWS_ENDPOINT_URL itself.
    fs = s3fs.S3FileSystem()
    bucket = s3_bucket.removeprefix("s3://")
    fs.pipe(f"{bucket}/dir/a-cache", b"payload")
    assert fs.cat(f"{bucket}/dir/a-cache") == b"payload"
    assert fs.ls(f"{bucket}/dir", detail=False) == [f"{bucket}/dir/a-cache"]
    assert fs.info(f"{bucket}/dir/a-cache")["size"] == 7
    fs.rm(f"{bucket}/dir/a-cache")
    fs.invalidate_cache()
    assert fs.find(bucket) == []


def test_s3_buckets_are_fresh(s3_bucket):
    import s3fs

    assert re.fullmatch(r"s3://cachectl-test-[0-9a-f]{16}", s3_bucket)
    assert s3fs.S3FileSystem().find(s3_bucket) == []


def test_gcsfs_roundtrip_on_emulator(gcs_bucket, gcs_env):
    import gcsfs

    assert os.environ["STORAGE_EMULATOR_HOST"] == gcs_env["STORAGE_EMULATOR_HOST"]
    # The experimental class would probe each bucket over gRPC for 60 s.
    assert gcsfs.GCSFileSystem.__name__ == "GCSFileSystem"
    bucket = gcs_bucket.removeprefix("gs://")
    # Default credentials chain ends at "anon" against the emulator.
    fs = gcsfs.GCSFileSystem()
    assert fs.credentials.method == "anon"
    fs.pipe(f"{bucket}/dir/a-cache", b"payload")
    assert fs.cat(f"{bucket}/dir/a-cache") == b"payload"
    assert fs.ls(f"{bucket}/dir", detail=False) == [f"{bucket}/dir/a-cache"]
    assert fs.info(f"{bucket}/dir/a-cache")["size"] == 7
    anon = gcsfs.GCSFileSystem(token="anon")
    assert anon.cat(f"{bucket}/dir/a-cache") == b"payload"
    fs.rm(f"{bucket}/dir/a-cache")
    fs.invalidate_cache()
    assert fs.find(bucket) == []


def test_gcsfs_mv_is_served_by_the_emulator(gcs_bucket):
    """gcsfs's mv() uses objects.move; the emulator must answer it, not 501 (34 s of retries)."""
    import time

    import gcsfs

    fs = gcsfs.GCSFileSystem()
    bucket = gcs_bucket.removeprefix("gs://")
    fs.pipe(f"{bucket}/ns/k-cache", b"data")
    start = time.monotonic()
    fs.mv(f"{bucket}/ns/k-cache", f"{bucket}/.quarantine/t/ns/k-cache")
    assert time.monotonic() - start < 5
    fs.invalidate_cache()
    assert not fs.exists(f"{bucket}/ns/k-cache")
    assert fs.cat(f"{bucket}/.quarantine/t/ns/k-cache") == b"data"
    with pytest.raises(FileNotFoundError):
        fs.mv(f"{bucket}/ns/missing", f"{bucket}/ns/other")


def test_storage_root_through_fsspec(storage_root):
    """Each storage_root is fresh, writable and listable through plain fsspec URLs."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(storage_root)
    assert fs.find(root) == []
    with fsspec.open(f"{storage_root}/ns/k-cache", "wb") as f:
        f.write(b"entry")
    with fsspec.open(f"{storage_root}/ns/k-cache", "rb") as f:
        assert f.read() == b"entry"
    fs.invalidate_cache()
    assert [p.rsplit("/", 1)[-1] for p in fs.find(root)] == ["k-cache"]


def test_pg_url_select_1(pg_url):
    import sqlalchemy as sa

    assert pg_url.startswith("postgresql+psycopg://")
    assert "@127.0.0.1:" in pg_url
    engine = sa.create_engine(pg_url)
    try:
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT 1")).scalar_one() == 1
            dbname = conn.execute(sa.text("SELECT current_database()")).scalar_one()
            assert pg_url.endswith("/" + dbname)
            assert dbname.startswith("cachectl_t_")
            # Fresh: no tables.
            assert sa.inspect(conn).get_table_names() == []
    finally:
        engine.dispose()


def test_db_url_both_backends(db_url):
    import sqlalchemy as sa

    engine = sa.create_engine(db_url)
    try:
        meta = sa.MetaData()
        t = sa.Table(
            "t", meta, sa.Column("id", sa.Integer, primary_key=True), sa.Column("v", sa.Text)
        )
        meta.create_all(engine)
        with engine.begin() as conn:
            conn.execute(t.insert(), [{"v": "a"}, {"v": "b"}])
        with engine.connect() as conn:
            assert conn.execute(sa.select(sa.func.count()).select_from(t)).scalar_one() == 2
    finally:
        engine.dispose()


def test_sqlite_url(sqlite_url, tmp_path):
    assert sqlite_url == f"sqlite:///{tmp_path}/index.db"


JAX_CODE = """
import jax
print(jax.jit(lambda x: x + 1)(1.0))
"""


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_jax_writes_cache_to_bucket(kind, request):
    """docs/jax-facts.md fact 3: JAX's persistent cache on s3:// (moto) and gs:// (emulator)."""
    import fsspec

    bucket = request.getfixturevalue(f"{kind}_bucket")
    cache_dir = f"{bucket}/x"
    proc = run_py(
        JAX_CODE,
        env={
            "JAX_COMPILATION_CACHE_DIR": cache_dir,
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES": "none",
            "JAX_RAISE_PERSISTENT_CACHE_ERRORS": "true",
            "JAX_PLATFORMS": "cpu",
        },
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "2.0"
    fs, path = fsspec.core.url_to_fs(cache_dir)
    fs.invalidate_cache()
    names = [p.rsplit("/", 1)[-1] for p in fs.find(path)]
    assert any(re.fullmatch(r"jit__lambda-[0-9a-f]{64}-cache", n) for n in names), names
