"""The one plug-in loader (``benchmark.loader``) and the schema as a pure function of what it loads
(``benchmark.config.build_schema``): every kind of plug-in in its order, a schema built from a
subset of them types only that subset, and building one changes no global state (Hydra's
ConfigStore is written only by ``register_configs``)."""
from __future__ import annotations

import copy
import typing

import pytest
from hydra.core.config_store import ConfigStore

from benchmark import analyses, baselines, references
from benchmark.config import ConfigError, Plugins, build_schema, resolve_config
from benchmark.loader import compose_config, load, schema
from methods import registry


def test_load_gives_every_plugin_of_each_kind_in_its_order():
    plugins = load()
    assert list(plugins.methods) == list(registry.METHODS)  # table row order
    assert list(plugins.references)[0] == references.ZOO and plugins.references == references.REFERENCES
    assert list(plugins.baselines) == list(baselines.BASELINES)  # table order
    own = list(analyses.OWN)
    assert list(plugins.analyses)[:len(own)] == own  # the package's, in the paper's order, then the hooks
    assert [name for name in plugins.analyses if name not in own] == [
        name for name, r in references.REFERENCES.items() if r.hooks.analysis is not None]


def test_a_schema_of_some_plugins_types_those_only_and_writes_no_global_state():
    every = load()
    some = Plugins(methods={"dropout": every.methods["dropout"]}, references={"zoo": every.references["zoo"]},
                   baselines={"prior": every.baselines["prior"]}, analyses={"toy": every.analyses["toy"]})
    before = copy.deepcopy(ConfigStore.instance().repo)
    built = build_schema(some)
    assert ConfigStore.instance().repo == before  # pure: nothing stored
    hints = typing.get_type_hints(built.root)
    assert [c.value for c in hints["method"]] == ["all", "dropout", "external"]
    assert [c.value for c in hints["analysis"]] == ["toy", "all"]
    assert hints["sample"].known_methods == ("dropout",) and hints["evaluate"].known_baselines == ("prior",)
    assert hints["reference"].known == ("zoo",) and list(built.references) == ["zoo"] and list(built.methods) == ["dropout"]
    assert [f for f in typing.get_type_hints(hints["methods"])] == ["dropout"]
    assert [f for f in typing.get_type_hints(hints["analyze"])] == ["toy"]
    assert build_schema(some).root is not built.root  # a new schema each call: no cache inside the pure function
    assert schema() is schema()  # the loader's: built once per set of plug-ins


def test_the_composed_config_refuses_a_name_no_plugin_has():
    with pytest.raises(ConfigError, match=r"evaluate.baselines='nope': expected registered baselines: some of prior"):
        resolve_config(compose_config(["evaluate.baselines=[nope]"]))
    with pytest.raises(ConfigError, match=r"sample.repetitions_per_method.nope='nope': expected a registered method"):
        resolve_config(compose_config(["+sample.repetitions_per_method.nope=2"]))
