"""The distribution's name: one of its own on the package index, the one every install line uses.

On the package index ``cachectl`` is an unrelated project (cache directories for pnpm, npm,
pip...): a user following ``pip install cachectl`` got it, and ``cachectl.activate()`` raised
AttributeError. The import and the command stay ``cachectl``; the distribution is
pyproject.toml's ``[project] name``, and the README (its service line), docs/install.md (its Dockerfile), the
examples and the release check (scripts/release_check.py installs the README's line from the
built wheel) all name it. scripts/installed_matches.py lets scripts/test take an existing
``pip install -e '.[all]'`` instead of running pip again.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import installed_matches  # noqa: E402
import release_check  # noqa: E402

# Taken on the package index by another project (checked with `pip index versions cachectl`).
TAKEN = {"cachectl"}
PIP_INSTALL = re.compile(r"pip install (?!-)['\"]?([A-Za-z0-9._-]+)(\[[^\]'\"]*\])?")


def _name() -> str:
    return str(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["name"])


def _docs() -> list[Path]:
    files = [REPO / "README.md", *(REPO / "examples").rglob("*"), *(REPO / "docs").rglob("*.md")]
    return [f for f in files if f.is_file() and f.suffix in (".md", ".yaml", ".py", "")]


def test_the_distribution_has_a_name_of_its_own_and_every_install_line_uses_it() -> None:
    name = _name()
    assert name not in TAKEN, f"{name!r} on the package index is another project"
    lines = []
    for path in _docs():
        for match in PIP_INSTALL.finditer(path.read_text(encoding="utf-8", errors="replace")):
            if match.group(1).startswith("cachectl"):
                lines.append((path.relative_to(REPO), match.group(0), match.group(1)))
    assert lines, "no install line found"
    wrong = [(str(p), text) for p, text, dist in lines if dist != name]
    assert not wrong, wrong
    # Not on the package index yet: the image installs the wheel built from the checkout.
    install_page = (REPO / "docs" / "install.md").read_text()
    assert f"RUN pip install {name} --find-links /tmp/wheels" in install_page  # the Dockerfile
    assert release_check.readme_install_name() == name
    # `all` names the project's own extras by the distribution's name.
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert all(r.startswith(f"{name}[") for r in extras["all"]), extras["all"]


def test_the_release_check_reads_the_readmes_install_line(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("a service needs only\n`pip install some-dist`). More.")
    assert release_check.readme_install_name(readme) == "some-dist"
    readme.write_text("no install line")
    with pytest.raises(release_check.StepFailed, match="no service install line"):
        release_check.readme_install_name(readme)


def test_scripts_test_takes_the_readmes_install_and_sees_what_it_lacks(tmp_path: Path) -> None:
    # This venv was made by pip install -e '.[all]' (scripts/test's, or by hand).
    assert installed_matches.problem() is None
    other = tmp_path / "other"  # another checkout: not the one this venv installed
    other.mkdir()
    (other / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text())
    found = installed_matches.problem(root=other)
    assert found is not None and "editable mode" in found, found
    text = (REPO / "pyproject.toml").read_text()
    field = "field = [\n"
    assert text.count(field) == 1
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(text.replace(field, field + '  "no-such-package-for-cachectl>=1",\n'))
    assert installed_matches.problem(pyproject=pyproject) == (
        "no-such-package-for-cachectl is not installed"
    )
    pyproject.write_text(text.replace('"jax>=0.9.2"', '"jax>=99"'))
    found = installed_matches.problem(pyproject=pyproject)
    assert found is not None and found.startswith("jax ") and "jax>=99" in found, found
