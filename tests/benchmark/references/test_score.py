"""``Reference.score``: a unit whose own files are unusable (a flipped bit, a tensor of the wrong
shape) is a failed row, while an error of the scoring itself stops the run: the evaluate stage
caches a failed row under the unit's key, so a scoring error taken for one would stick."""
from __future__ import annotations

import pytest

from bench.corruptions import corrupt
from benchmark.experiment import Experiment
from benchmark.references import ZooReference
from tests.benchmark.hmc_store import OVERRIDES, draws_near, write_unit
from tests.conftest import compose_config
from tests.benchmark.units import write_initial_checkpoints

pytestmark = pytest.mark.slow  # builds and scores a reference: make test, not make test-fast


@pytest.fixture
def scored(tmp_path):
    """A 12-network zoo, one 'swag' unit and the zoo reference."""
    exp = Experiment(compose_config([f"store={tmp_path / 'store'}", f"results={tmp_path / 'results'}", *OVERRIDES]))
    exp.store.ensure_writable()
    write_initial_checkpoints(exp, range(12))
    write_unit(exp, "swag", "one", 0, draws_near(100000, 4, exp), [100000])
    return exp, exp.store.sample_unit("swag", "one", 0), ZooReference(exp)


def test_an_intact_unit_is_scored(scored):
    exp, unit, reference = scored
    row = reference.score(unit, full=False)
    assert "failed" not in row and row["mmd_median"] > 0


@pytest.mark.parametrize("kind", ["bitflip", "wrong_shape"])
def test_a_damaged_unit_file_is_a_failed_row_naming_it(scored, kind):
    exp, unit, reference = scored
    path = exp.store.samples_path(unit)
    expected = corrupt(path, kind)
    row = reference.score(unit, full=False)
    assert set(row) == {"failed"} and expected in row["failed"]


def test_a_value_error_of_the_scoring_itself_stops_the_run(scored, monkeypatch):
    exp, unit, reference = scored

    def broken(*args, **kwargs):
        raise ValueError("a bug in the scoring")

    monkeypatch.setattr(reference, "score_samples", broken)
    with pytest.raises(ValueError, match="a bug in the scoring"):
        reference.score(unit, full=False)
