"""The import graph of cachectl/ and server/, built with ast: no cycle, few lazy project imports.

An edge is every import of a project module, at module level or inside a function
(``if TYPE_CHECKING:`` blocks excluded, except for the cycle check, which counts them: a cycle
hidden from the interpreter is a cycle in the design all the same). ``from pkg import sub`` is an edge to
``pkg.sub`` when ``sub`` is a module; the implicit import of a module's parent
packages is not an edge (every module would otherwise depend on ``cachectl/__init__``).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("cachectl", "server")
# Function-local imports of project modules are for keeping a cheap path cheap
# (activate() without SQLAlchemy, `import cachectl` without the serving runtime,
# `cachectl --help` without the index); everything else imports at the top.
MAX_LOCAL_PROJECT_IMPORTS = 13  # exec_hook (four) runs in every Python process exec starts: it
# imports the seam, the write capture, the probe and activate only once JAX is imported and its
# variables ask for them; the gate (trust/gate.py) imports the index's read SQL at a service's
# first compile, and storage/executables.py (the manifest's schema) at the first stored load
# The read commands' path (`ls`, `stats`, `cache list`, `prune --dry-run` from the stdlib reader,
# tests/test_cli_startup.py) defers, by (module, imported module), what only the other commands
# or server mode need: the SQL index, the HTTP client, the executor, gc, verify, tokens.
DEFERRED_FOR_READ_COMMANDS = {
    ("cachectl.operations", "cachectl.client.remote"),
    ("cachectl.operations", "cachectl.server_operations"),
    ("cachectl.operations", "cachectl.lifecycle.gc"),
    ("cachectl.operations", "cachectl.lifecycle.verify"),
    ("cachectl.operations", "cachectl.trust.tokens"),
    ("cachectl.lifecycle.prune", "cachectl.lifecycle.lease"),
    ("cachectl.lifecycle.prune", "cachectl.lifecycle.execute"),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _targets(
    modules: dict[str, Path], current: str, is_package: bool, node: ast.Import | ast.ImportFrom
) -> set[str]:
    names: list[str] = []
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            base = current.split(".")
            if not is_package:
                base = base[:-1]
            base = base[: len(base) - (node.level - 1)]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = node.module or ""
        subs = [f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in modules]
        if len(subs) < len(node.names):
            names.append(module)
        names.extend(subs)
    found = set()
    for name in names:
        parts = name.split(".")
        while parts and ".".join(parts) not in modules:
            parts.pop()
        if parts:
            found.add(".".join(parts))
    found.discard(current)
    return found


def import_graph(
    modules: dict[str, Path] | None = None, *, type_checking: bool = False
) -> tuple[dict[str, set[str]], list[tuple[str, int, str]]]:
    """(module -> project modules it imports, [(module, line, target) for each function-local one]);
    with ``type_checking`` the imports under ``if TYPE_CHECKING:`` are edges too."""
    modules = _modules() if modules is None else modules
    edges: dict[str, set[str]] = {}
    local: list[tuple[str, int, str]] = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        edges[name] = set()

        def visit(node: ast.AST, in_function: bool, name: str = name, path: Path = path) -> None:
            for child in ast.iter_child_nodes(node):
                if _is_type_checking(child) and not type_checking:
                    continue
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    targets = _targets(modules, name, path.name == "__init__.py", child)
                    edges[name] |= targets
                    if in_function:
                        local.extend((name, child.lineno, t) for t in sorted(targets))
                visit(
                    child,
                    in_function
                    or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)),
                )

        visit(tree, False)
    return edges, local


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), plus self-loops."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def strongconnect(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            strongconnect(v)
    return found


def test_the_import_graph_has_no_cycle() -> None:
    edges, _ = import_graph()
    assert len(edges) > 50  # the walk found the project
    assert cycles(edges) == []


# Cycles that only `if TYPE_CHECKING:` imports close, allowed by name (sorted modules).
TYPE_CHECKING_CYCLES_ALLOWED: list[list[str]] = []


def test_no_cycle_hides_behind_type_checking() -> None:
    edges, _ = import_graph(type_checking=True)
    found = cycles(edges)
    assert [c for c in found if c not in TYPE_CHECKING_CYCLES_ALLOWED] == [], found
    assert [c for c in TYPE_CHECKING_CYCLES_ALLOWED if c not in found] == [], (
        "an allowed cycle is gone: take it off TYPE_CHECKING_CYCLES_ALLOWED"
    )


def test_a_type_checking_import_closes_a_cycle(tmp_path: Path) -> None:
    """Two modules that import each other, one of them only for its annotations: a cycle."""
    (tmp_path / "a.py").write_text("from pkg import b\n")
    (tmp_path / "b.py").write_text(
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from pkg.a import A\n"
    )
    modules = {"pkg.a": tmp_path / "a.py", "pkg.b": tmp_path / "b.py"}
    assert cycles(import_graph(modules)[0]) == []
    assert cycles(import_graph(modules, type_checking=True)[0]) == [["pkg.a", "pkg.b"]]


def test_cycle_detection_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _leaves(edges: dict[str, set[str]], local: list[tuple[str, int, str]]) -> set[str]:
    """Modules no project module imports, at top level or in a function: the CLI's command
    modules, which cachectl.cli's lazy table loads by name."""
    imported = {t for targets in edges.values() for t in targets} | {t for _, _, t in local}
    return set(edges) - imported


def test_few_function_local_imports_of_project_modules() -> None:
    """A function-local import hides a dependency; only a leaf may defer its imports freely,
    since nothing imports a leaf and so no cycle can run through it (a command module
    imports its library when the command runs, so that `CMD --help` stays fast)."""
    edges, local = import_graph()
    leaves = _leaves(edges, local)
    assert {"cachectl.cli.warm_cmds", "cachectl.cli.env_cmds"} <= leaves
    deferred = {(m, t) for m, _line, t in local if (m, t) in DEFERRED_FOR_READ_COMMANDS}
    assert deferred == DEFERRED_FOR_READ_COMMANDS, "listed but no longer deferred: update the list"
    hidden = [
        (m, line, t)
        for m, line, t in local
        if m not in leaves and (m, t) not in DEFERRED_FOR_READ_COMMANDS
    ]
    assert len(hidden) <= MAX_LOCAL_PROJECT_IMPORTS, "\n".join(
        f"{m}:{line} -> {t}" for m, line, t in hidden
    )


def test_server_uses_the_library_not_the_cli_or_the_http_client() -> None:
    edges, _ = import_graph()
    bad = {
        (m, t)
        for m, targets in edges.items()
        if m == "server" or m.startswith("server.")
        for t in targets
        if t.startswith(("cachectl.cli", "cachectl.client"))
    }
    assert bad == set()


def test_every_index_driver_implements_the_backend_protocol() -> None:
    from cachectl.index.open import DRIVERS, driver
    from cachectl.index.protocol import IndexBackend

    members = [n for n, v in vars(IndexBackend).items() if callable(v) and not n.startswith("_")]
    assert "start_warm_run" in members and "find_environment" in members
    assert sorted(DRIVERS) == ["http", "sqlalchemy", "stdlib"]
    for name in DRIVERS:
        cls = driver(name).__self__  # type: ignore[attr-defined]  # each opener is a classmethod
        # the stdlib driver runs the rest on the SQLAlchemy one (its __getattr__)
        assert [n for n in members if not callable(getattr(cls, n, None))] == [] or (
            name == "stdlib" and "__getattr__" in vars(cls)
        ), cls


def test_no_backend_sniffing_or_context_patching() -> None:
    text = {p: p.read_text() for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    assert [str(p) for p, t in text.items() if "is_remote" in t] == []
    assert [
        str(p) for p, t in text.items() if '__dict__["index"]' in t or "__dict__['index']" in t
    ] == []


def test_commands_do_not_branch_on_server_mode() -> None:
    """Server mode is an Operations implementation chosen in cachectl.operations, not `if ctx.remote`."""
    cli = ROOT / "cachectl" / "cli"
    assert [
        str(p.relative_to(ROOT)) for p in sorted(cli.glob("*.py")) if "ctx.remote" in p.read_text()
    ] == []
    local = (ROOT / "cachectl" / "operations.py").read_text()
    server = (ROOT / "cachectl" / "server_operations.py").read_text()
    assert "class LocalOperations" in local and "def operations(" in local
    assert "class ServerOperations" in server


# Calls that write objects into a cache's storage (Store.write_bytes/write_file) or record entries in
# the index (upsert_entries), by (module, enclosing function). New entries and stored executables
# enter a cache through cachectl/storage/ingest.py only; every other writer is listed here with its reason.
INGEST = "cachectl/storage/ingest.py"
WRITES_OUTSIDE_INGEST = {
    # sync records objects already in storage (index repair): it writes no bytes.
    ("cachectl/lifecycle/sync.py", "_write", "upsert_entries"),
    # Not new entries of a cache: env.json, a pulled mirror (local copies), verify's write probe.
    ("cachectl/storage/namespace.py", "ensure_namespace", "write_bytes"),
    ("cachectl/service/mirror.py", "_atomic_write", "write_bytes"),
    ("cachectl/lifecycle/verify_execute.py", "_write_atimes", "write_bytes"),
    # A namespace's signed content list (signature.json), not an entry.
    ("cachectl/trust/signing.py", "_store_signature", "write_bytes"),
    (
        "cachectl/lifecycle/deep.py",
        "load_all",
        "write_bytes",
    ),  # a pathlib write to a temporary file
}
_WRITE_CALLS = ("write_bytes", "write_file", "upsert_entries")


def entry_writers() -> set[tuple[str, str, str]]:
    """(module path, enclosing function, method) of every write call outside the Store and the indexes."""
    found: set[tuple[str, str, str]] = set()
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            if rel == "cachectl/storage/store.py" or rel.startswith(
                ("cachectl/index/", "cachectl/client/")
            ):
                continue  # the implementations, not callers

            def visit(node: ast.AST, function: str, rel: str = rel) -> None:
                for child in ast.iter_child_nodes(node):
                    if (
                        isinstance(child, ast.Call)
                        and isinstance(child.func, ast.Attribute)
                        and child.func.attr in _WRITE_CALLS
                    ):
                        found.add((rel, function, child.func.attr))
                    inner = (
                        child.name
                        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
                        else function
                    )
                    visit(child, inner)

            visit(ast.parse(path.read_text(), filename=str(path)), "<module>")
    return found


def test_ingest_is_the_only_writer_of_new_entries() -> None:
    found = entry_writers()
    assert {f for f in found if f[0] == INGEST and f[2] == "upsert_entries"}, (
        "ingest indexes new entries"
    )
    assert {f for f in found if f[0] == INGEST and f[2] in ("write_bytes", "write_file")}, (
        "ingest writes them"
    )
    outside = {f for f in found if f[0] != INGEST}
    assert outside - WRITES_OUTSIDE_INGEST == set(), (
        "write new entries through cachectl/storage/ingest.py"
    )
    assert WRITES_OUTSIDE_INGEST - outside == set(), "a listed writer is gone: take it off the list"


def test_the_repository_names_no_file_outside_it() -> None:
    """The JAX facts and contracts the code relies on live in the repository (docs/jax-facts.md,
    the README), never in a design note outside it."""
    paths = [
        p
        for top in ("cachectl", "server", "tests", "bench", "scripts", "migrations", "docs", ".ci")
        for p in (ROOT / top).rglob("*")
        if p.is_file()
        and p.suffix in ("", ".py", ".md", ".sh", ".toml", ".yaml", ".ini")
        and "__pycache__" not in p.parts
    ]
    paths += [ROOT / n for n in ("README.md", "ARCHITECTURE.md", "BENCHMARKS.md", "pyproject.toml")]
    needle = "DESIGN" + ".md"
    assert [
        str(p.relative_to(ROOT)) for p in paths if needle in p.read_text(errors="replace")
    ] == []


def test_every_jax_fact_names_tests_that_exist() -> None:
    """docs/jax-facts.md: the facts are numbered 1..N as the code cites them, and every test named exists."""
    text = (ROOT / "docs" / "jax-facts.md").read_text()
    numbers = [int(line.split(".")[0]) for line in text.splitlines() if line[:1].isdigit()]
    assert numbers == list(range(1, len(numbers) + 1)) and len(numbers) >= 11
    named = set()
    current = None
    for token in text.replace("`", " ").split():
        if token.startswith("tests/") and "::" in token:
            current, _, name = token.partition("::")
            named.add((current, name.rstrip(",.")))
        elif token.startswith("test_") and current is not None:
            named.add((current, token.rstrip(",.")))
    missing = [
        f"{path}::{name}"
        for path, name in sorted(named)
        if f"def {name}(" not in (ROOT / path).read_text()
    ]
    assert named and missing == []


def test_no_test_module_imports_another() -> None:
    """What tests share lives in tests/support/ (on the path through pytest's ``pythonpath``)."""
    tests = ROOT / "tests"
    names = {p.stem for p in tests.rglob("test_*.py")}
    bad = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module.split(".")[0]]
            elif isinstance(node, ast.Import):
                targets = [a.name.split(".")[0] for a in node.names]
            bad += [f"{path.relative_to(ROOT)}:{node.lineno} -> {t}" for t in targets if t in names]
    assert bad == []
    assert not [p.name for p in tests.rglob("test_*.py") if "def test" not in p.read_text()]


# The layers, lowest first. A module may import its own layer and the layers below it,
# never one above (ARCHITECTURE.md, "Layers"). A layer is a list of module prefixes.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("core", ("cachectl.core",)),
    ("domain", ("cachectl.manifest", "cachectl.telemetry")),
    ("index", ("cachectl.index",)),
    ("storage", ("cachectl.storage",)),
    ("client", ("cachectl.client",)),
    ("context", ("cachectl.context",)),
    ("trust", ("cachectl.trust",)),
    ("lifecycle", ("cachectl.lifecycle",)),
    ("service", ("cachectl.service",)),
    ("serving", ("cachectl.dispatch",)),
    ("warm", ("cachectl.warm",)),
    ("usage", ("cachectl.usage",)),
    ("bundle", ("cachectl.bundle",)),
    (
        "application",
        (
            "=cachectl",  # the package itself ("=": this module only): activate, serving
            "cachectl.__main__",
            "cachectl.operations",
            "cachectl.server_operations",
            "cachectl.cli",
            "server",
        ),
    ),
]


def layer_of(module: str) -> int:
    """The index in LAYERS of the longest prefix that names ``module``; -1 for none."""
    best, best_len = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            exact = prefix.startswith("=")
            name = prefix.lstrip("=")
            matches = module == name or (not exact and module.startswith(name + "."))
            if matches and len(name) > best_len:
                best, best_len = i, len(name)
    return best


def layer_violations(edges: dict[str, set[str]]) -> list[str]:
    found = []
    for module, targets in sorted(edges.items()):
        for target in sorted(targets):
            if layer_of(target) > layer_of(module):
                found.append(
                    f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} "
                    f"({LAYERS[layer_of(target)][0]})"
                )
    return found


def test_every_module_belongs_to_a_layer() -> None:
    edges, _ = import_graph()
    orphans = sorted(m for m in edges if layer_of(m) < 0)
    assert not orphans, f"modules outside every layer (add them to LAYERS or move them): {orphans}"


def test_a_module_imports_only_its_layer_or_below() -> None:
    edges, _ = import_graph()
    assert layer_violations(edges) == []


def test_layer_check_finds_an_upward_import() -> None:
    assert layer_violations({"cachectl.core.errors": {"cachectl.service.activate"}}) == [
        "cachectl.core.errors (core) imports cachectl.service.activate (service)"
    ]


ARCHITECTURE = ROOT / "ARCHITECTURE.md"
_SEARCHED = ("cachectl", "server", "tests", "scripts", "bench", "migrations")


def _named_paths(text: str) -> set[str]:
    """Every `x.py`, `dir/x.py` or `dir/` the page names between backticks."""
    import re

    found: set[str] = set()
    for span in re.findall(r"`([^`\n]+)`", text):
        if "<" in span:  # a pattern such as cli/<group>_cmds.py
            continue
        for token in re.findall(r"[\w./]+", span):
            if token.endswith(".py") or (token.endswith("/") and len(token) > 1):
                found.add(token.strip("."))
    return found


def _exists(name: str) -> bool:
    bare = name.rstrip("/")
    if "/" not in bare:
        return (
            any(any(True for _ in (ROOT / top).rglob(bare)) for top in _SEARCHED)
            or (ROOT / bare).exists()
        )
    return (ROOT / bare).exists() or (ROOT / "cachectl" / bare).exists()


def test_architecture_names_only_modules_that_exist() -> None:
    missing = sorted(n for n in _named_paths(ARCHITECTURE.read_text()) if not _exists(n))
    assert missing == [], f"ARCHITECTURE.md names paths that do not exist: {missing}"


def test_architecture_names_every_package_and_server_module() -> None:
    text = ARCHITECTURE.read_text()
    packages = sorted(
        str(p.parent.relative_to(ROOT / "cachectl")) + "/"
        for p in (ROOT / "cachectl").rglob("__init__.py")
        if p.parent != ROOT / "cachectl" and "__pycache__" not in p.parts
    )
    servers = sorted(
        f"server/{p.name}" for p in (ROOT / "server").glob("*.py") if p.name != "__init__.py"
    )
    unnamed = [n for n in packages + servers if f"`{n}" not in text and f" {n}" not in text]
    assert unnamed == [], f"ARCHITECTURE.md does not name: {unnamed}"


def test_the_architecture_check_finds_a_missing_module() -> None:
    assert not _exists("cachectl/no_such_module.py")
    assert "runtime.py" in _named_paths("`runtime.py` and `warm/plan.py`")


_PATH_IN_TEXT = r"\b(?:cachectl|server|tests|bench|scripts|migrations|docs)/[\w/.-]*\w\.(?:py|md)\b"
_NOT_DOCS = {".git", ".venv", "node_modules", "__pycache__"}


def stale_paths(text: str) -> list[str]:
    """The repository paths (``cachectl/dispatch/router.py``, ``docs/jax-facts.md``) a text
    names that do not exist."""
    import re

    return sorted({p for p in re.findall(_PATH_IN_TEXT, text) if not (ROOT / p).exists()})


def test_the_markdown_names_only_files_that_exist() -> None:
    """Every page (README, ARCHITECTURE, BENCHMARKS, docs/) names paths that exist, so a moved or
    split module leaves no stale name behind."""
    pages = [
        p
        for p in ROOT.rglob("*.md")
        if not any(part in _NOT_DOCS or part.startswith(".") for part in p.relative_to(ROOT).parts)
    ]  # hidden folders (.venv, .git, a scratch copy) are no one's docs
    assert ROOT / "README.md" in pages and ROOT / "docs" / "jax-facts.md" in pages
    stale = {str(p.relative_to(ROOT)): stale_paths(p.read_text()) for p in pages}
    assert {page: names for page, names in stale.items() if names} == {}


def test_package_docstrings_name_only_modules_that_exist() -> None:
    """A package's docstring maps its modules (``calls.py`` ...): each one named exists, in the
    package or as a path under cachectl/."""
    import re

    missing = []
    for init in sorted((ROOT / "cachectl").rglob("__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        for name in set(re.findall(r"[\w/.]+\.py\b", doc)):
            if not any((base / name).exists() for base in (init.parent, ROOT / "cachectl", ROOT)):
                missing.append(f"{init.relative_to(ROOT)}: {name}")
    assert missing == []


def test_the_stale_path_check_finds_a_missing_file() -> None:
    assert stale_paths("see `cachectl/dispatch/runtime.py` and cachectl/dispatch/router.py") == [
        "cachectl/dispatch/runtime.py"
    ]


def private_imports() -> list[str]:
    """``from other_module import _name``: a module reaching into another's private names."""
    found = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            project = node.level > 0 or (node.module or "").startswith(("cachectl", "cachectl_"))
            for alias in node.names if project else ():
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{name}:{node.lineno} imports {alias.name}")
    return found


def test_no_module_imports_another_modules_private_name() -> None:
    assert private_imports() == []


MAX_MODULE_LINES = 600


def test_no_module_of_the_package_or_the_server_is_over_600_lines() -> None:
    """One module, one job: a module grown past 600 lines is split along its jobs."""
    long = [
        f"{path.relative_to(ROOT)}: {n} lines"
        for pkg in ("cachectl", "server")
        for path in sorted((ROOT / pkg).rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert long == []


# The gate (cachectl/trust/gate.py, ARCHITECTURE.md "The gate"): no other module reads an entry or
# a stored executable for loading, or deserializes one. Found by ast: a call of a deserializer
# (a backend's deserialize_executable, serialize_executable.deserialize_and_load), an unpickle
# (pickle/cloudpickle/dill/marshal loads, any Unpickler; a round trip of one's own object,
# ``pickle.loads(pickle.dumps(x))``, is not one), a read whose path names an entry or executable
# file (CACHE_SUFFIX, EXECUTABLE_SUFFIX, "-cache", "-aot"), a class JAX's cache would call.
GATE = "cachectl/trust/gate.py"
# (module, enclosing function or class, what) outside the gate, each with why it loads nothing.
STORED_BYTES_OUTSIDE_THE_GATE = {
    # The seam's plumbing: JAX's get returns what the gate returns (tested below), nothing else.
    ("cachectl/core/jax_cache_io.py", "VerifyingCache", "jax-cache"),
    # The seam names JAX's unpickler class; only the gate unpickles with it.
    ("cachectl/core/jax_executables.py", "pjrt_pickler_classes", "unpickle"),
    # verify checks an executable's header and checksum: unpickles nothing.
    ("cachectl/lifecycle/checks.py", "check_executable", "read"),
    # sync hashes files to index them, and push uploads a mirror's files: nothing loads.
    ("cachectl/lifecycle/sync.py", "_observe", "read"),
    ("cachectl/lifecycle/sync.py", "read_namespace", "read"),
    ("cachectl/service/mirror_push.py", "_triage", "read"),
    ("cachectl/service/mirror_push.py", "_executables_to_push", "read"),
    # pull copies a file into a mirror when the gate's comparison (matches) says its bytes are
    # the index row's; JAX reads the mirror through the gate.
    ("cachectl/service/mirror.py", "_copy", "read"),
    # The node tier's fetch and read: the bytes go back to the gate (EntryGate.get, the
    # verified record's sha256 checked), which alone hands them to JAX.
    ("cachectl/service/node_source.py", "fetch", "read"),
    ("cachectl/service/node_source.py", "read_entry", "read"),
    # warm, in server mode, uploads the file at a bucket's key only when its sha256 is still
    # its row's, which is one this run's put was handed.
    ("cachectl/warm/settle.py", "_server_entry", "read"),
    # a stored executable's header (no unpickle), to tell whether serving would use it or warm
    # stores it again; serving loads it through the gate.
    ("cachectl/warm/settle.py", "_bound_here", "read"),
}
_DESERIALIZERS = {"deserialize_executable", "deserialize_and_load"}
_PICKLES = {"pickle", "_pickle", "cloudpickle", "dill", "marshal"}
_READ_WORDS = ("read", "open", "download", "fetch", "cat")  # read_bytes, self._read, fs.cat_file


def _a_read(name: str) -> bool:
    return any(word in name.lower() for word in _READ_WORDS)


_SUFFIX_NAMES = {"CACHE_SUFFIX", "EXECUTABLE_SUFFIX"}


def _names_an_entry_file(node: ast.AST) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and sub.id in _SUFFIX_NAMES:
            return True
        if isinstance(sub, ast.Attribute) and sub.attr in _SUFFIX_NAMES:
            return True
        if isinstance(sub, ast.Constant) and str(sub.value).endswith(("-cache", "-aot")):
            return True
    return False


def _a_round_trip(call: ast.Call) -> bool:
    first = call.args[0] if call.args else None
    return isinstance(first, ast.Call) and ast.unparse(first.func).endswith("dumps")


def stored_byte_loaders(rel: str, source: str) -> set[tuple[str, str, str]]:
    """(module, enclosing function or class, what) of each place ``source`` reads an entry or
    executable file, deserializes or unpickles bytes, or makes a class JAX's cache calls."""
    found: set[tuple[str, str, str]] = set()

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Call):
                func = child.func
                name = ast.unparse(func).rsplit(".", 1)[-1]
                owner = ast.unparse(func.value) if isinstance(func, ast.Attribute) else ""
                paths = [*child.args, *(k.value for k in child.keywords)]
                if name in ("read_bytes", "read_text") and isinstance(func, ast.Attribute):
                    paths.append(func.value)  # Path(...).read_bytes()
                if name in _DESERIALIZERS:
                    found.add((rel, where, "deserialize"))
                elif owner in _PICKLES and name in ("loads", "load") and not _a_round_trip(child):
                    found.add((rel, where, "unpickle"))
                elif _a_read(name) and any(_names_an_entry_file(p) for p in paths):
                    found.add((rel, where, "read"))
            elif isinstance(child, (ast.Name, ast.Attribute)):
                ident = child.id if isinstance(child, ast.Name) else child.attr
                if "unpickler" in ident.lower():
                    found.add((rel, where, "unpickle"))
            elif isinstance(child, ast.ClassDef) and any(
                "CacheInterface" in ast.unparse(b) for b in child.bases
            ):
                found.add((rel, child.name, "jax-cache"))
            inner = (
                child.name
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                else where
            )
            visit(child, inner)

    visit(ast.parse(source, filename=rel), "<module>")
    return found


def _loaders_outside_the_gate(sources: dict[str, str]) -> set[tuple[str, str, str]]:
    found: set[tuple[str, str, str]] = set()
    for rel, source in sources.items():
        found |= stored_byte_loaders(rel, source)
    return {f for f in found if f[0] != GATE} - STORED_BYTES_OUTSIDE_THE_GATE


def _package_sources() -> dict[str, str]:
    return {
        str(p.relative_to(ROOT)): p.read_text()
        for pkg in PACKAGES
        for p in sorted((ROOT / pkg).rglob("*.py"))
    }


def test_only_the_gate_loads_stored_bytes() -> None:
    sources = _package_sources()
    gate = stored_byte_loaders(GATE, sources[GATE])
    assert {w for _, _, w in gate} >= {"read", "deserialize", "unpickle"}, gate
    outside = _loaders_outside_the_gate(sources)
    assert outside == set(), (
        "read stored bytes for loading, and deserialize or unpickle them, only in "
        f"cachectl/trust/gate.py (the gate): {sorted(outside)}"
    )
    everywhere: set[tuple[str, str, str]] = set()
    for rel, source in sources.items():
        everywhere |= stored_byte_loaders(rel, source)
    gone = STORED_BYTES_OUTSIDE_THE_GATE - everywhere
    assert gone == set(), f"a listed reader is gone: take it off the list: {sorted(gone)}"
    # The seam's verifying cache hands JAX what the gate returns, and tells it every put.
    seam = ast.parse(sources["cachectl/core/jax_cache_io.py"])
    (cache,) = [
        n for n in ast.walk(seam) if isinstance(n, ast.ClassDef) and n.name == "VerifyingCache"
    ]
    methods = {f.name: f for f in cache.body if isinstance(f, ast.FunctionDef)}
    assert [ast.unparse(s) for s in methods["get"].body] == [
        "return verifier.get(key, self._base.get)"
    ]
    assert ast.unparse(methods["put"].body[-1]) == "verifier.put(key, bytes(value))"


def test_the_gate_check_finds_a_module_that_loads_outside_it() -> None:
    planted = """
import pickle
from cachectl.storage.entries import CACHE_SUFFIX, EXECUTABLE_SUFFIX

def serve(store, key, backend):
    meta = pickle.loads(store.read_bytes(key + EXECUTABLE_SUFFIX))
    return backend.deserialize_executable(store.read_bytes(f"{key}{CACHE_SUFFIX}"), meta)

def copy(path):
    return pickle.loads(pickle.dumps(path))  # a round trip of one's own object
"""
    found = _loaders_outside_the_gate({"cachectl/dispatch/planted.py": planted})
    assert found == {
        ("cachectl/dispatch/planted.py", "serve", "read"),
        ("cachectl/dispatch/planted.py", "serve", "unpickle"),
        ("cachectl/dispatch/planted.py", "serve", "deserialize"),
    }
