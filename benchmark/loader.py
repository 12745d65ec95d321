"""The one plug-in loader: every method, reference, baseline and analysis (``load``), the config
schema built from them (``benchmark.config.build_schema``) and the config composed over it
(``compose_config``).

Each kind of plug-in is found by the one discovery rule (``benchmark.core.plugins.discover``) when its
package is imported: the methods of ``methods/`` (``methods.registry.METHODS``, plus any kept outside
the package, ``register_method``), the references of ``benchmark/references/`` (``REFERENCES``), the
baselines of ``benchmark/baselines/`` (``BASELINES``) and the analyses of ``benchmark/analyses/``
followed by the references' analysis hooks (``benchmark.analyses.found``). ``load`` reads them when it
is called, so a plug-in registered after an import is seen by the next ``load``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from benchmark import analyses, baselines, references
from benchmark.config import CONF_DIR, Plugins, Schema, build_schema, compose, register_configs, resolve_config
from benchmark.core.store.importing import KeyMapping
from methods import registry

_schemas: dict[tuple, Schema] = {}


def load() -> Plugins:
    """Every plug-in, each kind in its order: the methods in table row order, the references with
    the zoo first, the baselines in table order, the analyses in drawing order with the references'
    hooks last."""
    return Plugins(methods=dict(registry.METHODS), references=dict(references.REFERENCES),
                   baselines=dict(baselines.BASELINES), analyses=analyses.found())


def schema() -> Schema:
    """``build_schema(load())``, built once per set of plug-ins (a plug-in registered later gives a new one)."""
    plugins = load()
    key = tuple((kind, name, id(plugin)) for kind in ("methods", "references", "baselines", "analyses")
                for name, plugin in getattr(plugins, kind).items())
    if key not in _schemas:
        _schemas[key] = build_schema(plugins)
    return _schemas[key]


def register() -> None:
    """Store the schema of every plug-in in Hydra's ConfigStore (``benchmark.config.register_configs``):
    what ``python -m benchmark`` composes its config from."""
    register_configs(schema())


def compose_config(overrides: Sequence[str] = (), config_dir: str = CONF_DIR):
    """The project's config (an OmegaConf ``DictConfig``) with command-line style ``overrides``
    applied, over every plug-in (``benchmark.config.compose`` of ``schema()``)."""
    return compose(schema(), overrides, config_dir)


def analysis_names() -> tuple[str, ...]:
    """The names ``analysis=`` accepts besides ``all``, in drawing order."""
    return tuple(load().analyses)


def ready_mappings() -> dict[str, KeyMapping]:
    """The ready-made key mappings of ``conf/zoo_import/`` by option name (``zoo_import=<name>``)."""
    names = sorted(path.stem for path in (Path(CONF_DIR) / "zoo_import").glob("*.yaml"))
    return {name: resolve_config(compose_config([f"zoo_import={name}"])).zoo_import.mapping for name in names}
