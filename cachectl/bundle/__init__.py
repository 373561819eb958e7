"""Bundles: one file holding a namespace, for images and clusters without bucket credentials.

``cachectl bundle create`` writes a zstd-compressed tar stream:

1. ``bundle.json``: format, the environment (fields and digest), the cache it came
   from, the index rows (function, bucket, sizes, sha256, compile times) and the
   content list (every file with its size and sha256, signing.content_list);
2. ``signature.json`` when made with a signing key: the content list signed;
3. ``files/env.json``, ``files/<key>-cache``, ``files/<key>-aot``.

Entries are compressed by JAX already, so they are stored in raw zstd blocks (no second
compression); the rest is compressed at ``--level``. Any zstd decoder reads the stream.

``cachectl bundle install`` checks the environment against this machine (exit 3
with the differing fields), the signature when the target cache trusts keys,
then extracts into a staging directory verifying every size and sha256 against
the list (a file not listed, a missing one, a member longer than listed or a
changed byte refuses the whole bundle, exit 2; each member is read only up to
its listed size), each entry and executable through ingest's checks, and the
staged env.json against the bundle's environment; only then moves the files
into the namespace (a fresh local namespace is one directory rename) and
indexes them (origin ``bundle``). A refused bundle leaves nothing behind, in
storage or the index. A signed bundle's ``signature.json`` also signs its
entries (``entries_signature``: every field an install writes).
"""

from __future__ import annotations

from cachectl.bundle.create import create
from cachectl.bundle.format import (
    FORMAT,
    BadBundle,
    BundleEntry,
    BundleInfo,
    InstallResult,
    describe,
)
from cachectl.bundle.install import environment_diff, install

__all__ = [
    "FORMAT",
    "BadBundle",
    "BundleEntry",
    "BundleInfo",
    "InstallResult",
    "create",
    "describe",
    "environment_diff",
    "install",
]
