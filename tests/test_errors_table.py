"""cachectl.core.errors.ERRORS: one table for exit codes and HTTP statuses, read both ways."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from cachectl.core import errors
from cachectl.core.errors import (
    ERRORS,
    BadInput,
    CachectlError,
    EntryConflict,
    EnvironmentMismatch,
    NotFound,
    OperationFailed,
    PermissionDenied,
    ProblemsReported,
    QuotaExceeded,
    Unreachable,
    error_for_status,
    error_named,
    http_status,
)

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("cls", "code", "status"),
    [
        (BadInput, 2, 400),
        (NotFound, 2, 404),
        (Unreachable, 2, 503),
        (QuotaExceeded, 2, 413),
        (OperationFailed, 1, 409),
        (EntryConflict, 1, 409),
        (ProblemsReported, 1, 409),
        (EnvironmentMismatch, 3, 409),
        (PermissionDenied, 4, 403),
    ],
)
def test_each_error_has_its_exit_code_and_status(
    cls: type[CachectlError], code: int, status: int
) -> None:
    exc = cls("x")
    assert exc.exit_code == code and http_status(exc) == status
    assert ERRORS[cls] == (code, status)


def test_unlisted_errors_are_internal_and_an_instance_may_carry_its_code() -> None:
    assert http_status(CachectlError("x")) == 500
    assert CachectlError("x", exit_code=1).exit_code == 1


def test_the_client_reads_the_table_backwards() -> None:
    for cls in ERRORS:
        assert error_named(cls.__name__) is cls
    assert error_named("LeaseHeld") is OperationFailed
    assert error_named("KeyError") is None and error_named(None) is None
    assert error_for_status(404) is NotFound and error_for_status(422) is BadInput
    assert error_for_status(503) is Unreachable and error_for_status(418) is None


def test_only_the_cli_group_maps_errors_to_exit_codes() -> None:
    """No command calls ctx.exit / sys.exit / click Exit: they raise, CachectlGroup exits."""
    offenders = []
    for path in sorted((ROOT / "cachectl").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                text = ast.unparse(node.func)
                if (
                    text.endswith((".exit", "sys.exit", "exceptions.Exit", "click.Exit"))
                    or text == "exit"
                ):
                    offenders.append(f"{path.relative_to(ROOT)} {text}")
    # The group's own ctx.exit (a CachectlError's code, or 130 on an interrupt).
    assert sorted(offenders) == ["cachectl/cli/__init__.py ctx.exit"] * 2
    assert "cachectl: error:" not in "".join(
        p.read_text() for p in (ROOT / "cachectl" / "cli").glob("*_cmds.py")
    )


def test_module_documents_the_table() -> None:
    assert "ERRORS" in (errors.__doc__ or "")
