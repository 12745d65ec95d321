"""The reference zoo's caches are keyed by exactly what computes them: a change to a function in
metrics/symmetries rebuilds the canonical (and aligned) forms and leaves the predictive cache alone;
changed settings, device or inputs give other keys; a damaged cache is rebuilt."""
from __future__ import annotations

import shutil

import pytest
import torch

import benchmark.core.fingerprint as fingerprint
from benchmark.core.store import load_sample_set, read_metadata
from benchmark.experiment import Experiment
from benchmark.references import ZooReference
from metrics.symmetries import canonicalize, spec_for_model
from tests.conftest import REPO, compose_config
from tests.benchmark.units import write_initial_checkpoints

pytestmark = pytest.mark.slow  # builds and scores a reference from a trained zoo: make test, not make test-fast


@pytest.fixture
def zoo(tmp_path):
    """Six seeded initialisations as the reference zoo (the caches do not care whether they were trained)."""
    exp = Experiment(compose_config([f"store={tmp_path / 'store'}", "seeds.reference=[0,6]", "seeds.heldout=[100000,100002]"]))
    exp.store.ensure_writable()
    write_initial_checkpoints(exp, range(6))
    return exp


def _cache_key(exp: Experiment, name: str) -> str:
    return read_metadata(exp.store.reference_dir / f"{name}.safetensors")["key"]


def test_an_edit_of_a_symmetry_spec_makes_every_reference_cache_stale(zoo, tmp_path, monkeypatch):
    """``metrics/symmetries/architectures.py`` is reached through ``spec_for_model`` (data), not
    through the imports of ``metrics.symmetries.canonical``: an edit of ``chain_spec`` must still
    make the canonical and aligned caches stale, which keying every cache by the whole
    computational source does."""
    ref = ZooReference(zoo)
    ref.canonical()
    ref.predictive()
    keys = {name: _cache_key(zoo, name) for name in ("canonical", "predictive")} | {"aligned": ref.key("aligned"),
                                                                                     "zoo": ref.key("zoo")}
    copy = tmp_path / "source"
    for package in ("methods", "metrics", "benchmark/core", "benchmark"):
        shutil.copytree(REPO / package, copy / package, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    spec = copy / "metrics" / "symmetries" / "architectures.py"
    spec.write_text(spec.read_text().replace("def chain_spec(", "FIXED_IN_A_LATER_VERSION = True\n\n\ndef chain_spec(", 1))
    monkeypatch.setattr(fingerprint, "SOURCE_ROOT", copy)
    again = ZooReference(zoo)
    assert all(again.key(name) != key for name, key in keys.items())
    again.canonical()  # rebuilt under the new key
    assert _cache_key(zoo, "canonical") == again.key("canonical")


def test_the_canonical_cache_holds_the_canonical_zoo_and_is_rebuilt_when_damaged(zoo):
    ref = ZooReference(zoo)
    canonical = ref.canonical()
    expected = canonicalize(ref.weights(), spec_for_model(zoo.model()), ref.steps)[0]
    assert all(torch.equal(canonical[k], expected[k]) for k in expected)
    path = zoo.store.reference_dir / "canonical.safetensors"
    path.write_bytes(path.read_bytes()[:-16])  # truncated
    rebuilt = ZooReference(zoo).canonical()
    assert all(torch.equal(rebuilt[k], expected[k]) for k in expected) and load_sample_set(path).keys() == expected.keys()


def test_keys_follow_settings_inputs_and_device(zoo, tmp_path):
    ref = ZooReference(zoo)
    other_steps = ZooReference(Experiment(compose_config([f"store={tmp_path / 'store'}", "seeds.reference=[0,6]",
                                                       "seeds.heldout=[100000,100002]",
                                                       "evaluate.canonical_steps=[scale,sort,softmax]"])))
    assert other_steps.key("canonical") != ref.key("canonical") and other_steps.key("zoo") == ref.key("zoo")
    fewer = ZooReference(Experiment(compose_config([f"store={tmp_path / 'store'}", "seeds.reference=[0,5]",
                                                 "seeds.heldout=[100000,100002]"])))
    assert all(fewer.key(c) != ref.key(c) for c in ("zoo", "canonical", "aligned", "predictive"))
    on_cpu = ref.key("canonical")
    ref.exp.__dict__["device"] = torch.device("meta")  # a device type other than the one the caches were built on
    assert ZooReference(ref.exp).key("canonical") != on_cpu


def test_the_input_files_key_holds_no_absolute_path_so_a_moved_store_keeps_its_caches(tmp_path):
    """A key holding absolute paths (or mtimes) would make a moved or copied store rebuild every
    cache and leave the old folders behind: the key is each file's name and content digest."""
    import shutil

    from benchmark.core.store import save_checkpoint
    from benchmark.references import files_key

    first = tmp_path / "a" / "zoo" / "seed_000001.safetensors"
    first.parent.mkdir(parents=True)
    save_checkpoint(first, {"w": torch.ones(3)}, {"seed": 1})
    moved = tmp_path / "b" / "zoo" / first.name
    moved.parent.mkdir(parents=True)
    shutil.copyfile(first, moved)  # a copy: new mtime, same content
    assert files_key([first]) == files_key([moved]) and str(tmp_path) not in str(files_key([first]))
    save_checkpoint(moved, {"w": torch.zeros(3)}, {"seed": 1})
    assert files_key([first]) != files_key([moved])
