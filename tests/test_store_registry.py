"""The store registry (core/urls.py ``STORES``) and its backend modules (storage/backends/).

A store is one registry line plus one backend module; every "is it an object store" question is
the registry's, never a list of schemes in the code. Azure Blob (``az://``, adlfs) is the store
that proved it: these tests check its URLs, its policy, its credentials and its missing package
without a server; tests/test_store.py, test_lifecycle_matrix.py, test_e2e_sync.py, test_warm.py
and test_serving.py run it against Azurite.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest
from click.testing import CliRunner

from cachectl.cli import cli
from cachectl.core.cache_info import CacheInfo
from cachectl.core.config import storage_bounds
from cachectl.core.errors import BadInput
from cachectl.core.urls import STORES, is_object_store, normalize_url, url_kind
from cachectl.storage.backends import backend
from cachectl.storage.jax_storage import child_env, jax_options

PACKAGE = Path(__file__).resolve().parents[1] / "cachectl"
# Where a store's scheme may be written: the registry and the backend modules.
REGISTRY_FILES = {"core/urls.py"}
BACKENDS_DIR = "storage/backends/"


def test_every_registry_line_names_a_backend_module_with_the_whole_interface() -> None:
    for kind, entry in STORES.items():
        module = backend(kind)
        assert module.__name__ == entry.module
        assert isinstance(module.FSSPEC, str) and module.FSSPEC
        for name in ("client_options", "jax_options", "probe_options", "bucket"):
            assert callable(getattr(module, name)), (kind, name)
        for scheme in entry.schemes:
            assert url_kind(f"{scheme}://bucket/p") == kind


def test_no_module_outside_the_registry_names_a_store_scheme() -> None:
    """The literal ("s3", "gcs") stood in five places; a new store had to find them all."""
    schemes = {s for entry in STORES.values() for s in entry.schemes} - {"file", "local", "memory"}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in REGISTRY_FILES or rel.startswith(BACKENDS_DIR):
            continue
        tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
        for tok in tokens:
            if tok.type == tokenize.STRING and tok.string.strip("\"'") in schemes:
                found.append(f"{rel}:{tok.start[0]}: {tok.string}")
    assert found == []


def test_az_urls_are_canonical_and_other_schemes_are_refused_naming_az() -> None:
    assert normalize_url(" az://models/jax/ ") == "az://models/jax"
    assert url_kind("az://models/jax") == "az" and is_object_store("az://models/jax")
    assert not is_object_store("/srv/cache") and not is_object_store("memory://x")
    with pytest.raises(BadInput, match=r"'abfs://'.*az://"):
        normalize_url("abfs://models/jax")
    with pytest.raises(BadInput, match="names no bucket"):
        normalize_url("az://")


def test_an_az_cache_is_read_only_for_services_by_default() -> None:
    info = CacheInfo(name="blob", root_url="az://models/jax")
    assert info.effective_service_writes == "deny"
    assert CacheInfo(name="disk", root_url="/srv/jax").effective_service_writes == "allow"


def test_az_options_reach_jax_with_the_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHECTL_STORAGE_CONNECT_TIMEOUT", "3")
    protocol, handed = jax_options("az://models/jax", {"account_name": "acct"}) or ("", {})
    assert protocol == "az"
    read_s = storage_bounds().read_s
    assert handed == {
        "account_name": "acct",
        "connection_timeout": 3.0,
        "read_timeout": read_s,
        "cachectl_pause_after": 1,  # JAX's client pauses after one failure (backends/az.py)
    }
    variables = child_env("az://models/jax", {"account_name": "acct"})
    assert json.loads(variables["FSSPEC_AZ"])["account_name"] == "acct"
    assert jax_options("/srv/jax", {}) is None and child_env("memory://x", {}) == {}


@pytest.mark.parametrize(
    "option",
    [
        "connection_string=DefaultEndpointsProtocol=https;AccountName=a;AccountKey=c2VjcmV0",
        "account_key=c2VjcmV0",
        "sas_token=sv=2024&sig=abc",
        "account_host=a.blob.core.windows.net?sv=2024&sig=abc",
        "accountKey=c2VjcmV0",  # camelCase names (issue 62)
        "connectionString=c2VjcmV0",
        "accessKeyId=c2VjcmV0",
    ],
)
def test_azure_credentials_never_reach_the_index(option: str) -> None:
    result = CliRunner().invoke(
        cli, ["cache", "add", "blob", "az://models/jax", "--storage-option", option]
    )
    assert result.exit_code == 2, result.output
    assert "credential" in result.output and "AZURE_STORAGE_" in result.output
    assert "c2VjcmV0" not in result.output and "sig=abc" not in result.output


def test_a_missing_adlfs_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """Without adlfs (blocked in the child), an az:// cache names the package and the extra."""
    code = (
        "import sys; sys.modules['adlfs'] = None\n"
        "from cachectl.cli import main\n"
        "sys.argv = ['cachectl', 'cache', 'add', 'blob', 'az://models/jax']\n"
        "main()\n"
    )
    env = {
        "XDG_DATA_HOME": str(tmp_path / "data"),
        "XDG_CONFIG_HOME": str(tmp_path / "config"),
        "XDG_STATE_HOME": str(tmp_path / "state"),
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
        "PATH": "/usr/bin:/bin",
    }
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "adlfs" in lines[0] and "cachectl-jax[azure]" in lines[0], lines


def test_the_docs_az_block_runs_as_written_against_azurite(
    tmp_path: Path, az_env: dict[str, str]
) -> None:
    """docs/commands.md's az:// commands, unchanged, with Azurite's account in the environment
    (the docs test skips the block: it needs an account)."""
    from support.infra import create_az_container

    page = (Path(__file__).resolve().parents[1] / "docs" / "commands.md").read_text()
    section = page[page.index("## Azure Blob Storage (`az://`)") :]
    start = section.index("```sh\n") + len("```sh\n")
    block = section[start : section.index("```", start)]
    assert "az://jax-cache/prod" in block, block
    create_az_container(az_env["AZURE_STORAGE_CONNECTION_STRING"], "jax-cache")
    bin_dir = str(Path(sys.executable).parent)
    proc = subprocess.run(
        ["bash", "-e", "-c", block],
        capture_output=True,
        text=True,
        env={**os.environ, "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}"},
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    listed = json.loads(
        CliRunner().invoke(cli, ["cache", "list", "--json"], catch_exceptions=False).output
    )
    blob = next(c for c in listed if c["name"] == "blob")
    assert blob["root_url"] == "az://jax-cache/prod"
    assert blob["storage_options"] == {"assume_container_exists": True}
