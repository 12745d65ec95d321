"""``prior``: independent draws of every parameter from the recipe's prior N(0, 1/(N x weight_decay))
(N the training split; the precision the L2 term of the recipe implies, the prior of HMC and
SGHMC); buffers (BatchNorm statistics) as a fresh model has them."""
from __future__ import annotations

import torch

from benchmark.baselines.base import Baseline, generator
from benchmark.core.training import seeded
from benchmark.experiment import Experiment
from benchmark.references.zoo import ZooReference


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


class Prior(Baseline):
    """``prior``: independent draws of every parameter from the recipe's prior N(0, 1/(N x
    weight_decay)) (N: the training split); buffers as a fresh model has them."""

    name = "prior"
    label = "Prior"
    about = "draws from the recipe's Gaussian prior N(0, 1/(N weight_decay)) per weight"
    order = 0

    @classmethod
    def draw(cls, exp: Experiment, zoo: ZooReference, n: int, repetition: int
             ) -> tuple[dict[str, torch.Tensor], list[int] | None]:
        """``prior_samples`` under the baseline's generator for ``repetition``."""
        return prior_samples(exp, n, generator(cls.name, repetition)), None
