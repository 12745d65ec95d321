"""Reference rows: what a table's numbers mean, scored exactly as a method's samples are.

A score of 6 says little until one knows what the prior scores, or a second zoo of the same
recipe (what a perfect method would score: the noise floor). sbibm and the NeurIPS 2021 BDL
competition print such rows; these are ours. Each baseline draws ``sample.per_method`` weight
samples per repetition of the sample stage (the same repetitions as the methods), which the
evaluate stage scores against the reference like a method's samples (MMD, NS MMD, predictive
metrics; ``Reference.score_samples``) into rows of group ``baseline``, never ranked among the
methods:

- ``prior``: independent draws of every parameter from the recipe's prior N(0, 1/(N x
  weight_decay)) (N the training split; the precision the L2 term of the recipe implies, the
  prior of HMC and SGHMC); buffers (BatchNorm statistics) as a fresh model has them.
- ``init``: untrained networks, the model's own initialisation under seeds no zoo uses.
- ``gaussian``: a mean-field Gaussian fitted to the reference zoo (each weight's mean and
  standard deviation over the checkpoints), sampled independently per weight.
- ``gaussian_ns``: the same fitted to the symmetry-free zoo (the NS steps of
  ``evaluate.canonical_steps`` removed), so its draws are in the canonical coordinates.
- ``second_zoo``: converged networks of the reference's own recipe that are not in it: repetition
  k's block of ``seeds.heldout`` (the networks Deep Ensembles' repetition k uses as members):
  the noise floor of the measure.

The draws are a pure function of the baseline, the repetition and the reference, so the
evaluate stage caches their numbers like a method's (keyed by these inputs and the source).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from benchmark.core.store import iter_checkpoint_batches, load_checkpoints_as_sample_set
from benchmark.core.training import seeded
from benchmark.config import BaselineChoice
from benchmark.experiment import Experiment
from benchmark.design import Design
from benchmark.inventory import converged
from benchmark.references.zoo import Reference

BASELINE_MODE = "baseline"
"""The metrics.csv ``mode`` (table group) of the baseline rows."""

INIT_SEED_START = 5_000_000
"""Untrained networks are initialised under seeds from here on (past every zoo seed, which has
at most six digits): repetition k's i-th under ``INIT_SEED_START + 1000 k + i``."""


@dataclass(frozen=True)
class Baseline:
    """A reference row: ``name`` (metrics.csv's ``method``), ``label`` (the table's row name) and
    ``about`` (what it is, for the captions)."""

    name: str
    label: str
    about: str


BASELINES: dict[str, Baseline] = {b.name: b for b in (
    Baseline("prior", "Prior", "draws from the recipe's Gaussian prior N(0, 1/(N weight_decay)) per weight"),
    Baseline("init", "Untrained init.", "untrained networks at the model's own initialisation"),
    Baseline("gaussian", "Gaussian fit", "a mean-field Gaussian fitted to the reference's weights"),
    Baseline("gaussian_ns", "Gaussian fit (NS)",
             "a mean-field Gaussian fitted to the symmetry-free reference (draws in its canonical coordinates)"),
    Baseline("second_zoo", "Second zoo",
             "converged held-out networks of the reference's own recipe (the members of Deep Ensembles' repetition): "
             "the noise floor, what a method sampling the reference exactly scores"),
)}
"""Every baseline, in table order (``evaluate.baselines`` selects among them; their names are
``benchmark.config.BaselineChoice``'s)."""


def _generator(name: str, repetition: int) -> torch.Generator:
    """A CPU generator seeded by the baseline and the repetition alone."""
    seed = int.from_bytes(hashlib.sha256(f"baseline {name} repetition {repetition}".encode()).digest()[:8], "little")
    return torch.Generator(device="cpu").manual_seed(seed % 2**63)


def reference_moments(zoo: Reference, symmetry_free: bool) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per-coordinate mean and standard deviation (float64, ``{key: (mean [...], sd [...])}``, the
    sd with R - 1 in the denominator) over the reference's checkpoints, raw or symmetry-free
    (``symmetry_free``); a streamed reference is read in batches."""
    if zoo.in_memory:
        batches = [zoo.canonical() if symmetry_free else zoo.weights()]
    else:
        paths = zoo.canonical_paths() if symmetry_free else zoo.checked_paths()
        batches = iter_checkpoint_batches(paths, zoo.batch, validated=True)
    sums: dict[str, torch.Tensor] = {}
    squares: dict[str, torch.Tensor] = {}
    count = 0
    for batch in batches:
        for key, values in batch.items():
            values = values.double()
            sums[key] = sums.get(key, 0) + values.sum(0)
            squares[key] = squares.get(key, 0) + (values * values).sum(0)
        count += int(next(iter(batch.values())).shape[0])
    out = {}
    for key in sums:
        mean = sums[key] / count
        variance = (squares[key] - count * mean * mean).clamp_min(0) / max(count - 1, 1)
        out[key] = (mean, variance.sqrt())
    return out


def gaussian_samples(moments: dict[str, tuple[torch.Tensor, torch.Tensor]], n: int, generator: torch.Generator
                     ) -> dict[str, torch.Tensor]:
    """``n`` independent draws ``{key: [n, ...]}`` (float32) of the mean-field Gaussian with the
    per-coordinate ``moments`` ``{key: (mean [...], sd [...])}``."""
    out = {}
    for key, (mean, sd) in moments.items():
        noise = torch.randn((n, *mean.shape), generator=generator, dtype=torch.float64, device="cpu")
        out[key] = (mean + sd * noise).float()
    return out


def prior_samples(exp: Experiment, n: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """``n`` draws ``{key: [n, ...]}`` of every parameter from N(0, 1/(N x weight_decay)) (N: the
    training split's size; the recipe's weight decay), buffers as a fresh model holds them."""
    weight_decay = float(exp.recipe.weight_decay)
    if weight_decay <= 0:
        raise ValueError(f"baseline prior: train.weight_decay={weight_decay:g} gives no proper Gaussian prior; "
                         "drop 'prior' from evaluate.baselines")
    sd = (len(exp.train_set) * weight_decay) ** -0.5
    with seeded(0):
        model = exp.model()
    parameters = dict(model.named_parameters())
    out = {}
    for key, value in model.state_dict().items():
        if key in parameters:
            out[key] = sd * torch.randn((n, *value.shape), generator=generator, device="cpu")
        else:
            out[key] = value.detach().cpu()[None].expand(n, *value.shape).clone()
    return out


def init_samples(exp: Experiment, n: int, repetition: int) -> dict[str, torch.Tensor]:
    """``n`` untrained networks ``{key: [n, ...]}``: the model's initialisation under seeds
    ``INIT_SEED_START + 1000 x repetition + i``."""
    states = []
    for i in range(n):
        with seeded(INIT_SEED_START + 1000 * repetition + i):
            states.append({k: v.detach().cpu() for k, v in exp.model().state_dict().items()})
    return {key: torch.stack([s[key] for s in states]) for key in states[0]}


def second_zoo_seeds(exp: Experiment, repetition: int, n: int) -> list[int]:
    """The ``n`` converged held-out seeds of repetition ``repetition``'s block (``Design.block``:
    from converged held-out seed ``repetition x Design.stride`` on, as the sample stage reads them);
    raises ``ValueError`` naming the shortfall when the store holds fewer."""
    design = Design.of(exp)
    seeds = list(design.block(converged(exp, exp.heldout), repetition, n))
    if len(seeds) < n:
        raise ValueError(f"baseline second_zoo: repetition {repetition} needs {n} converged held-out networks from "
                         f"converged seed {design.start(repetition)} of seeds.heldout={[exp.heldout.start, exp.heldout.stop]}, "
                         f"the store has {len(seeds)}; train them (stage=zoo zoo.range=heldout) or drop 'second_zoo' "
                         "from evaluate.baselines")
    return seeds


def baseline_samples(exp: Experiment, zoo: Reference, name: str, repetition: int
                     ) -> tuple[dict[str, torch.Tensor], list[int] | None]:
    """Repetition ``repetition``'s ``sample.per_method`` weight samples ``{key: [n, ...]}`` of
    baseline ``name`` (``BASELINES``), and the seeds of the networks they are (``second_zoo``,
    ``init``; ``None`` for draws). ``zoo``: the reference the Gaussians are fitted to."""
    n = Design.of(exp).per_method
    if name == "prior":
        return prior_samples(exp, n, _generator(name, repetition)), None
    if name == "init":
        return init_samples(exp, n, repetition), [INIT_SEED_START + 1000 * repetition + i for i in range(n)]
    if name in ("gaussian", "gaussian_ns"):
        return gaussian_samples(reference_moments(zoo, name == "gaussian_ns"), n, _generator(name, repetition)), None
    if name == "second_zoo":
        seeds = second_zoo_seeds(exp, repetition, n)
        return load_checkpoints_as_sample_set(exp.store.checkpoint_paths(seeds)), seeds
    raise ValueError(f"evaluate.baselines: unknown baseline {name!r}; expected some of {', '.join(BASELINES)}")
