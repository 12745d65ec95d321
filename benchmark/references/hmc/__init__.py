"""The HMC reference (``reference=hmc``): the pooled draws of every chain of full-batch HMC's
multi-mode units (``method=hmc mode=multi``, every repetition), scored with the same machinery as
the zoo (``benchmark.references.base.Reference``: the same MMD, symmetries and predictive metrics, whose agreement and
TV are then against HMC's predictive, as the NeurIPS 2021 competition scores). Every row is scored
against it, an HMC repetition against the other repetitions' chains only (``against``), and the zoo
itself gets a row (``scores_zoo``: blocks of reference checkpoints scored as a method's samples).

Its report hooks: ``table_hmc.{md,csv}`` and the findings about the two references
(``benchmark.report.hmc``), and ``analysis=hmc`` (``benchmark.analyses.hmc``).
"""
from __future__ import annotations

import torch

from benchmark.core.store import SampleSetMetadata, Unit, load_sample_set, read_metadata, validate_tensors
from benchmark.experiment import Experiment
from benchmark.inventory import MissingInputsError, row_units
from benchmark.references.base import Reference, ReportHooks, files_key
from metrics.mcmc import predictive_convergence

HMC_ROW = ("hmc", "multi")
"""The rows whose draws, pooled over the repetitions, are the HMC reference."""


class HMCReference(Reference):
    """The HMC reference (``reference=hmc``): the draws of every chain of the units of ``HMC_ROW``
    (one per repetition, each ``sample.modes_multi`` chains from independent starts), pooled, held
    in memory (HMC runs only models without BatchNorm: OptuNet-sized), and their mean predictive
    (from the units' stored predictions). ``exclude``: units left out of the pool, so that an HMC
    repetition is scored against the other repetitions' chains, never against its own draws.
    Its forms are computed in memory per run (no disk cache: a few hundred small networks); it has
    no anchor network, so no WM columns."""

    name = "hmc"
    needs = "every repetition of hmc/multi (stage=sample method=hmc mode=multi)"
    own_row = HMC_ROW
    scores_zoo = True
    hooks = ReportHooks(report="benchmark.report.hmc", analysis="benchmark.analyses.hmc")

    def __init__(self, exp: Experiment, exclude: tuple[Unit, ...] = ()) -> None:
        problem = self.problem(exp)
        if problem is not None:
            raise MissingInputsError(f"reference=hmc needs {problem}")
        units = [u for u in row_units(exp, *HMC_ROW) if u not in exclude]
        if not units:
            raise ValueError(f"reference=hmc: every unit of {'/'.join(HMC_ROW)} is excluded ({[u.label for u in exclude]})")
        paths = [p for u in units for p in exp.store.unit_paths(u)]
        super().__init__(exp, {"files": files_key(paths), "units": [u.label for u in units]})
        self.units = units
        self._own: dict[Unit, HMCReference] = {}

    @classmethod
    def problem(cls, exp: Experiment) -> str | None:
        """Why the store cannot give the HMC reference (a repetition of ``hmc``/``multi`` missing),
        with the command that draws it; ``None`` when every repetition's files are there."""
        store = exp.store
        missing = [r for r in range(exp.design.repetitions)
                   if not all(p.is_file() for p in store.unit_paths(store.sample_unit(*HMC_ROW, r)))]
        if not missing:
            return None
        return (f"the HMC reference: repetitions {missing} of {'/'.join(HMC_ROW)} are not in {store.samples_dir}; run "
                f"python -m benchmark stage=sample experiment={exp.name} method={HMC_ROW[0]} mode={HMC_ROW[1]} first "
                "(make hmc runs it end to end)")

    @classmethod
    def drawn_by(cls, exp: Experiment) -> bool:
        """Whether ``exp``'s sample stage draws HMC's multi-mode units (``method=hmc``, a mode with multi)."""
        return exp.config.method.value == HMC_ROW[0] and exp.config.mode.value in ("both", HMC_ROW[1])

    def against(self, unit: Unit) -> Reference:
        """An HMC unit of the pool against the other units' chains (leave one repetition out); any other unit against the pool."""
        if unit not in self.units:
            return self
        if unit not in self._own:
            self._own[unit] = HMCReference(self.exp, exclude=(unit,))
        return self._own[unit]

    def weights(self) -> dict[str, torch.Tensor]:
        """The pooled draws ``{key: [R, ...]}`` of the reference's units, in unit order."""
        def build():
            store, parts = self.exp.store, []
            for unit in self.units:
                path = store.samples_path(unit)
                samples = load_sample_set(path)
                validate_tensors(samples, self.exp.model(), source=str(path), leading=1)
                parts.append(samples)
            return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        return self._remember("weights", build)

    def chain_predictions(self) -> torch.Tensor:
        """The stored test-split softmax outputs of every draw, grouped by chain ``[chains, draws, N, C]``
        (each unit's draws are its chains' in base order, ``samples_per_base`` each)."""
        store, groups = self.exp.store, []
        for unit in self.units:
            path = store.preds_path(unit)
            meta = SampleSetMetadata.decode(read_metadata(path))
            probs = load_sample_set(path, ["id"])["id"]
            chains = len(meta.base_seeds or ()) or 1
            groups.append(probs.reshape(chains, len(probs) // chains, *probs.shape[1:]))
        lengths = {g.shape[1] for g in groups}
        if len(lengths) != 1:
            each = ", ".join(f"{store.preds_path(u).name}: {g.shape[1]}" for u, g in zip(self.units, groups))
            raise ValueError(f"reference=hmc: the units' chains must have the same number of draws to be pooled; "
                             f"draws per chain: {each} (redraw the odd units with stage=sample method=hmc)")
        return torch.cat(groups)

    def predictive(self) -> torch.Tensor:
        """The mean predictive of the pooled draws on the ID test set ``[N, C]`` (float64)."""
        return self._remember("predictive", lambda: self.chain_predictions().double().mean((0, 1)))

    def health(self) -> str:
        """How well the pooled chains mixed (``convergence``), for the evaluate stage's log."""
        report = self.convergence()
        return (f"{self.name} reference: {self.size} draws of {int(report['chains'])} chains; predictive R-hat (test "
                f"log-likelihood) {report['rhat_loglik']:.3f}, softmax median {report['rhat_softmax_median']:.3f}")

    def convergence(self) -> dict[str, float]:
        """The predictive R-hat of the pooled chains on the test split (``metrics.mcmc.predictive_convergence``:
        ``rhat_loglik``, ``rhat_softmax_median``/``_max``, ``softmax_converged``), ``ess_loglik_min``
        (the smallest per-chain ESS of the test log-likelihood), ``chains`` and ``draws_per_chain``."""
        probs = self.chain_predictions()
        report = predictive_convergence(probs, self.exp.test_tensors[1])
        ess = report.pop("ess_loglik")
        return {**{k: float(v) for k, v in report.items()}, "ess_loglik_min": float(ess.min()),
                "chains": float(probs.shape[0]), "draws_per_chain": float(probs.shape[1])}
