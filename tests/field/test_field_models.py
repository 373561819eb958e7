"""The field suite's model services (tests/support/field_cases_models.py), served as the library
cases are (tests/support/field_run.py): a sharded orbax restore over 8 host devices, haiku state,
transformers' Flax GPT-2 with masks, a lax.scan decoder, a Pallas kernel with custom_vjp, x64.

A file of their own, so that the suite's workers (a test file each) share them out.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.field_cases_models import MODEL_CASES, MODEL_REQUIRES
from support.field_run import check_case

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.mark.parametrize("name", sorted(MODEL_CASES))
def test_field_model_service(tmp_path: Path, name: str) -> None:
    check_case(tmp_path, name, MODEL_CASES[name], MODEL_REQUIRES.get(name))
