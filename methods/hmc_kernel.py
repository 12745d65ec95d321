"""Hamiltonian Monte Carlo for many chains at once: one stacked leapfrog over the chains'
positions ``q [C, D]``, a Metropolis correction per chain, step-size adaptation during warm-up,
thinning, divergence handling, and a per-chain state that can be saved and resumed bit for bit.

Each iteration of a chain is one HMC transition (Neal 2011) with a diagonal mass matrix ``M``:
momenta ``p ~ N(0, M)``, ``L = ceil(trajectory_length / step)`` leapfrog steps (at most
``max_leapfrog_steps``: an iteration the cap cuts short is counted in the chain's ``truncated``), accepted with probability ``min(1, exp(H_0 - H_L))``, ``H = U(q) + p' M^-1 p / 2``.
``M^-1`` starts from a chain's ``initial_inverse_mass`` (the identity unless the caller gives a
guess, e.g. the inverse of the likelihood's Fisher diagonal plus the prior precision) and
(``adapt_mass``) becomes each coordinate's posterior variance estimated during warm-up, as Stan does, so that ``trajectory_length`` is in units of the posterior's own scales. The chains share the leapfrog
loop (one call of the potential per step for all of them) but nothing else: every chain has its
own step size, its own number of steps (a chain whose trajectory is over, or has diverged, is
frozen while the others finish), its own random stream (``torch.Generator``) and its own
adaptation. A chain's numbers therefore never depend on which other chains run beside it, as
long as the potential computes each chain's value from that chain's position alone.

Warm-up (Stan's schedule): the step size starts from a search that doubles or halves it until
one leapfrog step's acceptance crosses 0.8 (as Pyro's HMC does), then follows Nesterov dual
averaging towards ``target_accept`` (Hoffman & Gelman 2014; Pyro's ``DualAveraging``, Stan's
constants). With ``adapt_mass``, after an initial buffer (15% of the warm-up, at most 75
iterations) the positions are accumulated (Welford) in windows that double in length (the first
25, or 75% of the warm-up when it is short), up to a terminal buffer (10%, at most 50); at the end
of each window ``M^-1`` becomes the regularised variance ``n/(n+5) var + 1e-3 x 5/(n+5) x M0^-1`` (Stan's,
with its identity replaced by the chain's initial ``M0^-1``) and the
step search and dual averaging start again. The sampling phase uses the averaged step. Divergence: a trajectory whose energy error
``H_s - H_0`` exceeds ``divergence_threshold`` at any step (or becomes NaN) is stopped and
rejected. In warm-up that is part of the adaptation (counted); in the sampling phase it is
recorded (iteration, step size, energy error) and the chain restarts from its starting point,
warm-up included, with its step size capped at ``restart_step_factor`` x the diverged one, at
most ``max_restarts`` times; after that the chain is marked ``diverged`` and stops (its record
says why; it is never dropped silently).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
from pyro.ops.dual_averaging import DualAveraging
from tqdm.auto import tqdm

from benchmark.core.settings import require
from benchmark.core.store import CheckpointError, load_checkpoint
from benchmark.core.store.chains import KEY as CHAIN_KEY
from benchmark.core.store.checkpoint import write_safetensors

Potential = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""``q [C, D] -> (U [C], dU/dq [C, D])``: potential energy (minus the log density) of each chain."""

WARMUP, SAMPLING, DIVERGED = "warmup", "sampling", "diverged"
FIND_THRESHOLD = math.log(0.8)  # the initial step search aims at one step's acceptance 0.8 (Pyro's)
MIN_STEP, MAX_STEP = 1e-10, 1e10  # Pyro's bounds on the step size (a chain that rejects everything stays finite)
FORMAT = 2  # version of the saved chain-state layout (2: initial_inverse_mass)
SYNC_EVERY = 16
"""Leapfrog steps between the host's checks that some chain is still integrating: the loop asks
the device (``alive.any()``, a host synchronisation) once per ``SYNC_EVERY`` steps, not after each;
the extra steps after every chain has stopped leave every chain frozen (``torch.where``), so the
draws are the same bit for bit (``tests/methods/test_hmc.py``)."""


@dataclass
class KernelSettings:
    """What an HMC run of the chains does (``methods.hmc.HMCSettings`` extends it with the method's
    own settings, so the config keys are these names).

    ``trajectory_length``: integration time per iteration (leapfrog steps x step size);
    ``max_leapfrog_steps``: at most this many steps per iteration (a tiny warm-up step would
    otherwise make one iteration endless); ``target_accept``: dual averaging's target acceptance;
    ``warmup``: adaptation iterations (discarded); ``thinning``: a draw is kept every ``thinning``
    sampling iterations; ``initial_step_size``: where the step search starts; ``divergence_threshold``:
    energy error that counts as a divergence; ``max_restarts`` and ``restart_step_factor``: what
    a divergence in the sampling phase does; ``adapt_mass``: adapt a diagonal mass matrix during
    warm-up (see the module doc).
    """

    def mass_windows(self) -> list[tuple[int, int]]:
        """Warm-up iterations ``[(first, end), ...)`` whose positions estimate ``M^-1`` (Stan's
        windows; none without ``adapt_mass`` or with fewer than 20 warm-up iterations)."""
        if not self.adapt_mass or self.warmup < 20:
            return []
        init, term, base = 75, 50, 25
        if init + term + base > self.warmup:
            init, term = int(0.15 * self.warmup), int(0.1 * self.warmup)
            base = self.warmup - init - term
        windows, first, size, last = [], init, base, self.warmup - term
        while first < last:
            end = first + size
            if end + 2 * size > last:  # the next window would not fit: this one runs to the terminal buffer
                end = last
            windows.append((first, end))
            first, size = end, 2 * size
        return windows

    trajectory_length: float = 1.0
    warmup: int = 100
    thinning: int = 1
    target_accept: float = 0.8
    initial_step_size: float = 0.01
    max_leapfrog_steps: int = 1000
    divergence_threshold: float = 1000.0
    max_restarts: int = 2
    restart_step_factor: float = 0.5
    adapt_mass: bool = True

    def __post_init__(self) -> None:
        for key in ("trajectory_length", "initial_step_size", "divergence_threshold"):
            value = getattr(self, key)
            require(math.isfinite(value) and value > 0, key, value, "a positive number")
        require(0 < self.target_accept < 1, "target_accept", self.target_accept, "a number in (0, 1)")
        require(self.warmup >= 0, "warmup", self.warmup, "an integer >= 0")
        require(self.thinning >= 1, "thinning", self.thinning, "a positive integer")
        require(self.max_leapfrog_steps >= 1, "max_leapfrog_steps", self.max_leapfrog_steps, "a positive integer")
        require(self.max_restarts >= 0, "max_restarts", self.max_restarts, "an integer >= 0")
        require(0 < self.restart_step_factor < 1, "restart_step_factor", self.restart_step_factor, "a number in (0, 1)")


def _adaptation_state(adapter: DualAveraging) -> dict[str, float]:
    return {key: float(getattr(adapter, key)) for key in ("prox_center", "_x_avg", "_g_avg", "_t", "_x_t")
            if hasattr(adapter, key)}


def _adapter(state: dict[str, float]) -> DualAveraging:
    adapter = DualAveraging(prox_center=state["prox_center"])
    for key, value in state.items():
        setattr(adapter, key, int(value) if key == "_t" else value)
    return adapter


@dataclass
class ChainState:
    """Everything a chain is, so that a saved chain resumes exactly where it stopped.

    ``name``: the chain's identity (e.g. ``seed_100003``); ``start [D]``: where it started (and
    restarts); ``position [D]``, with its ``potential`` and ``gradient`` (None until evaluated);
    ``generator``: its random stream; ``sampling_seed``: reseeds that stream when the chain first
    enters the sampling phase (None: no reseeding, or done); ``phase`` (warmup, sampling, diverged);
    ``iteration``: iterations done in the current phase; ``step_size`` (NaN: not yet searched) and
    ``step_cap`` (its upper bound after restarts); ``adaptation``: the dual-averaging state;
    ``draws [n, D]``: kept positions; per sampling iteration ``accept_probs`` and ``energies``
    (the Hamiltonian of the state the iteration ends in); ``accepted`` proposals; ``n_leapfrog``:
    every leapfrog step the chain took (warm-up and restarts included); ``warmup_divergences``;
    ``divergences``: one record per sampling-phase divergence; ``restarts``; ``tag``: what the
    chain was run for (a fingerprint of settings and data that a resumed run checks);
    ``inverse_mass [D]``: the diagonal of ``M^-1``; ``welford``: the running count, mean and sum of
    squared deviations of the positions in the current mass-adaptation window;
    ``initial_inverse_mass [D]``: where ``M^-1`` starts (and restarts after a divergence);
    ``origin``: where the caller says the start came from (e.g. ``{"init_seed": ...}``), for the record;
    ``truncated``: sampling iterations whose trajectory ``max_leapfrog_steps`` cut short (fewer than
    ``ceil(trajectory_length / step_size)`` steps: the chain then moves less than the trajectory
    length asks, and the run reports it rather than hiding it).
    """

    name: str
    start: torch.Tensor
    position: torch.Tensor
    generator: torch.Generator
    sampling_seed: Optional[int] = None
    potential: Optional[float] = None
    gradient: Optional[torch.Tensor] = None
    phase: str = WARMUP
    iteration: int = 0
    step_size: float = math.nan
    step_cap: float = math.inf
    adaptation: dict[str, float] = field(default_factory=dict)
    draws: torch.Tensor = None  # type: ignore[assignment]
    accept_probs: list[float] = field(default_factory=list)
    energies: list[float] = field(default_factory=list)
    accepted: int = 0
    n_leapfrog: int = 0
    warmup_divergences: int = 0
    divergences: list[dict[str, Any]] = field(default_factory=list)
    restarts: int = 0
    tag: str = ""
    inverse_mass: torch.Tensor = None  # type: ignore[assignment]
    welford: dict[str, torch.Tensor] = field(default_factory=dict)
    initial_inverse_mass: torch.Tensor = None  # type: ignore[assignment]
    origin: dict[str, Any] = field(default_factory=dict)
    truncated: int = 0

    def __post_init__(self) -> None:
        if self.draws is None:
            self.draws = self.position.new_empty(0, self.position.numel())
        if self.initial_inverse_mass is None:
            self.initial_inverse_mass = torch.ones_like(self.position)
        if self.inverse_mass is None:
            self.inverse_mass = self.initial_inverse_mass.clone()

    @property
    def dimension(self) -> int:
        return self.position.numel()

    def copy(self) -> "ChainState":
        """An independent copy (tensors and random stream cloned)."""
        generator = torch.Generator(self.generator.device)
        generator.set_state(self.generator.get_state())
        return ChainState(
            self.name, self.start.clone(), self.position.clone(), generator, self.sampling_seed, self.potential,
            None if self.gradient is None else self.gradient.clone(), self.phase, self.iteration, self.step_size,
            self.step_cap, dict(self.adaptation), self.draws.clone(), list(self.accept_probs), list(self.energies),
            self.accepted, self.n_leapfrog, self.warmup_divergences, [dict(d) for d in self.divergences], self.restarts,
            self.tag, self.inverse_mass.clone(), {k: v.clone() for k, v in self.welford.items()},
            self.initial_inverse_mass.clone(), dict(self.origin), self.truncated,
        )

    def summary(self) -> dict[str, Any]:
        """Per-chain diagnostics: phase, step size, acceptance (mean Metropolis probability and
        accepted fraction over the sampling iterations), leapfrog steps, divergences, restarts."""
        n = len(self.accept_probs)
        return {
            "name": self.name, "phase": self.phase, "step_size": self.step_size, "kept": len(self.draws),
            "sampling_iterations": n, "accept_prob": sum(self.accept_probs) / n if n else math.nan,
            "accepted_fraction": self.accepted / n if n else math.nan, "n_leapfrog": self.n_leapfrog,
            "warmup_divergences": self.warmup_divergences, "divergences": [dict(d) for d in self.divergences],
            "restarts": self.restarts, "origin": dict(self.origin), "truncated": self.truncated,
            "truncated_fraction": self.truncated / n if n else math.nan,
        }

    def save(self, path: str | os.PathLike) -> None:
        """Write the state to ``path`` (safetensors: tensors and the random stream; JSON metadata:
        the rest), atomically."""
        tensors = {"start": self.start, "position": self.position, "draws": self.draws,
                   "generator": self.generator.get_state(),
                   "accept_probs": torch.tensor(self.accept_probs, dtype=torch.float64, device="cpu"),
                   "energies": torch.tensor(self.energies, dtype=torch.float64, device="cpu")}
        if self.gradient is not None:
            tensors["gradient"] = self.gradient
        tensors["inverse_mass"] = self.inverse_mass
        tensors["initial_inverse_mass"] = self.initial_inverse_mass
        tensors |= {f"welford.{k}": v for k, v in self.welford.items()}
        scalars = {key: getattr(self, key) for key in ("name", "sampling_seed", "potential", "phase", "iteration",
                                                          "step_size", "step_cap", "adaptation", "accepted", "n_leapfrog",
                                                          "warmup_divergences", "divergences", "restarts", "tag",
                                                          "origin", "truncated")}
        write_safetensors(path, {k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()},
                          {"chain_state": json.dumps(scalars), "chain_format": str(FORMAT), CHAIN_KEY: self.tag})

    @classmethod
    def load(cls, path: str | os.PathLike, device: torch.device | str = "cpu") -> "ChainState":
        """The state ``save`` wrote to ``path``, its tensors on ``device``. A damaged file (checksum
        mismatch, truncated, NaN) or another kind of file raises ``CheckpointError`` naming it."""
        tensors, metadata = load_checkpoint(path)  # checksums of the tensors and metadata, finite values
        if metadata.get("chain_format") != str(FORMAT) or "chain_state" not in metadata:
            raise CheckpointError(f"{path}: not an HMC chain state of format {FORMAT} (metadata {sorted(metadata)})")
        scalars = json.loads(metadata["chain_state"])
        generator = torch.Generator()
        generator.set_state(tensors["generator"])
        device = torch.device(device)
        on = lambda key: tensors[key].to(device)  # noqa: E731
        return cls(
            scalars["name"], on("start"), on("position"), generator, scalars["sampling_seed"], scalars["potential"],
            on("gradient") if "gradient" in tensors else None, scalars["phase"], scalars["iteration"],
            scalars["step_size"], scalars["step_cap"], scalars["adaptation"], on("draws"),
            tensors["accept_probs"].tolist(), tensors["energies"].tolist(), scalars["accepted"], scalars["n_leapfrog"],
            scalars["warmup_divergences"], scalars["divergences"], scalars["restarts"], scalars["tag"],
            on("inverse_mass"), {k.removeprefix("welford."): on(k) for k in tensors if k.startswith("welford.")},
            on("initial_inverse_mass"), scalars["origin"], scalars.get("truncated", 0),
        )


def new_chain(name: str, start: torch.Tensor, seed: int, sampling_seed: Optional[int] = None,
              inverse_mass: Optional[torch.Tensor] = None) -> ChainState:
    """A chain at ``start [D]`` whose random stream is seeded with ``seed`` (and reseeded with
    ``sampling_seed`` when it enters the sampling phase, if given), its ``M^-1`` starting at
    ``inverse_mass [D]`` (None: the identity)."""
    start = start.detach().reshape(-1).clone()
    initial = None if inverse_mass is None else inverse_mass.detach().reshape(-1).to(start).clone()
    return ChainState(name, start, start.clone(), torch.Generator().manual_seed(seed), sampling_seed,
                      initial_inverse_mass=initial)


def _bounded(step: float, cap: float) -> float:
    """``step`` within ``[MIN_STEP, min(cap, MAX_STEP)]``."""
    return max(MIN_STEP, min(step, cap, MAX_STEP))


def _kinetic(p: torch.Tensor, inverse_mass: torch.Tensor) -> torch.Tensor:
    """``p' M^-1 p / 2`` per chain ``[C]`` in float64 (``inverse_mass [C, D]``: the diagonal of ``M^-1``)."""
    return 0.5 * (inverse_mass.double() * p.double() ** 2).sum(-1)


class StackedHMC:
    """HMC on ``potential`` for a list of ``ChainState`` at once (see the module doc)."""

    def __init__(self, potential: Potential, settings: KernelSettings) -> None:
        self.potential = potential
        self.settings = settings

    # -- one iteration -------------------------------------------------------------------------
    def _evaluate(self, chains: Sequence[ChainState]) -> None:
        """Fill in the potential and gradient of chains that have none."""
        todo = [c for c in chains if c.potential is None or c.gradient is None]
        if not todo:
            return
        value, gradient = self.potential(torch.stack([c.position for c in todo]))
        for i, chain in enumerate(todo):
            chain.potential, chain.gradient = float(value[i]), gradient[i].detach().clone()

    def _momenta(self, chains: Sequence[ChainState]) -> torch.Tensor:
        """``p ~ N(0, M)`` ``[C, D]``, each chain's from its own stream."""
        z = torch.stack([torch.randn(c.dimension, generator=c.generator).to(c.position.device) for c in chains])
        return z / torch.stack([c.inverse_mass for c in chains]).sqrt()

    def _leapfrog(self, q, p, grad, u, inverse_mass, step, steps: torch.Tensor, start_energy: torch.Tensor):
        """Up to ``steps [C]`` leapfrog steps of size ``step [C]`` from ``(q, p)`` with gradient
        ``grad``, potential ``u`` and mass ``M^-1 = diag(inverse_mass [C, D])``; a chain stops after its own steps or when its energy error
        exceeds the threshold (or is NaN). Returns the end ``(q, p, grad, u)``, the largest energy
        error ``[C]`` and the steps taken ``[C]``."""
        threshold = self.settings.divergence_threshold
        half = step[:, None] / 2
        alive = steps > 0
        taken = torch.zeros_like(steps)
        worst = torch.zeros(len(q), dtype=torch.float64, device=q.device)
        for s in range(int(steps.max())):
            live = alive[:, None]
            p_half = torch.where(live, p - half * grad, p)
            q_new = torch.where(live, q + step[:, None] * (inverse_mass * p_half), q)
            u_new, g_new = self.potential(q_new)
            u_new, g_new = u_new.detach(), g_new.detach()
            p_new = torch.where(live, p_half - half * g_new, p)
            q, p = q_new, p_new
            grad, u = torch.where(live, g_new, grad), torch.where(alive, u_new.to(u.dtype), u)
            error = u.double() + _kinetic(p, inverse_mass) - start_energy
            error = torch.where(torch.isnan(error), torch.full_like(error, math.inf), error)
            worst = torch.where(alive, torch.maximum(worst, error), worst)
            taken = taken + alive.long()
            alive = alive & (taken < steps) & (error <= threshold)
            if (s + 1) % SYNC_EVERY == 0 and not bool(alive.any()):  # no per-step host synchronisation
                break
        return q, p, grad, u, worst, taken

    def _find_step_sizes(self, chains: Sequence[ChainState]) -> None:
        """Step sizes of chains that need one: from their last step (``initial_step_size`` at first;
        capped by ``step_cap``), doubled or halved until one leapfrog step's acceptance crosses 0.8
        (Pyro's ``_find_reasonable_step_size``); dual averaging starts again from there."""
        q = torch.stack([c.position for c in chains])
        grad = torch.stack([c.gradient for c in chains])
        mass = torch.stack([c.inverse_mass for c in chains])
        u = torch.tensor([c.potential for c in chains], dtype=torch.float64, device=q.device)
        first = [self.settings.initial_step_size if math.isnan(c.step_size) else c.step_size for c in chains]
        step = torch.tensor([min(f, c.step_cap) for f, c in zip(first, chains)], dtype=q.dtype, device=q.device)
        p = self._momenta(chains)
        energy = u + _kinetic(p, mass)
        ones = torch.ones(len(chains), dtype=torch.long, device=q.device)

        def log_accept(step):
            q1, p1, _, u1, _, _ = self._leapfrog(q, p, grad, u, mass, step, ones, energy)
            for c in chains:
                c.n_leapfrog += 1
            value = energy - (u1.double() + _kinetic(p1, mass))
            return torch.where(torch.isnan(value), torch.full_like(value, -math.inf), value)

        direction = torch.where(log_accept(step) > FIND_THRESHOLD, 1.0, -1.0).to(q.dtype)
        capped = torch.tensor([c.step_cap for c in chains], dtype=q.dtype, device=q.device)
        searching = torch.ones(len(chains), dtype=torch.bool, device=q.device)
        for _ in range(60):  # 2^60: far beyond any scale a float32 network has
            grown = torch.where(direction > 0, step * 2, step / 2).clamp(MIN_STEP, MAX_STEP)
            at_cap = searching & (grown > capped)  # growing past the cap: stop at the cap
            step = torch.where(at_cap, capped, step)
            searching = searching & ~at_cap
            if not bool(searching.any()):
                break
            trial = torch.where(searching, grown, step)
            flipped = torch.where(log_accept(trial) > FIND_THRESHOLD, 1.0, -1.0).to(q.dtype) != direction
            step = trial
            searching = searching & ~flipped
            if not bool(searching.any()):
                break
        for chain, value in zip(chains, step.tolist()):
            chain.step_size = value
            chain.adaptation = _adaptation_state(DualAveraging(prox_center=math.log(10 * value)))

    def iterate(self, chains: Sequence[ChainState]) -> None:
        """One HMC iteration of every chain in ``chains`` (none of them diverged)."""
        s = self.settings
        self._evaluate(chains)
        fresh = [c for c in chains if not c.adaptation]  # a new chain, a restart, a new mass matrix
        if fresh:
            self._find_step_sizes(fresh)
        for chain in chains:
            if chain.phase == WARMUP and chain.iteration >= s.warmup:  # no warm-up at all
                chain.phase, chain.iteration = SAMPLING, 0
            if chain.phase == SAMPLING and chain.iteration == 0 and chain.sampling_seed is not None:
                chain.generator.manual_seed(chain.sampling_seed)  # the first sampling iteration: reseed
                chain.sampling_seed = None
        q = torch.stack([c.position for c in chains])
        grad = torch.stack([c.gradient for c in chains])
        u = torch.tensor([c.potential for c in chains], dtype=torch.float64, device=q.device)
        mass = torch.stack([c.inverse_mass for c in chains])
        step = torch.tensor([c.step_size for c in chains], dtype=q.dtype, device=q.device)
        wanted = [max(1, math.ceil(s.trajectory_length / c.step_size)) for c in chains]
        steps = torch.tensor([min(s.max_leapfrog_steps, w) for w in wanted], dtype=torch.long, device=q.device)
        p = self._momenta(chains)
        energy = u + _kinetic(p, mass)
        q1, p1, g1, u1, worst, taken = self._leapfrog(q, p, grad, u, mass, step, steps, energy)
        end_energy = u1.double() + _kinetic(p1, mass)
        for i, chain in enumerate(chains):
            chain.n_leapfrog += int(taken[i])
            chain.truncated += chain.phase == SAMPLING and wanted[i] > s.max_leapfrog_steps
            diverged = not (float(worst[i]) <= s.divergence_threshold)
            log_ratio = -math.inf if diverged else float(energy[i] - end_energy[i])
            accept_prob = math.exp(min(0.0, log_ratio))
            accept = bool(torch.rand(1, generator=chain.generator).item() < accept_prob)
            if chain.phase == WARMUP:
                chain.warmup_divergences += diverged
            elif diverged:
                self._diverged(chain, float(worst[i]))
                continue
            if accept:
                chain.position, chain.gradient, chain.potential = q1[i].clone(), g1[i].clone(), float(u1[i])
            self._advance(chain, accept, accept_prob, float(end_energy[i] if accept else energy[i]))

    def _advance(self, chain: ChainState, accept: bool, accept_prob: float, energy: float) -> None:
        """Adaptation, bookkeeping and draws after an iteration that did not diverge in sampling."""
        s = self.settings
        chain.iteration += 1
        if chain.phase == WARMUP:
            adapter = _adapter(chain.adaptation)
            adapter.step(s.target_accept - accept_prob)
            x_t, x_avg = adapter.get_state()
            chain.adaptation = _adaptation_state(adapter)
            chain.step_size = _bounded(math.exp(x_t), chain.step_cap)
            self._adapt_mass(chain)
            if chain.iteration >= s.warmup:  # warm-up over: the averaged step from now on
                chain.step_size = _bounded(math.exp(x_avg), chain.step_cap)
                chain.phase, chain.iteration = SAMPLING, 0
            return
        chain.accept_probs.append(accept_prob)
        chain.energies.append(energy)
        chain.accepted += accept
        if chain.iteration % s.thinning == 0:
            chain.draws = torch.cat([chain.draws, chain.position[None]])

    def _adapt_mass(self, chain: ChainState) -> None:
        """Accumulate the position in the current mass window (Welford); at a window's end set
        ``M^-1`` to the regularised variance and start the step adaptation again."""
        done = chain.iteration  # warm-up iterations completed, this one included
        for first, end in self.settings.mass_windows():
            if not first < done <= end:
                continue
            w = chain.welford or {"count": torch.zeros((), dtype=torch.float64),
                                  "mean": torch.zeros_like(chain.position, dtype=torch.float64),
                                  "m2": torch.zeros_like(chain.position, dtype=torch.float64)}
            x = chain.position.double()
            w["count"] = w["count"] + 1
            delta = x - w["mean"]
            w["mean"] = w["mean"] + delta / w["count"]
            w["m2"] = w["m2"] + delta * (x - w["mean"])
            chain.welford = w
            if done == end:
                n = float(w["count"])
                variance = w["m2"] / max(n - 1, 1)
                shrink = 1e-3 * (5 / (n + 5)) * chain.initial_inverse_mass.double()
                chain.inverse_mass = ((n / (n + 5)) * variance + shrink).to(chain.position.dtype)
                chain.welford, chain.adaptation = {}, {}  # the step search and dual averaging start again
            return

    def _diverged(self, chain: ChainState, error: float) -> None:
        """Record a sampling-phase divergence; restart the chain with a smaller step, or stop it."""
        s = self.settings
        record = {"iteration": chain.iteration, "step_size": chain.step_size, "energy_error": error,
                  "restarted": chain.restarts < s.max_restarts}
        chain.divergences.append(record)
        if chain.restarts >= s.max_restarts:
            chain.phase = DIVERGED
            return
        chain.restarts += 1
        chain.step_cap = chain.step_size * s.restart_step_factor
        chain.position, chain.potential, chain.gradient = chain.start.clone(), None, None
        chain.phase, chain.iteration, chain.step_size, chain.adaptation = WARMUP, 0, math.nan, {}
        chain.inverse_mass, chain.welford = chain.initial_inverse_mass.clone(), {}
        chain.draws = chain.draws[:0]
        chain.accept_probs, chain.energies, chain.accepted, chain.truncated = [], [], 0, 0

    # -- runs ------------------------------------------------------------------------------------
    def finished(self, chain: ChainState, draws: int, warmup_only: bool = False) -> bool:
        """Whether ``chain`` needs no more iterations: diverged, or ``draws`` kept (or, with
        ``warmup_only``, its warm-up done)."""
        if chain.phase == DIVERGED:
            return True
        if warmup_only:
            return chain.phase == SAMPLING
        return chain.phase == SAMPLING and len(chain.draws) >= draws

    def run(
        self,
        chains: Sequence[ChainState],
        draws: int,
        *,
        warmup_only: bool = False,
        on_iteration: Callable[[Sequence[ChainState]], None] | None = None,
        progress: bool = False,
        description: str = "hmc",
    ) -> Sequence[ChainState]:
        """Iterate ``chains`` (in place) until each has kept ``draws`` draws (or only finished its
        warm-up with ``warmup_only``) or diverged for good; ``on_iteration(chains)`` after every
        iteration (e.g. to save them). Returns ``chains``."""
        require(draws >= 0, "draws", draws, "an integer >= 0")
        s = self.settings
        per_chain = s.warmup + (0 if warmup_only else draws * s.thinning)
        bar = tqdm(total=len(chains) * per_chain, desc=description, unit="chain-it", dynamic_ncols=True,
                   disable=not progress)
        while True:
            live = [c for c in chains if not self.finished(c, draws, warmup_only)]
            if not live:
                break
            self.iterate(live)
            if on_iteration is not None:
                on_iteration(chains)
            bar.update(len(live))
        bar.close()
        return chains
