"""The staging area's runs (loraplex/engine/staging.py): first fit, freed runs join their free
neighbours, and a run not taken cannot be given back."""

import pytest

from loraplex.engine.staging import Runs


def test_runs_are_taken_first_fit_and_join_when_given_back():
    runs = Runs(10)
    assert [runs.take(3), runs.take(3), runs.take(3)] == [0, 3, 6]
    assert runs.take(2) is None and runs.num_free_blocks == 1
    runs.give_back(3, 3)
    assert runs.take(4) is None  # [3, 6) and [9, 10) are apart
    runs.give_back(6, 3)  # joins [3, 6) and [9, 10): [3, 10)
    assert runs.take(7) == 3
    runs.give_back(0, 3)
    runs.give_back(3, 7)
    assert runs.num_free_blocks == 10 and runs.take(10) == 0


@pytest.mark.parametrize(("start", "count"), [(2, 3), (1, 2), (9, 2), (-1, 1)],
                         ids=["free", "half-free", "past-the-end", "negative"])
def test_a_run_not_taken_cannot_be_given_back(start, count):
    runs = Runs(10)
    assert runs.take(2) == 0  # [0, 2) taken, [2, 10) free
    with pytest.raises(ValueError, match="was not taken"):
        runs.give_back(start, count)
    assert runs.num_free_blocks == 8


def test_a_run_cannot_be_given_back_twice():
    runs = Runs(10)
    runs.take(2)
    runs.give_back(0, 2)
    with pytest.raises(ValueError, match="was not taken"):
        runs.give_back(0, 2)


def test_counts_must_be_positive():
    with pytest.raises(ValueError):
        Runs(4).take(0)
    with pytest.raises(ValueError):
        Runs(-1)
    assert Runs(0).num_free_blocks == 0 and Runs(0).take(1) is None
