"""cachectl/core/bulk_pass.py: the collector's young threshold raised while a pass over every file
runs, and put back when the last pass on any thread ends, after an error too."""

from __future__ import annotations

import gc
import threading

import pytest

from cachectl.core.bulk_pass import YOUNG_THRESHOLD, bulk_pass


@pytest.fixture(autouse=True)
def default_thresholds():
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*before)


def test_inside_a_pass_the_young_threshold_is_raised_and_put_back_after_an_error() -> None:
    with pytest.raises(RuntimeError), bulk_pass():
        assert gc.get_threshold() == (YOUNG_THRESHOLD, 10, 10)
        raise RuntimeError("a pass that fails")
    assert gc.get_threshold() == (700, 10, 10)


def test_overlapping_passes_on_threads_put_back_what_was_there_before_the_first() -> None:
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, tuple[int, ...]] = {}

    def first() -> None:
        with bulk_pass():
            first_in.set()
            second_in.wait(10)
        first_out.set()

    def second() -> None:
        first_in.wait(10)
        with bulk_pass():
            second_in.set()
            first_out.wait(10)
            seen["after the first left"] = gc.get_threshold()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert seen["after the first left"] == (YOUNG_THRESHOLD, 10, 10)  # the second still runs
    assert gc.get_threshold() == (700, 10, 10)


def test_a_higher_threshold_someone_set_is_kept(tmp_path) -> None:
    gc.set_threshold(250_000, 5, 5)
    with bulk_pass():
        assert gc.get_threshold() == (250_000, 5, 5)
    assert gc.get_threshold() == (250_000, 5, 5)
