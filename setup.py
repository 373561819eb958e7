"""Package discovery for the three import roots (the rest of the build is pyproject.toml).

setuptools' ``packages.find`` cannot rename a folder, and server/ and migrations/ install
as ``cachectl_server`` and ``cachectl_migrations`` (nothing called plain "server" may land
in site-packages). So every package under each root is found here, never listed by hand:
a new subpackage ships without anyone editing a list. Folders of data (templates, the
exec hook's sitecustomize) are packages too, as setuptools asks of data it installs
(scripts/release-check compares the built wheel with the source tree).
"""

from setuptools import find_namespace_packages, setup

ROOTS = {"cachectl": "cachectl", "cachectl_server": "server", "cachectl_migrations": "migrations"}

setup(
    package_dir=ROOTS,
    packages=[
        f"{name}.{sub}" if sub else name
        for name, folder in ROOTS.items()
        for sub in ["", *find_namespace_packages(folder, exclude=["*__pycache__*"])]
    ],
)
