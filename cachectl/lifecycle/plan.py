"""Deletion plans for prune and gc; cachectl/lifecycle/execute.py is the one engine that carries them out.

A plan is built from index queries only, shown (table or JSON), and stops
there on --dry-run. Execution deletes from storage first and from the index
second, batch by batch: a namespace as one recursive delete, entries in
batches of at most 1000 paths, one ``rm`` call per batch (S3 DeleteObjects of
up to 1000 keys; GCS batch requests). A run killed between the two steps
leaves index rows whose files are gone, never files without rows, and the
same selection re-run finishes the job (deleting a missing file is a no-op);
`cachectl sync` reconciles anything else.

An entry and its stored executable (``<key>-aot``) are one unit: deleted in
the same batch, counted together in every size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

from cachectl.storage.entries import CACHE_SUFFIX, EXECUTABLE_SUFFIX


@dataclass(frozen=True, slots=True)
class PlannedEntry:
    """One entry file to delete, with its stored executable (``-aot``) when it has one, plus
    its -atime sidecar where JAX eviction is on."""

    environment_id: int
    namespace: str
    key: str
    size: int  # the JAX entry's bytes
    reason: str
    aot_size: int | None = None  # the stored executable's bytes, deleted with the entry

    __json_extra__ = ("bytes", "files")

    @property
    def bytes(self) -> int:
        """What deleting this unit frees: the entry and its executable."""
        return self.size + (self.aot_size or 0)

    @property
    def files(self) -> list[str]:
        """The files deleted, relative to the cache root (the -atime sidecar aside)."""
        out = [f"{self.namespace}/{self.key}{CACHE_SUFFIX}"]
        if self.aot_size is not None:
            out.append(f"{self.namespace}/{self.key}{EXECUTABLE_SUFFIX}")
        return out


class PlannedEntries(Sequence[PlannedEntry]):
    """A plan's entries kept as the rows a query returned, each ``PlannedEntry`` built when it is
    read: a gc plan of 200k entries builds none while planning (the table reads 50; executing and
    --json read each once, as they would read a list). Equal to a list of the same entries."""

    __slots__ = ("_rows", "_make", "_bytes")

    def __init__(
        self,
        rows: Sequence[tuple[Any, ...]],
        make: Callable[[tuple[Any, ...]], PlannedEntry],
        total_bytes: int,
    ) -> None:
        self._rows, self._make, self._bytes = rows, make, total_bytes

    @property
    def total_bytes(self) -> int:
        """What deleting them all frees (the entries and their executables), known without a pass."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._rows)

    @overload
    def __getitem__(self, i: int) -> PlannedEntry: ...
    @overload
    def __getitem__(self, i: slice) -> list[PlannedEntry]: ...
    def __getitem__(self, i: int | slice) -> PlannedEntry | list[PlannedEntry]:
        if isinstance(i, slice):
            return [self._make(row) for row in self._rows[i]]
        return self._make(self._rows[i])

    def __iter__(self) -> Iterator[PlannedEntry]:
        return map(self._make, self._rows)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]  # mutable-equal like a list

    def __repr__(self) -> str:
        return f"PlannedEntries({len(self)} entries)"


@dataclass(frozen=True)
class PlannedNamespace:
    """A namespace deleted as one unit; its environment row is marked deleted."""

    environment_id: int
    digest: str
    namespace: str
    jax_version: str
    entries: int
    bytes: int
    reason: str


@dataclass(frozen=True)
class Protected:
    """Something the plan leaves alone on purpose, and why."""

    namespace: str
    reason: str
    entries: int = 0
    bytes: int = 0


@dataclass
class DeletionPlan:
    """What prune or gc will delete: namespaces whole, entries one by one."""

    operation: str
    cache: str
    root: str
    criteria: dict[str, Any]
    namespaces: list[PlannedNamespace] = field(default_factory=list)
    entries: Sequence[PlannedEntry] = field(default_factory=list)  # gc: a PlannedEntries
    protected: list[Protected] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    __json_extra__ = ("entry_count", "bytes_to_free")

    @property
    def entry_count(self) -> int:
        return sum(n.entries for n in self.namespaces) + len(self.entries)

    @property
    def bytes_to_free(self) -> int:
        entries = self.entries
        freed = (
            entries.total_bytes
            if isinstance(entries, PlannedEntries)
            else sum(e.bytes for e in entries)
        )
        return sum(n.bytes for n in self.namespaces) + freed

    @property
    def empty(self) -> bool:
        return not (self.namespaces or self.entries)


@dataclass(frozen=True)
class ExecutionResult:
    namespaces_deleted: int
    entries_deleted: int
    bytes_freed: int
    storage_calls: int
    index_rows_removed: int
    duration_s: float


@dataclass(frozen=True)
class LifecycleResult:
    """A plan and, unless it was a dry run, what executing it did."""

    plan: DeletionPlan
    execution: ExecutionResult | None
    dry_run: bool
    planning_s: float
