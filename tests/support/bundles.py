"""Bundles for tests: a warmed, bundled tiny manifest on a fresh home, and a bundle's members."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path
from typing import Any

import pytest
import zstandard

from support.warming import invoke, tiny, warm_json


def fresh_home(tmp_path: Path, monkeypatch, name: str) -> Path:
    home = tmp_path / name
    for var, sub in (
        ("XDG_DATA_HOME", "data"),
        ("XDG_CACHE_HOME", "cache"),
        ("XDG_CONFIG_HOME", "config"),
        ("XDG_STATE_HOME", "state"),
    ):
        (home / sub).mkdir(parents=True)
        monkeypatch.setenv(var, str(home / sub))
    return home


def default_root() -> Path:
    return Path(os.environ["XDG_CACHE_HOME"]) / "cachectl" / "default"


def environments() -> list[dict[str, Any]]:
    return json.loads(invoke("ls", "--json").stdout)["environments"]


def assert_nothing_installed() -> None:
    root = default_root()
    found = [p for p in root.rglob("*")] if root.exists() else []
    assert found == [], found
    assert environments() == []


def members(path: Path) -> list[tuple[tarfile.TarInfo, bytes]]:
    with open(path, "rb") as fh:
        raw = zstandard.ZstdDecompressor().stream_reader(fh, read_across_frames=True).read()
    out = []
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tar:
        for m in tar.getmembers():
            out.append((m, tar.extractfile(m).read()))
    return out


def write_members(path: Path, items: list[tuple[str, bytes]]) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:", format=tarfile.PAX_FORMAT) as tar:
        for name, data in items:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    path.write_bytes(zstandard.ZstdCompressor().compress(buf.getvalue()))


@pytest.fixture
def made(tmp_path: Path, monkeypatch) -> dict[str, Any]:
    """A warmed tiny manifest in HOME 'a', bundled; the test continues on a fresh HOME 'b'."""
    fresh_home(tmp_path, monkeypatch, "a")
    manifest = tiny(tmp_path)
    report = warm_json(str(manifest))
    key = tmp_path / "signer.key"
    invoke("key", "generate", str(key))
    out = tmp_path / "cache.tar.zst"
    signed = tmp_path / "signed.tar.zst"
    created = json.loads(
        invoke("bundle", "create", "--manifest", str(manifest), "-o", str(out), "--json").stdout
    )
    json.loads(
        invoke("bundle", "create", "-o", str(signed), "--sign-key", str(key), "--json").stdout
    )
    fresh_home(tmp_path, monkeypatch, "b")
    return {
        "manifest": manifest,
        "report": report,
        "bundle": out,
        "signed": signed,
        "created": created,
        "key": key,
        "pub": Path(str(key) + ".pub"),
    }
