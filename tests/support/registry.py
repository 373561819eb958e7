"""Writing to an OCI registry over plain HTTP on loopback, as a test that builds its own
artifacts does (no login: the tests' private registries)."""

from __future__ import annotations

import hashlib

import requests


def put_blob(url: str, repo: str, body: bytes) -> str:
    """Upload ``body`` as a blob of ``repo`` (one POST, one PUT); its digest."""
    digest = "sha256:" + hashlib.sha256(body).hexdigest()
    r = requests.post(f"http://{url}/v2/{repo}/blobs/uploads/", timeout=10)
    loc = r.headers["Location"]
    loc = loc if loc.startswith("http") else f"http://{url}{loc}"
    sep = "&" if "?" in loc else "?"
    requests.put(f"{loc}{sep}digest={digest}", data=body, timeout=10).raise_for_status()
    return digest
