"""The analyses' streamed paths read zoo files validated (the collapse analysis of a zoo larger
than ``evaluate.max_in_memory_gb``)."""
import pytest

from bench.corruptions import corrupt
from benchmark.analyses.collapse import member_probabilities
from benchmark.experiment import Experiment
from benchmark.inventory import CorruptZooError
from tests.conftest import compose_config
from tests.benchmark.units import write_initial_checkpoints

pytestmark = pytest.mark.slow  # runs stages end to end or trains networks: make test, not make test-fast


@pytest.mark.parametrize("kind", ["other_experiment", "nan"])
def test_collapse_streamed_refuses_an_invalid_zoo_file(tmp_path, kind):
    cfg = compose_config([f"store={tmp_path / 'store'}", f"results={tmp_path / 'results'}", "seeds.reference=[0,4]",
                          "evaluate.max_in_memory_gb=1e-6"])
    exp = Experiment(cfg)
    exp.store.ensure_writable()
    write_initial_checkpoints(exp, range(4))
    probs_id, _ = member_probabilities(exp, [0, 1, 2, 3])
    assert probs_id.shape[0] == 4
    corrupt(exp.store.checkpoint_path(2), kind)  # valid checksums: only validation can tell
    with pytest.raises(CorruptZooError, match="seed_000002"):
        member_probabilities(exp, [0, 1, 2, 3])
