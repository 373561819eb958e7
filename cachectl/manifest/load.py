"""Reading a manifest: YAML -> schema -> cross-field checks -> bucket limit, never importing user code or JAX."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from cachectl.errors import BadInput
from cachectl.manifest.checks import _semantic_problems
from cachectl.manifest.problems import _pydantic_problems, _raise_problems
from cachectl.manifest.schema import Manifest
from cachectl.manifest.source import (
    _describe,
    _expanded_size,
    _line_map,
    _Loader,
    _Source,
)

# A manifest is a few hundred YAML nodes; one that expands (through aliases) to more than
# this is an alias bomb ("billion laughs"), refused before anything walks it.
MAX_MANIFEST_NODES = 100_000
# The most buckets one manifest may expand to (the product of each function's axes);
# `warm --max-buckets N` raises it through the environment, so warm's worker processes
# (which load the manifest again) apply the same limit.
DEFAULT_MAX_BUCKETS = 10_000
MAX_BUCKETS_ENV = "CACHECTL_MAX_BUCKETS"


def max_buckets() -> int:
    """The bucket limit: CACHECTL_MAX_BUCKETS (set by --max-buckets), else DEFAULT_MAX_BUCKETS."""
    text = os.environ.get(MAX_BUCKETS_ENV, "").strip()
    if not text:
        return DEFAULT_MAX_BUCKETS
    if not text.isdigit() or int(text) < 1:
        raise BadInput(f"bad {MAX_BUCKETS_ENV} {text!r}: a positive number of buckets, e.g. 20000")
    return int(text)


def manifest_digest(path: str | Path) -> str:
    """sha256 hex of the file's bytes: records which manifest produced an entry."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def load_manifest(path: str | Path) -> Manifest:
    """Read and validate a manifest; every problem is a one-line ``BadInput`` naming file:line."""
    name = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise BadInput(f"{name}: cannot read manifest: {reason}") from None
    return parse_manifest(text, name=name, directory=Path(path).resolve().parent)


def parse_manifest(text: str, name: str = "<manifest>", directory: Path | None = None) -> Manifest:
    """Validate manifest YAML given as text (``name`` is used in messages, ``directory`` for imports)."""
    loader = _Loader(text)
    try:
        root = loader.get_single_node()
        if root is not None and _expanded_size(root, MAX_MANIFEST_NODES) > MAX_MANIFEST_NODES:
            raise BadInput(
                f"{name}: the YAML expands to more than {MAX_MANIFEST_NODES} nodes through "
                "aliases (an alias bomb?): refused"
            )
        data = loader.construct_document(root) if root is not None else None
        lines = _line_map(loader, root) if root is not None else {}
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else 1
        problem = exc.problem or "syntax error"
        if exc.context:
            problem += f" ({exc.context})"
        raise BadInput(f"{name}:{line}: invalid YAML: {problem}") from None
    except yaml.YAMLError as exc:
        raise BadInput(f"{name}: invalid YAML: {exc}") from None
    finally:
        loader.dispose()
    source = _Source(name, directory, lines)
    if not isinstance(data, dict):
        raise BadInput(
            source.message(
                (), f"a manifest is a mapping with 'version' and 'functions', got {_describe(data)}"
            )
        )
    return _validate(data, source)


def _validate(data: dict[str, Any], source: _Source) -> Manifest:
    try:
        manifest = Manifest.model_validate(data)
    except ValidationError as exc:
        _raise_problems(source, list(_pydantic_problems(exc)))
        raise  # unreachable: _raise_problems always raises
    manifest._source = source
    for index, spec in enumerate(manifest.functions):
        spec._source = source
        spec._index = index
    problems = list(_semantic_problems(manifest))
    if problems:
        _raise_problems(source, problems)
    _check_bucket_count(manifest, source, max_buckets())
    return manifest


def _check_bucket_count(manifest: Manifest, source: _Source, limit: int) -> None:
    """BadInput when the functions' axes multiply out past ``limit`` buckets (counted before
    ``exclude``, without building them): a typo'd axis must not make warm build millions."""
    total = 0
    for index, spec in enumerate(manifest.functions):
        product = 1
        for values in spec.buckets.values():
            product *= max(len(values), 1)
        total += product
        if total > limit:
            raise BadInput(
                source.message(
                    ("functions", index, "buckets"),
                    f"the manifest's axes multiply out to {total} buckets or more, "
                    f"above the limit of {limit}: split the manifest, shrink the axes "
                    "or raise --max-buckets",
                )
            )
