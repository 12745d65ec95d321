"""MC Dropout on the last layer's input (Gal & Ghahramani 2016) as a mixture of Diracs in weight space.

A network is trained from scratch with dropout of rate ``p`` on the input of its last Linear
layer (appendix B: p 0.2 OptuNet, 0.5 ResNet-18, at train and test time). Dropping input j
of that layer and scaling the kept inputs by ``1/(1-p)`` is the same as zeroing column j of
its weight and scaling the other columns by ``1/(1-p)``; so each dropout mask is one weight
sample (bias and every other layer unchanged), and predicting with the weight sample equals
predicting with the mask.

Training draws each network's dropout masks from its own generator (``mask_generator(seed)``, a
stream of its own, neither torch's global RNG nor the data order's), one ``[B, in]`` mask per
step (``training_noise``), so that the networks of one round of base seeds can be trained
together as stacked networks (``prefit``: ``benchmark.core.training.train_networks`` with
``DropoutObjective``, the packed CPU kernels multiplying the last Linear's input and its
gradient by the mask, ``torch.func.vmap`` elsewhere): each follows its one-at-a-time training
(``fit`` alone: ``train_network`` with ``MaskedDropout``) up to float rounding, with the same
masks, and its result does not depend on the other networks of its stack.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from benchmark.core.models import predict_with_weights
from benchmark.core.settings import require
from benchmark.core.store import SampleSet
from benchmark.core.training import NonFiniteError, TrainResult, seeded, train_network
from benchmark.core.training.objective import CrossEntropyObjective, Gather
from benchmark.core.training.stacked import Params, StackedNetworks, stacked_networks
from benchmark.core.training.vectorised import stacking_problem, train_networks
from methods.base import MethodConfigError, MethodFitError, MethodSettings, PosteriorMethod

# Fewest dropout networks worth stacking (bench/bench_methods_stacked.py, 2 digits epochs, one thread,
# three runs on a shared 2-core machine): alone, a network trains 1.8-2.7x faster one at a time (the
# packed kernels compute 16 lanes at once); 2 stacked are 1.1-1.3x faster than 2 one at a time, 10
# stacked 5.1-6.8x faster than 10 one at a time.
MIN_STACK = 2


def dropout_layers(model: nn.Module) -> tuple[nn.Dropout, str, nn.Linear]:
    """``(the Dropout module, the last Linear's name, the last Linear)`` of a model built with dropout.

    The model factories put their single Dropout on the last Linear's input.
    """
    drops = [m for m in model.modules() if isinstance(m, nn.Dropout)]
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if len(drops) != 1 or not linears:
        raise MethodConfigError(
            f"method=dropout: model {type(model).__name__} needs exactly one Dropout before a last Linear layer, "
            f"found {len(drops)} Dropout and {len(linears)} Linear modules"
        )
    return drops[0], *linears[-1]


def draw_masks(n: int, width: int, p: float, generator: torch.Generator) -> torch.Tensor:
    """``n`` dropout masks ``[n, width]`` (float 0/1), each unit kept with probability ``1 - p``."""
    return (torch.rand(n, width, generator=generator) >= p).float()


def masked_weights(weight: torch.Tensor, masks: torch.Tensor, p: float) -> torch.Tensor:
    """Last-layer weights ``[n, out, in]`` of masks ``[n, in]``: dropped columns zeroed, kept ones scaled by 1/(1-p)."""
    return weight[None] * (masks / (1.0 - p))[:, None, :]


def mask_generator(seed: int) -> torch.Generator:
    """The generator of the training masks of the dropout network of ``seed``: seeded with the first
    number drawn from ``torch.Generator().manual_seed(seed)``, so its stream is not the data order's
    (which ``train_network`` draws from a generator seeded with ``seed`` itself) nor shifted from it."""
    first = int(torch.randint(0, 2**62, (), generator=torch.Generator().manual_seed(seed)))
    return torch.Generator().manual_seed(first)


def training_noise(batch: int, width: int, p: float, generator: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """One training step's inverted-dropout multipliers ``[batch, width]`` (CPU, ``dtype``): a
    ``draw_masks`` mask (drawn in float32 whatever ``dtype``) divided by ``1 - p``."""
    return draw_masks(batch, width, p, generator).to(dtype) / (1.0 - p)


class MaskedDropout(nn.Dropout):
    """Inverted dropout of inputs ``[B, in]`` whose training masks come from ``generator``
    (``training_noise``), not from torch's global RNG; the identity in eval mode."""

    def __init__(self, p: float, generator: torch.Generator) -> None:
        super().__init__(p)
        self.generator = generator

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        return x * training_noise(x.shape[0], x.shape[1], self.p, self.generator, x.dtype).to(x.device)


def use_mask_generator(model: nn.Module, generator: torch.Generator) -> None:
    """Replace ``model``'s Dropout (``dropout_layers``) by a ``MaskedDropout`` of the same rate drawing from ``generator``."""
    drop, _, _ = dropout_layers(model)
    name = next(name for name, module in model.named_modules() if module is drop)
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent), leaf, MaskedDropout(drop.p, generator))


class DropoutObjective(CrossEntropyObjective):
    """The cross-entropy of K dropout networks ``models`` stacked as ``stacked`` (their plain
    architecture), with dropout of rate ``p`` on the last Linear layer's input (``width`` inputs):
    at every step network ``k`` (the trainer's index ``lanes[position]``) draws its mask from
    ``generators[k]`` as ``MaskedDropout`` draws it (``training_noise``), and its last Linear's
    input, and that input's gradient, are multiplied by it (``last_input_scale``: one multiply in
    the packed kernels' head). Accuracies are those of the networks without dropout (eval mode)."""

    def __init__(self, stacked: StackedNetworks, models: Sequence[nn.Module], generators: Sequence[torch.Generator],
                 p: float, width: int) -> None:
        super().__init__(stacked, models)
        self.generators, self.p, self.width = list(generators), p, width
        fused = getattr(stacked, "loss_and_grads", None)
        if fused is not None:
            self.loss_and_grads = lambda params, batch, labels, lanes: fused(params, batch, labels,
                                                                             self.noise(params, labels, lanes))

    def noise(self, params: Params, labels: torch.Tensor, lanes: Sequence[int]) -> torch.Tensor:
        """The step's multipliers ``[K, B, width]`` of the networks ``lanes`` (``labels [K, B]``), each from its own generator."""
        first = next(iter(params.values()))
        draws = [training_noise(labels.shape[1], self.width, self.p, self.generators[lane], first.dtype) for lane in lanes]
        return torch.stack(draws).to(first.device)

    def losses(self, params: Params, gather: Gather, labels: torch.Tensor, lanes: Sequence[int]) -> torch.Tensor:
        logits = self.stacked.forward(params, gather(1), self.noise(params, labels, lanes))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape).mean(1)


@dataclass
class DropoutSettings(MethodSettings):
    """``p``: dropout rate on the last layer's input, at train and test time (appendix B:
    0.2 OptuNet, 0.5 ResNet-18; set per model in ``conf/model/*.yaml``)."""

    p: float = 0.2

    def __post_init__(self) -> None:
        require(0.0 < self.p < 1.0, "p", self.p, "a dropout rate in (0, 1)")


class DropoutMethod(PosteriorMethod):
    """Last-layer MC Dropout; ``fit`` retrains a dropout network from the base's seed (``prefit``
    trains a round's networks together where they can be stacked)."""

    name = "dropout"
    order = 10
    paper_label = "Dropout"
    label = "Dropout"
    fits_can_fail = True
    Settings = DropoutSettings

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._model: nn.Module | None = None
        self._weights: dict[str, torch.Tensor] | None = None
        self._prefitted: dict[int, TrainResult | NonFiniteError] = {}

    @property
    def p(self) -> float:
        return float(self.settings.p)

    def check(self, mode: str) -> None:
        super().check(mode)
        with seeded(0):  # building a model draws from the global RNG; leave it as it was
            dropout_layers(self.model_factory(dropout=self.p))

    def built(self, seed: int) -> tuple[nn.Module, torch.Generator]:
        """The dropout network of ``seed`` before training (initialised under ``seeded(seed)``, the
        base's initialisation) and the generator of its training masks (``mask_generator``)."""
        with seeded(seed):  # building a model draws from the global RNG; leave it as it was
            model = self.new_model(dropout=self.p)
        return model, mask_generator(seed)

    def stacking_problem(self) -> str | None:
        """Why the dropout networks cannot be trained as stacked networks, or None: it needs a
        validation split (the convergence rule), an in-memory training set and an architecture the
        stacked networks run (its plain form: the mask is the objective's)."""
        if self.data.check is None:
            return "no validation split to judge the convergence rule on"
        return stacking_problem(self.data.train, lambda: stacked_networks(self.new_model(), self.device))

    def prefit(self, seeds: Sequence[int], load_base: Callable[[int], dict[str, torch.Tensor]]) -> None:
        """Train the dropout networks of ``seeds`` together as stacked networks when they can be
        (``stacking_problem``) and there are at least ``MIN_STACK`` of them: each as ``fit`` would
        train it alone, with the same masks, up to float rounding, and to the bit whatever the other
        networks of the stack; ``fit`` then takes its outcome (a failed or non-finite network raises there)."""
        todo = [int(s) for s in seeds if int(s) not in self._prefitted]
        if len(todo) < MIN_STACK or self.stacking_problem() is not None:
            return
        models, generators = zip(*(self.built(seed) for seed in todo))
        with seeded(0):  # building a model draws from the global RNG; leave it as it was
            template = self.new_model()
        width = dropout_layers(models[0])[2].in_features
        objective = DropoutObjective(stacked_networks(template, self.device), models, generators, self.p, width)
        templates = [template] * len(todo)  # the architecture and device: the objective holds the parameters
        outcomes = train_networks(templates, self.data, self.recipe, todo, [f"dropout seed {s}" for s in todo],
                                  objective=objective, progress=f"dropout: {len(todo)} networks stacked")
        self._prefitted.update(zip(todo, outcomes))

    def fit(self, base: dict[str, torch.Tensor], seed: int) -> None:
        """Train a dropout network from scratch with the experiment's recipe; ``seed`` fixes its
        initialisation (the base's), data order and training masks (``mask_generator``). ``base``
        itself is not used: dropout changes training. When ``prefit`` trained it with others, its
        outcome is taken from there (the same training up to float rounding).

        Raises ``NonFiniteError`` on NaN/Inf, ``MethodFitError`` if the run fails the recipe's
        convergence rule.
        """
        self._model = self._weights = None
        model, generator = self.built(seed)
        if seed in self._prefitted:
            result = self._prefitted[seed]  # kept: a base shared by two units is trained once
            if isinstance(result, NonFiniteError):
                raise result
            model.load_state_dict(result.state_dict)
        else:
            use_mask_generator(model, generator)
            result = train_network(model, self.data.train, self.data.check, self.recipe, seed, where=f"dropout seed {seed}")
        if result.failure:
            raise MethodFitError(f"method=dropout: the dropout network of seed {seed} failed: {result.failure}")
        self._model, self._weights = model.eval(), result.state_dict

    def _fitted(self) -> tuple[nn.Module, dict[str, torch.Tensor]]:
        if self._model is None or self._weights is None:
            raise RuntimeError("method=dropout: call fit() before sample() or predict_own()")
        return self._model, self._weights

    def sample(self, n: int, generator: torch.Generator) -> SampleSet:
        """``n`` masked copies of the trained weights ``{key: [n, ...]}``; only the last Linear's weight varies."""
        model, weights = self._fitted()
        _, name, last = dropout_layers(model)
        masks = draw_masks(n, last.in_features, self.p, generator)
        out = {k: v[None].expand(n, *v.shape).clone() for k, v in weights.items()}
        out[f"{name}.weight"] = masked_weights(weights[f"{name}.weight"], masks, self.p)
        return out

    @torch.no_grad()
    def predict_own(self, images: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
        """Probabilities ``[n, N, C]`` of the dropout network with mask i (drawn as ``sample`` draws
        them) applied to the last layer's input of every image."""
        model, _ = self._fitted()
        drop, _, last = dropout_layers(model)
        masks = draw_masks(n, last.in_features, self.p, generator)
        out = []
        for mask in masks.to(self.device):
            handle = drop.register_forward_hook(lambda _m, inputs, _out: inputs[0] * mask / (1.0 - self.p))
            try:
                out.append(predict_with_weights(model, {k: v[None] for k, v in model.state_dict().items()}, images)[0])
            finally:
                handle.remove()
        return torch.stack(out)
