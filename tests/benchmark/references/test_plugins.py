"""References as plug-ins (``benchmark.references``): the registry, what each needs and the
messages naming it, and a third reference as one module + one yaml: another store's zoo
(``reference=other_zoo``, e.g. a released zoo as the reference of a locally trained one), whose
rows land in the one metrics.csv with ``reference`` = ``other_zoo`` and equal the metrics called
directly on that zoo."""
from __future__ import annotations

import dataclasses
import typing

import pytest
import torch
from hydra.errors import ConfigCompositionException

from benchmark.config import ConfigError, reference_schema
from benchmark.core.models import predict_with_weights
from benchmark.core.store import load_checkpoints_as_sample_set, save_checkpoint
from benchmark.experiment import Experiment
from benchmark.loader import load, schema
from benchmark.references import REFERENCES, Reference, ZooReference, evaluated, problems, reference_class, register
from benchmark.references.hmc import HMCReference
from benchmark.references.other_zoo import OtherZooReference, OtherZooSettings
from benchmark.results import read_metrics, read_repetitions, rows_against
from benchmark.stages import evaluate, verify
from metrics.mmd import mmd
from metrics.predictive import predictive_metrics
from tests.benchmark.hmc_store import OVERRIDES, draws_near, write_unit
from tests.conftest import REPO, compose_config
from tests.benchmark.units import write_initial_checkpoints

OTHER = "released_optunet"
"""The experiment name the other store's checkpoints were written under."""
OTHER_SEEDS = range(300, 312)


def _zoo(exp: Experiment, seeds) -> None:
    """Seeded untrained networks as converged reference checkpoints of ``exp``'s store (their
    numbers do not matter to the scoring, which is what is tested)."""
    exp.store.ensure_writable()
    write_initial_checkpoints(exp, seeds)


def _experiment(tmp_path, *overrides: str) -> Experiment:
    return Experiment(compose_config([f"store={tmp_path / 'store'}", f"results={tmp_path / 'results'}", *OVERRIDES,
                                      *overrides]))


def test_the_registry_holds_one_class_per_reference_and_one_yaml_each():
    assert {"zoo": ZooReference, "hmc": HMCReference, "other_zoo": OtherZooReference}.items() <= REFERENCES.items()
    for name in REFERENCES:  # each reference's settings: conf/reference/<name>.yaml
        assert (REPO / "conf" / "reference" / f"{name}.yaml").is_file()
    with pytest.raises(ValueError, match=r"reference=nope: not a registered reference; expected one of \['hmc', 'other_zoo', 'zoo'\]"):
        reference_class("nope")
    with pytest.raises(TypeError, match="expected a Reference subclass"):
        register(dict)
    clash = type("Clash", (Reference,), {"name": "hmc"})
    with pytest.raises(ValueError, match="a reference named 'hmc' is already registered"):
        register(clash)


def test_the_zoo_is_always_evaluated_and_reference_adds_one(tmp_path):
    assert evaluated(_experiment(tmp_path)) == ["zoo"]
    assert evaluated(_experiment(tmp_path, "reference=hmc")) == ["zoo", "hmc"]
    assert evaluated(_experiment(tmp_path, "reference=other_zoo")) == ["zoo", "other_zoo"]


def test_problems_name_what_is_missing_and_the_command(tmp_path):
    exp = _experiment(tmp_path, "reference=hmc")
    assert problems(_experiment(tmp_path)) == []
    (found,) = problems(exp)
    assert found.startswith("reference=hmc needs the HMC reference: repetitions [0, 1] of hmc/multi")
    assert "method=hmc mode=multi" in found
    assert problems(exp, skip=frozenset({"hmc"})) == []
    other = _experiment(tmp_path, "reference=other_zoo", f"reference.store={tmp_path / 'released'}",
                        f"reference.experiment={OTHER}")
    (found,) = problems(other)
    assert "is not a folder" in found and f"reference.store={tmp_path / 'released'} reference.experiment={OTHER}" in found
    _zoo(OtherZooReference.source_of(other), [0])  # one checkpoint of this run's range [0, 12)
    (found,) = problems(other)
    assert "at least 2 converged checkpoints" in found and "found 1" in found and "stage=import" in found


@pytest.mark.slow  # runs the evaluate stage end to end
def test_another_stores_zoo_is_a_reference_with_rows_in_the_one_metrics_csv(tmp_path):
    released = tmp_path / "released"
    exp = _experiment(tmp_path, "reference=other_zoo", f"reference.store={released}", f"reference.experiment={OTHER}",
                      f"reference.seeds=[{OTHER_SEEDS.start},{OTHER_SEEDS.stop}]", "evaluate.baselines=[]")
    _zoo(exp, range(12))
    source = OtherZooReference.source_of(exp)
    assert source.name == OTHER and source.store.root == released
    _zoo(source, OTHER_SEEDS)
    units = {r: write_unit(exp, "swag", "one", r, draws_near(100000 + 4 * r, 4, exp), [100000 + 4 * r]) for r in range(2)}
    before = sorted(p for p in released.rglob("*"))
    evaluate.run(exp)
    assert sorted(p for p in released.rglob("*")) == before  # the other store is only read
    every = read_metrics(exp.results_dir / "metrics.csv")
    assert sorted(set(every["reference"])) == ["other_zoo", "zoo"]
    rows = rows_against(every, "other_zoo").set_index(["method", "mode"])
    assert rows.loc[("swag", "one"), "n_reference"] == 12
    reps = rows_against(read_repetitions(exp.results_dir / "repetitions.csv"), "other_zoo").set_index(
        ["method", "mode", "repetition"])
    zoo_reps = rows_against(read_repetitions(exp.results_dir / "repetitions.csv"), "zoo").set_index(
        ["method", "mode", "repetition"])
    other_zoo = load_checkpoints_as_sample_set(source.store.checkpoint_paths(OTHER_SEEDS))
    model, labels = exp.model(), exp.test_tensors[1]
    predictive = predict_with_weights(model, other_zoo, exp.test_tensors[0]).double().mean(0)
    for r, (samples, preds) in units.items():
        expected = mmd(other_zoo, samples).aggregate["median"]
        assert reps.loc[("swag", "one", r), "mmd_median"] == pytest.approx(expected, rel=1e-6)
        assert zoo_reps.loc[("swag", "one", r), "mmd_median"] != pytest.approx(expected, rel=1e-3)  # another zoo
        numbers = predictive_metrics(preds["id"], labels, preds["ood"], reference_id=predictive)
        assert reps.loc[("swag", "one", r), "agreement"] == pytest.approx(numbers["agreement"], abs=1e-9)
        assert reps.loc[("swag", "one", r), "tv"] == pytest.approx(numbers["tv"], rel=1e-5)
    for r in range(2):  # its numbers cached beside the zoo's, under the reference's name
        zoo_cache = exp.store.eval_path(exp.store.sample_unit("swag", "one", r))
        assert zoo_cache.is_file() and zoo_cache.with_suffix(".other_zoo.json").is_file()
    assert (exp.store.base / "reference-other_zoo").is_dir()  # its forms cached in this store


def _pooled() -> dict[str, str]:
    """The schema's methods whose rows are a reference's own (``SampleConfig.pooled_methods``)."""
    return dict(typing.get_type_hints(schema().root)["sample"].pooled_methods)


def test_the_zoo_method_stays_pooled_by_the_zoo_whatever_the_registration_order():
    assert OtherZooReference.own_row is None  # another store's zoo has no row of its own in this store
    register(OtherZooReference)  # registered again, after the zoo: adds nothing over the zoo's row
    assert _pooled() == {"zoo": "zoo", "hmc": "hmc"}


def test_a_reference_whose_settings_are_not_a_dataclass_is_refused_naming_it(tmp_path):
    with pytest.raises(TypeError, match=r"reference 'nope': its Settings must be a dataclass, got <class 'dict'>"):
        reference_schema("nope", dict)
    with pytest.raises(ConfigCompositionException, match=r"Could not find 'reference/nope'"):
        _experiment(tmp_path, "reference=nope")  # no yaml, no node: the schema holds the registered ones


def test_hmc_units_with_different_draws_per_chain_are_named_with_their_lengths(tmp_path):
    exp = _experiment(tmp_path, "reference=hmc")
    _zoo(exp, [*range(12), *range(100000, 100012)])
    write_unit(exp, "hmc", "multi", 0, draws_near(500, 4, exp), [100000, 100001])  # 2 chains x 2 draws
    write_unit(exp, "hmc", "multi", 1, draws_near(502, 4, exp), [100004])  # 1 chain x 4 draws
    names = [exp.store.preds_path(exp.store.sample_unit("hmc", "multi", r)).name for r in range(2)]
    with pytest.raises(ValueError, match=f"draws per chain: {names[0]}: 2, {names[1]}: 4"):
        HMCReference(exp).chain_predictions()


def test_an_unregistered_reference_name_is_refused_when_the_config_is_composed(tmp_path):
    """``reference.name=nope`` is refused when the composed config is resolved (``Experiment``, before
    any stage), naming the registered references; so is a setting the chosen reference does not
    declare (at composition) and one its ``Settings`` refuses; nothing is written."""
    with pytest.raises(ConfigError, match=r"reference.name='nope': expected a registered reference, chosen with "
                                          r"reference=<name>: one of hmc, other_zoo, zoo"):
        _experiment(tmp_path, "reference.name=nope")
    with pytest.raises(ConfigError, match=r"reference.name='hmc': expected zoo, the reference chosen with reference=zoo"):
        _experiment(tmp_path, "reference.name=hmc")
    with pytest.raises(ConfigCompositionException, match=r"Could not override 'reference.store'"):
        _experiment(tmp_path, "reference.store=/elsewhere")  # the zoo declares no settings
    with pytest.raises(ConfigError, match=r"reference.seeds=\[1\]: expected null or \[start, stop\)"):
        _experiment(tmp_path, "reference=other_zoo", "reference.seeds=[1]")
    assert not (tmp_path / "store").exists() and not (tmp_path / "results").exists()


def test_the_reference_node_is_typed_by_the_settings_each_reference_declares(tmp_path):
    """``reference=<name>`` is ``reference_schema(name)``: the registered reference's ``Settings``
    fields, with their types and defaults, and ``Reference.settings`` reads them back."""
    assert load().references == REFERENCES and set(schema().references) == set(REFERENCES)
    for name, reference in REFERENCES.items():
        fields = [f.name for f in dataclasses.fields(schema().references[name])]
        assert fields == ["name", *(f.name for f in dataclasses.fields(reference.Settings))]
    exp = _experiment(tmp_path, "reference=other_zoo", "reference.store=/released", "reference.seeds=[3,9]")
    assert OtherZooReference.settings(exp) == OtherZooSettings(store="/released", experiment=None, seeds=[3, 9])
    assert type(exp.config.reference).__name__ == "OtherZooReferenceConfig"
    assert _pooled()["hmc"] == "hmc"  # HMCReference.own_row's method: its repetitions are the reference's


def test_verify_checks_the_cache_folder_of_every_registered_reference(tmp_path):
    """A damaged form cache in another store's zoo's folder (``reference-other_zoo/``) is named by
    ``stage=verify``'s cache check, as one in ``reference/`` is; an intact one is counted."""
    exp = _experiment(tmp_path)
    for folder in (exp.store.reference_dir, OtherZooReference.cache_folder(exp.store)):
        folder.mkdir(parents=True)
        save_checkpoint(folder / "canonical.safetensors", {"w": torch.ones(3)}, {"seed": 0})
    damaged = OtherZooReference.cache_folder(exp.store) / "predictive.safetensors"
    damaged.write_bytes(b"not a safetensors file")
    health = verify.ExperimentHealth(exp.name, "test")
    verify.check_caches(None, exp.store, health)
    assert list(health.damaged_caches) == [damaged] and health.caches["reference"] == 3


def test_a_plugin_without_its_forms_or_draws_is_refused():
    from benchmark.baselines import register
    from benchmark.baselines.base import Baseline
    from benchmark.references.base import Reference

    class Drawless(Baseline):
        name, label, about = "drawless", "Drawless", "no draw"

    with pytest.raises(TypeError, match="needs a classmethod draw"):
        register(Drawless)

    class Formless(Reference):
        name = "formless"

    with pytest.raises(TypeError, match="abstract"):
        Formless(None)
