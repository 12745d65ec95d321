"""Every measured column of the results, defined once: what metrics.csv and repetitions.csv store,
how the tables label and print it, which way is better, and where it appears.

A ``Column`` is one entry of ``COLUMNS`` (in metrics.csv's order); the predictive metrics
(``metrics.predictive.METRIC_KEYS``), the results' column lists (``benchmark.results``), Table 1
(``benchmark.report.tables.TABLE1_SOURCES``), the printed scale of every cell and the directions
of findings.md's comparisons are all read from it. A new Table 1 column is one entry here plus
the function that computes it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

Kind = Literal["weight", "predictive", "test"]
Better = Optional[Literal["lower", "higher"]]


@dataclass(frozen=True)
class Column:
    """One measured column.

    ``key``: its name in metrics.csv and repetitions.csv; ``label``: its header in the tables;
    ``kind``: ``weight`` (a distance between the weight samples and the reference, ``metrics.mmd``),
    ``predictive`` (``metrics.predictive``) or ``test`` (the fraction of layers a test rejects:
    no interval); ``unit``: what the stored value is; ``scale``: the printed cell is the stored value
    x ``scale`` (x100: MMD 0.150 prints 15.0, accuracy 0.833 prints 83.3, MI 0.021 nats prints 2.1);
    ``better``: which way is better (None: no direction, e.g. mutual information); ``table1``: its
    position among Table 1's columns (None: not there); ``against_baselines``: compared with every
    baseline row in findings.md."""

    key: str
    label: str
    kind: Kind
    unit: str
    better: Better = None
    scale: float = 100.0
    table1: Optional[int] = None
    against_baselines: bool = False

    @property
    def lower(self) -> bool:
        """Lower is better (``ValueError`` for a column without a direction)."""
        if self.better is None:
            raise ValueError(f"column {self.key!r} has no better direction (metrics.columns.COLUMNS)")
        return self.better == "lower"


_MMD = "unbiased MMD^2 estimate, parameter-weighted over layers"

COLUMNS: tuple[Column, ...] = (
    Column("mmd_median", "MMD", "weight", f"median over the 20 kernels of the {_MMD}", "lower", table1=0,
           against_baselines=True),
    Column("mmd_mean", "MMD mean", "weight", f"mean over the 20 kernels of the {_MMD}", "lower"),
    Column("mmd_max", "MMD max", "weight", f"max over the 20 kernels of the {_MMD}", "lower"),
    Column("ns_mmd_median", "NS MMD", "weight", "MMD median on the symmetry-free weights", "lower", table1=1,
           against_baselines=True),
    Column("ns_mmd_mean", "NS MMD mean", "weight", "MMD mean on the symmetry-free weights", "lower"),
    Column("ns_mmd_max", "NS MMD max", "weight", "MMD max on the symmetry-free weights", "lower"),
    Column("wm_mmd_median", "WM MMD", "weight", "MMD median on the weight-matched weights", "lower"),
    Column("wm_mmd_mean", "WM MMD mean", "weight", "MMD mean on the weight-matched weights", "lower"),
    Column("wm_mmd_max", "WM MMD max", "weight", "MMD max on the weight-matched weights", "lower"),
    Column("mmd_shared_median", "MMD median (shared bandwidths)", "weight",
           "MMD median with one bandwidth grid per layer for every row", "lower"),
    Column("ns_mmd_shared_median", "NS MMD median (shared bandwidths)", "weight",
           "NS MMD median with one bandwidth grid per layer for every row", "lower"),
    Column("energy", "Energy", "weight", "energy coefficient E / (2 E|x - y|), parameter-weighted over layers",
           "lower", table1=2, against_baselines=True),
    Column("ns_energy", "NS Energy", "weight", "energy coefficient on the symmetry-free weights", "lower", table1=3,
           against_baselines=True),
    Column("acc", "Acc", "predictive", "fraction of the ID test set", "higher", table1=4, against_baselines=True),
    Column("nll", "NLL", "predictive", "nats per ID test input", "lower", against_baselines=True),
    Column("brier", "Brier", "predictive", "squared error of the predictive, summed over classes, per input", "lower",
           table1=6, against_baselines=True),
    Column("ece", "ECE", "predictive", "fraction (15 bins)", "lower", table1=5, against_baselines=True),
    Column("aupr", "AUPR", "predictive", "fraction (OOD as the positive class)", "higher", table1=7,
           against_baselines=True),
    Column("fpr95", "FPR95", "predictive", "fraction of ID inputs above the 95%-TPR threshold", "lower", table1=8,
           against_baselines=True),
    Column("id_mi", "ID MI", "predictive", "nats per ID test input", table1=9),
    Column("ood_mi", "OOD MI", "predictive", "nats per OOD input", table1=10),
    Column("agreement", "Agree", "predictive", "fraction of ID inputs whose argmax is the reference's", "higher",
           table1=11),
    Column("tv", "TV", "predictive", "total variation to the reference's predictive, per ID input", "lower", table1=12),
    Column("mmd_reject", "MMD rej.", "test", "fraction of layers where MMDAgg rejects the same distribution"),
    Column("ns_mmd_reject", "NS rej.", "test", "fraction of layers where MMDAgg rejects it on the symmetry-free weights"),
)

BY_KEY: dict[str, Column] = {c.key: c for c in COLUMNS}


def column(key: str) -> Column:
    """The column named ``key``; ``KeyError`` naming the known ones."""
    try:
        return BY_KEY[key]
    except KeyError:
        raise KeyError(f"no measured column {key!r} (metrics.columns.COLUMNS: {', '.join(BY_KEY)})") from None


def keys(kind: Kind) -> tuple[str, ...]:
    """The keys of the columns of ``kind``, in metrics.csv's order."""
    return tuple(c.key for c in COLUMNS if c.kind == kind)


def table1_columns() -> tuple[Column, ...]:
    """Table 1's columns in its order (``Column.table1``)."""
    return tuple(sorted((c for c in COLUMNS if c.table1 is not None), key=lambda c: c.table1))


def baseline_directions() -> dict[str, bool]:
    """Column -> lower is better, for the columns findings.md compares with every baseline."""
    return {c.key: c.lower for c in COLUMNS if c.against_baselines}
