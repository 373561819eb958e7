"""A process that compiles one slow program through activate() and counts its compiles from
JAX's own monitoring events (requests that use the persistent cache, less hits); PLAIN=1 runs it
without cachectl. N (its length: N=1500 takes about 1.5 s to compile on an idle core), SALT and
FN (its name) choose the program; EXIT_AFTER=S compiles it on a thread and exits S seconds after it took the lease. It prints one JSON line: pid, compiles, requests, out, t.
"""

CHILD = """
import json, os, sys, time
import numpy as np
import jax, jax.numpy as jnp
from jax import monitoring
counts = {"requests": 0, "hits": 0}
def on_event(event, **kw):
    if event == "/jax/compilation_cache/compile_requests_use_cache":
        counts["requests"] += 1
    elif event == "/jax/compilation_cache/cache_hits":
        counts["hits"] += 1
monitoring.register_event_listener(on_event)
if os.environ.get("PLAIN") != "1":
    import cachectl
    cachectl.activate(telemetry=False)
def body(x):
    for i in range(int(os.environ["N"])):
        x = jnp.sin(x) * (1.0 + i * 1e-3) + jnp.cos(x * float(os.environ["SALT"]))
    return x
body.__name__ = os.environ.get("FN", "slow")
t0 = time.monotonic()
if os.environ.get("EXIT_AFTER"):  # a normal exit while a thread compiles
    import threading
    threading.Thread(target=jax.jit(body), args=(np.arange(8, dtype=np.float32),), daemon=True).start()
    while not any(t.name == "cachectl-compile-lease" for t in threading.enumerate()):
        time.sleep(0.02)  # until it holds the lease (its heartbeat runs)
    time.sleep(float(os.environ["EXIT_AFTER"]))
    sys.exit(0)
out = np.asarray(jax.jit(body)(np.arange(8, dtype=np.float32)))
print(json.dumps({"pid": os.getpid(), "compiles": counts["requests"] - counts["hits"],
                  "requests": counts["requests"], "out": out.tolist(), "t": time.monotonic() - t0}))
"""
