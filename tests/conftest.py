"""Shared fixtures: real PostgreSQL, S3 (moto) and GCS (gcp-storage-emulator) on loopback.

Fixtures (see tests/infra.py for what was found about each service):

  isolated_home   autouse. XDG_DATA_HOME / XDG_CACHE_HOME / XDG_CONFIG_HOME /
                  XDG_STATE_HOME -> fresh dirs under tmp_path; every CACHECTL_*
                  and JAX_* variable removed, and COLUMNS and LINES (xdist's workers
                  set COLUMNS; a test's commands print as to a log). Yields the tmp
                  "home" Path.
  moto_server     session. infra.Server for moto's S3 API (.url, .port, .env).
  s3_env          function. Sets AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID,
                  AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION; yields that dict.
  s3_bucket       function. A fresh bucket on moto; yields "s3://<bucket>".
  gcs_server      session. infra.Server for gcp-storage-emulator (plus the
                  objects.move call gcsfs's mv() uses; see infra.gcs_emulator_main).
  gcs_env         function. Sets STORAGE_EMULATOR_HOST (and the process-wide
                  GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false, NO_GCE_CHECK=true);
                  yields that dict.
  gcs_bucket      function. A fresh bucket on the emulator; yields "gs://<bucket>".
  azurite_server  session. infra.Server for Azurite's Blob service (the Azure
                  Storage emulator, installed by scripts/test's setup_azurite).
  az_env          function. Sets AZURE_STORAGE_CONNECTION_STRING; yields that dict.
  az_container    function. A fresh container on Azurite; yields "az://<container>".
  pg_url          function. A fresh PostgreSQL database (dropped afterwards);
                  yields its SQLAlchemy URL "postgresql+psycopg://...".
  sqlite_url      function. "sqlite:///<tmp_path>/index.db".
  db_url          function, parametrized [sqlite, postgresql]: one of the two.
  storage_root    function, parametrized [local, memory, s3, gcs, az]: a fresh root
                  URL: <tmp_path>/cache, memory://cachectl-test-<id>,
                  s3://<fresh bucket>/cachectl, gs://<fresh bucket>/cachectl,
                  az://<fresh container>/cachectl.

Servers start lazily, the first time a test asks for them, and stop at the
end of the session. Set CACHECTL_TEST_PG_URL (scripts/test does) for the
PostgreSQL fixtures; CACHECTL_TEST_NO_PG=1 skips them instead of failing.
Azurite is found through CACHECTL_TEST_AZURITE (scripts/test), the checkout's
.test-azurite/ or PATH; CACHECTL_TEST_NO_AZURITE=1 skips the az:// tests.
"""

from __future__ import annotations

import copy
import os

import pytest
from support import infra

# Fixtures shared by several test modules, defined in tests/support/.
pytest_plugins = ["support.bundles"]

# Before anything imports gcsfs or google.auth (they read some of these at import).
infra.configure_process_env()

# Read once: isolated_home removes every CACHECTL_* variable from each test's
# environment, these two included.
PG_ADMIN_URL = os.environ.get("CACHECTL_TEST_PG_URL") or None
NO_PG = os.environ.get("CACHECTL_TEST_NO_PG") == "1"
AZURITE = infra.azurite_command()
NO_AZURITE = os.environ.get("CACHECTL_TEST_NO_AZURITE") == "1"


# Heavy tests (pip installs, full warms, benchmarks) run in CI (.ci/run sets CI=true)
# or with CACHECTL_TEST_HEAVY=1; a quick local run skips them.
RUN_HEAVY = (
    os.environ.get("CI", "").lower() in ("1", "true")
    or os.environ.get("CACHECTL_TEST_HEAVY") == "1"
)


def pytest_collection_modifyitems(config, items):
    if RUN_HEAVY:
        return
    skip = pytest.mark.skip(reason="heavy: runs in CI (CI=true) or with CACHECTL_TEST_HEAVY=1")
    for item in items:
        if "heavy" in item.keywords:
            item.add_marker(skip)


# ------------------------------------------------------------ environment


@pytest.fixture(autouse=True)
def isolated_home(tmp_path_factory, monkeypatch):
    """Point XDG dirs at a fresh tmp dir and drop CACHECTL_*/JAX_* variables, and COLUMNS
    (pytest-xdist's workers set it): a command's output is a log's, whole lines, unless a
    test gives COLUMNS or a terminal (tests/test_tty.py)."""
    home = tmp_path_factory.mktemp("home")
    for var, sub in (
        ("XDG_DATA_HOME", "data"),
        ("XDG_CACHE_HOME", "cache"),
        ("XDG_CONFIG_HOME", "config"),
        ("XDG_STATE_HOME", "state"),
    ):
        (home / sub).mkdir()
        monkeypatch.setenv(var, str(home / sub))
    for var in list(os.environ):
        if var.startswith(("CACHECTL_", "JAX_")) or var in ("COLUMNS", "LINES"):
            monkeypatch.delenv(var)
    # fsspec's per-protocol defaults are process-wide: an in-process activate() hands them a
    # cache's endpoint and bounds (storage/jax_storage.py), which the next test must not inherit.
    import fsspec.config

    saved = copy.deepcopy(fsspec.config.conf)
    yield home
    fsspec.config.conf.clear()
    fsspec.config.conf.update(saved)


def _set_env(monkeypatch, values: dict[str, str]) -> None:
    for key, value in values.items():
        monkeypatch.setenv(key, value)
    infra.clear_fsspec_instance_caches()


# -------------------------------------------------------------------- S3


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory):
    server = infra.start_moto(tmp_path_factory.mktemp("moto-logs"))
    yield server
    server.stop()


@pytest.fixture
def s3_env(moto_server, monkeypatch):
    env = dict(moto_server.env)
    _set_env(monkeypatch, env)
    yield env
    infra.clear_fsspec_instance_caches()


@pytest.fixture
def s3_bucket(s3_env):
    name = infra.unique_name()
    infra.create_s3_bucket(s3_env["AWS_ENDPOINT_URL"], name)
    yield f"s3://{name}"


# ------------------------------------------------------------------- GCS


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
    server = infra.start_gcs_emulator(tmp_path_factory.mktemp("gcs-logs"))
    yield server
    server.stop()


@pytest.fixture
def gcs_env(gcs_server, monkeypatch):
    env = dict(gcs_server.env)
    _set_env(monkeypatch, env)
    yield env
    infra.clear_fsspec_instance_caches()


@pytest.fixture
def gcs_bucket(gcs_env):
    name = infra.unique_name()
    infra.create_gcs_bucket(gcs_env["STORAGE_EMULATOR_HOST"], name)
    yield f"gs://{name}"


# ------------------------------------------------------------ Azure Blob


@pytest.fixture(scope="session")
def azurite_server(tmp_path_factory):
    if NO_AZURITE:
        pytest.skip("Azure Blob tests skipped: CACHECTL_TEST_NO_AZURITE=1")
    if AZURITE is None:
        pytest.fail(
            "Azurite (npm package azurite) is not installed. Run the tests through scripts/test, "
            "which installs it (setup_azurite), or export CACHECTL_TEST_AZURITE=/path/to/azurite-blob, "
            "or set CACHECTL_TEST_NO_AZURITE=1 to skip the az:// tests.",
            pytrace=False,
        )
    server = infra.start_azurite(AZURITE, tmp_path_factory.mktemp("azurite-logs"))
    yield server
    server.stop()


@pytest.fixture
def az_env(azurite_server, monkeypatch):
    env = dict(azurite_server.env)
    _set_env(monkeypatch, env)
    yield env
    infra.clear_fsspec_instance_caches()


@pytest.fixture
def az_container(az_env):
    name = infra.unique_name()
    infra.create_az_container(az_env["AZURE_STORAGE_CONNECTION_STRING"], name)
    yield f"az://{name}"


# -------------------------------------------------------------- databases


@pytest.fixture(scope="session")
def pg_admin_url():
    """CACHECTL_TEST_PG_URL, checked once: the database new test databases are made from."""
    if PG_ADMIN_URL is None:
        if NO_PG:
            pytest.skip("PostgreSQL tests skipped: CACHECTL_TEST_NO_PG=1")
        pytest.fail(
            "CACHECTL_TEST_PG_URL is not set. Run the tests through scripts/test, which "
            "installs and starts PostgreSQL, or export CACHECTL_TEST_PG_URL="
            "postgresql+psycopg://USER:PASS@127.0.0.1:PORT/DB (a role with CREATEDB), "
            "or set CACHECTL_TEST_NO_PG=1 to skip the PostgreSQL tests.",
            pytrace=False,
        )
    try:
        infra.pg_check(PG_ADMIN_URL)
    except Exception as exc:
        pytest.fail(f"cannot connect to CACHECTL_TEST_PG_URL: {exc}", pytrace=False)
    return PG_ADMIN_URL


@pytest.fixture
def pg_url(pg_admin_url):
    name = infra.unique_name("cachectl_t").replace("-", "_")
    url = infra.pg_create_database(pg_admin_url, name)
    yield url
    infra.pg_drop_database(pg_admin_url, name)


@pytest.fixture
def sqlite_url(tmp_path):
    return f"sqlite:///{tmp_path / 'index.db'}"


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request):
    name = {"sqlite": "sqlite_url", "postgresql": "pg_url"}[request.param]
    return request.getfixturevalue(name)


# ---------------------------------------------------------------- storage


@pytest.fixture(params=["local", "memory", "s3", "gcs", "az"])
def storage_root(request, tmp_path):
    kind = request.param
    if kind == "local":
        yield str(tmp_path / "cache")
    elif kind == "memory":
        import fsspec

        url = f"memory://{infra.unique_name()}"
        yield url
        fs = fsspec.filesystem("memory")
        if fs.exists(url):
            fs.rm(url, recursive=True)
    elif kind == "s3":
        yield request.getfixturevalue("s3_bucket") + "/cachectl"
    elif kind == "az":
        yield request.getfixturevalue("az_container") + "/cachectl"
    else:
        yield request.getfixturevalue("gcs_bucket") + "/cachectl"
