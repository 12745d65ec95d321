"""Study: does SGHMC sample the right variance with minibatches, and can it on digits? Last result (issue 31): at digits' noise level (top direction 12-21x the target at batches of 32, lr 0.05) a regression gets 1.00-1.03x the exact variance with the step lowered until the top direction's noise is 0.1 of the target (per-coordinate correction: 0.96-0.98x, cold); on digits (base 100001) that step (0.0057 at friction 20) with 10 chains x 10 states costs 64 s per repetition and the chains are not stationary (split R-hat of the train log-likelihood 1.65, ESS of the mean 11.1 of 100; conf/experiment/digits_optunet.yaml).

Checks of SGHMC (``methods/sghmc.py``) too heavy for the unit tests; prints the numbers.

1. ``toys``: the minibatch noise correction on closed-form targets with the batches the method
   draws (``independent_batches``: with replacement, independent per step) against the per-epoch
   reshuffle of the training loop (``iterate_batches``, what the method read before issue 20):
   sample variance / target variance on a Gaussian posterior at two noise levels (batches of 32 of
   1295 points, lr 0.05, friction 1: digits' minibatch setting) and on a Bayesian linear regression
   (batches of 10 of 200), 400 chains each.
2. ``noise`` (needs the digits zoo in ``--store``): at held-out bases, the minibatch gradient
   noise (batches of 32, lr 0.05, friction 1) as a share of the intended noise, per coordinate
   (mean; what the correction sees) and along the eigenvectors of its covariance (top one; count
   above 1), from the exact per-example gradients; the largest eigenvalue of the Hessian of the
   per-example log posterior and the step it allows (BAOA is stable below 2 / sqrt(h_max)).
3. ``digits`` (needs the zoo): one repetition of the one-mode row on the first held-out base,
   SGHMC as configured (``conf/experiment/digits_optunet.yaml``) against main's SGHMC before
   issue 20 (commit b8d736a, read from git), side by side in one process: wall time of
   ``fit`` + ``sample(100)``, the ESS of the 100 kept states (``metrics.mcmc.
   effective_sample_size``, median over the weights that move, as the report's diagnostics), the
   test accuracy of the kept states, and the new method's diagnostics.

4. ``regression``: sample variance / exact variance on a Bayesian linear regression at digits'
   noise level (N 1,295, batches of 32 from ``independent_batches``, top noise 28x the target at lr
   0.05, friction 1) at the step ``noise_margin`` 0.1 / 0.25 / 0.5 sets and at the unlowered one,
   with and without the per-coordinate correction.
5. ``minibatch``: one repetition of the one-mode row as configured on
   the first held-out base (trained here with the recipe, seed 100000, when the store has no zoo):
   wall time, the step, the chain diagnostics (ESS chains as chains, split R-hat, stationary).

6. ``per_step`` (needs the zoo; not in the default sections): the per-step cost of both timed in
   alternation, scaled to a repetition (less sensitive to a changing load than 3).

Usage: ``python studies/check_sghmc.py [--store store] [--sections toys,regression,noise,digits,minibatch,per_step]``. Timings
on a busy machine are noisy: compare the ratio only, and re-measure on an idle one.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmark.core.data import InMemoryImageDataset  # noqa: E402
from benchmark.core.training import iterate_batches, seeded  # noqa: E402
from methods.sghmc import Chain, independent_batches  # noqa: E402
from metrics.mcmc import effective_sample_size  # noqa: E402

BEFORE = "b8d736a"  # main before issue 20's SGHMC


def reshuffled_indices(n: int, batch_size: int, chains: int, seed: int):
    """The per-epoch reshuffle without replacement the method read before, as index batches ``[chains, B]``
    (every chain the same order, as one chain of the old method saw it)."""
    data = InMemoryImageDataset(torch.arange(n, dtype=torch.float32)[:, None, None, None], torch.zeros(n, dtype=torch.long))
    generator = torch.Generator().manual_seed(seed)
    while True:
        for images, _ in iterate_batches(data, batch_size, generator, torch.device("cpu")):
            yield images.reshape(-1).long().expand(chains, -1)


def run_chains(log_posterior, start, stream, n, burn_in=300, kept=40, thinning=25, lr=0.05):
    chain = Chain(log_posterior, lr=lr, friction=1.0, temperature=1.0 / n)
    with seeded(2):
        state = chain.run(chain.start(start), stream, burn_in, "burn-in")
        return torch.cat([next(iter(s.values())) for s in chain.thinned(state, stream, kept, thinning, "kept")])


def toys(chains: int = 400) -> None:
    print("== toys: sample variance / target variance (1 = exact), per coordinate")
    n, a = 1295, torch.tensor([1.0, 0.5])
    for noise in (0.3, 1.0):
        x = torch.randn(n, 2, generator=torch.Generator().manual_seed(0)) * noise**0.5

        def gaussian(params, indices):
            diff = params["x"][:, None, :] - x[indices]
            return -0.5 * (a * diff**2).sum(-1).mean(1).sum(), torch.empty(0)

        start = {"x": x.mean(0).expand(chains, -1).clone()}
        for name, stream in (("independent_batches", independent_batches(n, 32, chains, torch.Generator().manual_seed(1))),
                             ("per-epoch reshuffle", reshuffled_indices(n, 32, chains, 1))):
            kept = run_chains(gaussian, {k: v.clone() for k, v in start.items()}, stream, n, burn_in=200, kept=30, thinning=20)
            ratio = kept.var(0) / (1.0 / (n * a))
            print(f"gaussian, noise {noise}, batches of 32 of {n}, {name:20s}: {[round(float(r), 3) for r in ratio]}")
    g = torch.Generator().manual_seed(0)
    n, d, prior = 200, 3, 0.05
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    y = x @ torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64) + torch.randn(n, generator=g, dtype=torch.float64)
    cov = torch.linalg.inv(x.T @ x + n * prior * torch.eye(d, dtype=torch.float64))
    mean = cov @ x.T @ y

    def regression(params, indices):
        w = params["w"]
        residual = y[indices] - (x[indices] * w[:, None, :]).sum(-1)
        return (-0.5 * (residual**2).mean(1) - 0.5 * prior * (w**2).sum(-1)).sum(), torch.empty(0)

    for name, stream in (("independent_batches", independent_batches(n, 10, chains, torch.Generator().manual_seed(1))),
                         ("per-epoch reshuffle", reshuffled_indices(n, 10, chains, 1))):
        kept = run_chains(regression, {"w": mean.expand(chains, -1).clone()}, stream, n)
        ratio = kept.var(0) / cov.diagonal()
        print(f"linear regression, batches of 10 of {n}, {name:20s}: {[round(float(r), 3) for r in ratio]}")


def experiment(store: str):
    from benchmark.loader import compose_config
    from benchmark.experiment import Experiment

    return Experiment(compose_config([f"store={store}", "device=cpu"]))


def heldout_bases(exp, count: int) -> list[int]:
    from benchmark.stages.sample import select_bases

    return list(select_bases(exp, count))[:count]


def noise(exp, bases: list[int], batch_size: int = 32, lr: float = 0.05, friction: float = 1.0) -> None:
    from torch.func import functional_call, grad, hessian, vmap

    from benchmark.stages.sample import load_base

    print(f"== noise: minibatch noise of batches of {batch_size} at lr {lr}, friction {friction}, as a share of the "
          "intended noise; curvature")
    images, labels = exp.train_tensors
    n, wd = len(labels), exp.recipe.weight_decay
    model = exp.model().double().eval()
    keys = [k for k, _ in model.named_parameters()]
    for seed in bases:
        base = load_base(exp, seed)
        shapes, sizes = [base[k].shape for k in keys], [base[k].numel() for k in keys]
        flat = torch.cat([base[k].reshape(-1) for k in keys]).double()

        def unflat(f):
            return {k: t.view(s) for k, t, s in zip(keys, f.split(sizes), shapes)}

        def nll(f, x, y):
            return F.cross_entropy(functional_call(model, unflat(f), (x[None],)), y[None])

        per_example = vmap(grad(nll), in_dims=(None, 0, 0))(flat, images.double(), labels)  # [n, d]
        covariance = torch.cov(per_example.T, correction=0) / batch_size  # of a batch mean, with replacement
        c2 = math.exp(-2 * friction * lr)
        share = lambda v: c2 * lr**2 * v / ((1 - c2) / n)  # noqa: E731  (Chain.noise_share at T = 1/N)
        eigen = torch.linalg.eigvalsh(covariance)
        curvature = wd * torch.eye(len(flat), dtype=torch.float64)
        for part in torch.arange(n).split(50):  # the Hessian in chunks (memory)
            curvature += hessian(lambda f: F.cross_entropy(functional_call(model, unflat(f), (images[part].double(),)),
                                                           labels[part], reduction="sum") / n)(flat)
        h = torch.linalg.eigvalsh(curvature)
        print(f"base {seed}: per-coordinate share mean {float(share(covariance.diagonal()).mean()):.3f}; top direction "
              f"{float(share(eigen[-1])):.1f}; directions above 1: {int((share(eigen) > 1).sum())} of {len(flat)}; "
              f"Hessian eigenvalues {float(h[0]):.3g} .. {float(h[-1]):.3g} ({int((h < 0).sum())} negative); "
              f"stable lr < {2 / math.sqrt(float(h[-1])):.3f}")


def method_before() -> type:
    """``SGHMCMethod`` of commit ``BEFORE`` (read from git into a temporary module)."""
    source = subprocess.run(["git", "-C", str(REPO), "show", f"{BEFORE}:methods/sghmc.py"], check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "sghmc_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("sghmc_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["sghmc_before"] = module
    spec.loader.exec_module(module)
    return module.SGHMCMethod


def digits(exp, seed: int, n: int = 100) -> None:
    from benchmark.core.models import predict_with_weights
    from benchmark.stages.sample import load_base

    print(f"== digits: one repetition of SGHMC one-mode on base {seed}, {n} kept states")
    base = load_base(exp, seed)
    images, labels = exp.test_tensors
    settings = exp.method_settings("sghmc")
    before_cls = method_before()
    fields = {f.name for f in dataclasses.fields(before_cls.Settings)}
    before_settings = before_cls.Settings(**{k: v for k, v in dataclasses.asdict(before_cls.Settings()).items()
                                             if k in fields})  # main's defaults (its digits config set none)
    from methods.sghmc import SGHMCMethod

    candidates = [(f"before ({BEFORE})", before_cls, before_settings), ("new (as configured)", SGHMCMethod, settings)]
    times = {}
    for label, cls, s in candidates:
        method = cls(exp.model, exp.training_data, s, recipe=exp.recipe, device=exp.device)
        start = time.perf_counter()
        method.fit(base, seed)
        samples = method.sample(n, torch.Generator().manual_seed(seed))
        times[label] = time.perf_counter() - start
        draws = np.concatenate([v.reshape(n, -1).double().numpy() for v in samples.values() if v.is_floating_point()], 1)
        moving = draws.std(0) > 0
        ess = float(np.median(effective_sample_size(draws[:, moving])))
        acc = (predict_with_weights(exp.model(), samples, images).argmax(-1) == labels).double().mean(1)
        print(f"{label}: {times[label]:.1f} s; ESS {ess:.1f} of {n}; test accuracy of the kept states "
              f"min/median/max {float(acc.min()):.3f}/{float(acc.median()):.3f}/{float(acc.max()):.3f}")
        print(f"  settings {s}")
        print(f"  diagnostics { {k: round(v, 4) for k, v in method.diagnostics(images, labels).items()} }")
    (a, ta), (b, tb) = times.items()
    print(f"wall time ratio new / before: {tb / ta:.2f} (busy machine: re-measure on an idle one)")


def per_step(exp, seed: int, rounds: int = 5) -> None:
    """Per-step cost of the two, timed in alternation (``rounds`` bursts each, medians): a busy
    machine's load then weighs on both alike. The full repetition is 410 + 100 x 82 = 8610 steps
    before and ``burn_in + thinning`` steps (of every chain at once) now."""
    from benchmark.stages.sample import load_base
    from methods.sghmc import SGHMCMethod

    print(f"== per-step cost, before and new alternating ({rounds} bursts each, base {seed})")
    base = load_base(exp, seed)
    before_cls = method_before()
    fields = {f.name for f in dataclasses.fields(before_cls.Settings)}
    before = before_cls(exp.model, exp.training_data, before_cls.Settings(
        **{k: v for k, v in dataclasses.asdict(before_cls.Settings()).items() if k in fields} | {"burn_in_epochs": 2.0}),
        recipe=exp.recipe, device=exp.device)
    settings = exp.method_settings("sghmc")
    new = SGHMCMethod(exp.model, exp.training_data, dataclasses.replace(settings, burn_in_epochs=10.0),
                      recipe=exp.recipe, device=exp.device)
    new.fit(base, seed)  # compiles the kernels
    times: dict[str, list[float]] = {"before": [], "new": []}
    for _ in range(rounds):
        for label, method in (("before", before), ("new", new)):
            start = time.perf_counter()
            method.fit(base, seed)
            times[label].append((time.perf_counter() - start) / method.plan().burn_in)
    b, nw = float(np.median(times["before"])), float(np.median(times["new"]))
    plan = SGHMCMethod(exp.model, exp.training_data, settings, recipe=exp.recipe, device=exp.device).plan()
    full_before, full_new = 8610 * b, (plan.burn_in + plan.thinning) * nw
    print(f"before: {b * 1e3:.1f} ms per step (one chain, batch 32) -> {full_before:.0f} s per repetition; new: "
          f"{nw * 1e3:.0f} ms per step ({plan.chains} chains, full batch) -> {full_new:.0f} s; ratio {full_new / full_before:.2f}")


class NoisyRegression:
    """The regression of tests/methods/test_sghmc.py (``_NoisyRegression``): ``chains`` Bayesian
    linear regressions ``w [C, 3]`` on N = 1,295 points, correlated features x 10, residual sd 0.3,
    prior 0.5, analytic gradients; minibatch noise at batches of 32 ~28x the target along its top
    direction at lr 0.05, friction 1 (digits' OptuNets: 12-21x)."""

    def __init__(self, n: int = 1295) -> None:
        g = torch.Generator().manual_seed(0)
        mixing = torch.tensor([[1.0, 0, 0], [0.8, 0.6, 0], [0.3, 0.2, 0.5]], dtype=torch.float64)
        self.x = 10 * torch.randn(n, 3, generator=g, dtype=torch.float64) @ mixing.T
        self.y = self.x @ torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64) + 0.3 * torch.randn(
            n, generator=g, dtype=torch.float64)
        self.prior, self.n = 0.5, n
        self.cov = torch.linalg.inv(self.x.T @ self.x + n * self.prior * torch.eye(3, dtype=torch.float64))
        self.mean = self.cov @ self.x.T @ self.y

    def value_and_grad(self, params, indices):
        w, x = params["w"], self.x[indices]
        residual = self.y[indices] - (x * w[:, None, :]).sum(-1)
        value = float((-0.5 * (residual**2).mean(1) - 0.5 * self.prior * (w**2).sum(-1)).sum())
        return value, {"w": (x * residual[..., None]).mean(1) - self.prior * w}

    def unpack(self, params, chain):
        return {k: v[chain] for k, v in params.items()}

    def count(self, params):
        return next(iter(params.values())).shape[0]


def regression(chains: int = 400, friction: float = 9.0) -> None:
    """Sample variance / exact variance on ``NoisyRegression`` under ``independent_batches`` (32
    per batch) at the step ``step_for_noise`` sets for each margin, with and without the
    per-coordinate correction (2 time units of burn-in from the mean, 3 states 0.5 apart)."""
    from methods.sghmc import noise_share_at, step_for_noise, top_noise_variance

    target = NoisyRegression()
    temperature = 1.0 / target.n
    start = {"w": target.mean.expand(chains, -1).clone()}
    top = top_noise_variance(target, start, independent_batches(target.n, 32, chains, torch.Generator().manual_seed(9)), 10)
    print(f"== regression: N {target.n}, batches of 32 (independent_batches), friction {friction}; top noise share "
          f"at lr 0.05, friction 1: {noise_share_at(0.05, 1.0, temperature, top):.1f}")
    for margin in (0.1, 0.25, 0.5, None):
        lr = 0.05 if margin is None else step_for_noise(0.05, friction, temperature, top, margin)
        for correction in (False, True):
            chain = Chain(target, lr=lr, friction=friction, temperature=temperature, noise_correction=correction)
            stream = independent_batches(target.n, 32, chains, torch.Generator().manual_seed(1))
            unit = math.ceil(1 / lr)
            with seeded(2):
                state = chain.run(chain.start({k: v.clone() for k, v in start.items()}), stream, 2 * unit, "burn-in")
                kept = torch.cat([p["w"] for p in chain.thinned(state, stream, 3, unit // 2, "kept")])
            ratio = (kept.var(0) / target.cov.diagonal()).tolist()
            print(f"margin {margin}, lr {lr:.4g}, correction {'on ' if correction else 'off'}: variance ratio "
                  f"{[round(r, 3) for r in ratio]}, clamped {state.clamped_sum / state.steps:.3f}")


def train_base(exp, first: int = 100000) -> tuple[int, dict]:
    """The first held-out seed from ``first`` that converges under the recipe and its rule, trained
    here as the zoo stage trains it (``benchmark.stages.zoo.train_seed``), when the store has no zoo."""
    from benchmark.stages.zoo import train_seed

    for seed in range(first, first + 20):
        result = train_seed(exp, seed, role="heldout")
        if result.failure is None:
            print(f"base {seed}: trained here, train accuracy {result.train_accuracy:.3f}")
            return seed, {k: v.detach().clone() for k, v in result.state_dict.items()}
    raise RuntimeError(f"no converged seed in [{first}, {first + 20})")


def minibatch(exp, seed: int, base: dict, overrides: list[dict], n: int = 100) -> None:
    """SGHMC as configured (``conf/experiment/digits_optunet.yaml``) and with ``overrides``, on
    base ``seed``: wall time of fit + sample(n), the step the noise margin set, the chain
    diagnostics, the kept states' test accuracy."""
    from benchmark.core.models import predict_with_weights
    from methods.sghmc import SGHMCMethod

    images, labels = exp.test_tensors
    configured = exp.method_settings("sghmc")
    print(f"== minibatch: SGHMC one-mode on base {seed}, {n} kept states")
    for override in [{}, *overrides]:
        settings = dataclasses.replace(configured, **override)
        method = SGHMCMethod(exp.model, exp.training_data, settings, recipe=exp.recipe, device=exp.device)
        start = time.perf_counter()
        method.fit(base, seed)
        samples = method.sample(n, torch.Generator().manual_seed(seed))
        wall = time.perf_counter() - start
        d = method.diagnostics(images, labels)
        acc = (predict_with_weights(exp.model(), samples, images).argmax(-1) == labels).double().mean(1)
        plan = method.plan()
        print(f"{override or 'as configured'}: {wall:.0f} s, {plan.burn_in + plan.thinning * math.ceil(n / plan.chains)} "
              f"steps of {plan.chains} chains; test accuracy {float(acc.min()):.3f}/{float(acc.median()):.3f}/"
              f"{float(acc.max()):.3f}; top noise share at lr 0.05, friction 1: "
              f"{noise_share_at_base(method, plan):.1f}")
        print(f"  diagnostics { {k: round(v, 4) for k, v in d.items()} }")


def noise_share_at_base(method, plan) -> float:
    from methods.sghmc import noise_share_at

    return noise_share_at(0.05, 1.0, plan.temperature / len(method._train_data()), method._noise_top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", default="store", help="store holding the digits_optunet zoo (default: store)")
    parser.add_argument("--sections", default="toys,regression,noise,digits,minibatch")
    args = parser.parse_args()
    torch.set_num_threads(1)
    sections = args.sections.split(",")
    if "toys" in sections:
        toys()
    if "regression" in sections:
        regression()
    if "minibatch" in sections:  # trains its base when the store has none
        exp = experiment(args.store)
        try:
            seed = heldout_bases(exp, 1)[0]
            from benchmark.stages.sample import load_base
            base = load_base(exp, seed)
        except Exception:
            print(f"minibatch: no zoo in --store {args.store}: training a held-out base with the recipe here")
            seed, base = train_base(exp)
        minibatch(exp, seed, base, [])
    if {"noise", "digits", "per_step"} & set(sections):
        exp = experiment(args.store)
        try:
            bases = heldout_bases(exp, 3)
        except Exception as err:  # no zoo in the store: say so and stop
            print(f"noise/digits/per_step skipped: no held-out bases of digits_optunet in --store {args.store} ({err}); "
                  "run `python -m benchmark stage=zoo` first")
            return
        if "noise" in sections:
            noise(exp, bases)
        if "digits" in sections:
            digits(exp, bases[0])
        if "per_step" in sections:
            per_step(exp, bases[0])


if __name__ == "__main__":
    main()
