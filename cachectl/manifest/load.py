"""Reading a manifest: YAML -> schema -> cross-field checks -> bucket limit, every problem at once.

Never imports JAX or user code, unless asked (``import_paths``) to list a bad manifest's
import problems too."""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cachectl.core.config import DEFAULT_MAX_BUCKETS, MAX_BUCKETS_ENV
from cachectl.core.errors import BadInput, path_words
from cachectl.core.jsonable import type_adapter
from cachectl.manifest.checks import semantic_problems
from cachectl.manifest.imports import import_problems
from cachectl.manifest.problems import pydantic_problems, raise_problems
from cachectl.manifest.schema import (
    ArgSpec,
    FunctionSpec,
    Manifest,
    Target,
    Unchecked,
    build,
    located,
)
from cachectl.manifest.source import (
    Loader,
    Loc,
    Source,
    describe,
    expanded_size,
    line_map,
)

ARG_FIELDS = frozenset(f.name for f in dataclasses.fields(ArgSpec))

# A manifest is a few hundred YAML nodes; one that expands (through aliases) to more than
# this is an alias bomb ("billion laughs"), refused before anything walks it.
MAX_MANIFEST_NODES = 100_000


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


@dataclass(frozen=True)
class LoadedManifest:
    """A manifest file read once: its bytes, their sha256 and what they validated to. Warm
    hands this down (signing check, plan, run row, a distributed job's agreement), so the
    digest it records is of the very bytes it compiled, and one process reads the file once."""

    path: str
    data: bytes = field(repr=False)
    digest: str
    manifest: Manifest


def read_manifest(
    path: str | Path, *, import_paths: Sequence[str | Path] | None = None
) -> LoadedManifest:
    """Read a manifest file once and validate it (:func:`load_manifest`'s errors)."""
    name = str(path)
    try:
        data = Path(path).read_bytes()
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise BadInput(f"{path_words(path)}: cannot read manifest: {reason}") from None
    manifest = parse_manifest(
        text, name=name, directory=Path(path).resolve().parent, import_paths=import_paths
    )
    return LoadedManifest(name, data, hashlib.sha256(data).hexdigest(), manifest)


def as_loaded(
    manifest: str | Path | LoadedManifest, *, import_paths: Sequence[str | Path] | None = None
) -> LoadedManifest:
    """The manifest as read already, or read now."""
    if isinstance(manifest, LoadedManifest):
        return manifest
    return read_manifest(manifest, import_paths=import_paths)


def load_manifest(
    path: str | Path, *, import_paths: Sequence[str | Path] | None = None
) -> Manifest:
    """Read and validate a manifest; one ``BadInput`` lists every problem, a line each naming
    file:line (``import_paths``: see :func:`parse_manifest`)."""
    return read_manifest(path, import_paths=import_paths).manifest


def parse_manifest(
    text: str,
    name: str = "<manifest>",
    directory: Path | None = None,
    *,
    import_paths: Sequence[str | Path] | None = None,
) -> Manifest:
    """Validate manifest YAML given as text (``name`` is used in messages, ``directory`` for imports).

    With ``import_paths`` (``--path`` dirs, maybe none), a manifest with problems also has the
    user code it names imported, so that the one BadInput lists the import problems too; a
    valid manifest imports nothing (:func:`check_imports` does, later)."""
    loader: Loader | None = None
    try:
        loader = Loader(text)  # a character YAML forbids (binary garbage) is refused here
        root = loader.get_single_node()
        if root is not None and expanded_size(root, MAX_MANIFEST_NODES) > MAX_MANIFEST_NODES:
            raise BadInput(
                f"{name}: the YAML expands to more than {MAX_MANIFEST_NODES} nodes through "
                "aliases (an alias bomb?): refused"
            )
        data = loader.construct_document(root) if root is not None else None
        lines = line_map(loader, root) if root is not None else {}
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else 1
        problem = exc.problem or "syntax error"
        if exc.context:
            problem += f" ({exc.context})"
        raise BadInput(f"{name}:{line}: invalid YAML: {problem}") from None
    except yaml.YAMLError as exc:
        raise BadInput(f"{name}: invalid YAML: {' '.join(str(exc).split())}") from None
    except RecursionError:  # aliases that nest anchors in anchors past the depth limit
        raise BadInput(
            f"{name}: invalid YAML: it nests too deep (through aliases?): refused"
        ) from None
    finally:
        if loader is not None:
            loader.dispose()
    source = Source(name, directory, lines)
    if not isinstance(data, dict):
        raise BadInput(
            source.message(
                (), f"a manifest is a mapping with 'version' and 'functions', got {describe(data)}"
            )
        )
    return _validate(data, source, import_paths)


def _validate(
    data: dict[str, Any], source: Source, import_paths: Sequence[str | Path] | None = None
) -> Manifest:
    manifest = _built(data, source)
    if manifest is None:
        manifest, problems = _collect_problems(data, source, import_paths)
        if problems or manifest is None:
            raise_problems(source, problems)
            raise AssertionError("unreachable: raise_problems always raises")
    _check_bucket_count(manifest, source, max_buckets())
    return manifest


def _built(data: dict[str, Any], source: Source) -> Manifest | None:
    """A manifest the schema's own builder takes and the cross-field checks pass, without
    pydantic (about 60 ms to import and build: most of a service's start-up beyond JAX's);
    None when there is anything to report, which pydantic's errors then describe."""
    try:
        manifest: Manifest = build(Manifest, data)
    except Unchecked:
        return None
    located(manifest, source)
    for index, spec in enumerate(manifest.functions):
        located(spec, source, index)
    if next(iter(semantic_problems(list(manifest.functions), manifest.target, source)), None):
        return None
    return manifest


def _collect_problems(
    data: dict[str, Any], source: Source, import_paths: Sequence[str | Path] | None
) -> tuple[Manifest | None, list[tuple[Loc, str]]]:
    """Every stage's problems at once: schema, then cross-field checks on each function entry
    that can be checked (those with schema errors in an argument's fields too, those fields
    left out), then, with ``import_paths``, the imports of a manifest that has problems.

    A later stage's problem at, above or under an earlier one's field is its consequence
    and is left out. A valid manifest is returned with no problems (nothing imported)."""
    from pydantic import ValidationError

    manifest: Manifest | None
    try:
        valid = type_adapter(Manifest).validate_python(data)
    except ValidationError as exc:
        manifest = None
        schema = list(pydantic_problems(exc))
    else:
        schema = []
        located(valid, source)
        manifest = valid
    specs = _function_specs(data, manifest, source, [loc for loc, _ in schema])
    target = manifest.target if manifest is not None else _valid_target(data)
    problems = _unrelated(schema, list(semantic_problems(specs, target, source)))
    if import_paths is not None and problems:
        problems = _unrelated(problems, import_problems(data, specs, source, import_paths))
    return (manifest if not problems else None), problems


def _unrelated(
    earlier: list[tuple[Loc, str]], later: list[tuple[Loc, str]]
) -> list[tuple[Loc, str]]:
    """``earlier`` and those of ``later`` not at, above or under one of its fields."""
    broken = [loc for loc, _ in earlier]
    return earlier + [(loc, p) for loc, p in later if not any(_related(loc, b) for b in broken)]


def _related(loc: Loc, other: Loc) -> bool:
    """One of the two is a prefix of the other: the same field, a part of it or its container."""
    n = min(len(loc), len(other))
    return loc[:n] == other[:n]


def _function_specs(
    data: dict[str, Any], manifest: Manifest | None, source: Source, broken: list[Loc]
) -> list[FunctionSpec]:
    """The function entries later stages can check: all of a valid manifest's; else each entry
    validated on its own, an argument's fields with schema errors left out."""
    if manifest is not None:
        specs = list(manifest.functions)
    else:
        entries = data.get("functions")
        if not isinstance(entries, list):
            return []
        specs = []
        for index, entry in enumerate(entries):
            spec = _salvage(entry, [loc[2:] for loc in broken if loc[:2] == ("functions", index)])
            if spec is not None:
                located(spec, source, index)
                specs.append(spec)
    if manifest is not None:
        for index, spec in enumerate(specs):
            located(spec, source, index)
    return specs


def _salvage(entry: Any, broken: list[Loc]) -> FunctionSpec | None:
    """``entry`` as a FunctionSpec, without the fields its schema errors (``broken``, relative
    to the entry) name; None where an error is not in a field that can be left out (a
    function's ``name`` or one of an argument's fields)."""
    if not isinstance(entry, dict):
        return None
    entry = dict(entry)
    args = list(entry["args"]) if isinstance(entry.get("args"), list) else None
    for loc in broken:
        if loc[:1] == ("name",):
            entry.pop("name", None)
        elif (
            args is not None
            and len(loc) >= 3
            and loc[0] == "args"
            and isinstance(loc[1], int)
            and 0 <= loc[1] < len(args)
            and isinstance(args[loc[1]], dict)
            and loc[2] in ARG_FIELDS
        ):
            args[loc[1]] = {k: v for k, v in args[loc[1]].items() if k != loc[2]}
        else:
            return None
    if args is not None:
        entry["args"] = args
    from pydantic import ValidationError

    try:
        spec: FunctionSpec = type_adapter(FunctionSpec).validate_python(entry)
    except ValidationError:
        return None
    return spec


def _valid_target(data: dict[str, Any]) -> Target | None:
    from pydantic import ValidationError

    try:
        target: Target = type_adapter(Target).validate_python(data.get("target"))
    except ValidationError:
        return None
    return target


def _check_bucket_count(manifest: Manifest, source: Source, limit: int) -> None:
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
