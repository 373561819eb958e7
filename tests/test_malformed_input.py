"""Malformed input is one line and exit 2, never a traceback, and nothing is written or installed:
seven bundle.json shapes (issue 62 finding 9) and a TPU topology of thousands of digits. Each
runs the CLI in-process (a traceback there is an exit 1 with the exception kept) on a real
bundle file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support.bundles import assert_nothing_installed, write_members
from support.warming import invoke, tiny

from cachectl.bundle.format import FORMAT

BASE: dict[str, Any] = {
    "format": FORMAT,
    "environment": {},
    "digest": "0" * 64,
    "namespace": "jax-0/cpu-cpu-x1/" + "0" * 16,
    "entries": [],
    "content": {"files": []},
}
DEEP = "[" * 100_000 + "]" * 100_000

# What each shape raised before it was checked: RecursionError, AttributeError, KeyError,
# ValueError, TypeError, deep in the install.
SHAPES = {
    "deep-nesting": json.dumps(BASE).replace('"environment": {}', f'"environment": {DEEP}'),
    "environment-a-list": json.dumps({**BASE, "environment": []}),
    "content-a-list": json.dumps({**BASE, "content": []}),
    "file-without-size": json.dumps({**BASE, "content": {"files": [{"name": "x"}]}}),
    "size-not-a-number": json.dumps(
        {**BASE, "content": {"files": [{"name": "x", "size": "many", "sha256": "s"}]}}
    ),
    "file-a-list": json.dumps({**BASE, "content": {"files": [["x", 1, "s"]]}}),
    "files-an-object": json.dumps({**BASE, "content": {"files": {"x": 1}}}),
}


def _one_line(*args: str) -> str:
    done = invoke(*args, code=None)
    assert done.exit_code == 2, (done.exit_code, done.output, done.exception)
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("cachectl: error: ")
    return done.stderr


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_malformed_bundle_json_is_one_line_and_installs_nothing(
    tmp_path: Path, shape: str
) -> None:
    bundle = tmp_path / "bad.tar.zst"
    write_members(bundle, [("bundle.json", SHAPES[shape].encode())])
    assert str(bundle) in _one_line("bundle", "install", str(bundle))
    assert_nothing_installed()


def test_a_topology_of_thousands_of_digits_is_one_line(tmp_path: Path) -> None:
    manifest = tiny(tmp_path)
    for name in ("v5e:" + "9" * 5000, "v5e-" + "9" * 5000, "v5e:" + "9" * 5000 + "x1"):
        err = _one_line("warm", str(manifest), "--topology", name)
        assert "unknown TPU topology" in err and len(err) < 400, err
