"""The repetition design (``benchmark.design``): the same bases as before it owned them, its
layout, and that no other module reads the sample counts (``sample.repetitions``, ``per_method``, ...) or the stride."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from benchmark.design import Design, pool_size
from benchmark.experiment import Experiment
from methods import method_class, selected
from tests.conftest import REPO, compose_config

# The candidate blocks (positions among the converged held-out seeds, [start, stop)) of every
# repetition of every method x mode of the default digits config (per_method=100, modes_multi=10,
# 5 repetitions), as the sample stage computed them before the design owned them (main at 9872efb:
# inventory.repetition_stride, inventory.pool_size, stages.sample.repetition_candidates).
STARTS = (0, 100, 200, 300, 400)
DIGITS_BEFORE = {
    **{(m, mode): 100 for m in ("dropout", "bnn") for mode in ("one", "multi")},  # retrained: the whole stride
    ("bnn_ordered", "one"): 100, ("bnn_skip", "one"): 100, ("ensemble", "multi"): 100,
    **{(m, "one"): 1 for m in ("sghmc", "sghmc_sa", "swag", "laplace")},
    ("swag", "multi"): 10, ("laplace", "multi"): 10,
}


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> Experiment:
    return Experiment(compose_config(["experiment=digits_optunet", f"store={tmp_path_factory.mktemp('design') / 'store'}"]))


def test_the_design_gives_the_default_digits_config_the_bases_it_had(digits):
    design = digits.design
    assert (design.repetitions, design.per_method, design.modes_multi) == (5, 100, 10)
    # the rows that start from the base run 8 (conf/experiment/digits_optunet.yaml), the others 5
    assert dict(design.per_method_repetitions) == {"swag": 8, "laplace": 8, "ensemble": 8, "sghmc": 8}
    assert all(method_class(m).starts_from_base for m, _ in design.per_method_repetitions)
    assert [design.repetitions_of(m) for m in ("dropout", "bnn", "sghmc_sa", "hmc")] == [5] * 4
    assert design.stride == 100 and design.reach == 800 and design.needed(100) == 800
    assert set(selected("all", "both")) == set(DIGITS_BEFORE)
    seeds = list(range(100000, 100600))  # converged held-out seeds, in seed order
    for (name, mode), pool in DIGITS_BEFORE.items():
        cls = method_class(name)
        for k, start in enumerate(STARTS):
            got = design.candidates(seeds, cls, design.bases(cls, mode), k)
            assert got == tuple(seeds[start : start + pool]), (name, mode, k)
            assert design.unit_layout(name, mode, k) == f"converged held-out seeds {start}..{start + pool - 1}"


def test_blocks_never_overlap_and_the_reference_blocks_split_the_zoo():
    design = Design(3, 4, 2)
    assert design.stride == 4 and pool_size(method_class("dropout"), 2) == 4
    with pytest.raises(ValueError, match="a block of 5 is larger than the stride 4"):
        design.block(list(range(20)), 0, 5)
    assert design.block(list(range(20)), 2, 3) == (8, 9, 10)
    assert design.block(list(range(9)), 2, 3) == (8,)  # the seeds end first: fewer
    assert design.reference_blocks(list(range(20))) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert design.reference_blocks(list(range(7))) == [[0, 1], [2, 3], [4, 5]]  # an equal share of a small zoo
    assert [design.baseline_repetitions(w, held_out=h) for w, h in ((None, False), (20, False), (20, True))] == [3, 20, 3]
    with pytest.raises(ValueError, match=r"sample.repetitions is 0, expected a positive integer"):
        Design(0, 4, 2)


def test_the_number_of_repetitions_moves_no_block():
    one, five = Design(1, 4, 2), Design(5, 4, 2)
    assert [one.unit_layout("swag", "multi", k) for k in range(1)] == [five.unit_layout("swag", "multi", 0)]
    assert five.unit_layout("swag", "multi", 3) == "converged held-out seeds 12..13"
    # per_method moves the Deep Ensemble's block end (its pool: one base per sample), not swag's
    assert (Design(5, 2, 2).unit_layout("ensemble", "multi", 1), five.unit_layout("ensemble", "multi", 1)) == (
        "converged held-out seeds 4..5", "converged held-out seeds 4..7")


def test_per_method_counts_keep_the_layout_and_the_pairing():
    """A method with more repetitions than the default gets more blocks of the same layout: its
    repetition k starts where every other row's does (rows paired by repetition index), the blocks
    of the repetitions the default count has do not move, and the held-out range is laid out for
    the largest count."""
    five, more = Design(5, 4, 2), Design(5, 4, 2, {"swag": 8, "laplace": 7})
    assert more.per_method_repetitions == (("laplace", 7), ("swag", 8))  # a mapping is stored as sorted pairs
    assert [more.repetitions_of(m) for m in ("swag", "laplace", "dropout", "external_thing")] == [8, 7, 5, 5]
    assert (more.most, five.most) == (8, 5) and more.stride == five.stride == 4
    assert (more.reach, more.needed(2), five.needed(2)) == (32, 30, 18)  # (8 - 1) x 4 + 2: the largest count's
    for name, mode in selected("all", "both"):
        for k in range(5):  # the default count's blocks, whatever the overrides
            assert more.unit_layout(name, mode, k) == five.unit_layout(name, mode, k), (name, mode, k)
    for k in range(7):  # repetition k of SWAG and of Laplace start from the same converged seed
        assert more.unit_block("swag", "one", k)[0] == more.unit_block("laplace", "one", k)[0] == 4 * k
    seeds = list(range(100, 140))
    assert more.candidates(seeds, method_class("swag"), 1, 7) == (128,)
    assert more.candidates(seeds, method_class("swag"), 1, 3) == five.candidates(seeds, method_class("swag"), 1, 3)
    # the reference rows keep the default count
    assert len(more.reference_blocks(list(range(100)))) == 5
    assert more.baseline_repetitions(20, held_out=True) == 5
    assert more.baseline_repetitions(20, held_out=True, reach="most") == 8  # the copies of the bases: every method's
    assert more.baseline_repetitions(6, held_out=True, reach="most") == 6
    with pytest.raises(ValueError, match=r"sample.repetitions_per_method.swag is 0, expected a positive integer"):
        Design(5, 4, 2, {"swag": 0})


def test_the_config_checks_the_per_method_counts(tmp_path):
    from benchmark.config import ConfigError, resolve_config
    digits = ["experiment=digits_optunet", f"store={tmp_path}"]
    with pytest.raises(ConfigError, match=r"sample.repetitions_per_method.nope='nope': expected a registered "
                                          r"method: one of dropout, .*swag, laplace, ensemble"):
        resolve_config(compose_config([*digits, "+sample.repetitions_per_method.nope=3"]))
    with pytest.raises(ConfigError, match=r"sample.repetitions_per_method.swag=0: expected a positive integer"):
        resolve_config(compose_config([*digits, "sample.repetitions_per_method.swag=0"]))
    with pytest.raises(ConfigError, match=r"sample.repetitions_per_method.hmc=8: expected no entry: hmc's rows "
                                          r"are the hmc reference's own, with sample.repetitions repetitions"):
        resolve_config(compose_config([*digits, "+sample.repetitions_per_method.hmc=8"]))
    # null drops the experiment's counts; a method it does not name is added with '+'
    assert resolve_config(compose_config([*digits, "sample.repetitions_per_method=null"])).sample.repetitions_per_method is None
    added = resolve_config(compose_config([*digits, "+sample.repetitions_per_method.dropout=6"])).sample
    assert added.repetitions_per_method == {"swag": 8, "laplace": 8, "ensemble": 8, "sghmc": 8, "dropout": 6}


def _digits(tmp_path, *overrides) -> Experiment:
    return Experiment(compose_config(["experiment=digits_optunet", f"store={tmp_path / 'store'}", *overrides]))


def test_more_repetitions_for_a_method_keep_the_ones_done_and_add_units(tmp_path):
    """Growing a method's count leaves the keys of its done repetitions as they were (no unit goes
    stale), and the units a full run writes and a row averages follow each method's count."""
    from benchmark.inventory import expected_units, unit_expectations
    base = _digits(tmp_path, "sample.repetitions_per_method=null")
    grown = _digits(tmp_path, "sample.repetitions_per_method.swag=12")
    assert [grown.design.repetitions_of(m) for m in ("swag", "laplace", "dropout")] == [12, 8, 5]
    for mode in ("one", "multi"):
        for k in range(5):
            unit = base.store.sample_unit("swag", mode, k)
            assert unit_expectations(grown, unit) == unit_expectations(base, unit)
    counts = {}
    for unit in expected_units(grown):
        counts[unit.row()] = counts.get(unit.row(), 0) + 1
    assert counts[("swag", "one")] == counts[("swag", "multi")] == 12
    assert counts[("laplace", "one")] == 8 and counts[("dropout", "multi")] == 5
    digits = {u.row(): 0 for u in expected_units(_digits(tmp_path))}
    for unit in expected_units(_digits(tmp_path)):
        digits[unit.row()] += 1
    assert {row for row, n in digits.items() if n == 8} == {
        ("swag", "one"), ("swag", "multi"), ("laplace", "one"), ("laplace", "multi"), ("ensemble", "multi"), ("sghmc", "one")}
    assert all(n == 5 for row, n in digits.items() if n != 8)


def test_the_heldout_shortfall_uses_the_largest_count_and_names_the_keys(tmp_path):
    """The held-out range must hold the blocks of the method with the most repetitions: the digits
    range holds 8 x 100 (its Deep Ensemble's 800 members); the range sized for 5 does not, and the
    message names the range to use and the keys that set the count."""
    from benchmark.inventory import heldout_shortfall
    assert heldout_shortfall(_digits(tmp_path), 100) is None
    problem = heldout_shortfall(_digits(tmp_path, "seeds.heldout=[100000,100780]"), 100)
    assert problem is not None and "8 repetition(s)" in problem and "need 800 converged held-out seeds" in problem
    assert "use 'seeds.heldout=[100000,101160]'" in problem
    assert "sample.repetitions_per_method.ensemble" in problem and "sample.repetitions_per_method.swag" in problem
    assert heldout_shortfall(_digits(tmp_path, "seeds.heldout=[100000,100780]", "sample.repetitions_per_method=null"),
                             100) is None
    # one method at 9: the range for 8 is short by one stride; the message names that method's key alone
    problem = heldout_shortfall(_digits(tmp_path, "sample.repetitions_per_method.swag=9"), 100)
    assert "need 900" in problem and "sample.repetitions_per_method.swag /" in problem
    assert "sample.repetitions_per_method.laplace" not in problem


# ---- no module but the design reads the sample counts or the stride ----------------------------

OWNER = "benchmark/design.py"
SCHEMA = "benchmark/config.py"  # the config schema declares and range-checks sample.repetitions
PENDING: set[str] = set()
"""Modules still reading ``sample.repetitions`` themselves, owned by other branches while the design
was introduced: switch each to ``exp.design`` and remove it here (the test fails for one that
no longer reads it, so this list cannot outlive the reads)."""
PACKAGES = ("benchmark", "methods", "metrics")
DESIGN_KEYS = ("repetitions", "repetitions_per_method", "per_method", "modes_multi")
"""The ``sample`` node's keys only the design (and the schema) read."""


def design_reads(source: str) -> list[str]:
    """Where ``source`` reads what the design owns: ``<x>.sample.repetitions`` or
    ``sample.repetitions`` (or their ``repetitions_per_method``, ``per_method``, ``modes_multi``),
    and any use of a ``repetition_stride``; as ``line: text``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in DESIGN_KEYS:
            inner = node.value
            if (isinstance(inner, ast.Attribute) and inner.attr == "sample") or (isinstance(inner, ast.Name) and inner.id == "sample"):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else (
            node.name if isinstance(node, (ast.FunctionDef, ast.alias)) else None)
        if name == "repetition_stride":
            found.append(f"{getattr(node, 'lineno', 0)}: repetition_stride")
    return sorted(found, key=lambda read: int(read.split(":")[0]))


def readers(root: Path) -> dict[str, list[str]]:
    """Module path -> its reads of the design's values, for every module of ``PACKAGES`` under ``root``."""
    out = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")) if (root / package).is_dir() else ():
            reads = design_reads(path.read_text())
            if reads:
                out[path.relative_to(root).as_posix()] = reads
    return out


def test_only_the_design_reads_the_repetitions_and_the_stride():
    found = readers(REPO)
    assert OWNER in found  # the owner reads them: the scanner sees real reads
    outside = {path: reads for path, reads in found.items() if path not in (OWNER, SCHEMA, *PENDING)}
    assert outside == {}, "read the repetition design through benchmark.design.exp.design"
    assert PENDING <= set(found), f"no longer read there: drop {sorted(PENDING - set(found))} from PENDING"


def test_the_scanner_sees_each_kind_of_read():
    planted = ("def f(exp, sample):\n"
               "    a = exp.config.sample.repetitions\n"
               "    b = sample.repetitions\n"
               "    from benchmark.inventory import repetition_stride\n"
               "    return repetition_stride(2, 2), exp.config.evaluate.baseline_repetitions, exp.repetitions\n"
               "def g(exp):\n"
               "    return exp.config.sample.repetitions_per_method\n"
               "def h(exp, sample):\n"
               "    return exp.config.sample.per_method, sample.modes_multi, exp.per_method\n")
    assert [r.split(":")[0] for r in design_reads(planted)] == ["2", "3", "4", "5", "7", "9", "9"]
    assert design_reads("def repetition_stride():\n    pass\n")
    assert design_reads("x = '''sample.repetitions''' # sample.repetitions\n") == []  # text is not a read
