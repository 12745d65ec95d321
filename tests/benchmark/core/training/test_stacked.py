"""Stacked networks (benchmark.core.training.stacked): K networks at once give each network's own
forward pass and gradients, checked against the plain PyTorch modules one network at a time."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from numba.core.codegen import get_host_cpu_features
from torch import nn

from benchmark.core.data.in_memory import pad_with
from benchmark.core.models import mlp, optunet
from benchmark.core.training.kernels import gather_batch
from benchmark.core.training.stacked import NotStackableError, PackedChain, VmapNetworks, stacked_networks
from tests.conftest import REPO

CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("single_torch_thread")


def every_piece() -> nn.Sequential:
    """Conv with bias and 2 input channels per group, pool then ReLU, conv + ReLU without pool,
    conv + pool without ReLU, global pool, Flatten, two Linear layers (one without bias)."""
    return nn.Sequential(
        nn.Conv2d(4, 6, 3, groups=2), nn.MaxPool2d(2), nn.ReLU(),
        nn.Conv2d(6, 4, 2, bias=False), nn.ReLU(),
        nn.Conv2d(4, 4, 2, groups=4), nn.MaxPool2d(2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 5), nn.ReLU(), nn.Dropout(0.0), nn.Linear(5, 3, bias=False),
    )


def per_network(factory, states, images, labels):
    """Logits and parameter gradients of each network run alone with plain PyTorch."""
    logits, grads = [], []
    for state, x, y in zip(states, images, labels):
        model = factory().double()
        model.load_state_dict(state)
        out = model(x)
        F.cross_entropy(out, y).backward()
        logits.append(out.detach())
        grads.append({k: p.grad for k, p in model.named_parameters()})
    return logits, grads


@pytest.mark.parametrize("factory, shape", [
    (optunet, (1, 28, 28)),
    pytest.param(every_piece, (4, 18, 18), marks=pytest.mark.slow),  # compiles kernels for every piece (a minute)
    (lambda: mlp(12, [7, 5], 4), (3, 2, 2)),
])
@pytest.mark.parametrize("implementation", ["packed", "vmap"])
def test_stacked_forward_and_gradients_equal_each_network_alone(factory, shape, implementation):
    torch.manual_seed(0)
    k, b = 5, 6
    states = [factory().double().state_dict() for _ in range(k)]
    images = torch.randn(k, b, *shape, dtype=torch.float64)
    # Constant patches make exact ties inside max-pool windows (the first maximum wins).
    images[:, :, :, :6, :6] = 0.5
    labels = torch.randint(0, 3, (k, b))
    want_logits, want_grads = per_network(factory, states, images, labels)

    stacked = stacked_networks(factory(), CPU, implementation)
    params = {key: value.requires_grad_() for key, value in stacked.pack(states).items()}
    source = stacked.source(images.flatten(0, 1), CPU)
    batch = stacked.batch(source, torch.arange(k * b).view(k, b), None, 0, 0.0)
    logits = stacked.forward(params, batch)
    losses = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(k, b).mean(1)
    losses.sum().backward()
    grads = {key: value.grad for key, value in params.items()}
    for i in range(k):
        torch.testing.assert_close(logits[i], want_logits[i], rtol=1e-10, atol=1e-12)
        unpacked = stacked.unpack(grads, i)
        for key, want in want_grads[i].items():
            torch.testing.assert_close(unpacked[key], want, rtol=1e-9, atol=1e-12, msg=f"network {i} {key}")
    if implementation == "packed":  # the trainer's own step (no autograd): the same losses and gradients
        losses_alone = [F.cross_entropy(want_logits[i], labels[i]) for i in range(k)]
        fused_losses, fused_grads = stacked.loss_and_grads({key: value.detach() for key, value in params.items()}, batch, labels)
        torch.testing.assert_close(fused_losses, torch.stack(losses_alone), rtol=1e-10, atol=1e-12)
        for i in range(k):
            unpacked = stacked.unpack(fused_grads, i)
            for key, want in want_grads[i].items():
                torch.testing.assert_close(unpacked[key], want, rtol=1e-9, atol=1e-12, msg=f"fused: network {i} {key}")
    shared = stacked.predict({key: value.detach() for key, value in params.items()}, images[0])
    for i in range(k):
        model = factory().double()
        model.load_state_dict(states[i])
        torch.testing.assert_close(shared[i], model(images[0]), rtol=1e-10, atol=1e-12)


def test_pack_unpack_select_round_trip():
    states = [optunet().state_dict() for _ in range(4)]
    stacked = PackedChain(optunet())
    params = stacked.pack(states)
    assert params["conv1.weight"].shape == (2, 1, 4, 4, 4) and params["fc1.weight"].shape == (4, 3, 10)
    chosen = stacked.select(params, torch.tensor([3, 1]))
    for position, index in enumerate([3, 1]):
        assert all(torch.equal(stacked.unpack(chosen, position)[k], states[index][k]) for k in states[index])
    assert list(stacked.unpack(params, 0)) == list(states[0])


def test_crops_gathered_for_each_network_are_the_data_crops():
    from benchmark.core.data import crop_at

    torch.manual_seed(1)
    images = torch.randn(7, 1, 6, 6)
    index = torch.tensor([[0, 3, 5], [6, 6, 1]])
    offsets = torch.randint(0, 5, (2, 2, 3))  # [K, 2, B]
    packed = PackedChain(optunet()).batch(PackedChain(optunet()).source(images, CPU), index, offsets, 2, -0.7)
    for k in range(2):
        want = crop_at(images[index[k]], 2, -0.7, offsets[k])
        assert torch.equal(packed[..., k], want)
        vm = VmapNetworks(optunet()).batch(images, index, offsets, 2, -0.7)
        assert torch.equal(vm[k], want)


@pytest.mark.parametrize("networks", [1, 16, 37])
def test_crops_of_many_networks_gathered_from_codes_are_each_networks_crops(networks):
    """The gather reads a tile of networks at a time (``GATHER_TILE``): a stack of whole tiles, one
    tile and a part tile gives every network its own crops, from the codes as from the images."""
    from benchmark.core.data import crop_at

    torch.manual_seed(4)
    codes = torch.randint(0, 200, (11, 1, 9, 7), dtype=torch.uint8)
    levels = torch.randn(1, 256)
    images = levels[0, codes.long()]
    index = torch.randint(0, 11, (networks, 5))
    offsets = torch.randint(0, 7, (networks, 2, 5))
    packed = PackedChain(optunet())
    for source in (packed.source(images, CPU), packed.source(images, CPU, (codes, levels))):
        batch = packed.batch(source, index, offsets, 3, float(levels[0, 0]))
        assert batch.shape == (5, 1, 9, 7, -(-networks // 16) * 16)  # lanes padded with network 0's images
        for k in range(batch.shape[-1]):
            want = k if k < networks else 0
            assert torch.equal(batch[..., k], crop_at(images[index[want]], 3, float(levels[0, 0]), offsets[want]))
    out = torch.empty(5, 1, 9, 7, networks)  # the kernel alone, without the padding lanes (a part tile)
    rows, cols = (np.ascontiguousarray(part) for part in offsets.permute(1, 2, 0).numpy())
    gather_batch(pad_with(codes, 3, 0).numpy(), levels.numpy(), index.T.numpy().astype(np.uint32), rows, cols, out.numpy())
    for k in range(networks):
        assert torch.equal(out[..., k], crop_at(images[index[k]], 3, float(levels[0, 0]), offsets[k]))


def test_nan_in_one_network_stays_in_that_network():
    torch.manual_seed(2)
    states = [optunet().state_dict() for _ in range(3)]
    states[1]["conv1.weight"][0, 0, 0, 0] = float("nan")
    stacked = PackedChain(optunet())
    logits = stacked.predict(stacked.pack(states), torch.randn(4, 1, 28, 28))
    assert torch.isnan(logits[1]).any() and torch.isfinite(logits[[0, 2]]).all()


@pytest.mark.parametrize("model, message", [
    (lambda: nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.Flatten(), nn.Linear(2 * 9, 2)), "padding"),
    (lambda: nn.Sequential(nn.Conv2d(1, 2, 3, stride=2), nn.Flatten(), nn.Linear(2, 2)), "stride"),
    (lambda: nn.Sequential(nn.Conv2d(1, 2, 3), nn.MaxPool2d(3, stride=2), nn.Flatten(), nn.Linear(2, 2)), "MaxPool2d"),
    (lambda: nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(2, 2)), "BatchNorm2d"),
    (lambda: optunet(dropout=0.2), "Dropout"),
])
def test_unsupported_layers_are_named(model, message):
    with pytest.raises(NotStackableError, match=message):
        PackedChain(model())


def test_resnet_cannot_be_stacked_and_says_why():
    from benchmark.core.models import resnet18

    with pytest.raises(NotStackableError, match="packed: .*layer_chain.*vmap: .*BatchNorm"):
        stacked_networks(resnet18(num_classes=10), CPU)
    assert isinstance(stacked_networks(optunet(), CPU), PackedChain)
    assert isinstance(stacked_networks(optunet(), torch.device("meta")), VmapNetworks)  # any non-CPU device


@pytest.mark.parametrize("count, fill_is_a_level", [(7, False), (256, False), (256, True)])
def test_batches_gathered_from_uint8_codes_equal_those_from_the_images(count, fill_is_a_level):
    """A set read from uint8 arrays can be gathered from its codes: the same batches bit for bit, crops
    included (the fill is the code of its level (MNIST: black), else one more level; with all 256
    codes taken by other values, the images are decoded)."""
    torch.manual_seed(3)
    codes = torch.randint(0, count, (9, 2, 6, 6), dtype=torch.uint8)
    levels = torch.randn(2, count)
    levels[:, 5] = -0.7 if fill_is_a_level else levels[:, 5]
    images = levels[torch.arange(2).view(1, 2, 1, 1).expand_as(codes), codes.long()]
    index = torch.randint(0, 9, (3, 4))
    offsets = torch.randint(0, 5, (3, 2, 4))
    packed = PackedChain(optunet())
    plain, coded = packed.source(images, CPU), packed.source(images, CPU, (codes, levels))
    assert torch.equal(packed.batch(plain, index, None, 0, 0.0), packed.batch(coded, index, None, 0, 0.0))
    assert torch.equal(packed.batch(plain, index, offsets, 2, -0.7), packed.batch(coded, index, offsets, 2, -0.7))
    kept = packed._padding[3]  # made once per source: a second batch reuses it
    packed.batch(coded, index, offsets, 2, -0.7)
    assert packed._padding[3] is kept and isinstance(kept, type(coded)) == (count < 256 or fill_is_a_level)
    vmapped = VmapNetworks(optunet())  # the GPU's path: the codes on the device, decoded per batch
    plain, coded = vmapped.source(images, CPU), vmapped.source(images, CPU, (codes, levels))
    assert torch.equal(vmapped.batch(plain, index, offsets, 2, -0.7), vmapped.batch(coded, index, offsets, 2, -0.7))
    assert coded.codes.dtype == torch.uint8


def test_a_batch_taken_in_parts_gives_the_whole_batch_sums_to_the_bit(monkeypatch):
    """loss_and_grads runs a batch in parts of PART_IMAGES images (for the cache); the kernels add
    the parts' gradients image by image, so 40 images in parts of 16, 16 and 8 give exactly what
    one part of 40 gives, and each network's autograd gradient."""
    import benchmark.core.training.stacked as stacked_module

    torch.manual_seed(3)
    k, b = 5, 40
    states = [optunet().state_dict() for _ in range(k)]
    images = torch.randn(k, b, 1, 28, 28)
    labels = torch.randint(0, 10, (k, b))
    stacked = stacked_networks(optunet(), CPU, "packed")
    params = stacked.pack(states)
    batch = stacked.batch(stacked.source(images.flatten(0, 1), CPU), torch.arange(k * b).view(k, b), None, 0, 0.0)
    monkeypatch.setattr(stacked_module, "PART_IMAGES", 16)
    losses, grads = stacked.loss_and_grads(params, batch, labels)
    monkeypatch.setattr(stacked_module, "PART_IMAGES", b)
    whole_losses, whole_grads = stacked.loss_and_grads(params, batch, labels)
    assert torch.equal(losses, whole_losses)
    for key in grads:
        assert torch.equal(grads[key], whole_grads[key]), key
    want_logits, want_grads = per_network(lambda: optunet().double(), [{key: v.double() for key, v in s.items()} for s in states],
                                          images.double(), labels)
    for i in range(k):
        torch.testing.assert_close(losses[i].double(), F.cross_entropy(want_logits[i], labels[i]), rtol=1e-5, atol=1e-6)
        for key, want in want_grads[i].items():
            torch.testing.assert_close(stacked.unpack(grads, i)[key].double(), want, rtol=1e-4, atol=1e-6, msg=f"network {i} {key}")


STEP_DIGEST = """
import hashlib, json
import numba, torch
from benchmark.core.models import optunet
from benchmark.core.training.stacked import stacked_networks
torch.manual_seed(0)
k, b = 32, 16
states = [optunet().state_dict() for _ in range(k)]
images, labels = torch.rand(k * b, 1, 28, 28), torch.randint(0, 10, (k, b))
stacked = stacked_networks(optunet(), torch.device("cpu"), "packed")
params = stacked.pack(states)
batch = stacked.batch(stacked.source(images, torch.device("cpu")), torch.arange(k * b).view(k, b), None, 0, 0.0)
losses, grads = stacked.loss_and_grads(params, batch, labels)
digest = hashlib.sha256(losses.numpy().tobytes())
for key in sorted(grads):
    digest.update(grads[key].contiguous().numpy().tobytes())
print(json.dumps({"features": numba.config.CPU_FEATURES, "digest": digest.hexdigest()}))
"""


@pytest.mark.slow  # a subprocess compiling the kernels twice
def test_the_packed_step_is_the_same_to_the_bit_with_512_bit_vectors():
    """docs/performance.md "Training the zoo": on an AVX-512 CPU, NUMBA_CPU_FEATURES set to the host's features plus
    ``-prefer-256-bit`` widens the kernels' vectors without changing one bit of a training step: 32
    OptuNets' losses and gradients equal those of LLVM's own choice for the CPU (the host's features)."""
    host = get_host_cpu_features()
    if "+avx512f" not in host.split(","):
        pytest.skip("the CPU has no AVX-512: no wider vectors to compare")

    def step(features: str) -> dict:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "NUMBA_CPU_FEATURES": features}
        done = subprocess.run([sys.executable, "-c", STEP_DIGEST], env=env, cwd=REPO, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    wide, own = step(host + ",-prefer-256-bit"), step(host)
    assert wide["features"].endswith(",-prefer-256-bit") and own["features"] == host
    assert wide["digest"] == own["digest"]
