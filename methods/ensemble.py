"""Deep Ensembles (Lakshminarayanan et al. 2017): each member is one weight sample.

The members are converged checkpoints of the held-out seed range, disjoint from the reference
zoo's seeds (multi-mode only: one sample per base network, ``sample.per_method`` members).
"""
from __future__ import annotations

import torch

from benchmark.core.store import SampleSet
from benchmark.core.training import seeded
from methods.base import MethodConfigError, PosteriorMethod


class EnsembleMethod(PosteriorMethod):
    """A member is its base checkpoint, unchanged: ``fit`` keeps it, ``sample(1)`` returns it."""

    name = "ensemble"
    order = 90
    paper_label = "DE"
    label = "Deep Ensembles"
    table_note = (
        "{label}: its members are held-out networks trained with the reference's own recipe, the networks of the "
        "Second zoo baseline: its weight-space scores are the measure's noise floor by construction, not a method's "
        "achievement."
    )
    modes = ("multi",)
    samples_per_base = 1
    starts_from_base = True  # the members are the repetition's base networks

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._member: torch.nn.Module | None = None

    def check(self, mode: str) -> None:
        if mode not in self.modes:
            raise MethodConfigError(
                f"method=ensemble mode={mode}: a Deep Ensemble is one sample per independently trained network "
                f"(multi-mode by construction); use mode=multi"
            )
        super().check(mode)

    def fit(self, base: dict[str, torch.Tensor], seed: int) -> None:
        """Keep ``base`` (a held-out checkpoint) as the member; ``seed`` is unused."""
        with seeded(seed):  # building a model draws from the global RNG; leave it as it was
            model = self.new_model()
        model.load_state_dict(base)  # refuses a checkpoint of another architecture
        self._member = model.eval()

    def _fitted(self) -> torch.nn.Module:
        if self._member is None:
            raise RuntimeError("method=ensemble: call fit() before sample() or predict_own()")
        return self._member

    def sample(self, n: int, generator: torch.Generator) -> SampleSet:
        """The member ``n`` times ``{key: [n, ...]}`` (a single Dirac; the generator is not used)."""
        return {k: v.detach().cpu()[None].expand(n, *v.shape).clone() for k, v in self._fitted().state_dict().items()}

    @torch.no_grad()
    def predict_own(self, images: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
        """Probabilities ``[n, N, C]`` of the member network, repeated ``n`` times."""
        probs = torch.softmax(self._fitted()(images.to(self.device)), dim=-1).float().cpu()
        return probs[None].expand(n, *probs.shape).clone()
