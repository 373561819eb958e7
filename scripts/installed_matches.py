"""Exit 0 when this interpreter's environment already holds what `pip install -e '.[all]'` installs.

scripts/test runs it (with the venv's python) before its own pip step, so that a venv someone
already made with `.venv/bin/pip install -e '.[all]'` is not installed a second time: the
project is installed in editable mode from this checkout, and every requirement pyproject.toml
names for the base install and the `all` extra (the extras it names, followed) is installed at
a version its specifier accepts. Anything else exits 1 with the first thing missing.
"""

from __future__ import annotations

import json
import sys
import sysconfig
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent


def requirements(project: dict, extra: str) -> list[Requirement]:
    """The base requirements and those of ``extra``, self-references expanded."""
    name = canonicalize_name(project["name"])
    extras = project.get("optional-dependencies", {})
    out = [Requirement(r) for r in project.get("dependencies", [])]
    todo, seen = [extra], set()
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        for text in extras.get(current, []):
            req = Requirement(text)
            if canonicalize_name(req.name) == name:
                todo.extend(req.extras)
            else:
                out.append(req)
    return out


def problem(extra: str = "all", root: Path = ROOT, pyproject: Path | None = None) -> str | None:
    """What is missing, or None when nothing is (``root``: the checkout installed from; its
    pyproject.toml unless another is given)."""
    project = tomllib.loads((pyproject or root / "pyproject.toml").read_text())["project"]
    # Looked up in the environment's site-packages only: the checkout's own
    # `<name>.egg-info` (which an editable install or `pip wheel .` leaves beside pyproject.toml)
    # is on sys.path whenever the working directory is, and carries no direct_url.json.
    site = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    found = list(metadata.distributions(name=project["name"], path=site))
    if not found:
        return f"{project['name']} is not installed"
    dist = found[0]
    direct = json.loads(dist.read_text("direct_url.json") or "{}")
    if not direct.get("dir_info", {}).get("editable") or direct.get("url") != root.as_uri():
        return f"{project['name']} is not installed in editable mode from {root}"
    for req in requirements(project, extra):
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            version = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            return f"{req.name} is not installed"
        if not req.specifier.contains(version, prereleases=True):
            return f"{req.name} {version} does not satisfy {req}"
    return None


if __name__ == "__main__":
    found = problem(*sys.argv[1:2])
    if found:
        print(found)
    sys.exit(1 if found else 0)
