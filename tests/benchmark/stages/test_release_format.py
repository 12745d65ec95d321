"""The released zoos' format, written here as torch-uncertainty writes it, imported end to end
through ``stage=import zoo_import.evaluate=true`` (the command line's ``run``).

torch-uncertainty/Checkpoints holds float16 safetensors made by its ``scripts/to_hub_format.py``
from Lightning checkpoints: ``{key.replace("model.", ""): val.to(device="cpu", dtype=torch.float16)}``
for every entry of ``state_dict``, so the keys are bare, every tensor is float16 (BatchNorm's
``num_batches_tracked`` counters too: Inf beyond 65,504 steps), and a file is ``<name>.safetensors``
for version 0 and ``<name>_<version>.safetensors`` after; members of a tar archive in directory
order. The networks have no convolution biases; TorchUncertainty's ResNet-18 names its last layer
``linear`` and its projection shortcuts ``shortcut``.

Two small zoos in that format: OptuNets on the digits experiment, and narrow (width 4) ResNet-18s
on a mock ``tiny-imagenet-200/`` whose ``wnids.txt`` is not sorted, trained here with labels
numbered by torch-uncertainty's own rule (line of ``wnids.txt``), computed independently of our
reader. Each imports with the accuracy the original network has after float16 rounding; the same
zoos against a data set numbered otherwise are refused as near chance, naming the class order.
"""
from __future__ import annotations

import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from benchmark.cli import run
from benchmark.core.data import as_tensors, get_dataset
from benchmark.core.data.tinyimagenet import TinyImageNet
from benchmark.core.models import optunet, resnet18
from benchmark.core.store import load_checkpoint, read_metadata
from benchmark.core.training import seeded
from benchmark.experiment import Experiment
from benchmark.stages.import_zoo import NearChanceError
from tests.benchmark.core.data import formats
from tests.conftest import compose_config, one_thread

pytestmark = pytest.mark.slow  # runs stages end to end or trains networks: make test, not make test-fast

WNIDS = ["n09256479", "n07753592", "n01443537", "n02124075"]  # line order; sorting moves every class
COLOURS = [(200, 30, 40), (20, 180, 60), (10, 40, 220), (230, 220, 40)]
TINYIMAGENET_STEPS = 200 * 782  # the recipe's 200 epochs of 100,000 images in batches of 128: Inf in float16


@pytest.fixture(autouse=True)
def restore_threads():
    """``run`` sets the torch threads (threads=1): put them back after each test."""
    saved = torch.get_num_threads()
    yield
    torch.set_num_threads(saved)



def to_hub_format(lightning_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What torch-uncertainty's scripts/to_hub_format.py does to a Lightning checkpoint's state_dict (--fp16)."""
    return {key.replace("model.", ""): val.to(device="cpu", dtype=torch.float16) for key, val in lightning_state_dict.items()}


def tu_resnet_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our ResNet-18 keys as TorchUncertainty's ResNet-18 names them."""
    return {k.replace("fc.", "linear.").replace(".downsample.", ".shortcut."): v for k, v in state.items()}


def write_release(tmp_path: Path, name: str, states: list[dict[str, torch.Tensor]]) -> Path:
    """``<name>.tgz`` holding ``<name>/<name>[_<version>].safetensors`` for each of ``states`` (as a
    Lightning module holds them, under ``model.``), members in the order ``ls`` lists them."""
    folder = tmp_path / name
    folder.mkdir()
    for version, state in enumerate(states):
        lightning = {f"model.{key}": value for key, value in state.items()}
        save_file(to_hub_format(lightning), str(folder / f"{name}{'' if version == 0 else f'_{version}'}.safetensors"))
    archive = tmp_path / f"{name}.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        for path in sorted(folder.iterdir()):
            tar.add(path, arcname=f"{name}/{path.name}")
    return archive


def set_batchnorm_statistics(model: torch.nn.Module, images: torch.Tensor) -> None:
    """BatchNorm's running statistics set to those of ``images`` (one pass, a cumulative average);
    the model is left in eval mode."""
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.reset_running_stats()
            module.momentum = None
    model.train()(images)
    model.eval()


def fp16_accuracy(model: torch.nn.Module, state: dict[str, torch.Tensor], images: torch.Tensor, labels: torch.Tensor) -> float:
    """Independent expectation: accuracy of ``state`` rounded to float16 (counters left as they are)."""
    rounded = {k: v.half().float() if v.is_floating_point() else v for k, v in state.items()}
    model.load_state_dict(rounded)
    with torch.no_grad():
        return int((model.eval()(images).argmax(1) == labels).sum()) / len(labels)


def import_config(tmp_path: Path, archive: Path, *overrides: str):
    # The paper's convergence rule only: the briefly trained fixture network (~0.4) would fail
    # digits' own end check (50%), which is not what these tests are about.
    return compose_config(["stage=import", f"zoo_import.source={archive}", "zoo_import.evaluate=true", "threads=1",
                           "train.fail_rule.final_min_accuracy=null",
                           f"store={tmp_path / 'store'}", f"results={tmp_path / 'results'}", *overrides])


# ---------------------------------------------------------------- OptuNet, digits


@pytest.fixture(scope="module")
def trained_optunet() -> dict[str, torch.Tensor]:
    """An OptuNet trained briefly on the digits (full-batch Adam on 256 images: ~0.4 test accuracy)."""
    exp = Experiment(compose_config([]))
    images, labels = exp.train_tensors
    images, labels = images[:256], labels[:256]
    with exp.backends(), one_thread():
        with seeded(0):
            model = optunet()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
        for _ in range(40):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(images), labels).backward()
            optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def permute_hidden_units(state: dict[str, torch.Tensor], order: list[int]) -> dict[str, torch.Tensor]:
    """The same function with fc1's units in another ``order`` (another member of the permutation orbit)."""
    out = dict(state)
    out["fc1.weight"], out["fc1.bias"] = state["fc1.weight"][order], state["fc1.bias"][order]
    out["fc2.weight"] = state["fc2.weight"][:, order]
    return out


def test_optunet_release_zoo_imports_and_evaluates(tmp_path, trained_optunet):
    dead = dict(trained_optunet)
    dead["fc2.bias"] = torch.tensor([50.0] + [0.0] * 9)  # always class 0: a member that did not converge
    members = [trained_optunet, permute_hidden_units(trained_optunet, [1, 2, 0]),
               permute_hidden_units(trained_optunet, [2, 0, 1]), dead]
    archive = write_release(tmp_path, "mnist-optunet", members)
    assert set(load_file(str(tmp_path / "mnist-optunet" / "mnist-optunet_1.safetensors"))) == set(trained_optunet)
    run(import_config(tmp_path, archive, "zoo_import.limit=3"))
    # resumed: the one file left (at chance) is not judged alone against chance; the convergence rule fails it
    run(import_config(tmp_path, archive))
    exp = Experiment(import_config(tmp_path, archive))
    images, labels = exp.test_tensors
    want = fp16_accuracy(optunet(), trained_optunet, images, labels)
    assert want > 0.3  # the fixture trained: far above chance (0.1)
    assert exp.store.completed_seeds() == [0, 1, 2]
    for seed in (0, 1, 2):
        stored, meta = load_checkpoint(exp.store.checkpoint_path(seed), exp.model())
        assert float(meta["test_accuracy"]) == want
        assert torch.equal(stored["fc2.bias"], members[seed]["fc2.bias"].half().float())
        assert meta["source_file"] == f"mnist-optunet/mnist-optunet{'' if seed == 0 else f'_{seed}'}.safetensors"
    failure = exp.store.failed_seeds()[3]
    assert failure["reason"].startswith("validation accuracy") and "imported checkpoint" in failure["reason"]


def test_optunet_zoo_trained_with_another_class_order_is_refused(tmp_path, trained_optunet):
    """Networks whose output rows follow another label order (rolled by one) score near chance:
    refused with the numbers and the likely causes; no checkpoint written, no claim left."""
    rolled = []
    for order in ([0, 1, 2], [1, 2, 0], [2, 0, 1]):
        state = permute_hidden_units(trained_optunet, order)
        state["fc2.weight"], state["fc2.bias"] = state["fc2.weight"].roll(1, 0), state["fc2.bias"].roll(1, 0)
        rolled.append(state)
    archive = write_release(tmp_path, "mnist-optunet", rolled)
    with pytest.raises(NearChanceError, match=r"refused: the 3 imported network\(s\) checked first score a median test "
                                              r"accuracy of 0\.\d+ .* on digits's test split \(360 images\), within 0.050 of "
                                              r"chance \(0.10\d\).*Likely causes: the class order, .*normalisation.*another data set") as err:
        run(import_config(tmp_path, archive))
    assert "wnids" not in str(err.value)  # the hints fit the data set: digits has no wnids.txt
    store = tmp_path / "store" / "digits_optunet"
    assert not list(store.rglob("*.safetensors")) and not list(store.rglob("*.json"))
    assert (store / ".claims").is_dir() and not list((store / ".claims").glob("*.claim"))  # released


# ---------------------------------------------------------------- ResNet-18 (width 4), mock TinyImageNet


@pytest.fixture(scope="module")
def tinyimagenet_dir(tmp_path_factory) -> Path:
    """A mock data folder: ``tiny-imagenet-200/`` with 4 classes (3 train, 2 val images each, a
    colour per class plus noise) listed unsorted in wnids.txt, and DTD (the OOD set preflight opens)."""
    root = tmp_path_factory.mktemp("release_data")
    formats.write_tinyimagenet(root, WNIDS, {w: [c] * 3 for w, c in zip(WNIDS, COLOURS)},
                               [(w, c) for w, c in zip(WNIDS, COLOURS) for _ in range(2)])
    rng = np.random.default_rng(0)
    for path in sorted((root / "tiny-imagenet-200").rglob("*.JPEG")):
        pixels = np.asarray(Image.open(path).convert("RGB"), dtype=np.int16)
        Image.fromarray(np.clip(pixels + rng.integers(-40, 41, pixels.shape), 0, 255).astype(np.uint8)).save(path)
    formats.write_dtd(root, {"train": [("banded", COLOURS[0], (64, 64))], "val": [("banded", COLOURS[1], (64, 64))],
                             "test": [("zigzagged", COLOURS[2], (64, 64))]})
    return root


def torch_uncertainty_labels(root: Path, split: str) -> torch.Tensor:
    """The labels torch-uncertainty gives our reader's images: the line of the image's wnid in
    wnids.txt (train: the image's folder; val: val_annotations.txt), in our reader's image order."""
    ids = [line.strip() for line in (root / "tiny-imagenet-200" / "wnids.txt").read_text().splitlines()]
    annotations = dict(line.split("\t")[:2] for line in
                       (root / "tiny-imagenet-200" / "val" / "val_annotations.txt").read_text().splitlines())
    paths = [Path(path) for path, _ in TinyImageNet(root, split).samples]
    wnids = [p.parent.parent.name for p in paths] if split == "train" else [annotations[p.name] for p in paths]
    return torch.tensor([ids.index(w) for w in wnids])


@pytest.fixture(scope="module")
def trained_resnets(tinyimagenet_dir) -> list[dict[str, torch.Tensor]]:
    """Two ResNet-18s of width 4 trained on the mock (8 full-batch Adam steps; BatchNorm statistics
    then taken over the train images), their counters set to the real recipe's step count."""
    images = as_tensors(get_dataset("tinyimagenet", "train", tinyimagenet_dir))[0]
    labels = torch_uncertainty_labels(tinyimagenet_dir, "train")
    states = []
    for seed in (0, 1):
        with seeded(seed):
            model = resnet18(num_classes=200, width=4)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        with one_thread():
            for _ in range(8):
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(model(images), labels).backward()
                optimizer.step()
        with torch.no_grad():
            set_batchnorm_statistics(model, images)
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        states.append({k: torch.tensor(TINYIMAGENET_STEPS) if k.endswith("num_batches_tracked") else v for k, v in state.items()})
    return states


def test_tinyimagenet_resnet18_release_zoo_imports_and_evaluates(tmp_path, tinyimagenet_dir, trained_resnets):
    archive = write_release(tmp_path, "tinyimagenet-resnet18", [tu_resnet_names(s) for s in trained_resnets])
    written = load_file(str(tmp_path / "tinyimagenet-resnet18" / "tinyimagenet-resnet18.safetensors"))
    assert written["linear.weight"].dtype == torch.float16 and "conv1.bias" not in written
    assert torch.isinf(written["bn1.num_batches_tracked"]) and "layer2.0.shortcut.0.weight" in written
    overrides = ("experiment=tinyimagenet_resnet18", "zoo_import=tu_resnet18", "+model.kwargs.width=4",
                 f"dataset.data_dir={tinyimagenet_dir}")
    run(import_config(tmp_path, archive, *overrides))
    exp = Experiment(import_config(tmp_path, archive, *overrides))
    images = exp.test_tensors[0]
    labels = torch_uncertainty_labels(tinyimagenet_dir, "test")
    assert exp.store.completed_seeds() == [0, 1]
    for seed, state in enumerate(trained_resnets):
        want = fp16_accuracy(resnet18(num_classes=200, width=4), state, images, labels)
        assert want == 1.0  # the fixture trained: each colour its class
        stored, meta = load_checkpoint(exp.store.checkpoint_path(seed), exp.model())
        assert float(meta["test_accuracy"]) == want
        assert int(stored["layer1.0.bn1.num_batches_tracked"]) == 0  # Inf in the file: dropped, refilled
        assert torch.equal(stored["fc.weight"], state["fc.weight"].half().float())
    assert read_metadata(exp.store.checkpoint_path(1))["source_file"] == "tinyimagenet-resnet18/tinyimagenet-resnet18_1.safetensors"


def test_tinyimagenet_zoo_against_a_data_set_numbered_otherwise_is_refused(tmp_path, tinyimagenet_dir, trained_resnets):
    """The same zoo against a copy of the data whose wnids.txt is sorted (what our reader did
    before: every label moves): the networks score 0, and the import is refused naming the class order."""
    data = tmp_path / "data"
    shutil.copytree(tinyimagenet_dir, data)
    (data / "tiny-imagenet-200" / "wnids.txt").write_text("\n".join(sorted(WNIDS)) + "\n")
    archive = write_release(tmp_path, "tinyimagenet-resnet18", [tu_resnet_names(s) for s in trained_resnets])
    with pytest.raises(NearChanceError, match=r"median test accuracy of 0.000 .*within 0.\d+ of chance \(0.250\).*"
                                              r"the class order \(tinyimagenet: class i = line i of wnids.txt\)"):
        run(import_config(tmp_path, archive, "experiment=tinyimagenet_resnet18", "zoo_import=tu_resnet18",
                          "+model.kwargs.width=4", f"dataset.data_dir={data}"))
    assert not list((tmp_path / "store").rglob("*.safetensors"))
