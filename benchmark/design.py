"""The repetition design: how many repetitions every row has, and which networks each one reads.

One object (``Design``, ``exp.design``: built once from the config's ``sample`` node) owns it, so that no stage reads these settings on its own:

- ``repetitions``: ``sample.repetitions``, the independent repetitions of every method x mode,
  unless ``sample.repetitions_per_method`` names the method (``repetitions_of``: cheap rows can
  run more, so that their paired exact tests can reach the claims' level); the rows of the references
  and the baselines have the default count: a reference's own method's (the config refuses an entry
  for it: the reference pools its repetitions), the zoo's blocks under ``reference=<name>``, the
  second zoo at most that
  (a baseline is compared with every method, unpaired);
- ``most``: the largest count of any method (the held-out blocks laid out: ``reach``, ``needed``);
- the base pools: ``pool(method, bases)``, the block of candidate held-out seeds one repetition of
  a method reserves (its bases, plus spares where a fit can fail);
- their layout: ``stride``, the converged held-out seeds between the starts of two repetitions
  (the largest pool any registered method x mode reserves), so repetition k of every row starts
  at converged held-out seed ``k x stride`` (its one-mode base is the first of the multi-mode and
  ensemble bases: the rows' differences are paired) and no base is in two repetitions.

A unit's place in the layout (``unit_layout``: the positions of its candidate block among the
converged held-out seeds) is part of its key (``inventory.unit_expectations``, the ``layout``
metadata of its files): a change of ``sample.per_method``, ``sample.modes_multi`` or of the
registered methods' pools that moves a repetition's block makes exactly the units whose block
moved stale. The number of repetitions moves no block: more repetitions (for every method, or for
one through ``sample.repetitions_per_method``) keep the ones done, and repetition k of a method with
8 repetitions starts from the same base as repetition k of one with 5 (the rows stay paired on
their common repetitions 0 .. 4). Which seeds lie at those positions is not in the
design: a unit records the held-out seeds it read (``read_seeds``) and is stale when the converged
seeds now at those positions differ (``inventory.moved_seeds``), so a held-out range grown at its
end keeps every unit drawn.

The design reads positions, never the store: which seeds the positions are is the inventory's and
the sample stage's business (``select_bases``, ``inventory.heldout_shortfall``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Mapping, Sequence, TypeVar

from methods import MethodConfigError, PosteriorMethod, method_class, selected
from methods.modes import plan_counts

T = TypeVar("T")


def pool_size(method: type[PosteriorMethod] | PosteriorMethod, bases: int) -> int:
    """The smallest block of candidate seeds one repetition needs: the bases, plus spares (a fifth,
    and one) for methods whose fit around a base can fail (retrained networks that do not
    converge; the sample stage lets those go on through their repetition's whole block)."""
    return bases + (math.ceil(0.2 * bases) + 1 if method.fits_can_fail else 0)


@dataclass(frozen=True)
class Design:
    """The repetition design of a config's ``sample`` node (see the module doc): ``repetitions``
    (the default count), ``per_method`` (samples per method and mode), ``modes_multi`` (multi-mode
    bases), ``per_method_repetitions`` (``sample.repetitions_per_method``: method name -> its
    count, overriding ``repetitions`` in both modes; a mapping is stored as sorted pairs)."""

    repetitions: int
    per_method: int
    modes_multi: int
    per_method_repetitions: tuple[tuple[str, int], ...] = ()

    @classmethod
    def of(cls, sample) -> "Design":
        """The design of a config's ``sample`` node (``sample.repetitions``, ``sample.per_method``,
        ``sample.modes_multi``, ``sample.repetitions_per_method``); ``Experiment.design`` holds its
        experiment's."""
        return cls(sample.repetitions, sample.per_method, sample.modes_multi,
                   tuple(sorted(dict(sample.repetitions_per_method or {}).items())))

    def __post_init__(self) -> None:
        for name in ("repetitions", "per_method", "modes_multi"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Design: sample.{name} is {value!r}, expected a positive integer")
        counts = self.per_method_repetitions
        if isinstance(counts, Mapping):
            counts = tuple(sorted(counts.items()))
            object.__setattr__(self, "per_method_repetitions", counts)
        for method, value in counts:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Design: sample.repetitions_per_method.{method} is {value!r}, expected a "
                                 "positive integer")

    # ---- how many repetitions ------------------------------------------------------------------

    def repetitions_of(self, method: str) -> int:
        """How many repetitions the rows of ``method`` (both modes) have: its
        ``sample.repetitions_per_method`` entry, else ``repetitions``."""
        return dict(self.per_method_repetitions).get(str(method), self.repetitions)

    @property
    def most(self) -> int:
        """The largest count of any method: the held-out blocks every run lays out (``reach``,
        ``needed``), whichever methods it selects."""
        return max([self.repetitions, *(count for _, count in self.per_method_repetitions)])

    # ---- the layout --------------------------------------------------------------------------

    def plan_counts(self, method: type[PosteriorMethod] | PosteriorMethod, mode: str) -> tuple[int, int]:
        """``(bases, samples per base)`` of one repetition of ``method`` in ``mode``: ``per_method``
        samples split over ``modes_multi`` bases in multi mode, one base in one mode, or the method's
        fixed ``samples_per_base`` (``methods.modes.plan_counts``; ``MethodConfigError`` when the
        sample counts do not split)."""
        return plan_counts(method, mode, self.per_method, self.modes_multi)

    def bases(self, method: type[PosteriorMethod] | PosteriorMethod, mode: str) -> int:
        """How many base networks a repetition of ``method`` in ``mode`` takes (``plan_counts``)."""
        return self.plan_counts(method, mode)[0]

    @cached_property
    def stride(self) -> int:
        """Converged held-out seeds between the starts of two repetitions: the largest pool
        (``pool_size``) any registered method x mode reserves under ``per_method`` and
        ``modes_multi``, whichever methods a run selects, so every row's repetition k starts at
        the same seed."""
        pools = []
        for name, mode in selected("all", "both"):
            cls = method_class(name)
            try:
                pools.append(pool_size(cls, self.bases(cls, mode)))
            except MethodConfigError:  # a method whose counts do not split is refused by its own check
                continue
        return max(pools, default=1)

    def pool(self, method: type[PosteriorMethod] | PosteriorMethod, bases: int) -> int:
        """The candidate block one repetition of ``method`` with ``bases`` bases reads: the whole
        stride for a method whose fits can fail (at the failure rates seen, MC Dropout on digits
        ~20%, the minimal pool runs short for some repetition of five often; the bases it takes are
        still the first that fit), else its ``pool_size``."""
        return self.stride if method.fits_can_fail else pool_size(method, bases)

    def start(self, repetition: int) -> int:
        """The position, among the converged held-out seeds, where ``repetition``'s block starts."""
        if repetition < 0:
            raise ValueError(f"Design.start: repetition {repetition}, expected a non-negative integer")
        return repetition * self.stride

    def block(self, seeds: Sequence[T], repetition: int, size: int) -> tuple[T, ...]:
        """The ``size`` seeds of ``seeds`` (the converged held-out seeds in seed order) from
        ``repetition``'s start on (``size`` at most the stride: blocks never overlap); fewer when
        ``seeds`` ends before."""
        if size > self.stride:
            raise ValueError(f"Design.block: a block of {size} is larger than the stride {self.stride}")
        start = self.start(repetition)
        return tuple(seeds[start : start + size])

    def candidates(self, seeds: Sequence[int], method: type[PosteriorMethod] | PosteriorMethod, bases: int,
                   repetition: int) -> tuple[int, ...]:
        """The candidate bases of ``repetition`` of ``method`` (``bases`` bases): its ``pool`` of
        ``seeds`` from the repetition's start on. A block depends neither on how many repetitions
        are asked nor on which methods run."""
        return self.block(seeds, repetition, self.pool(method, bases))

    @property
    def reach(self) -> int:
        """How many converged held-out seeds every block of every repetition lies in (of the
        method with the most repetitions: ``most``)."""
        return self.most * self.stride

    def needed(self, bases: int) -> int:
        """Converged held-out seeds the repetitions need when a unit takes at most ``bases`` bases,
        at the largest count of any method (``most``): ``(most - 1) x stride + bases``."""
        return (self.most - 1) * self.stride + bases

    def unit_block(self, method: str, mode: str, repetition: int) -> tuple[int, int] | None:
        """``(start, size)``: the candidate block of a unit of registered ``method`` in ``mode``
        among the converged held-out seeds; ``None`` when its sample counts do not split (a unit
        the sample stage refuses)."""
        cls = method_class(method)
        try:
            pool = self.pool(cls, self.bases(cls, mode))
        except MethodConfigError:
            return None
        return self.start(repetition), pool

    def unit_layout(self, method: str, mode: str, repetition: int) -> str:
        """The place of a unit of registered ``method`` in the layout, as recorded in its files
        (``layout``): the positions of its candidate block (``unit_block``). A unit whose recorded
        layout differs from this one was drawn around other bases: stale."""
        block = self.unit_block(method, mode, repetition)
        if block is None:
            return f"none (sample.per_method={self.per_method} does not split into {method}'s {mode}-mode bases)"
        start, size = block
        return f"converged held-out seeds {start}..{start + size - 1}"

    # ---- the repetitions of the references' and the baselines' rows ---------------------------

    def reference_blocks(self, seeds: Sequence[T]) -> list[list[T]]:
        """The zoo row's repetitions (under a ``reference=<name>`` that scores the zoo): ``repetitions`` (the default count, whatever
        ``sample.repetitions_per_method`` gives single methods) disjoint blocks of
        ``seeds`` (the converged reference seeds, in seed order) of ``per_method`` each (the size of
        a method's sample set), or of an equal share of them when they are fewer."""
        size = min(self.per_method, len(seeds) // self.repetitions)
        return [list(seeds[k * size : (k + 1) * size]) for k in range(self.repetitions)]

    def baseline_repetitions(self, wanted: int | None, held_out: bool, reach: str = "repetitions") -> int:
        """How many repetitions a baseline row gets: ``wanted`` (``evaluate.baseline_repetitions``;
        ``None``: ``repetitions``); for one that reads the held-out blocks (``held_out``) at most
        ``repetitions`` (the default count, not ``most``: a baseline is compared with every method)
        when it reads whole blocks (``reach="repetitions"``: the second zoo, one block per method
        repetition), at most ``most`` when it reads only the bases at the blocks' starts
        (``reach="most"``: the copies of the bases, which every method with ``most`` repetitions draws)."""
        count = wanted or self.repetitions
        if not held_out:
            return count
        if reach not in ("repetitions", "most"):
            raise ValueError(f"Design.baseline_repetitions: reach={reach!r}, expected 'repetitions' or 'most'")
        return min(count, self.repetitions if reach == "repetitions" else self.most)
