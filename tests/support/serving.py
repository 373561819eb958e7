"""What serving tests run in their service processes and read back from them."""

from __future__ import annotations

import json
from typing import Any

COUNT_EVENTS = """
import json, sys, warnings
events = dict()
def _on(e, d, **kw):
    events[e] = events.get(e, 0) + 1
import jax
jax.monitoring.register_event_duration_secs_listener(_on)
def compiles():
    return dict((k, v) for k, v in events.items()
                if k in ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/backend_compile_duration"))
"""


def last_json(proc: Any) -> dict[str, Any]:
    return json.loads(proc.stdout.strip().splitlines()[-1])
