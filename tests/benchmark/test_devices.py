"""device=cuda: mixed precision and channels_last for the ResNet-18 zoo, GPU MMD and symmetry
removal. The CPU tests run the same code paths (bf16 autocast and NHWC work on a CPU); the
CUDA tests compare the GPU with the CPU and are skipped on a machine without a GPU."""
from __future__ import annotations

import pytest
import torch

from benchmark.config import ConfigError
from benchmark.core.data import InMemoryImageDataset
from benchmark.experiment import Experiment
from benchmark.core.models import optunet, resnet18
from benchmark.core.training import FULL_PRECISION, Acceleration, Recipe, seeded, train_network
from tests.conftest import compose_config
from tests.devices import ImplicitDeviceError, available_devices, explicit_devices

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_torch_thread")]  # trains zoos on each device path: make test, not make test-fast


def tiny_images(n=8, generator_seed=0):
    g = torch.Generator().manual_seed(generator_seed)
    return torch.randn(n, 3, 8, 8, generator=g), torch.arange(n) % 10


def train_tiny_resnet(acceleration: Acceleration, device="cpu"):
    images, labels = tiny_images()
    with seeded(0):
        model = resnet18(num_classes=10).to(device)
    recipe = Recipe(epochs=1, batch_size=4, lr=0.05, momentum=0.9)
    return train_network(model, InMemoryImageDataset(images, labels), (images, labels), recipe, 0,
                         acceleration=acceleration)


def test_precision_and_memory_format_follow_the_device_and_the_model(tmp_path, monkeypatch):
    cpu = Experiment(compose_config(["model=resnet18", "device=cpu"]))  # device=auto picks a GPU where there is one
    assert cpu.acceleration == FULL_PRECISION  # auto: nothing on a CPU
    assert Experiment(compose_config(["precision=bf16", "channels_last=true", "device=cpu"])).acceleration == \
        Acceleration(torch.bfloat16, True)
    with pytest.raises(ConfigError, match="precision=fp16: float16 training with loss scaling needs CUDA"):
        _ = Experiment(compose_config(["precision=fp16", "device=cpu"])).acceleration
    # What auto picks on a GPU (resolved without running anything on it).
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    for model, want in (("resnet18", Acceleration(torch.bfloat16, True)), ("optunet", FULL_PRECISION)):
        exp = Experiment(compose_config([f"model={model}"]))
        exp.__dict__["device"] = torch.device("cuda")
        assert exp.acceleration == want, model
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    old_gpu = Experiment(compose_config(["model=resnet18", "channels_last=false"]))
    old_gpu.__dict__["device"] = torch.device("cuda")
    assert old_gpu.acceleration == Acceleration(torch.float16, False)


def _crop_at_before_the_fix(images, padding, fill, offsets):
    """``crop_at`` as it was when the MNIST zoo crashed on CUDA (index ranges made on the CPU)."""
    b, _, h, w = images.shape
    padded = torch.nn.functional.pad(images, (padding, padding, padding, padding), value=fill)
    rows = (offsets[0, :, None] + torch.arange(h))[:, None, :, None]
    cols = (offsets[1, :, None] + torch.arange(w))[:, None, None, :]
    return padded[torch.arange(b)[:, None, None, None], torch.arange(images.shape[1])[None, :, None, None], rows, cols]


def test_the_device_guard_catches_the_crop_that_crashed_on_cuda():
    from benchmark.core.data import crop_at, crop_offsets

    images, offsets = torch.randn(5, 3, 6, 6), crop_offsets(5, 2, torch.Generator().manual_seed(0))
    with pytest.raises(ImplicitDeviceError, match=r"test_devices.py:\d+: torch.arange\(...\) without device="):
        with explicit_devices(also=(__file__,)):
            _crop_at_before_the_fix(images, 2, -0.5, offsets)
    with explicit_devices():
        fixed = crop_at(images, 2, -0.5, offsets)
    assert torch.equal(fixed, _crop_at_before_the_fix(images, 2, -0.5, offsets))
    with explicit_devices():  # a factory inside torch (a module building its weight on the CPU) is not the project's
        torch.nn.Linear(3, 2)


def test_an_epochs_crop_offsets_in_one_draw_equal_the_per_batch_draws():
    from benchmark.core.data import crop_offsets, epoch_crop_offsets

    for n, batch in ((50, 7), (1295, 64), (128, 128)):
        one, per_batch = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
        whole = epoch_crop_offsets(n, batch, 2, one)
        for start in range(0, n, batch):
            assert torch.equal(whole[:, start : start + batch], crop_offsets(min(batch, n - start), 2, per_batch))
        assert torch.equal(torch.randint(0, 99, (4,), generator=one), torch.randint(0, 99, (4,), generator=per_batch))


@pytest.mark.parametrize("device", available_devices())
def test_crops_on_each_device_equal_the_cpu(device):
    from benchmark.core.data import crop_at, crop_offsets

    images, offsets = torch.randn(6, 3, 8, 8), crop_offsets(6, 4, torch.Generator().manual_seed(1))
    on_device = crop_at(images.to(device), 4, 0.25, offsets)  # offsets drawn on the CPU, images on the device
    assert on_device.device.type == device
    assert torch.equal(on_device.cpu(), crop_at(images, 4, 0.25, offsets))


def gradients(acceleration: Acceleration) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and gradients of one training step of a fresh ResNet-18, as ``train_epoch`` computes them."""
    images, labels = tiny_images()
    with seeded(0):
        model = acceleration.prepare(resnet18(num_classes=10))
    with acceleration.autocasting(torch.device("cpu")):
        loss = torch.nn.functional.cross_entropy(model(acceleration.inputs(images)), labels)
    loss.backward()
    return float(loss.detach()), {k: p.grad for k, p in model.named_parameters()}


def test_channels_last_and_bf16_autocast_on_cpu():
    loss, grads = gradients(FULL_PRECISION)
    nhwc_loss, nhwc = gradients(Acceleration(None, True))
    mixed_loss, mixed = gradients(Acceleration(torch.bfloat16, True))
    assert nhwc_loss == pytest.approx(loss, rel=1e-5) and mixed_loss == pytest.approx(loss, rel=0.05)
    assert mixed_loss != loss, "bf16 autocast changed nothing: the forward pass did not run in bfloat16"
    for key, grad in grads.items():
        # The same math in NHWC (other kernels: rounding-level differences, relative to the tensor's scale).
        assert float((nhwc[key] - grad).abs().max()) <= 1e-4 * float(grad.abs().max()) + 1e-7, key
        assert mixed[key].dtype == torch.float32 and torch.isfinite(mixed[key]).all()  # master weights stay float32
    trained = train_tiny_resnet(Acceleration(torch.bfloat16, True))
    assert all(v.is_contiguous() and torch.isfinite(v.float()).all() for v in trained.state_dict.values())


def test_the_zoo_records_how_a_seed_was_trained(tmp_path):
    from benchmark.stages.zoo import one_at_a_time

    assert one_at_a_time(Experiment(compose_config(["model=resnet18", "device=cpu"]))) == "one at a time"
    assert one_at_a_time(Experiment(compose_config(["precision=bf16", "channels_last=true", "device=cpu"]))) == \
        "one at a time (autocast bfloat16, channels_last)"


@cuda
def test_resnet_training_with_automatic_precision_on_cuda():
    result = train_tiny_resnet(Acceleration(torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16, True), "cuda")
    assert all(torch.isfinite(v.float()).all() for v in result.state_dict.values())


@cuda
def test_stacked_training_on_cuda_equals_the_cpu_kernels(tmp_path):
    from benchmark.core.training.vectorised import train_networks

    exp = Experiment(compose_config(["train.epochs=1", "train.fail_rule.epoch=null"]))
    data, seeds = exp.training_data, [0, 1, 2]

    def run(device):
        models = []
        for s in seeds:
            with seeded(s):
                models.append(exp.model().to(device))
        return train_networks(models, data, exp.recipe, seeds, [str(s) for s in seeds])

    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    with exp.backends():
        cpu = run("cpu")
    for a, b in zip(run("cuda"), cpu):
        for key in b.state_dict:
            torch.testing.assert_close(a.state_dict[key], b.state_dict[key], rtol=1e-3, atol=1e-4)


@cuda
def test_hmc_potential_and_gradient_on_cuda_equal_the_cpu():
    """U(q) and its gradient of 16 stacked OptuNets on 256 digits images (float32): the GPU's
    vmap forward against the CPU's packed kernels, within 1e-4 relative (sums in another order)."""
    from methods.hmc import NetworkPotential

    exp = Experiment(compose_config(["device=cpu"]))
    images, labels = (t[:256] for t in exp.train_tensors)
    states = []
    for seed in range(16):
        with seeded(seed):
            states.append(exp.model().state_dict())
    cpu = NetworkPotential(exp.model(), images, labels, 3.0)
    gpu = NetworkPotential(exp.model(), images, labels, 3.0, device="cuda")
    q = torch.stack([cpu.flatten(state) for state in states])
    (value, grad), (gpu_value, gpu_grad) = cpu(q), gpu(q.cuda())
    torch.testing.assert_close(gpu_value.cpu(), value, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(gpu_grad.cpu(), grad, rtol=1e-4, atol=1e-3)


@cuda
def test_mmd_and_symmetry_removal_on_cuda_equal_the_cpu():
    from metrics.mmd import mmd
    from metrics.symmetries import canonicalize, min_mass, spec_for_model
    from tests.metrics.symmetries.nets import random_sample_set

    zoo, samples = random_sample_set(lambda: resnet18(num_classes=10), 6, 0), random_sample_set(lambda: resnet18(num_classes=10), 4, 1)
    spec = spec_for_model(resnet18(num_classes=10))
    on_cpu, _ = canonicalize(zoo, spec)
    on_gpu, _ = canonicalize(zoo, spec, device="cuda")
    for key in zoo:
        assert on_gpu[key].device.type == "cpu"
        torch.testing.assert_close(on_gpu[key], on_cpu[key], rtol=1e-9, atol=1e-12)
    cpu_mmd, gpu_mmd = mmd(zoo, samples).aggregate, mmd(zoo, samples, device="cuda").aggregate
    assert gpu_mmd == pytest.approx(cpu_mmd, rel=1e-6)
    small = random_sample_set(optunet, 8, 2)
    spec_small = spec_for_model(optunet())
    cpu_mass = min_mass(small, spec_small)[1]["mass_after"]
    gpu_mass = min_mass({k: v.cuda() for k, v in small.items()}, spec_small)[1]["mass_after"]
    torch.testing.assert_close(gpu_mass.cpu(), cpu_mass, rtol=1e-8, atol=0)


def test_tf32_is_an_explicit_option_off_by_default_on_cuda(monkeypatch):
    """On CUDA, ``backends()`` sets TensorFloat-32 for matmuls and cuDNN convolutions as ``tf32`` says
    (PyTorch's own default turns it on for convolutions) and restores both after."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        for value, want in (("false", False), ("true", True)):
            exp = Experiment(compose_config(["device=cpu", f"tf32={value}"]))
            exp.__dict__["device"] = torch.device("cuda")  # resolved without running anything on a GPU
            with exp.backends():
                assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (want, want)
            assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (True, True)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_on_a_gpu_the_stack_is_as_large_as_its_free_memory_holds(monkeypatch):
    """zoo.vectorize=auto: on a CPU at most AUTO_NETWORKS (a larger stack is no faster there), on a
    GPU every network that half the free memory holds (sized as ``networks_that_fit`` does)."""
    import benchmark.experiment as experiment
    from benchmark.core.training.vectorised import AUTO_NETWORKS

    monkeypatch.setattr(experiment, "networks_that_fit", lambda *a, **k: (5000, 1, 10_000))
    monkeypatch.setattr(experiment, "stacked_networks", lambda model, device, *a: object())
    cpu = Experiment(compose_config(["device=cpu"]))
    assert cpu.zoo_trainer.networks == AUTO_NETWORKS
    gpu = Experiment(compose_config(["device=cpu"]))
    gpu.__dict__["device"] = torch.device("meta")  # any non-CPU device: the model moves there without memory
    assert gpu.zoo_trainer.stacked and gpu.zoo_trainer.networks == 5000
