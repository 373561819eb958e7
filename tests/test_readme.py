"""The README and the docs site, run the way a newcomer runs them: every shell block, in order,
on a fresh clone and HOME.

Blocks are the pages' ```sh, ```bash and ```console fences (console: the
``$ `` lines). An HTML comment right above a fence marks it:

  <!-- readme-test: heavy (why) -->  pip install, full warm, the test script: run
                                     only by the heavy test (CI, or CACHECTL_TEST_HEAVY=1)
  <!-- readme-test: skip (why) -->   never run; the README must say why in its prose

The quick test runs every unmarked block with a stand-in ``.venv`` in the clone
(wrappers around this test's interpreter, as if the README's first command had
made it; its pip refuses to run); the heavy one starts from nothing and runs
the first command for real.
The one change made to what the README says: ``scripts/test`` is only checked for syntax
(``bash -n``): CI runs it itself (.ci/run), and a nested run would install the whole test
toolchain again.

The docs pages (mkdocs.yml's nav, in order) run in one more test: one fresh clone and HOME,
the example warmed once, then every unmarked block of every page, each page in a subshell.

The Flax NNX and Equinox recipes of docs/manifests.md are written out from
its ```python / ```yaml blocks (named by their first-line comment),
warmed, and called by its service in a fresh process.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = REPO / "docs"
# The pages that may name test files: the suite itself, the threat model's proofs, and the JAX
# facts (each pinned by the test it names).
NAMES_TESTS = {"development.md", "signatures.md", "jax-facts.md"}
_TEST_FILE = re.compile(r"tests/[\w/]*test_\w+\.py|\btest_\w+\.py")

_FENCE = re.compile(
    r"(?:<!-- readme-test: (?P<mark>heavy|skip)\b(?P<why>[^>]*)-->[ \t]*\n)?"
    r"^```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^```[ \t]*$",
    re.S | re.M,
)
_SHELL = ("sh", "bash", "console")
# What the README's test command becomes here: set up and collect, never run the suite again.
_TEST_COMMAND = re.compile(r"^scripts/test\s*$", re.M)
_TEST_COMMAND_HERE = "bash -n scripts/test"


@dataclass(frozen=True)
class Block:
    lang: str
    body: str
    line: int
    mark: str | None
    why: str
    source: str = "README.md"


def readme_blocks(text: str | None = None, source: str = "README.md") -> list[Block]:
    text = README.read_text(encoding="utf-8") if text is None else text
    return [
        Block(
            m["lang"],
            m["body"],
            text.count("\n", 0, m.start("body")) + 1,
            m["mark"],
            (m["why"] or "").strip(),
            source,
        )
        for m in _FENCE.finditer(text)
    ]


def docs_pages() -> list[Path]:
    """The site's pages in mkdocs.yml's nav order."""
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text(encoding="utf-8"))

    def walk(node: object) -> list[str]:
        if isinstance(node, str):
            return [node]
        if isinstance(node, list):
            return [page for item in node for page in walk(item)]
        if isinstance(node, dict):
            return [page for value in node.values() for page in walk(value)]
        return []

    return [DOCS / page for page in walk(config["nav"])]


def page_blocks(page: Path) -> list[Block]:
    return readme_blocks(page.read_text(encoding="utf-8"), f"docs/{page.name}")


def runnable(blocks: list[Block], *, heavy: bool) -> list[Block]:
    return [
        b for b in blocks if b.lang in _SHELL and b.mark != "skip" and (heavy or b.mark != "heavy")
    ]


def shell_blocks(*, heavy: bool) -> list[Block]:
    return runnable(readme_blocks(), heavy=heavy)


def _commands(block: Block) -> str:
    if block.lang == "console":
        return "\n".join(line[2:] for line in block.body.splitlines() if line.startswith("$ "))
    return _TEST_COMMAND.sub(_TEST_COMMAND_HERE, block.body)


def script(blocks: list[Block]) -> str:
    """One bash script, so `source .venv/bin/activate` and `eval "$(cachectl env)"` carry over."""
    parts = [
        "set -eE -o pipefail",
        "trap 'echo \"README command failed (exit $?): $BASH_COMMAND\" >&2' ERR",
    ]
    for block in blocks:
        parts += [f"echo '--- {block.source}:{block.line}' >&2", _commands(block)]
    return "\n".join(parts) + "\n"


def _clone(dest: Path) -> Path:
    """The files a fresh clone of this working tree has (tracked, and new ones not ignored)."""
    listed = (
        subprocess.run(
            ["git", "-C", str(REPO), "ls-files", "-z", "-co", "--exclude-standard"],
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for rel in filter(None, listed):
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


def _fresh_env(tmp_path: Path) -> dict[str, str]:
    """A newcomer's shell: a fresh HOME and XDG dirs; no cachectl or JAX settings; no venv on PATH."""
    home = tmp_path / "home"
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("CACHECTL_", "JAX_", "XDG_", "VIRTUAL_ENV", "PYTHON"))
    }
    venv_bins = {
        str(Path(sys.executable).parent),
        str(Path(sys.prefix) / "bin"),
        str(REPO / ".venv" / "bin"),
    }
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "").split(os.pathsep) if p not in venv_bins
    )
    env["HOME"] = str(home)
    for var, sub in (
        ("XDG_DATA_HOME", ".local/share"),
        ("XDG_CACHE_HOME", ".cache"),
        ("XDG_CONFIG_HOME", ".config"),
        ("XDG_STATE_HOME", ".local/state"),
    ):
        (home / sub).mkdir(parents=True, exist_ok=True)
        env[var] = str(home / sub)
    return env


def _stand_in_venv(venv: Path) -> None:
    """The clone's .venv as the README's first command leaves it, run by this test's interpreter.

    Wrappers, not a link to the real virtualenv: a README block that installs
    something must fail here, never install into (or over) the developer's .venv.
    """
    bin_dir = venv / "bin"
    bin_dir.mkdir(parents=True)
    refuse = 'echo "quick README test: no installs here (mark the block heavy)" >&2; exit 97'
    wrappers = {
        "python": (
            f'case "$1 $2" in "-m pip"|"-m ensurepip"|"-m venv") {refuse};; esac\n'
            f'exec {sys.executable} "$@"'
        ),
        "cachectl": f'exec {sys.executable} -m cachectl "$@"',
        "pip": refuse,
    }
    wrappers["python3"] = wrappers["python"]
    for name, body in wrappers.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    (bin_dir / "activate").write_text(
        f'VIRTUAL_ENV={venv}\nexport VIRTUAL_ENV\nPATH="{bin_dir}:$PATH"\nexport PATH\n'
    )


def _run_readme(
    tmp_path: Path, *, heavy: bool, timeout: int, text: str | None = None
) -> subprocess.CompletedProcess[str]:
    clone = _clone(tmp_path / "cachectl")
    if not heavy:
        _stand_in_venv(clone / ".venv")
    (tmp_path / "readme.sh").write_text(text or script(shell_blocks(heavy=heavy)))
    return subprocess.run(
        ["bash", str(tmp_path / "readme.sh")],
        cwd=clone,
        env=_fresh_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def _explain(proc: subprocess.CompletedProcess[str]) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}"


def test_readme_blocks_are_marked_and_start_with_the_main_job() -> None:
    text = README.read_text(encoding="utf-8")
    assert text.count("\n") <= 400, "a README a newcomer reads in 10 minutes: the rest is docs/"
    blocks = readme_blocks()
    shell = [b for b in blocks if b.lang in _SHELL]
    assert len(shell) >= 4, shell
    first = shell[0]
    assert first.line <= 5, "the two commands open the README"
    commands = [line for line in first.body.splitlines() if line and not line.startswith("#")]
    assert len(commands) == 2 and _TEST_COMMAND.search(commands[1]), commands
    assert first.mark == "heavy" and commands[0].endswith("cachectl warm examples/manifest.yaml")
    assert "pip install -e . " in commands[0], "the main job needs the core install only"
    assert "pip install -q" not in first.body, (
        "the install is the slow part: pip shows its progress"
    )
    assert not _TEST_FILE.search(text), "the README names no test file: docs/development.md does"
    assert all(b.why for b in blocks if b.mark), "every heavy or skipped block says why"
    # A bare `cachectl` needs .venv on PATH: the README activates it before its first bare command.
    unmarked = "\n".join(_commands(b) for b in shell_blocks(heavy=False))
    assert unmarked.index("source .venv/bin/activate") < unmarked.index("cachectl ")
    assert "serve.py" not in unmarked and "--env bb4051" not in unmarked


@pytest.mark.timeout(460)
def test_readme_commands_run_in_order_on_a_fresh_home(tmp_path: Path) -> None:
    proc = _run_readme(tmp_path, heavy=False, timeout=400)
    assert proc.returncode == 0, _explain(proc)
    assert "README command failed" not in proc.stderr
    assert "no service telemetry" not in proc.stdout, (
        "the tour's activate() one-liner records telemetry"
    )
    # The tour warms its one-liner with warm-run first: the service's program is a hit.
    stats = subprocess.run(
        [
            str(tmp_path / "cachectl" / ".venv" / "bin" / "cachectl"),
            "stats",
            "--since",
            "1h",
            "--json",
        ],
        cwd=tmp_path / "cachectl",
        env=_fresh_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert stats.returncode == 0, stats.stderr
    tour = [f for f in json.loads(stats.stdout)["functions"] if f["function"] == "jit__lambda"]
    assert tour and all(f["hits"] >= 1 and f["misses"] == 0 for f in tour), tour


@pytest.mark.heavy
@pytest.mark.timeout(960)  # a pip install from the index plus the full warm: past the default 300 s
def test_readme_top_to_bottom_from_a_fresh_clone(tmp_path: Path) -> None:
    """The whole README for real: the core install into the clone, the full warm, the tour."""
    proc = _run_readme(tmp_path, heavy=True, timeout=900)
    assert proc.returncode == 0, _explain(proc)
    assert "11 bucket(s): 11 compiled" in proc.stdout, _explain(proc)  # the first command's warm
    assert "11 bucket(s): 0 compiled, 11 cached" in proc.stdout  # the tour's warm
    assert "coverage: 11/11 buckets hit (100.0%)" in proc.stdout
    assert "3 bucket(s): 3 compiled" in proc.stdout  # your own model
    # The tour writes its bundle (and anything else) outside the checkout.
    left = subprocess.run(
        ["git", "status", "--porcelain", "--ignored"],
        cwd=tmp_path / "cachectl",
        capture_output=True,
        text=True,
    )
    assert "cache.tar.zst" not in left.stdout


# ------------------------------------------------------------ the docs site


def test_docs_pages_are_in_the_nav_and_name_no_test_file() -> None:
    pages = docs_pages()
    assert {p.name for p in pages} == {p.name for p in DOCS.glob("*.md")}, "every page in the nav"
    named = {
        p.name: sorted(set(_TEST_FILE.findall(p.read_text(encoding="utf-8"))))
        for p in pages
        if p.name not in NAMES_TESTS
    }
    assert {page: found for page, found in named.items() if found} == {}
    for page in pages:
        assert all(b.why for b in page_blocks(page) if b.mark), f"{page.name}: a mark says why"


def _docs_on_one_warmed_cache(
    tmp_path: Path, *, heavy: bool
) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """The example warmed once, then each page's blocks (unmarked, or heavy only) in a subshell."""
    parts = [
        "source .venv/bin/activate",
        "echo '--- the example warmed once: the pages share this cache' >&2",
        "cachectl warm examples/manifest.yaml",
    ]
    ran = []
    for page in docs_pages():
        blocks = [
            b for b in runnable(page_blocks(page), heavy=heavy) if heavy == (b.mark == "heavy")
        ]
        if blocks:
            ran.append(page.name)
            body = script(blocks).split("\n", 2)[2]  # the page's commands, without the prologue
            parts += [f"( # {page.name}", body, ")"]
    text = script([]) + "\n".join(parts) + "\n"
    return _run_readme(tmp_path, heavy=False, timeout=500, text=text), ran


@pytest.mark.timeout(560)
def test_docs_commands_run_on_one_warmed_cache(tmp_path: Path) -> None:
    """Every unmarked shell block of the site, page by page in nav order, on one warmed cache."""
    proc, ran = _docs_on_one_warmed_cache(tmp_path, heavy=False)
    assert proc.returncode == 0, _explain(proc)
    assert "README command failed" not in proc.stderr
    assert "11 bucket(s): 11 compiled" in proc.stdout, _explain(proc)
    assert {"commands.md", "serving.md", "server.md", "lifecycle.md"} <= set(ran), ran
    # The serving page's warm-check proves the shared cache, and its bundle went to a temp dir.
    assert "stored executables: 11/11 load and run" in proc.stdout, _explain(proc)
    assert not list((tmp_path / "cachectl").glob("*.tar.zst"))


@pytest.mark.heavy
@pytest.mark.timeout(560)
def test_docs_heavy_commands_run_on_one_warmed_cache(tmp_path: Path) -> None:
    """The pages' heavy blocks (a signed warm, the canary, warm-run), in CI."""
    proc, ran = _docs_on_one_warmed_cache(tmp_path, heavy=True)
    assert proc.returncode == 0, _explain(proc)
    assert {"commands.md", "signatures.md", "tpu.md"} <= set(ran), ran
    assert "canary: 11/11" in proc.stdout, _explain(proc)


# ------------------------------------------------------------ manifest recipes


def _named_blocks() -> dict[str, str]:
    """python/yaml blocks (README and docs) whose first line is `# NAME.py` or `# NAME.yaml...`."""
    named = {}
    for block in [b for page in docs_pages() for b in page_blocks(page)] + readme_blocks():
        match = re.match(r"# (\w+\.(?:py|yaml))\b", block.body)
        if block.lang in ("python", "yaml") and match:
            named[match.group(1)] = block.body
    return named


def _cachectl(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cachectl", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_readme_nnx_and_equinox_recipes_warm_and_hit(tmp_path: Path) -> None:
    pytest.importorskip("flax")
    pytest.importorskip("equinox")
    files = _named_blocks()
    assert {"nnx_model.py", "eqx_model.py", "models.yaml", "service.py"} <= set(files), sorted(
        files
    )
    for name, body in files.items():
        (tmp_path / name).write_text(body)

    warm = _cachectl(tmp_path, "warm", "models.yaml", "--json")
    assert warm.returncode == 0, warm.stderr
    report = json.loads(warm.stdout)
    assert [(b["function"], b["status"]) for b in report["buckets"]] == [
        ("nnx_forward", "compiled"),
        ("nnx_forward", "compiled"),
        ("eqx_forward", "compiled"),
        ("eqx_forward", "compiled"),
    ]
    check = _cachectl(tmp_path, "warm-check", "models.yaml")
    assert check.returncode == 0 and "coverage: 4/4 buckets hit (100.0%)" in check.stdout, (
        check.stderr
    )

    # The README's service, a fresh process: its telemetry says every forward call hit.
    service = subprocess.run(
        [sys.executable, "service.py"], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert service.returncode == 0, service.stderr
    assert service.stdout.splitlines() == ["(1, 4) (1, 4)", "(8, 4) (8, 4)"]
    stats = _cachectl(tmp_path, "stats", "--since", "1h", "--json")
    assert stats.returncode == 0, stats.stderr
    forward = [f for f in json.loads(stats.stdout)["functions"] if f["function"] == "jit_forward"]
    # Both manifest functions compile under one jit name; stats gives each its own row by key.
    assert sorted((f["name"], f["requests"], f["hits"], f["misses"]) for f in forward) == [
        ("eqx_forward", 2, 2, 0),
        ("nnx_forward", 2, 2, 0),
    ], forward

    # The same manifest through cachectl.serving: NNX State and Equinox trees as arguments,
    # every call (padded 3 -> 8) on a stored executable, nothing traced or compiled.
    serving = """
import json, numpy as np, jax, equinox as eqx
from flax import nnx
import cachectl, eqx_model, nnx_model
events = []
jax.monitoring.register_event_duration_secs_listener(lambda e, d, **k: events.append(e))
rt = cachectl.serving("models.yaml")
_, state = nnx.split(nnx_model.make_model())
params, _ = eqx.partition(eqx_model.make_model(), eqx.is_array)
jax.block_until_ready((state, params))
before = len([e for e in events if e.endswith(("jaxpr_trace_duration", "backend_compile_duration"))])
shapes = [(rt["nnx_forward"](state, np.ones((n, 16), np.float32)).shape,
           rt["eqx_forward"](params, np.ones((n, 16), np.float32)).shape) for n in (1, 3, 8)]
after = len([e for e in events if e.endswith(("jaxpr_trace_duration", "backend_compile_duration"))])
report = rt.report().to_dict()["functions"]
print(json.dumps({"compiles": after - before, "aot": [report[f]["aot"] for f in ("nnx_forward", "eqx_forward")],
                  "shapes": [[list(a), list(b)] for a, b in shapes]}))
"""
    served = subprocess.run(
        [sys.executable, "-c", serving], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert served.returncode == 0, served.stderr
    out = json.loads(served.stdout.strip().splitlines()[-1])
    assert out["compiles"] == 0 and out["aot"] == [3, 3], out
    assert out["shapes"] == [[[1, 4], [1, 4]], [[8, 4], [8, 4]], [[8, 4], [8, 4]]], out
