"""``gaussian``: a mean-field Gaussian fitted to the reference zoo (each weight's mean and standard
deviation over the checkpoints), sampled independently per weight; ``gaussian_ns``: the same
fitted to the symmetry-free zoo (the NS steps of ``evaluate.canonical_steps`` removed), so its
draws are in the canonical coordinates."""
from __future__ import annotations

import torch

from benchmark.baselines.base import Baseline, generator
from benchmark.core.store import iter_checkpoint_batches
from benchmark.experiment import Experiment
from benchmark.references.zoo import ZooReference


def reference_moments(zoo: ZooReference, symmetry_free: bool) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
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


class Gaussian(Baseline):
    """``gaussian``: a mean-field Gaussian fitted to the reference zoo (each weight's mean and
    standard deviation over its checkpoints), sampled independently per weight."""

    name = "gaussian"
    label = "Gaussian fit"
    about = "a mean-field Gaussian fitted to the reference's weights"
    order = 2
    symmetry_free = False

    @classmethod
    def draw(cls, exp: Experiment, zoo: ZooReference, n: int, repetition: int
             ) -> tuple[dict[str, torch.Tensor], list[int] | None]:
        """``gaussian_samples`` of the zoo's moments (``symmetry_free``: of its NS form)."""
        return gaussian_samples(reference_moments(zoo, cls.symmetry_free), n, generator(cls.name, repetition)), None


class GaussianNS(Gaussian):
    """``gaussian_ns``: ``Gaussian`` fitted to the symmetry-free zoo (``evaluate.canonical_steps``
    removed), so its draws are in the canonical coordinates."""

    name = "gaussian_ns"
    label = "Gaussian fit (NS)"
    about = "a mean-field Gaussian fitted to the symmetry-free reference (draws in its canonical coordinates)"
    order = 3
    symmetry_free = True
