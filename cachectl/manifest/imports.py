"""Importing the user code a manifest names, and the checks only the imported function allows."""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cachectl.core.errors import BadInput
from cachectl.manifest.problems import raise_problems
from cachectl.manifest.schema import REF_RE, FunctionSpec, Manifest, jit_options
from cachectl.manifest.source import Loc, Source, describe


def _search_paths(source: Source, extra: Sequence[str | Path]) -> list[Path]:
    """--path dirs, then the manifest's dir, the root of the package holding it, and the cwd."""
    paths = [Path(p) for p in extra]
    if source.directory is not None:
        paths.append(source.directory)
        root = source.directory
        while (root / "__init__.py").exists() and root.parent != root:
            root = root.parent
        paths.append(root)
    paths.append(Path.cwd())
    return paths


def _add_to_sys_path(paths: Sequence[Path], front: int) -> None:
    """The first ``front`` paths go first (explicit --path), the rest last (never shadow)."""
    present = set(sys.path)
    head = [str(p.resolve()) for p in paths[:front]]
    for entry in reversed(head):
        if entry not in present:
            sys.path.insert(0, entry)
            present.add(entry)
    for p in paths[front:]:
        entry = str(p.resolve())
        if entry not in present:
            sys.path.append(entry)
            present.add(entry)
    importlib.invalidate_caches()


class _RefError(Exception):
    pass


def _import_ref(ref: str, where: str = "") -> Any:
    if not REF_RE.fullmatch(ref):
        raise _RefError(
            f"{ref!r} is not of the form module:attribute (e.g. examples.lm:decode_step)"
        )
    module_name, attr = ref.split(":", 1)
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise _RefError(
                f"cannot import {module_name!r}: no module named {exc.name!r} "
                "(add its directory with --path)"
            ) from None
        raise _RefError(
            f"importing {module_name!r}{where} failed: {type(exc).__name__}: {exc}"
        ) from None
    except Exception as exc:
        raise _RefError(
            f"importing {module_name!r}{where} failed: {type(exc).__name__}: {exc}"
        ) from None
    walked = module_name
    for part in attr.split("."):
        if not hasattr(obj, part):
            close = difflib.get_close_matches(
                part, [n for n in dir(obj) if not n.startswith("_")], n=1
            )
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise _RefError(f"{walked!r} has no attribute {part!r}{hint}")
        obj = getattr(obj, part)
        walked += ("." if walked != module_name else ":") + part
    if obj is None:
        raise _RefError(
            f"{ref} is None, not a function, when {module_name!r} is imported{where or ' here'} "
            "(does the module build it only where it finds enough devices?): name a function "
            "it defines on any machine, such as the one jax.jit wraps, and declare its shardings "
            "in the manifest (mesh: and sharding:, or pytree leaves over a "
            "jax.sharding.AbstractMesh)"
        )
    if not callable(obj):
        raise _RefError(f"{ref} is not callable: it is {describe(obj)}")
    return obj


def resolve_callable(ref: str, search_paths: Sequence[str | Path] = ()) -> Any:
    """Import ``module:attr`` (attr may be dotted) after putting ``search_paths`` first on sys.path."""
    _add_to_sys_path([Path(p) for p in search_paths], front=len(search_paths))
    try:
        return _import_ref(ref)
    except _RefError as exc:
        raise BadInput(str(exc)) from None


def resolve_in(spec: FunctionSpec, ref: str, loc: Loc, search_paths: Sequence[str | Path]) -> Any:
    _add_to_sys_path(_search_paths(spec._source, search_paths), front=len(search_paths))
    try:
        return _import_ref(ref)
    except _RefError as exc:
        raise spec._bad(loc, str(exc)) from None


def is_jitted(obj: Any) -> bool:
    """True for a ``jax.jit``-wrapped function: warm lowers it as is, with its own options.

    Never imports JAX: when it is not loaded yet, nothing can have been jitted."""
    jit_type = _jit_type() if "jax" in sys.modules else None
    if jit_type is not None and isinstance(obj, jit_type):
        return True
    return callable(getattr(obj, "lower", None)) and callable(getattr(obj, "trace", None))


def _is_filter_jit(obj: Any) -> bool:
    """Equinox's filter_jit wrappers: they have .lower but no .trace, and jax.jit around them
    compiles another program (docs/jax-facts.md, fact 8)."""
    kind = type(obj)
    return kind.__module__.startswith("equinox") and "jit" in kind.__name__.lower()


@functools.cache
def _jit_type() -> type:
    import jax

    return type(jax.jit(identity))


def identity(x: Any) -> Any:
    return x


def _needs_static(value: Any) -> bool:
    """Values jax.jit cannot trace (a string anywhere in them), so they must be declared static."""
    if value is None or isinstance(value, (int, float, complex)):
        return False
    if isinstance(value, (list, tuple)):
        return any(_needs_static(v) for v in value)
    return True


def check_imports(
    manifest: Manifest, search_paths: Sequence[str | Path] = (), where: str = ""
) -> dict[str, Any]:
    """Import every function and pytree the manifest names; return {function name: callable}.

    Also checks what can only be known with the function in hand: the arguments bind to
    its signature, non-array static values are declared static, and an already-jitted
    function carries no ``jit:`` options (the service calls it with its own). One
    ``BadInput`` lists every problem, a line each. ``where`` says where the modules are
    imported when that is not the machine the programs are for (`` on this machine, for ...``).
    """
    resolved: dict[str, Any] = {}
    problems: list[tuple[Loc, str]] = []
    for spec in manifest.functions:
        fn = _spec_problems(spec, search_paths, problems, where)
        if fn is not None:
            resolved[spec.name] = fn
    if problems:
        raise_problems(manifest._source, problems)
    return resolved


def import_problems(
    data: dict[str, Any],
    specs: Sequence[FunctionSpec],
    source: Source,
    search_paths: Sequence[str | Path],
) -> list[tuple[Loc, str]]:
    """The import problems of a manifest that has others: those of each checkable function
    entry (``specs``), and of the references in the other entries of ``data``."""
    problems: list[tuple[Loc, str]] = []
    for spec in specs:
        _spec_problems(spec, search_paths, problems)
    entries = data.get("functions")
    checked = {spec._index for spec in specs}
    if not isinstance(entries, list):
        return problems
    for index, entry in enumerate(entries):
        if index in checked or not isinstance(entry, dict):
            continue
        refs: list[tuple[Loc, Any]] = [(("functions", index, "fn"), entry.get("fn"))]
        args = entry.get("args")
        for a, arg in enumerate(args if isinstance(args, list) else []):
            if isinstance(arg, dict):
                refs.append((("functions", index, "args", a, "pytree"), arg.get("pytree")))
        for loc, ref in refs:
            if isinstance(ref, str) and REF_RE.fullmatch(ref):  # else a schema problem
                _resolve(ref, loc, source, search_paths, problems)
    return problems


def _resolve(
    ref: str,
    loc: Loc,
    source: Source,
    search_paths: Sequence[str | Path],
    problems: list[tuple[Loc, str]],
    where: str = "",
) -> Any:
    """The object ``ref`` names, or None with the problem added to ``problems``."""
    _add_to_sys_path(_search_paths(source, search_paths), front=len(search_paths))
    try:
        return _import_ref(ref, where)
    except _RefError as exc:
        problems.append((loc, str(exc)))
        return None


def _spec_problems(
    spec: FunctionSpec,
    search_paths: Sequence[str | Path],
    problems: list[tuple[Loc, str]],
    where: str = "",
) -> Any:
    """Add one function entry's import problems to ``problems``; its callable, or None."""

    def bad(loc: Loc, problem: str) -> None:
        problems.append((spec._loc(*loc), problem))

    before = len(problems)
    fn = _resolve(spec.fn, spec._loc("fn"), spec._source, search_paths, problems, where)
    for a, arg in enumerate(spec.args):
        if arg.pytree is not None:
            loc = spec._loc("args", a, "pytree")
            _resolve(arg.pytree, loc, spec._source, search_paths, problems, where)
    if fn is None:
        return None
    if _is_filter_jit(fn):
        bad(
            ("fn",),
            f"{spec.fn} is wrapped in eqx.filter_jit, which cachectl cannot lower as the service "
            "does: name the plain function, pass the model's arrays as a pytree argument "
            "(eqx.partition with a predicate that keeps ShapeDtypeStruct) and its static parts "
            "as values",
        )
        return None
    jitted = is_jitted(fn)
    if jitted and jit_options(spec):
        bad(
            ("jit",),
            f"{spec.fn} is already jitted, so its jax.jit options are fixed; remove 'jit:' "
            "(a re-wrapped function would compile a different program than the service runs)",
        )
    if not jitted:
        static_names = set(spec.jit.static_argnames)
        for key, value in spec.kwargs.items():
            if isinstance(value, dict) and set(value) == {"axis"}:
                values = spec.buckets.get(value["axis"], [])
                needs = any(_needs_static(v) for v in values)
            else:
                needs = _needs_static(value)
            if needs and key not in static_names:
                bad(
                    ("kwargs", key),
                    f"{key!r} is not an array or number, so jax.jit must treat it as static: "
                    "add it to jit.static_argnames",
                )
        nargs = len(spec.args)
        static_nums = {n % nargs for n in spec.jit.static_argnums} if nargs else set()
        for a, arg in enumerate(spec.args):
            if arg.kind == "value" and _needs_static(arg.value) and a not in static_nums:
                bad(
                    ("args", a, "value"),
                    f"argument {a} is not an array or number, so jax.jit must treat it as "
                    "static: add it to jit.static_argnums",
                )
    signature_problem = _signature_problem(spec, fn)
    if signature_problem is not None:
        bad(("args",), signature_problem)
    return fn if len(problems) == before else None


def _signature_problem(spec: FunctionSpec, fn: Any) -> str | None:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins and some wrappers have none: let lowering tell
        return None
    try:
        signature.bind(*([None] * len(spec.args)), **dict.fromkeys(spec.kwargs))
    except TypeError as exc:
        return f"the arguments do not fit {spec.fn}{signature}: {exc}"
    return None
