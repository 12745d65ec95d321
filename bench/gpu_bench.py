"""GPU speed bench (run by ``make gpu-check`` on a CUDA host; ``--device cpu --smoke`` runs its code
paths in seconds anywhere, as a test does): the GPU figures next to their goals.

1. The float32 matmul peak of the device (8192^3 ``torch.mm``, TF32 off, best of 5, CUDA events).
2. The vectorised zoo (``train_networks``, the zoo stage's trainer) on digits (45 epochs) and on
   MNIST-shaped files (``bench/mnist_shaped.py``, the mnist_optunet recipe with random crops, 3
   epochs): work per second (OptuNet's forward + backward FLOPs per training image, as
   ``bench_zoo.py`` counts them) as a share of that peak. Goal >= 10%. K = ``--seeds`` networks in
   one stack (the zoo stage's K comes from the GPU's free memory: ``networks_that_fit``, printed).
   From the MNIST rate: the paper's 1,000-checkpoint MNIST zoo (60 epochs), goal <= 3 min.
3. HMC: one leapfrog step (the potential and its gradient) of 16 stacked OptuNets on the full digits
   training split, milliseconds on the device next to the CPU's packed kernels. Goal <= 2 ms.
4. ResNet-18 on CIFAR-sized batches (128 x 3 x 32 x 32, the experiment's acceleration: bf16
   autocast and channels_last on CUDA): milliseconds per training step, compute only, and the cost
   of a 75-epoch checkpoint at that rate (reported, no goal: a measured cost to plan a run by).

Every figure goes to ``$BENCH_SUMMARY`` through ``bench/summary.py``'s ``record``.
Usage: ``python bench/gpu_bench.py [--device cuda] [--seeds 1024] [--mnist-seeds 512] [--smoke]``.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from mnist_shaped import write_mnist_shaped  # noqa: E402  (bench/, next to this file)
from summary import record  # noqa: E402

MNIST_ZOO = 1000


class Timer:
    """Wall seconds of a block, the device's queued work included (CUDA: synchronised)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __enter__(self) -> "Timer":
        self.sync()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.sync()
        self.seconds = time.perf_counter() - self.start


def matmul_peak(device: torch.device, size: int, repeats: int = 5) -> float:
    """float32 FLOP/s of ``size``^3 matrix products on ``device`` (TF32 off; the best of ``repeats``)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        with Timer(device) as t:
            a @ b
        best = min(best, t.seconds)
    return 2 * size**3 / best


def flops_per_image(model_factory) -> float:
    """Forward + backward FLOPs per training image of the model (a batch of 32 28x28 images)."""
    from torch.utils.flop_counter import FlopCounterMode

    model, x, y = model_factory(), torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,))
    with FlopCounterMode(display=False) as count:
        F.cross_entropy(model(x), y).backward()
    return count.get_total_flops() / 32


def zoo_rate(exp, device: torch.device, seeds: int, epochs: int) -> tuple[float, float, int]:
    """``(seconds, training FLOPs, K that fits the device)``: ``seeds`` networks of ``exp`` trained
    stacked on ``device`` for ``epochs`` epochs (the convergence rule off: every network trains the
    same work)."""
    from benchmark.core.training import FailRule, seeded
    from benchmark.core.training.vectorised import networks_that_fit, train_networks

    recipe = exp.recipe.replaced(epochs=epochs, fail_rule=FailRule())
    models = []
    for seed in range(seeds):
        with seeded(seed):
            models.append(exp.model().to(device))
    data = exp.training_data
    shape = (exp.info.in_channels, exp.info.image_size, exp.info.image_size)
    fit = networks_that_fit(exp.model().to(device), shape, recipe.batch_size, device)[0]
    with Timer(device) as t:
        train_networks(models, data, recipe, list(range(seeds)), [f"seed {s}" for s in range(seeds)])
    return t.seconds, seeds * epochs * len(data.train) * flops_per_image(exp.model), fit


def hmc_step_ms(exp, device: torch.device, chains: int, repeats: int) -> float:
    """Milliseconds of one potential-and-gradient evaluation (one leapfrog step) of ``chains`` stacked
    networks of ``exp`` on its whole training split, on ``device`` (the best of ``repeats``)."""
    from benchmark.core.training import seeded
    from methods.hmc import NetworkPotential

    images, labels = exp.train_tensors
    potential = NetworkPotential(exp.model(), images, labels, 1.0, device=device)
    states = []
    for seed in range(chains):
        with seeded(seed):
            states.append(exp.model().state_dict())
    q = torch.stack([potential.flatten(s) for s in states]).to(device)
    potential(q)
    best = float("inf")
    for _ in range(repeats):
        with Timer(device) as t:
            potential(q)
        best = min(best, t.seconds)
    return best * 1e3


def resnet_step_ms(device: torch.device, batch: int, steps: int, width: int) -> tuple[float, str]:
    """Milliseconds per SGD step of a ResNet-18 (CIFAR stem, 100 classes, ``width``) on ``batch``
    CIFAR-sized images, with the acceleration the experiment picks on ``device``; and its name."""
    from benchmark.loader import compose_config
    from benchmark.experiment import Experiment

    exp = Experiment(compose_config(["experiment=cifar100_resnet18", f"device={device}", "store=unused",
                                     f"+model.kwargs.width={width}"]))
    acceleration = exp.acceleration
    model = acceleration.prepare(exp.model().to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x = acceleration.inputs(torch.randn(batch, 3, 32, 32, device=device))
    y = torch.randint(0, 100, (batch,), device=device)

    def step() -> None:
        with acceleration.autocasting(device):
            loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    for _ in range(3):
        step()
    with Timer(device) as t:
        for _ in range(steps):
            step()
    return t.seconds / steps * 1e3, f"{acceleration.autocast or 'fp32'}, channels_last={acceleration.channels_last}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seeds", type=int, default=1024, help="digits networks in one stack")
    parser.add_argument("--mnist-seeds", type=int, default=512, help="MNIST-shaped networks in one stack")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: the code paths only, no meaningful figure")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_bench: --device cuda, but torch sees no CUDA device (torch.cuda.is_available() is False)")
    from benchmark.loader import compose_config
    from benchmark.experiment import Experiment

    smoke = args.smoke
    seeds, mnist_seeds = (4, 4) if smoke else (args.seeds, args.mnist_seeds)
    peak = matmul_peak(device, 256 if smoke else 8192)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"device {device} ({name}): float32 matmul peak {peak / 1e12:.2f} TFLOP/s")

    digits = Experiment(compose_config(["store=unused", f"device={device}"]))
    with digits.backends():
        seconds, flops, fit = zoo_rate(digits, device, seeds, 1 if smoke else 45)
    print(f"digits zoo: {seeds} networks x {1 if smoke else 45} epochs in {seconds:.1f} s ({seeds / seconds * 3600:,.0f} "
          f"seeds/h); K that fits the free memory: {fit}")
    record("gpu", f"zoo, digits, {seeds} OptuNets stacked on {device}: share of the float32 peak (%)",
           100 * flops / seconds / peak, goal=10.0, unit="%")

    with tempfile.TemporaryDirectory() as tmp:
        root = write_mnist_shaped(Path(tmp), train=640 if smoke else 60_000, test=64 if smoke else 10_000)
        mnist = Experiment(compose_config(["experiment=mnist_optunet", f"dataset.data_dir={root}", "store=unused",
                                           f"device={device}"]))
        epochs = 1 if smoke else 3
        with mnist.backends():
            seconds, flops, fit = zoo_rate(mnist, device, mnist_seeds, epochs)
    share = flops / seconds / peak
    print(f"MNIST-shaped zoo: {mnist_seeds} networks x {epochs} epochs in {seconds:.1f} s; K that fits: {fit}")
    record("gpu", f"zoo, MNIST-shaped, {mnist_seeds} OptuNets stacked on {device}: share of the float32 peak (%)",
           100 * share, goal=10.0, unit="%")
    per_seed = seconds / (mnist_seeds * epochs) * mnist.recipe.epochs  # seconds of one 60-epoch checkpoint, stacked
    record("gpu", f"the paper's {MNIST_ZOO}-checkpoint MNIST zoo on one {name}, from that rate (min)",
           MNIST_ZOO * per_seed / 60, goal=3.0, unit="min", higher_is_better=False)

    chains = 16
    with digits.backends():
        on_device = hmc_step_ms(digits, device, chains, 3 if smoke else 20)
    cpu_exp = Experiment(compose_config(["store=unused", "device=cpu"]))
    with cpu_exp.backends():
        on_cpu = hmc_step_ms(cpu_exp, torch.device("cpu"), chains, 1 if smoke else 3)
    print(f"HMC: one leapfrog step of {chains} stacked OptuNets on the {len(digits.train_tensors[1])} digits training "
          f"images: {on_device:.2f} ms on {device}, {on_cpu:.1f} ms on the CPU ({torch.get_num_threads()} threads)")
    record("gpu", f"HMC leapfrog step, {chains} stacked OptuNets, full digits split, on {device} (ms)", on_device,
           goal=2.0, unit="ms", higher_is_better=False)
    record("gpu", f"HMC leapfrog step: CPU (packed kernels) / {device}", on_cpu / on_device)

    step_ms, how = resnet_step_ms(device, 8 if smoke else 128, 2 if smoke else 50, 8 if smoke else 64)
    checkpoint_min = step_ms / 1e3 * (50_000 * 0.9 / 128) * 75 / 60  # 75 epochs of the 45,000 training images
    print(f"ResNet-18, CIFAR-sized batch of {8 if smoke else 128} ({how}): {step_ms:.2f} ms per step, "
          f"{checkpoint_min:.1f} min of compute per 75-epoch checkpoint")
    record("gpu", f"ResNet-18 training step, batch {8 if smoke else 128}, on {device} ({how}) (ms)", step_ms, unit="ms",
           higher_is_better=False)
    record("gpu", f"ResNet-18, compute of one 75-epoch CIFAR-100 checkpoint on {device} (min)", checkpoint_min,
           unit="min", higher_is_better=False)


if __name__ == "__main__":
    main()
