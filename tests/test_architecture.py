"""The layers of ARCHITECTURE.md, checked on the import statements of every module of the
repository: the packages, ``bench/``, ``studies/`` and ``tests/`` (function-level imports included).

Each module belongs to the first rule whose prefix matches its name, and may import only the
prefixes that rule allows. On top of the layers: no stage imports another stage; the report and
the analyses import no stage; only the stages import the inventory's writes
(``benchmark.inventory.actions``, and the work-unit loop ``benchmark.core.store.work``: the rest of the inventory is read-only); no package imports
itself through others (a cycle). The checks run
on any tree, so the tests below also plant each kind of violation in a small fake repository and
show that it is caught.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO

PROJECT = ("benchmark", "methods", "metrics", "bench", "studies", "tests")
CORE = ("benchmark.core",)
METRICS = ("metrics", *CORE)  # metrics import only themselves; listed with core for the rules below
COMPUTE = ("methods", "metrics", *CORE)
BASE = ("benchmark.experiment", "benchmark.design", "benchmark.config", "benchmark.results")
QUERY = ("benchmark.inventory", "benchmark.references", "benchmark.baselines")
CONFIG_LIBRARIES = ("hydra", "omegaconf")
WRITES = ("benchmark.inventory.actions", "benchmark.inventory.migrations", "benchmark.core.store.work")  # the inventory's writes; the work-unit loop (quarantine)
WRITERS = ("benchmark.stages", "bench", "tests", *WRITES)  # who may import them
CONFIG_READERS = ("benchmark.cli", "benchmark.config", "benchmark.experiment", "tests", "bench", "studies")

RULES: list[tuple[str, tuple[str, ...]]] = [
    # (prefix of the importing module, prefixes it may import), top of the layers first
    ("tests", tuple(p for p in PROJECT if p != "studies")),
    ("bench", tuple(p for p in PROJECT if p not in ("tests", "studies"))),
    ("studies", tuple(p for p in PROJECT if p not in ("tests", "studies"))),  # research scripts: nothing imports them
    ("benchmark.__main__", ("benchmark.cli",)),
    ("benchmark.scoring", ("benchmark.loader", "benchmark.references", *BASE, *COMPUTE)),  # from benchmark import score; composes a config
    ("benchmark.cli", ("benchmark.stages", "benchmark.loader", *QUERY, *BASE, *COMPUTE)),
    ("benchmark.stages", ("benchmark.stages", "benchmark.report", "benchmark.analyses", "benchmark.loader", *QUERY, *BASE, *COMPUTE)),
    ("benchmark.loader", ("benchmark.analyses", *QUERY, *BASE, *COMPUTE)),  # every plug-in, the schema over them
    ("benchmark.report", ("benchmark.report", *QUERY, *BASE, *COMPUTE)),
    ("benchmark.analyses", ("benchmark.analyses", *QUERY, *BASE, *COMPUTE)),
    ("benchmark.baselines", ("benchmark.baselines", "benchmark.references", "benchmark.inventory", *BASE, *COMPUTE)),
    ("benchmark.inventory", ("benchmark.inventory", *BASE, *COMPUTE)),
    ("benchmark.references", ("benchmark.references", "benchmark.inventory", *BASE, *COMPUTE)),
    ("benchmark.experiment", ("benchmark.config", "benchmark.design", *COMPUTE)),
    ("benchmark.design", COMPUTE),  # the repetition design: positions from the sample settings, never the store
    ("benchmark.config", COMPUTE),
    ("benchmark.results", COMPUTE),
    ("benchmark.core", CORE),
    ("benchmark", ("benchmark.scoring",)),  # the package's __init__: score, imported on first use
    ("methods", ("methods", "metrics", *CORE)),
    ("metrics", ("metrics",)),
]


def _within(name: str, prefixes: tuple[str, ...] | list[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def scan(root: Path) -> dict[str, set[str]]:
    """Module -> the project modules and config libraries it imports: ``from a import b`` counts as
    ``a.b`` when that is a module of the tree, else as ``a``."""
    paths = [p for package in PROJECT if (root / package).is_dir() for p in sorted((root / package).rglob("*.py"))]
    known = {module_name(root, p) for p in paths}
    modules = {}
    for path in paths:
        names = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    names.add(full if full in known else node.module)
        modules[module_name(root, path)] = {n for n in names if n.split(".")[0] in (*PROJECT, *CONFIG_LIBRARIES)}
    return modules


def rule_of(name: str) -> tuple[str, tuple[str, ...]]:
    for prefix, allowed in RULES:
        if _within(name, (prefix,)):
            return prefix, allowed
    raise AssertionError(f"module {name} is in no layer; add it to ARCHITECTURE.md and to RULES here")


def layer_violations(modules: dict[str, set[str]]) -> list[str]:
    """``importer -> imported`` for every import that points up or across the layers, or that reads
    the config outside the config readers."""
    out = []
    for name, imports in sorted(modules.items()):
        prefix, allowed = rule_of(name)
        for target in sorted(imports):
            if target.split(".")[0] in CONFIG_LIBRARIES:
                if not _within(name, CONFIG_READERS):
                    out.append(f"{name} -> {target} (only {', '.join(CONFIG_READERS)} read the config)")
            elif not _within(target, allowed) and not _within(target, (name,)):
                out.append(f"{name} ({prefix}) -> {target}")
    return out


def stage_violations(modules: dict[str, set[str]]) -> list[str]:
    """A stage importing another stage, and a report or analyses module importing any stage."""
    out = []
    for name, imports in sorted(modules.items()):
        stages = sorted(t for t in imports if _within(t, ("benchmark.stages",)) and t != name)
        if _within(name, ("benchmark.stages",)) and name != "benchmark.stages" and stages:
            out.append(f"stage {name} imports {stages}: stages are siblings (share through benchmark.inventory/reference)")
        if _within(name, ("benchmark.report", "benchmark.analyses")) and stages:
            out.append(f"{name} imports {stages}: the report and the analyses import no stage")
    return out


def write_violations(modules: dict[str, set[str]]) -> list[str]:
    """``importer -> imported`` for every import of the inventory's writes (``WRITES``) outside the
    stages (and ``bench/``, ``tests/``): the report, the analyses, the references, the baselines
    and the inventory's queries only read the store."""
    return [f"{name} -> {target} (only the stages write to the store through the inventory)"
            for name, imports in sorted(modules.items()) for target in sorted(imports)
            if _within(target, WRITES) and not _within(name, WRITERS)]


def package_of(name: str, modules: dict[str, set[str]]) -> str:
    """The node of a module in the package graph: its package, or, for a module directly in
    ``benchmark/`` (a package of layers), the module itself; a reference plug-in's package is part of
    ``benchmark.references``."""
    if name.startswith("benchmark.references."):
        return "benchmark.references"
    if name in modules and any(other.startswith(name + ".") for other in modules):
        package = name  # a package's __init__
    else:
        package = name.rpartition(".")[0] or name
    return name if package == "benchmark" else package


def package_cycles(modules: dict[str, set[str]]) -> list[list[str]]:
    """Cycles among packages (each as the list of packages along it)."""
    edges: dict[str, set[str]] = {}
    for name, imports in modules.items():
        source = package_of(name, modules)
        for target in imports:
            if target.split(".")[0] in CONFIG_LIBRARIES:
                continue
            sink = package_of(target, modules)
            if sink != source:
                edges.setdefault(source, set()).add(sink)
    cycles, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    return cycles


MODULES = scan(REPO)


def test_every_module_belongs_to_a_layer():
    for name in MODULES:
        rule_of(name)


def test_imports_point_down_the_layers_only():
    assert layer_violations(MODULES) == []


def test_stages_are_siblings_and_the_report_and_analyses_import_no_stage():
    assert stage_violations(MODULES) == []


def test_only_the_stages_import_the_inventorys_writes():
    assert write_violations(MODULES) == []


def test_no_package_imports_itself_through_others():
    assert package_cycles(MODULES) == []


def test_this_test_sees_the_arrows():
    """A guard against a scanner that finds nothing: known arrows of each layer are seen."""
    assert "benchmark.core.store" in MODULES["methods.base"]
    assert "metrics.mmd" in MODULES["benchmark.references.zoo"]
    assert "benchmark.stages.zoo" in MODULES["benchmark.stages"]
    assert "benchmark.inventory" in MODULES["benchmark.stages.evaluate"]
    assert "benchmark.core.store.work" in MODULES["benchmark.stages.sample"]
    assert any(_within(m, ("benchmark",)) for m in MODULES["tests.conftest"])
    assert any(_within(m, ("benchmark.core",)) for m in MODULES["bench.reliability"])
    assert "benchmark.report.findings" in MODULES["benchmark.report.hmc"]
    assert "benchmark.references.hmc" in MODULES["benchmark.analyses.hmc"]


def test_a_reference_hook_lives_in_the_layer_it_adds_to(tmp_path):
    """A reference's report hook is a module of the report (``benchmark/report/<name>.py``), which may import
    the report's modules; the same import from the reference's own package runs up the layers: no module is
    judged by any other layer than its path's."""
    hooks = {**CLEAN, "benchmark/report/mine.py": "from benchmark.report.tables import x\nfrom benchmark.references import y\n",
             "benchmark/references/mine/__init__.py": "from benchmark.inventory import converged\n"}
    assert layer_violations(_tree(tmp_path, hooks)) == [] and package_cycles(_tree(tmp_path, hooks)) == []
    upward = {**hooks, "benchmark/references/mine/report.py": "from benchmark.report.tables import x\n"}
    assert "benchmark.references.mine.report (benchmark.references) -> benchmark.report.tables" in layer_violations(
        _tree(tmp_path / "b", upward))
    staged = {**hooks, "benchmark/analyses/mine.py": "from benchmark.stages.zoo import x\n"}
    assert "the report and the analyses import no stage" in stage_violations(_tree(tmp_path / "c", staged))[0]


def _tree(root: Path, files: dict[str, str]) -> dict[str, set[str]]:
    """A fake repository with ``files`` (path -> source) and empty package ``__init__`` files."""
    for rel, source in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
        for parent in path.relative_to(root).parents:
            if str(parent) != "." and not (root / parent / "__init__.py").exists():
                (root / parent / "__init__.py").write_text("")
    return scan(root)


CLEAN = {
    "benchmark/stages/zoo.py": "from benchmark.inventory import converged\n",
    "benchmark/stages/sample.py": "from benchmark.inventory import converged\n",
    "benchmark/inventory/zoo.py": "from benchmark.core.store import Unit\n",
    "benchmark/inventory/actions.py": "from benchmark.core.store import quarantine\n",
    "benchmark/report/tables.py": "from benchmark.results import COLUMNS\n",
    "benchmark/core/store/units.py": "",
}


def test_a_clean_fake_tree_passes(tmp_path):
    modules = _tree(tmp_path, CLEAN)
    assert layer_violations(modules) == [] and stage_violations(modules) == [] and package_cycles(modules) == []
    assert write_violations(modules) == []


def test_a_query_module_importing_the_inventorys_writes_is_caught(tmp_path):
    modules = _tree(tmp_path, {**CLEAN, "benchmark/report/tables.py": "from benchmark.inventory import actions\n",
                               "benchmark/inventory/zoo.py": "from benchmark.inventory.actions import quarantine_and_redo\n"})
    assert write_violations(modules) == [
        "benchmark.inventory.zoo -> benchmark.inventory.actions (only the stages write to the store through the inventory)",
        "benchmark.report.tables -> benchmark.inventory.actions (only the stages write to the store through the inventory)",
    ]
    assert layer_violations(modules) == []  # allowed by the layers: the rule above is what catches it


def test_a_stage_importing_another_stage_is_caught(tmp_path):
    modules = _tree(tmp_path, {**CLEAN, "benchmark/stages/sample.py": "from benchmark.stages.zoo import converged\n"})
    (found,) = stage_violations(modules)
    assert "stage benchmark.stages.sample imports ['benchmark.stages.zoo']" in found
    modules = _tree(tmp_path / "b", {**CLEAN, "benchmark/stages/sample.py": "def f():\n    from benchmark.stages import zoo\n"})
    assert stage_violations(modules)  # a function-level import, by module name, is seen too


def test_a_report_module_importing_a_stage_is_caught(tmp_path):
    modules = _tree(tmp_path, {**CLEAN, "benchmark/report/tables.py": "from benchmark.stages.zoo import x\n"})
    assert "the report and the analyses import no stage" in stage_violations(modules)[0]
    assert "benchmark.report.tables (benchmark.report) -> benchmark.stages.zoo" in layer_violations(modules)


def test_a_package_cycle_is_caught(tmp_path):
    modules = _tree(tmp_path, {**CLEAN, "benchmark/core/store/units.py": "from benchmark.core.data import x\n",
                               "benchmark/core/data/loading.py": "from benchmark.core.store import Unit\n"})
    assert layer_violations(modules) == []  # allowed arrows, each on its own
    assert package_cycles(modules) == [["benchmark.core.data", "benchmark.core.store", "benchmark.core.data"]]


def test_an_upward_import_and_config_outside_the_runners_are_caught(tmp_path):
    modules = _tree(tmp_path, {**CLEAN, "metrics/mmd.py": "import benchmark.experiment\n",
                               "methods/swag.py": "from omegaconf import DictConfig\n"})
    found = layer_violations(modules)
    assert "metrics.mmd (metrics) -> benchmark.experiment" in found
    assert any(f.startswith("methods.swag -> omegaconf") for f in found)


@pytest.mark.parametrize("bad", ["bench/x.py", "benchmark/core/data/x.py"])
def test_tests_are_imported_by_nobody(tmp_path, bad):
    modules = _tree(tmp_path, {**CLEAN, bad: "from tests.corruptions import corrupt\n", "tests/corruptions.py": ""})
    assert any("-> tests" in f for f in layer_violations(modules))
