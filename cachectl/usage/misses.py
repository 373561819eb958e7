"""`cachectl misses`: every program signature a service missed, explained against the manifest.

The expected signatures are computed the way the service's are recorded: each bucket of
the manifest is lowered (never compiled) in this process with the same pxla tap the
collector uses (cachectl/usage/misses_expected.py), so both sides are JAX's own flat input avals
and shardings. A missed signature is compared with the nearest bucket of its function
(same module name, same number of inputs, fewest differing fields) and every differing
field is said in words a user acts on (cachectl/usage/misses_explain.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from cachectl.core import jax_seam
from cachectl.core.errors import BadInput, path_words
from cachectl.core.fingerprint import Environment
from cachectl.core.jsonable import from_jsonable
from cachectl.index.misses_queries import MissesFacts, misses_facts
from cachectl.index.models import utcnow
from cachectl.index.telemetry_queries import SignatureRow
from cachectl.service.env_differences import compare
from cachectl.usage.misses_expected import (
    ExpectedSignature,
    LoweringFailure,
    expected_signatures,
)
from cachectl.usage.misses_explain import (
    MissFinding,
    explain,
    explosion_findings,
    leaf_of,
    nearest_bucket,
    not_in_manifest_finding,
    static_finding,
    weak_variants,
)


@dataclass(frozen=True)
class MissedSignature:
    function: str
    digest: str
    leaves: list[Any]
    requests: int
    misses: int
    uncacheable: int
    repeats: int
    nearest: str | None
    last_seen: datetime
    source: str | None = None  # "f at model.py:12", where JAX knew it
    statics: list[Any] | None = None


@dataclass(frozen=True)
class MissesReport:
    cache: str
    since: datetime
    manifest: str | None
    signatures: int
    requests: int
    hits: int
    misses: int
    uncacheable: int
    covered: int | None  # requests whose signature is a bucket of the manifest
    missed: list[MissedSignature]
    findings: list[MissFinding]
    # JAX-internal or fast programs JAX never writes (jit_stage, ...), not in the manifest: {module: requests}
    uncacheable_functions: dict[str, int] = field(default_factory=dict)
    # Every manifest explained against: --manifest, else the one that warmed each function and
    # the latest warm's for the functions none warmed (``manifest`` is the first of them)
    manifests: list[str] = field(default_factory=list)
    # Programs with host callbacks, which JAX never writes (so no warm can serve them): not
    # cacheable and never a miss, as `stats` counts them: {module: requests}
    host_callback_functions: dict[str, int] = field(default_factory=dict)

    __json_extra__ = ("coverage", "ok", "host_callbacks_cause")

    @property
    def host_callbacks_cause(self) -> str | None:
        """Why the programs with host callbacks are not cacheable, and the way out."""
        funcs = self.host_callback_functions
        return jax_seam.host_callbacks_cause(sorted(funcs)) if funcs else None

    @property
    def coverage(self) -> float | None:
        """Share of the service's observed cacheable compile requests that match a bucket."""
        total = (
            self.requests
            - sum(self.uncacheable_functions.values())
            - sum(self.host_callback_functions.values())
        )
        if self.covered is None or total <= 0:
            return None
        return self.covered / total

    @property
    def ok(self) -> bool:
        """Nothing missed: the exit status and the text say the same (not-cacheable programs and
        hits of a re-jitted function are no misses)."""
        return self.misses == 0


# --------------------------------------------------------------------------- the command


def _warmed_programs(facts: MissesFacts, missed: dict[str, list[SignatureRow]]) -> dict[str, int]:
    """{module: programs of it the cache's index holds}, for the missed modules; the keys the
    service looked up are not among them (a hit would have found them)."""
    looked_up = {r.key for rows in missed.values() for r in rows if r.key}
    out: dict[str, int] = {}
    for module in missed:
        held = [k for k in facts.programs.get(module, []) if k not in looked_up]
        if held:
            out[module] = len(held)
    return out


def _on_disk(paths: Sequence[str], seen: dict[str, bool]) -> str | None:
    for p in paths:
        if p and seen.setdefault(p, Path(p).is_file()):
            return str(p)
    return None


def warmed_manifest(facts: MissesFacts) -> str | None:
    """The manifest of the latest finished warm run into the cache that still exists on disk."""
    return _on_disk(facts.warm_manifests, {})


def manifests_that_warmed(facts: MissesFacts, modules: Sequence[str]) -> dict[str, str]:
    """{module: the manifest of the latest warm run into the cache that stored a program of it},
    for the manifests still on disk: each function is explained against the manifest that warmed
    it, not against whichever service warmed last."""
    seen: dict[str, bool] = {}
    out: dict[str, str] = {}
    for module in dict.fromkeys(modules):
        found = _on_disk(facts.manifests_by_module.get(module, []), seen)
        if found:
            out[module] = found
    return out


@dataclass(frozen=True)
class _ManifestSide:
    """The manifest's buckets as lowered, by JAX's module name; ``modules``: the missed
    modules ``--function`` keeps (None: every one)."""

    expected: list[ExpectedSignature]
    names: dict[str, str]  # module -> the manifest's function name (before --function)
    by_module: dict[str, list[ExpectedSignature]]
    buckets_of: dict[str, dict[str, list[Any]]]  # module -> axis -> values
    signatures: set[tuple[str, tuple[jax_seam.Leaf, ...]]]
    modules: set[str] | None
    # The same, weak types dropped: a program whose leaves differ from a bucket's in weak types
    # alone is that bucket exactly when JAX's key says so (``_Tally.warmed_keys``).
    strong: set[tuple[str, tuple[jax_seam.Leaf, ...]]] = field(default_factory=set)
    failures: list[LoweringFailure] = field(default_factory=list)  # buckets that did not lower


def _manifest_side(
    manifests: Sequence[str | Path],
    function: str | None,
    owner: dict[str, str] | None = None,
    fallback: str | None = None,
) -> _ManifestSide:
    """The buckets of ``manifests``, lowered; with ``owner`` ({module: manifest}), a module's
    buckets come from its own manifest only (``fallback``'s, the latest warm's, for a module
    none owns)."""
    expected: list[ExpectedSignature] = []
    failures: list[LoweringFailure] = []
    for manifest in manifests:
        previous = logging.getLogger("jax").level
        lowered = expected_signatures(manifest, failures=failures)
        logging.getLogger("jax").setLevel(previous)
        if owner is not None:
            lowered = [e for e in lowered if owner.get(e.module, fallback) == str(manifest)]
        expected.extend(lowered)
    names = {e.module: e.name for e in expected}
    modules = None
    if function is not None:
        modules = {m for m, n in names.items() if function in (m, n)} or {function}
        expected = [e for e in expected if e.module in modules]
    by_module: dict[str, list[ExpectedSignature]] = {}
    buckets_of: dict[str, dict[str, list[Any]]] = {}
    for e in expected:
        by_module.setdefault(e.module, []).append(e)
        axes = buckets_of.setdefault(e.module, {})
        for k, v in e.bucket.items():
            if v not in axes.setdefault(k, []):
                axes[k].append(v)
    signatures = {(e.module, e.leaves) for e in expected}
    strong = {(e.module, strong_leaves(e.leaves)) for e in expected}
    if function is not None:  # --function names the manifest function or its jit module
        failures = [f for f in failures if function in (f.function, f"jit_{f.function}")]
    return _ManifestSide(
        expected, names, by_module, buckets_of, signatures, modules, strong, failures
    )


def strong_leaves(leaves: Sequence[jax_seam.Leaf]) -> tuple[jax_seam.Leaf, ...]:
    """Leaves without their weak types, which JAX's cache key does not hold: it hashes the
    lowered program, and a weak type is in it only where it changed an operation (a promotion's
    convert), so the key, not the flag, says whether two programs are one."""
    return tuple((shape, dtype, False, sharding) for shape, dtype, _weak, sharding in leaves)


def leaves_of(r: SignatureRow) -> tuple[jax_seam.Leaf, ...]:
    return tuple(leaf_of(x) for x in r.leaves)


@dataclass
class _Tally:
    """What the rows of one report add up to, filled row by row."""

    covered: int = 0
    findings: list[MissFinding] = field(default_factory=list)
    missed: list[MissedSignature] = field(default_factory=list)
    uncacheable: dict[str, int] = field(default_factory=dict)  # module -> requests
    host_callbacks: dict[str, int] = field(default_factory=dict)  # module -> requests
    per_module: dict[str, list[SignatureRow]] = field(default_factory=dict)  # missed rows
    not_in_manifest: dict[str, list[SignatureRow]] = field(default_factory=dict)
    # Missed rows whose signature is exactly a bucket: the key differs elsewhere (environment).
    bucket_matched: list[SignatureRow] = field(default_factory=list)
    # Keys warm stored for a manifest function, among those of rows that are a bucket but for
    # weak types: such a row is covered when its key is one of them (``strong_leaves``).
    warmed_keys: set[str] = field(default_factory=set)


def _lowering_findings(failures: list[LoweringFailure]) -> list[MissFinding]:
    """A manifest function that did not lower: its buckets cannot be compared, and a warm of
    them fails too; one finding per function, its first bucket's error (as warm words it)."""
    first: dict[str, LoweringFailure] = {}
    for f in failures:
        first.setdefault(f.function, f)
    return [
        MissFinding(
            f.function,
            f.function,
            "lowering",
            f"{f.function}[{f.bucket}] cannot lower here: {f.error}; run `cachectl misses` "
            "where the service runs (inside a jax.distributed job: in every process, with "
            "JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID set)"
            if _MESH_TOO_BIG in f.error
            else f"{f.function}[{f.bucket}] does not lower: {f.error}; fix the function or its "
            "manifest entry (`cachectl warm` reports the same error per bucket)",
            bucket=f.bucket,
        )
        for f in first.values()
    ]


# manifest/mesh.py's words for a mesh larger than this process's devices: the machine (or a job
# this process has not joined), not the manifest.
_MESH_TOO_BIG = "the mesh needs"


def _rejit(r: SignatureRow, name: str | None) -> MissFinding:
    return MissFinding(
        r.function,
        name,
        "rejit",
        f"{r.function} compiled {r.requests} programs with identical shapes: the function object "
        "changes per call (a lambda or partial jitted inside a loop): jit it once at module level",
        field="function",
        observed=r.requests,
        requests=r.requests,
        misses=r.misses,
    )


def _row_findings(
    r: SignatureRow,
    nearest: ExpectedSignature | None,
    candidates: list[ExpectedSignature],
    side: _ManifestSide,
) -> list[MissFinding]:
    """Why one missed signature of a manifest function (or the signature bound's overflow row)
    missed."""
    if r.digest == "*":
        text = (
            f"{r.requests} compile requests beyond the signature bound were not recorded one by one"
        )
        return [
            MissFinding(
                r.function or "?", None, "overflow", text, requests=r.requests, misses=r.misses
            )
        ]
    if nearest is None:
        return [
            MissFinding(
                r.function,
                side.names.get(r.function),
                "shape",
                f"{r.function}: {len(r.leaves)} inputs, no bucket has that many "
                "(another pytree structure?)",
                field="structure",
                observed=len(r.leaves),
                requests=r.requests,
                misses=r.misses,
            )
        ]
    if any(e.host_callbacks for e in side.by_module.get(r.function, [])):
        return [
            MissFinding(
                r.function,
                side.names.get(r.function),
                "host-callbacks",
                jax_seam.host_callbacks_cause([r.function]),
                field="program",
                requests=r.requests,
                misses=r.misses,
            )
        ]
    diffs = explain(r, nearest, side.buckets_of.get(r.function, {}), r.misses, candidates)
    if diffs:
        return diffs
    statics: dict[str, list[Any]] = {}
    for e in side.by_module[r.function]:
        for k, v in e.statics.items():
            if v not in statics.setdefault(k, []):
                statics[k].append(v)
    return [static_finding(r, nearest, statics, r.misses)]


def _tally_row(tally: _Tally, r: SignatureRow, side: _ManifestSide) -> None:
    leaves = tuple(leaf_of(x) for x in r.leaves)
    if (r.function, leaves) in side.signatures or r.key in tally.warmed_keys:
        tally.covered += r.requests
    if r.uncacheable and not r.misses and not r.hits:
        # JAX-internal staging, or host callbacks: not cacheable, never a miss, never a re-jit
        kind = tally.uncacheable if jax_seam.is_staging(r.source) else tally.host_callbacks
        kind[r.function] = kind.get(r.function, 0) + r.requests
        return
    if not r.misses:  # a miss is a miss, written or not; a manifest function's always is
        return
    candidates = [e for e in side.by_module.get(r.function, []) if len(e.leaves) == len(leaves)]
    nearest = nearest_bucket(leaves, candidates)
    tally.missed.append(
        MissedSignature(
            r.function,
            r.digest,
            r.leaves,
            r.requests,
            r.misses,
            r.uncacheable,
            r.repeats,
            nearest.label if nearest else None,
            r.last_seen,
            r.source,
            r.statics,
        )
    )
    host_callbacks = any(e.host_callbacks for e in side.by_module.get(r.function, []))
    if r.repeats and not host_callbacks:  # never written, so compiled again: not a re-jit
        tally.findings.append(_rejit(r, side.names.get(r.function)))
    tally.per_module.setdefault(r.function, []).append(r)
    if r.digest != "*" and r.function not in side.by_module:  # with no manifest, every one
        tally.not_in_manifest.setdefault(r.function, []).append(r)
    elif (r.function, leaves) in side.signatures:
        tally.bucket_matched.append(r)  # said per environment, or per row (_environment_findings)
    else:
        tally.findings.extend(_row_findings(r, nearest, candidates, side))


def flags_words(here: Sequence[str], warmed: Sequence[str]) -> str:
    """'XLA flags: the service has X, the entries were built without it; ...'."""

    def it(flags: list[str]) -> str:
        return "it" if len(flags) == 1 else "them"

    added = [f for f in here if f not in warmed]
    lacking = [f for f in warmed if f not in here]
    parts = []
    if added:
        parts.append(
            f"the service has {' '.join(added)}, the entries were built without {it(added)}"
        )
    if lacking:
        parts.append(
            f"the entries were built with {' '.join(lacking)}, the service runs without "
            f"{it(lacking)}"
        )
    return "XLA flags: " + "; ".join(parts)


def _environment_findings(
    facts: MissesFacts, rows: list[SignatureRow], side: _ManifestSide
) -> list[MissFinding]:
    """Misses of programs that are exactly a bucket: the service's environment differs from the
    one warm filled in a component of JAX's key; each differing one named (env_differences.compare), the
    XLA flags with the flags themselves. A row of the warmed environment itself is explained as
    any other row."""
    if not rows:
        return []
    warmed = [Environment.from_dict(e) for e in facts.warmed_environments]
    by_digest = {w.digest: w for w in warmed}
    out: list[MissFinding] = []
    for digest in dict.fromkeys(r.environment for r in rows):
        mine = [r for r in rows if r.environment == digest]
        if digest in by_digest or not warmed:
            for r in mine:  # as before: the row against its nearest bucket
                leaves = tuple(leaf_of(x) for x in r.leaves)
                candidates = [e for e in side.by_module[r.function] if len(e.leaves) == len(leaves)]
                nearest = nearest_bucket(leaves, candidates)
                assert nearest is not None  # the row's signature is a bucket of the manifest
                out.extend(_row_findings(r, nearest, candidates, side))
            continue
        if digest not in facts.environments:  # deleted since: nothing to compare
            continue
        here = Environment.from_dict(facts.environments[digest])
        nearest_env = min(warmed, key=lambda w: len(compare(here, w)))
        diffs = compare(here, nearest_env)
        words = [
            flags_words(d.here, d.warmed) if d.field == "xla_flags" else d.message for d in diffs
        ]
        functions = sorted({r.function for r in mine})
        out.append(
            MissFinding(
                functions[0] if len(functions) == 1 else ", ".join(functions),
                side.names.get(functions[0]) if len(functions) == 1 else None,
                "environment",
                f"{sum(r.misses for r in mine)} misses of programs that are buckets of the "
                f"manifest: the service's environment ({digest[:16]}) is not the one warm filled "
                f"({nearest_env.digest[:16]}): " + "; ".join(words) + f" ({diffs[0].fix})",
                field=diffs[0].field,
                observed=diffs[0].here,
                expected=diffs[0].warmed,
                requests=sum(r.requests for r in mine),
                misses=sum(r.misses for r in mine),
            )
        )
    return out


def _function_findings(facts: MissesFacts, tally: _Tally, side: _ManifestSide) -> list[MissFinding]:
    """Said once per function: not in the manifest, weak-type variants, shape explosions."""
    missing = tally.not_in_manifest
    warmed = _warmed_programs(facts, missing) if missing else {}
    out = [
        not_in_manifest_finding(
            module, mrows, manifest=bool(side.by_module), warmed=warmed.get(module, 0)
        )
        for module, mrows in missing.items()
    ]
    for module, mrows in tally.per_module.items():
        out.extend(
            weak_variants(module, side.names.get(module), mrows, side.by_module.get(module, []))
        )
    for module, mrows in tally.per_module.items():
        out.extend(
            explosion_findings(
                module, side.names.get(module), mrows, side.by_module.get(module, [])
            )
        )
    return out


def _facts(index: Any, cache: str, since: timedelta) -> MissesFacts:
    """What the index says: read here, or asked of the server in server mode."""
    if getattr(index, "dialect", None) == "remote":
        window = f"{max(1, int(since.total_seconds()))}s"
        return from_jsonable(MissesFacts, index.misses_facts(cache, window))
    return misses_facts(index, cache, since)


def misses(
    ctx: Any,
    *,
    since: timedelta,
    function: str | None = None,
    manifest: str | Path | None = None,
    cache: str | None = None,
    facts: MissesFacts | None = None,
) -> MissesReport:
    """Every missed signature in ``cache`` over the window, explained against the manifest.
    ``facts``: what the index says (read from ``ctx.index`` when not given: the server sends
    them in server mode)."""
    info = ctx.cache(cache)
    if facts is None:
        facts = _facts(ctx.index, info.name, since)
    rows = list(facts.rows)
    owner: dict[str, str] | None = None
    latest: str | None = None
    if manifest is not None:
        if not Path(manifest).is_file():
            raise BadInput(f"--manifest: no such file: {path_words(manifest)}")
        manifests = [str(manifest)]
    else:  # each function against the manifest that warmed it; the latest for the rest
        owner = manifests_that_warmed(facts, [r.function for r in rows])
        unowned = any(r.misses and r.function not in owner and r.digest != "*" for r in rows)
        latest = warmed_manifest(facts) if unowned or not owner else None
        manifests = list(dict.fromkeys([*owner.values(), *([latest] if latest else [])]))
    side = _manifest_side(manifests, function, owner, latest)
    if side.modules is not None:
        rows = [r for r in rows if r.function in side.modules]
    weak_only = {  # keys of the rows that are a bucket but for weak types
        r.key
        for r in rows
        if r.key
        and (r.function, leaves_of(r)) not in side.signatures
        and (r.function, strong_leaves(leaves_of(r))) in side.strong
    }
    tally = _Tally(warmed_keys=weak_only & set(facts.warmed_keys))
    for r in rows:
        _tally_row(tally, r, side)
    tally.findings.extend(_environment_findings(facts, tally.bucket_matched, side))
    tally.findings.extend(_function_findings(facts, tally, side))
    tally.findings.extend(_lowering_findings(side.failures))
    return MissesReport(
        cache=info.name,
        since=utcnow() - since,
        manifest=manifests[0] if manifests else None,
        manifests=manifests,
        signatures=len(rows),
        requests=sum(r.requests for r in rows),
        hits=sum(r.hits for r in rows),
        misses=sum(r.misses for r in rows),
        uncacheable=sum(r.uncacheable for r in rows),
        covered=tally.covered if side.expected else None,
        missed=tally.missed,
        findings=tally.findings,
        uncacheable_functions=tally.uncacheable,
        host_callback_functions=tally.host_callbacks,
    )
