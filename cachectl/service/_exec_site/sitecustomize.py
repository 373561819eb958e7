"""Put on PYTHONPATH by `cachectl exec`: service telemetry for a process that never calls activate().

Nothing happens until the process imports JAX (a Python helper that never does
pays one environment lookup). Then the collector starts exactly as activate()
would start it, with the environment `cachectl exec` resolved, and a remembered
environment is checked against the process's own (cachectl.service.exec_hook). A user's own
sitecustomize further down the path still runs.
"""

import os
import runpy
import sys


def _chain_the_users_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if not entry or os.path.abspath(entry) == here:
            continue
        candidate = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(candidate):
            runpy.run_path(candidate, run_name="sitecustomize")
            return


if os.environ.get("CACHECTL_EXEC_ENVIRONMENT") or os.environ.get("CACHECTL_EXEC_COUNTS"):
    try:
        from cachectl.service.exec_hook import install

        install()
    except Exception:  # noqa: BLE001 - never break the service's start
        pass
_chain_the_users_sitecustomize()
