"""Bucket expansion: the cartesian product of each function's axes, minus ``exclude``; shards of it."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import re
from collections.abc import Iterator, Sequence
from typing import Any

from cachectl.core.errors import BadInput
from cachectl.manifest.schema import FunctionSpec, Manifest


def same_value(a: Any, b: Any) -> bool:
    """Equality that keeps true apart from 1 (Python says they are equal; YAML users do not)."""
    return isinstance(a, bool) == isinstance(b, bool) and a == b


@dataclasses.dataclass(frozen=True)
class Bucket:
    """One concrete compilation: a function and a value for each of its axes (in declared order)."""

    function: str
    values: dict[str, Any]
    index: int  # position in expand()'s list, 0-based

    @property
    def label(self) -> str:
        """``batch=4,seq=128``; empty for a function without axes."""
        return ",".join(f"{k}={_scalar_text(v)}" for k, v in self.values.items())

    @property
    def id(self) -> str:
        """16 hex digits from function and values, stable across machines, orderings and runs."""
        canon = json.dumps([self.function, sorted(self.values.items())], separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()[:16]

    def __str__(self) -> str:
        return f"{self.function}[{self.label}]"

    def __hash__(self) -> int:
        return hash((self.function, tuple(self.values.items()), self.index))


def _scalar_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def bucket_values(spec: FunctionSpec) -> Iterator[dict[str, Any]]:
    names = list(spec.buckets)
    for combo in itertools.product(*(spec.buckets[n] for n in names)):
        values = dict(zip(names, combo, strict=True))
        if not any(
            all(k in values and same_value(values[k], v) for k, v in entry.items())
            for entry in spec.exclude
        ):
            yield values


def expand(manifest: Manifest) -> list[Bucket]:
    """Every bucket: functions in manifest order, each the product of its axes in declared order."""
    buckets: list[Bucket] = []
    for spec in manifest.functions:
        for values in bucket_values(spec):
            buckets.append(Bucket(spec.name, values, len(buckets)))
    return buckets


def parse_shard(text: str) -> tuple[int, int]:
    """``"I/N"`` -> (I, N), with I counted from 1: ``--shard 1/4`` .. ``--shard 4/4``."""
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not match:
        raise BadInput(f"--shard: expected I/N such as 2/4, got {text!r}")
    i, n = int(match.group(1)), int(match.group(2))
    if n < 1 or not 1 <= i <= n:
        raise BadInput(f"--shard: {text!r} needs 1 <= I <= N (shards are counted from 1)")
    return i, n


def select_shard(buckets: Sequence[Bucket], i: int, n: int) -> list[Bucket]:
    """Shard i of n (1-based): every n-th bucket of the list, starting at the i-th.

    Round robin keeps the shards within one bucket of each other in size, and needs
    nothing but the list order, which :func:`expand` makes the same on every machine.
    """
    if n < 1 or not 1 <= i <= n:
        raise BadInput(f"shard {i}/{n}: needs 1 <= I <= N")
    return [b for k, b in enumerate(buckets) if k % n == i - 1]
