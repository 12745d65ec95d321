"""The import recipes of the released zoos (README's "Importing the released zoos": MNIST;
docs/import.md's "The released ResNet-18 zoos"), run line by line on tiny archives in the released
format (float16 safetensors, TorchUncertainty's key names, as torch-uncertainty's
``to_hub_format.py`` writes them), each to Table 1.

Every line of each block runs as written, in a working folder where the archives lie where
``hf download`` puts them (the download itself is the one line not run: its paths are checked
against the fixture's): the shell lines (``mkdir``, ``tar``, a ``for`` loop) through bash, the
``python -m benchmark`` lines in this process with the data folder and the counts scaled down
(``zoo_import.limit``/``zoo_import.skip``) and a few overrides appended for speed (a narrow
ResNet-18, one repetition, Deep Ensembles only). The counts the recipes name are checked against
the experiment configs first: the reference size, and the held-out count the sample stage reads.

The held-out range of each tiny run is larger than the count imported, as in the real configs
(e.g. mnist_optunet's 360 seeds against 300 imported): the sample stage must use exactly the
imported held-out networks, and nothing is trained.

The fixture networks are function-preserving variants (random permutations and positive scalings,
``metrics.symmetries``) of one network trained here to classify the tiny data perfectly, so every
import passes the near-chance check and the convergence rule.
"""
from __future__ import annotations

import fnmatch
import re
import shlex
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from PIL import Image

from benchmark.cli import run
from benchmark.core.store import unstack
from benchmark.core.training import seeded
from benchmark.experiment import Experiment
from benchmark.design import Design
from metrics.symmetries import permute, random_permutations, random_scales, rescale, spec_for_model
from tests.benchmark.core.data import formats
from tests.benchmark.stages.test_release_format import set_batchnorm_statistics, tu_resnet_names, write_release
from tests.conftest import REPO, compose_config, one_thread

pytestmark = pytest.mark.slow

REFERENCE, HELDOUT_EXTRA = 3, 2  # tiny reference size; held-out seeds beyond those imported
TINY = ("threads=1", "sample.repetitions=1", "sample.per_method=2", "sample.modes_multi=2", "method=ensemble",
        "evaluate.reference_resamples=0", "evaluate.test_permutations=0")
PER_EXPERIMENT = {
    "mnist_optunet": ("dataset.validation_fraction=0.25",),
    "cifar100_resnet18": ("+model.kwargs.width=4",),
    "tinyimagenet_resnet18": ("+model.kwargs.width=4",),
}
COLOURS = [(200, 30, 40), (20, 180, 60), (10, 40, 220), (230, 220, 40)]
WNIDS = ["n09256479", "n07753592", "n01443537", "n02124075"]  # not sorted: class i is line i


def heldout_count() -> int:
    """Held-out networks the tiny sample stage reads: repetitions x stride at the tiny settings."""
    return Design(1, 2, 2).reach


RECIPE_SECTIONS = (("README.md", "## Importing the released zoos"), ("docs/import.md", "## The released ResNet-18 zoos"))
"""Where the recipes are: MNIST's in the README, the ResNet-18s' in docs/import.md."""


def readme_recipes() -> dict[str, list[str]]:
    """Experiment -> the lines (continuations joined) of its bash block in the recipe sections (``RECIPE_SECTIONS``)."""
    recipes = {}
    for page, heading in RECIPE_SECTIONS:
        section = (REPO / page).read_text().split(heading, 1)[1].split("\n## ", 1)[0]
        for block in re.findall(r"```bash\n(.*?)```", section, re.S):
            lines = block.replace("\\\n", " ").splitlines()
            experiment = re.search(r"\((\w+)\)", lines[0]).group(1)
            recipes[experiment] = [" ".join(line.split()) for line in lines[1:] if line.strip()]
    return recipes


def overrides_of(line: str) -> list[str]:
    return shlex.split(line)[3:]  # after ".venv/bin/python -m benchmark"


def test_the_readme_counts_agree_with_the_configs():
    """Per released zoo: the README imports the config's reference size and exactly the held-out
    networks the sample stage reads (repetitions x stride), which the config's range can hold."""
    recipes = readme_recipes()
    assert set(recipes) == {"mnist_optunet", "cifar100_resnet18", "tinyimagenet_resnet18"}
    for experiment, lines in recipes.items():
        commands = [line for line in lines if line.startswith(".venv/bin/python -m benchmark")]
        ranges = {tuple(o for o in overrides_of(line) if o.startswith("seeds.")) for line in commands}
        assert len(ranges) == 1, (experiment, ranges)  # every command reads the same seed ranges
        exp = Experiment(compose_config([f"experiment={experiment}", *ranges.pop()]))
        needed = exp.design.reach
        imports = [dict(o.split("=", 1) for o in overrides_of(line) if "=" in o) for line in lines if "stage=import" in line]
        reference, heldout = imports
        assert int(reference["zoo_import.limit"]) == len(exp.reference) == 1000, experiment  # the paper's 1,000
        assert heldout["zoo_import.range"] == "heldout" and int(heldout["zoo_import.limit"]) == needed == 300, experiment
        assert len(exp.heldout) >= needed, experiment
        if reference["zoo_import.source"] == heldout["zoo_import.source"]:  # one source: the held-out files follow
            assert int(heldout["zoo_import.skip"]) == 1000, experiment
        if experiment != "mnist_optunet":
            assert all(line.count("zoo_import=tu_resnet18") == 1 for line in lines if "stage=import" in line)
        assert [o for line in lines if "stage=" in line and "stage=import" not in line
                for o in overrides_of(line) if o.startswith("stage=")] == ["stage=sample", "stage=evaluate", "stage=report"]


# ---------------------------------------------------------------- tiny data and networks


def noisy(colour, size, rng, channels=3):
    pixels = np.full((size, size, channels), colour[:channels], dtype=np.int16) + rng.integers(-25, 26, (size, size, channels))
    return np.clip(pixels, 0, 255).astype(np.uint8)


def write_data(experiment: str, root: Path) -> None:
    """Four classes, each a colour (a grey level on MNIST) plus noise, in the real on-disk format."""
    rng = np.random.default_rng(0)
    if experiment == "mnist_optunet":
        levels = [(30,), (100,), (170,), (240,)]

        def split(per_class):
            images = np.stack([noisy(levels[c], 28, rng, 1)[..., 0] for c in range(4) for _ in range(per_class)])
            return images, np.repeat(np.arange(4), per_class)
        formats.write_mnist_like(root, "MNIST", {"train": split(8), "test": split(4)})
        formats.write_mnist_like(root, "FashionMNIST", {"train": split(1), "test": split(1)})
    elif experiment == "cifar100_resnet18":
        def split(per_class):
            images = np.stack([noisy(COLOURS[c], 32, rng) for c in range(4) for _ in range(per_class)])
            return images, np.repeat(np.arange(4), per_class)
        formats.write_cifar100(root, {"train": split(3), "test": split(2)})
        formats.write_svhn(root, "test", *split(1))
    else:
        formats.write_tinyimagenet(root, WNIDS, {w: [c] * 3 for w, c in zip(WNIDS, COLOURS)},
                                   [(w, c) for w, c in zip(WNIDS, COLOURS) for _ in range(2)])
        for path in sorted((root / "tiny-imagenet-200").rglob("*.JPEG")):
            pixels = np.asarray(Image.open(path).convert("RGB"), dtype=np.int16)
            Image.fromarray(np.clip(pixels + rng.integers(-25, 26, pixels.shape), 0, 255).astype(np.uint8)).save(path)
        formats.write_dtd(root, {"train": [("banded", COLOURS[0], (64, 64))], "val": [("banded", COLOURS[1], (64, 64))],
                                 "test": [("zigzagged", COLOURS[2], (64, 64))]})


def perfect_network(exp: Experiment) -> dict[str, torch.Tensor]:
    """A network of the experiment's model trained (full-batch Adam) until it classifies the tiny
    train and test splits without error; BatchNorm statistics then taken over the train images."""
    images, labels = exp.train_tensors
    test_images, test_labels = exp.test_tensors
    for seed in range(5):
        with seeded(seed):
            model = exp.model()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
        for _ in range(150):
            model.train()
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(images), labels).backward()
            optimizer.step()
            with torch.no_grad():
                set_batchnorm_statistics(model, images)
                if bool((model(images).argmax(1) == labels).all()) and bool((model(test_images).argmax(1) == test_labels).all()):
                    return {k: v.detach().clone() for k, v in model.state_dict().items()}
    raise AssertionError(f"{exp.name}: no fixture network learnt the tiny data")


def variants(state: dict[str, torch.Tensor], model: torch.nn.Module, count: int) -> list[dict[str, torch.Tensor]]:
    """``count`` networks computing the function of ``state``: random permutations of the hidden
    units and positive rescalings (``metrics.symmetries``)."""
    spec = spec_for_model(model)
    generator = torch.Generator().manual_seed(1)
    stacked = {k: v.expand(count, *v.shape).clone() for k, v in state.items()}
    moved = permute(stacked, spec, random_permutations(spec, count, generator))
    moved = rescale(moved, spec, random_scales(spec, count, spread=0.2, generator=generator))
    return [{k: v.to(state[k].dtype) for k, v in unstack(moved, i).items()} for i in range(count)]


def write_archives(experiment: str, work: Path, members: list[dict[str, torch.Tensor]]) -> list[Path]:
    """The release archives where ``hf download --local-dir zoos`` puts them; the first holds the
    reference and one more, the next ones the rest (TorchUncertainty's ResNet-18 key names)."""
    if experiment == "mnist_optunet":
        (work / "zoos/models/mnist-optunet").mkdir(parents=True)
        return [write_release(work / "zoos/models/mnist-optunet", "mnist-optunet-0-8191", members)]
    named = [tu_resnet_names(m) for m in members]
    folder = {"cifar100_resnet18": ("cifar100-resnet18", "cifar100-resnet18"),
              "tinyimagenet_resnet18": ("tiny-imagenet-resnet18", "tiny-imagenet-resnet18")}[experiment]
    base = work / "zoos/models" / folder[0]
    base.mkdir(parents=True)
    return [write_release(base, f"{folder[1]}-0-1023", named[: REFERENCE + 1]),
            write_release(base, f"{folder[1]}-1024-2047", named[REFERENCE + 1:])]


# ---------------------------------------------------------------- the recipes


@pytest.fixture
def restore_threads():
    saved = torch.get_num_threads()
    yield
    torch.set_num_threads(saved)


def scaled(line: str, experiment: str, data: Path, heldout: int) -> list[str]:
    """A ``python -m benchmark`` line's overrides with the tiny data folder and counts, and the tiny settings."""
    out = []
    for override in overrides_of(line):
        key, _, value = override.partition("=")
        if key == "dataset.data_dir":
            value = str(data)
        elif key == "zoo_import.limit":
            value = str(REFERENCE if value == "1000" else heldout)
        elif key == "zoo_import.skip":
            value = str(REFERENCE)
        out.append(f"{key}={value}")
    return [*out, f"seeds.reference=[0,{REFERENCE}]", f"seeds.heldout=[100000,{100000 + heldout + HELDOUT_EXTRA}]",
            *TINY, *PER_EXPERIMENT[experiment]]


@pytest.mark.parametrize("experiment", ["mnist_optunet", "cifar100_resnet18", "tinyimagenet_resnet18"])
def test_the_readme_recipe_runs_to_table_1(experiment, tmp_path, monkeypatch, skip_md5, restore_threads, caplog):
    work, data = tmp_path / "work", tmp_path / "datasets"
    work.mkdir()
    write_data(experiment, data)
    heldout = heldout_count()
    exp = Experiment(compose_config([f"experiment={experiment}", f"dataset.data_dir={data}", *TINY, *PER_EXPERIMENT[experiment]]))
    with one_thread(), exp.backends():
        trained = perfect_network(exp)
    members = variants(trained, exp.model(), REFERENCE + heldout + 1)
    archives = write_archives(experiment, work, members)
    monkeypatch.chdir(work)
    for line in readme_recipes()[experiment]:
        if line.startswith("hf download"):
            wanted = [a for a in shlex.split(line)[3:] if a.startswith("models/")]
            patterns = wanted or [shlex.split(line)[shlex.split(line).index("--include") + 1]]
            for archive in archives:
                assert any(fnmatch.fnmatch(str(archive.relative_to(work / "zoos")), p) for p in patterns), (archive, line)
        elif line.startswith(".venv/bin/python -m benchmark"):
            run(compose_config(scaled(line, experiment, data, heldout)))
        else:
            subprocess.run(line, shell=True, executable="/bin/bash", cwd=work, check=True)
    store = Experiment(compose_config(scaled(readme_recipes()[experiment][-1], experiment, data, heldout))).store
    imported = store.completed_seeds()
    assert imported == [*range(REFERENCE), *range(100000, 100000 + heldout)]  # nothing trained here
    assert "mix locally trained" not in caplog.text
    table = (work / "results" / experiment / "table1.md").read_text()
    assert "Deep Ensembles" in table
    metrics = pd.read_csv(work / "results" / experiment / "metrics.csv")
    row = metrics[metrics["method"] == "ensemble"].iloc[0]
    assert row["n_reference"] == REFERENCE and row["acc"] == 1.0  # the imported members classify as trained
    assert np.isfinite(row["mmd_median"]) and np.isfinite(row["ns_mmd_median"])
