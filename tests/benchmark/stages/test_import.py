"""stage=import: checkpoints written here in every accepted format (plain state dicts, Lightning
checkpoints with a key prefix, the released float16 safetensors with TorchUncertainty's ResNet-18
names, in folders, zip and tar archives) become zoo checkpoints with their provenance."""
from __future__ import annotations

import io
import json
import re
import tarfile
import time
import zipfile

import pytest
import torch
from safetensors.torch import save_file

from benchmark.config import ConfigError
from benchmark.experiment import Experiment
from benchmark.core.models import optunet, resnet18
from benchmark.stages import import_zoo
from benchmark.inventory import range_state
from benchmark.core.store import CheckpointError, StoreError, load_checkpoint, save_checkpoint
from benchmark.core.store.claims import HOST_ENV, HeldElsewhereError
from benchmark.core.store.importing import check_against, natural_key
from benchmark.core.training import seeded
from tests.conftest import compose_config

pytestmark = pytest.mark.slow  # runs stages end to end or trains networks: make test, not make test-fast


def nets(factory, seeds):
    out = []
    for seed in seeds:
        with seeded(seed):
            out.append(factory().state_dict())
    return out


def experiment(tmp_path, source, *overrides):
    return Experiment(compose_config([f"store={tmp_path / 'store'}", f"results={tmp_path / 'results'}",
                                      f"zoo_import.source={source}", "zoo_import.evaluate=false", *overrides]))


def tu_names(state):
    """Our ResNet-18 keys as TorchUncertainty names them (``linear``, ``shortcut``)."""
    return {k.replace("fc.", "linear.").replace(".downsample.", ".shortcut."): v for k, v in state.items()}


def test_plain_lightning_and_prefixed_files_in_a_folder(tmp_path):
    states = nets(optunet, [10, 11, 12])
    folder = tmp_path / "zoo"
    (folder / "sub").mkdir(parents=True)
    torch.save(states[0], folder / "net_2.pt")
    lightning = {"state_dict": {**{f"model.{k}": v for k, v in states[1].items()},
                                "post_processing.temperature": torch.ones(1)},
                 "epoch": 59, "global_step": 100, "optimizer_states": [{"state": {}}], "hyper_parameters": {"lr": 0.04}}
    torch.save(lightning, folder / "net_10.ckpt")
    torch.save({f"module.{k}": v for k, v in states[2].items()}, folder / "sub" / "net_3.pth")
    exp = experiment(tmp_path, folder, "seeds.reference=[5,8]")
    summary = import_zoo.run(exp)
    assert summary.imported == [5, 6, 7]
    # natural order of the paths: net_2.pt, net_10.ckpt, sub/net_3.pth
    for seed, state, name in zip([5, 6, 7], states, ["net_2.pt", "net_10.ckpt", "sub/net_3.pth"]):
        stored, meta = load_checkpoint(exp.store.checkpoint_path(seed), exp.model())
        assert all(torch.equal(stored[k], state[k]) for k in state)
        assert meta["source"] == "import" and meta["source_file"] == name and json.loads(meta["seed"]) == seed
        assert meta["archive"] == str(folder.resolve()) and "config_hash" not in meta
        assert json.loads(meta["mapping"])["strip_prefixes"] == ["model.", "module.", "_orig_mod."]
    assert sorted(range_state(exp, exp.reference).accuracies) == [5, 6, 7]
    again = import_zoo.run(exp)
    assert again.imported == [] and again.skipped_done == [5, 6, 7]


def test_released_float16_safetensors_of_torchuncertainty_resnet18_in_a_tgz(tmp_path):
    states = nets(lambda: resnet18(num_classes=100), [0, 1])
    folder = tmp_path / "cifar100-resnet18-0-1"
    folder.mkdir()
    for i, state in enumerate(states):
        # As TorchUncertainty's to_hub_format.py writes them: every tensor float16, counters included.
        half = {k: v.to(torch.float16) for k, v in tu_names(state).items()}
        for key in half:
            if key.endswith("num_batches_tracked"):
                half[key] = torch.tensor(78200.0).half()  # inf in float16
        save_file(half, str(folder / f"model_{i + 40}.safetensors"))
    archive = tmp_path / "cifar100-resnet18-0-1.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(folder, arcname=folder.name)
    exp = experiment(tmp_path, archive, "experiment=cifar100_resnet18", "zoo_import=tu_resnet18", "zoo_import.seeds_from=name")
    assert import_zoo.run(exp).imported == [40, 41]
    for seed, state in zip([40, 41], states):
        stored, meta = load_checkpoint(exp.store.checkpoint_path(seed), exp.model())
        for key, value in state.items():
            want = torch.zeros_like(value) if key.endswith("num_batches_tracked") else value.half().float()
            assert torch.equal(stored[key], want), key
        assert meta["archive"] == str(archive) and meta["source_file"].endswith(f"model_{seed}.safetensors")
        assert json.loads(meta["mapping"])["rename"][0] == {"pattern": r"^linear\.", "replacement": "fc."}


def test_a_zoo_that_needs_a_ready_made_mapping_is_refused_naming_it(tmp_path):
    """TorchUncertainty's ResNet-18 names imported without ``zoo_import=tu_resnet18``: every file
    is refused, and the message names the ready-made mapping that reads them."""
    folder = tmp_path / "zoo"
    folder.mkdir()
    for i, state in enumerate(nets(lambda: resnet18(num_classes=100, width=4), [0, 1])):
        save_file({k: v.half() for k, v in tu_names(state).items()}, str(folder / f"m_{i}.safetensors"))
    exp = experiment(tmp_path, folder, "experiment=cifar100_resnet18", "+model.kwargs.width=4")
    with pytest.raises(import_zoo.ImportFailuresError, match=r"2 of 2 files could not be imported.*unexpected key "
                                                             r"'layer\d.0.shortcut.*the ready-made mapping zoo_import=tu_resnet18 "
                                                             r"\(conf/zoo_import/tu_resnet18.yaml\) reads this file"):
        import_zoo.run(exp)
    fixed = experiment(tmp_path, folder, "experiment=cifar100_resnet18", "+model.kwargs.width=4", "zoo_import=tu_resnet18")
    assert import_zoo.run(fixed).imported == [0, 1]  # the failure records of the first try are replaced


def test_a_plain_file_with_a_wrong_key_names_no_ready_made_mapping(tmp_path):
    folder = tmp_path / "zoo"
    folder.mkdir()
    state = nets(optunet, [0])[0]
    state["fc3.weight"] = state.pop("fc2.weight")
    torch.save(state, folder / "a.pt")
    with pytest.raises(import_zoo.ImportFailuresError) as err:
        import_zoo.run(experiment(tmp_path, folder))
    assert "add a rename to zoo_import.mapping" in str(err.value) and "ready-made" not in str(err.value)


def test_imported_resnet_weights_give_the_model_the_same_function(tmp_path):
    """The mapped file predicts what the original network predicts (up to float16 rounding)."""
    model = resnet18(num_classes=100).eval()
    folder = tmp_path / "zoo"
    folder.mkdir()
    save_file({k: v.to(torch.float16) for k, v in tu_names(model.state_dict()).items()}, str(folder / "0.safetensors"))
    exp = experiment(tmp_path, folder, "experiment=cifar100_resnet18", "zoo_import=tu_resnet18")
    import_zoo.run(exp)
    imported = exp.model().eval()
    imported.load_state_dict(load_checkpoint(exp.store.checkpoint_path(0))[0])
    x = torch.randn(4, 3, 32, 32)
    torch.testing.assert_close(imported(x), model(x), rtol=0.05, atol=0.05)
    assert (imported(x).argmax(1) == model(x).argmax(1)).float().mean() >= 0.75


def test_a_zip_of_lightning_checkpoints_with_seeds_from_names(tmp_path):
    states = nets(optunet, [3, 4])
    archive = tmp_path / "zoo.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for seed, state in zip([100003, 100007], states):
            path = tmp_path / f"seed{seed}.ckpt"
            torch.save({"state_dict": {f"model.{k}": v for k, v in state.items()}}, path)
            zf.write(path, f"ckpts/seed{seed}.ckpt")
    exp = experiment(tmp_path, archive, "zoo_import.range=heldout", "zoo_import.seeds_from=name")
    assert import_zoo.run(exp).imported == [100003, 100007]
    stored, meta = load_checkpoint(exp.store.checkpoint_path(100007))
    assert torch.equal(stored["fc2.weight"], states[1]["fc2.weight"]) and meta["role"] == "heldout"


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.update({"conv1.weight": torch.randn(2, 1, 5, 5)}), r"a\.pt: key 'conv1.weight' has shape \(2, 1, 5, 5\), expected \(2, 1, 4, 4\)"),
    (lambda s: s["fc1.weight"].__setitem__((0, 0), float("nan")), r"a\.pt: tensor 'fc1.weight' contains NaN"),
    (lambda s: s.update({"fc3.weight": s.pop("fc2.weight")}),
     r"a\.pt: missing key 'fc2.weight' \(expected shape \(10, 3\)\).*unexpected key 'fc3.weight' \(did you mean 'fc2.weight'\?"),
    (lambda s: s.update({"step": 3}), r"a\.pt: entry 'step' is a int, not a tensor"),
])
def test_bad_checkpoints_are_refused_naming_file_key_and_shape(tmp_path, edit, message):
    folder = tmp_path / "zoo"
    folder.mkdir()
    state = nets(optunet, [0])[0]
    edit(state)
    torch.save(state, folder / "a.pt")
    exp = experiment(tmp_path, folder)
    with pytest.raises(import_zoo.ImportFailuresError, match="1 of 1 files could not be imported.*" + message):
        import_zoo.run(exp)
    assert not list((tmp_path / "store").rglob("*.safetensors"))
    record = exp.store.failed_seeds()[0]
    assert record["kind"] == import_zoo.UNUSABLE and re.search(message, record["reason"]) and record["source_file"] == "a.pt"


def test_imagenet_stem_resnet_is_refused(tmp_path):
    folder = tmp_path / "zoo"
    folder.mkdir()
    state = tu_names(resnet18(num_classes=100).state_dict())
    state["conv1.weight"] = torch.randn(64, 3, 7, 7)
    save_file({k: v.half() for k, v in state.items()}, str(folder / "0.safetensors"))
    with pytest.raises(CheckpointError, match=r"0.safetensors: key 'conv1.weight' has shape \(64, 3, 7, 7\), expected \(64, 3, 3, 3\)"):
        import_zoo.run(experiment(tmp_path, folder, "experiment=cifar100_resnet18", "zoo_import=tu_resnet18"))
    assert not list((tmp_path / "store").rglob("*.safetensors"))


def test_sources_and_seeds_that_cannot_work_are_refused(tmp_path):
    folder = tmp_path / "zoo"
    folder.mkdir()
    with pytest.raises(CheckpointError, match="no checkpoint file"):
        import_zoo.planned(experiment(tmp_path, folder))
    with pytest.raises(CheckpointError, match="no such file or folder"):
        import_zoo.planned(experiment(tmp_path, tmp_path / "nothing"))
    with pytest.raises(ConfigError, match="zoo_import.source: missing"):
        import_zoo.planned(Experiment(compose_config([])))
    for name in ("m1.pt", "m01.pth", "m3.pt"):
        torch.save(nets(optunet, [0])[0], folder / name)
    with pytest.raises(ConfigError, match=r"3 checkpoints but seeds.reference=\[0, 2\] holds 2 seeds; pass 'seeds.reference=\[0,3\]' or zoo_import.limit=2"):
        import_zoo.planned(experiment(tmp_path, folder, "seeds.reference=[0,2]"))
    assert import_zoo.planned(experiment(tmp_path, folder, "seeds.reference=[0,2]", "zoo_import.limit=2"))[1] == [0, 1]
    names, seeds = import_zoo.planned(experiment(tmp_path, folder, "seeds.heldout=[100000,100002]", "zoo_import.range=heldout",
                                                 "zoo_import.skip=1", "zoo_import.limit=5"))
    assert (names, seeds) == (["m01.pth", "m3.pt"], [100000, 100001])  # natural order: m1.pt, m01.pth, m3.pt
    with pytest.raises(ConfigError, match="zoo_import.skip=3: .* holds only 3 checkpoints"):
        import_zoo.planned(experiment(tmp_path, folder, "zoo_import.skip=3"))
    with pytest.raises(ConfigError, match="seed 1 .* is also the seed of"):
        import_zoo.planned(experiment(tmp_path, folder, "zoo_import.seeds_from=name"))
    with pytest.raises(ConfigError, match=r"seed 3 \(from its file name\) is outside seeds.reference=\[0, 2\]"):
        (folder / "m01.pth").unlink()
        import_zoo.planned(experiment(tmp_path, folder, "zoo_import.seeds_from=name", "seeds.reference=[0,2]"))
    with pytest.raises(ConfigError, match=r"zoo_import.mapping.drop='\(': expected a regular expression"):
        Experiment(compose_config(["zoo_import.mapping.drop=['(']"]))


def test_a_trained_checkpoint_is_never_replaced(tmp_path):
    folder = tmp_path / "zoo"
    folder.mkdir()
    torch.save(nets(optunet, [0])[0], folder / "a.pt")
    exp = experiment(tmp_path, folder)
    exp.store.ensure_writable()
    save_checkpoint(exp.store.checkpoint_path(0), nets(optunet, [1])[0], {"seed": 0})
    with pytest.raises(StoreError, match="seed 0 is already in the store \\(trained by the zoo stage\\)"):
        import_zoo.run(exp)


def test_a_late_importer_never_replaces_what_another_worker_published(tmp_path, monkeypatch, caplog):
    # Another worker publishes seed 0 while this one is reading its file: fenced publication
    # keeps the other worker's checkpoint and drops this copy with one log line.
    folder = tmp_path / "zoo"
    folder.mkdir()
    torch.save(nets(optunet, [0])[0], folder / "a.pt")
    exp = experiment(tmp_path, folder, "seeds.reference=[0,1]")
    theirs = nets(optunet, [1])[0]
    prepare = import_zoo._Importer.prepare

    def prepare_then_lose_the_race(self, file, seed, summary):
        out = prepare(self, file, seed, summary)
        save_checkpoint(exp.store.checkpoint_path(seed), theirs, {"seed": seed})
        return out

    monkeypatch.setattr(import_zoo._Importer, "prepare", prepare_then_lose_the_race)
    summary = import_zoo.run(exp)
    assert summary.imported == [] and summary.skipped_busy == [] and summary.done_elsewhere == [0]  # published there
    stored, _ = load_checkpoint(exp.store.checkpoint_path(0))
    assert all(torch.equal(stored[k], theirs[k]) for k in theirs)
    assert "another worker published it first" in caplog.text


def test_an_importer_whose_claim_was_taken_over_writes_nothing(tmp_path, monkeypatch, caplog):
    from benchmark.core.store import Claim

    folder = tmp_path / "zoo"
    folder.mkdir()
    torch.save(nets(optunet, [0])[0], folder / "a.pt")
    exp = experiment(tmp_path, folder, "seeds.reference=[0,1]", "claims.wait_s=0")
    monkeypatch.setattr(Claim, "lost", property(lambda self: True))  # every claim, the take-over's too
    with pytest.raises(HeldElsewhereError, match=r"import digits_optunet: 1 unit\(s\) .*seed 0"):
        import_zoo.run(exp)
    assert not exp.store.checkpoint_path(0).exists() and not exp.store.failed_path(0).exists()
    assert "claim was taken over while importing" in caplog.text


def test_the_import_waits_for_a_seed_claimed_on_another_host_and_takes_it_over_once_stale(tmp_path, monkeypatch,
                                                                                        caplog):
    """A seed claimed by a job on another host (killed: its heartbeat stops) is skipped on the pass,
    waited for until its claim goes stale (claims.timeout_s), then imported here."""
    folder = tmp_path / "zoo"
    folder.mkdir()
    states = nets(optunet, [0, 1])
    for i, state in enumerate(states):
        torch.save(state, folder / f"m{i}.pt")
    exp = experiment(tmp_path, folder, "seeds.reference=[0,2]", "claims.timeout_s=2", "claims.heartbeat_s=1",
                     "claims.wait_s=60")
    exp.store.ensure_writable()
    claim = exp.store.claim_path(exp.store.seed_unit(1))
    claim.parent.mkdir(parents=True, exist_ok=True)
    claim.write_text(json.dumps({"host": "node-a", "pid": 4242, "started": time.time(), "token": "theirs"}))
    monkeypatch.setenv(HOST_ENV, "node-b")
    with caplog.at_level("INFO"):
        summary = import_zoo.run(exp)
    assert summary.imported == [0, 1] and summary.skipped_busy == [] and summary.done_elsewhere == []
    stored, _ = load_checkpoint(exp.store.checkpoint_path(1))
    assert all(torch.equal(stored[k], states[1][k]) for k in states[1])
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "waiting for 1 unit(s) claimed by other processes" in text and "taking over seeds [1]" in text


def test_natural_order_and_fill_missing():
    assert sorted(["m10.pt", "m2.pt", "a/m1.pt"], key=natural_key) == ["a/m1.pt", "m2.pt", "m10.pt"]
    from benchmark.core.store.importing import KeyMapping

    reference = resnet18(num_classes=10).state_dict()
    partial = {k: v for k, v in reference.items() if not k.endswith("num_batches_tracked")}
    filled = check_against(partial, reference, KeyMapping(), "f")
    assert list(filled) == list(reference) and int(filled["bn1.num_batches_tracked"]) == 0


def test_the_command_line_imports(tmp_path, cli):
    folder = tmp_path / "zoo"
    folder.mkdir()
    for i, state in enumerate(nets(optunet, [0, 1])):
        torch.save({"state_dict": {f"model.{k}": v for k, v in state.items()}}, folder / f"{i}.ckpt")
    code, out = cli("stage=import", f"zoo_import.source={folder}", f"store={tmp_path / 'store'}", "zoo_import.evaluate=false")
    assert code == 0, out
    assert sorted(p.name for p in (tmp_path / "store" / "digits_optunet" / "zoo").glob("*.safetensors")) == [
        "seed_000000.safetensors", "seed_000001.safetensors"]
    code, out = cli("stage=import", f"zoo_import.source={tmp_path / 'nope'}", f"store={tmp_path / 'store'}")
    assert code == 1 and "zoo_import.source=" in out and "no such file or folder" in out


def optunet_files(folder, count, suffix=".safetensors"):
    """``count`` small OptuNet checkpoints ``m_<i>`` in ``folder``; their state dicts by name."""
    folder.mkdir(parents=True, exist_ok=True)
    states = {}
    for i, state in enumerate(nets(optunet, range(count))):
        name = f"m_{i}{suffix}"
        save_file(state, str(folder / name)) if suffix == ".safetensors" else torch.save(state, folder / name)
        states[name] = state
    return states


def tgz(path, folder, names):
    """``folder``'s files ``names`` as a gzip tar at ``path``, members in the order of ``names``."""
    with tarfile.open(path, "w:gz") as tar:
        for name in names:
            tar.add(folder / name, arcname=name)
    return path


def test_a_bad_file_is_recorded_and_the_import_goes_on_then_is_retried(tmp_path):
    folder = tmp_path / "zoo"
    states = optunet_files(folder, 4, suffix=".pt")
    (folder / "m_1.pt").write_bytes(b"not a checkpoint")  # unreadable
    bad = dict(states["m_2.pt"])
    bad["fc1.bias"] = torch.tensor([0.0, float("inf"), 0.0])  # non-finite
    torch.save(bad, folder / "m_2.pt")
    exp = experiment(tmp_path, folder)
    with pytest.raises(import_zoo.ImportFailuresError,
                       match=r"2 of 4 files could not be imported .*seed 1: m_1.pt: cannot read the checkpoint .*"
                             r"seed 2: m_2.pt: tensor 'fc1.bias' contains NaN or Inf"):
        import_zoo.run(exp)
    assert exp.store.completed_seeds() == [0, 3]  # the others were imported all the same
    records = exp.store.failed_seeds()
    assert sorted(records) == [1, 2] and all(r["kind"] == import_zoo.UNUSABLE for r in records.values())
    assert "cannot read the checkpoint" in records[1]["reason"] and records[2]["source_file"] == "m_2.pt"
    torch.save(states["m_1.pt"], folder / "m_1.pt")  # fixed; m_2 still bad: tried again, recorded again
    with pytest.raises(import_zoo.ImportFailuresError, match="1 of 4 files"):
        import_zoo.run(exp)
    assert exp.store.completed_seeds() == [0, 1, 3] and sorted(exp.store.failed_seeds()) == [2]
    stored, meta = load_checkpoint(exp.store.checkpoint_path(1), exp.model())
    assert torch.equal(stored["fc2.weight"], states["m_1.pt"]["fc2.weight"]) and meta["source_file"] == "m_1.pt"


def test_a_damaged_failure_record_is_a_one_line_error(tmp_path):
    folder = tmp_path / "zoo"
    optunet_files(folder, 2)
    exp = experiment(tmp_path, folder)
    exp.store.ensure_writable()
    exp.store.failed_path(1).write_text('{"reason": "validation accura')  # cut mid-write by another tool
    with pytest.raises(StoreError, match=r"seed_000001.json: the failure record of seed 1 is damaged \(JSONDecodeError.*"
                                         r"Run stage=verify verify.repair=true"):
        import_zoo.run(exp)
    assert exp.store.completed_seeds() == []  # refused before any work
    exp.store.failed_path(1).write_text("[1, 2]")
    with pytest.raises(StoreError, match="damaged \\(not a JSON object with a 'reason'\\)"):
        import_zoo.run(exp)


@pytest.mark.parametrize("kind", ["tgz", "zip"])
def test_an_archive_naming_a_member_twice_is_refused(tmp_path, kind):
    folder = tmp_path / "zoo"
    optunet_files(folder, 3)
    archive = tmp_path / f"zoo.{kind}"
    if kind == "tgz":
        with tarfile.open(archive, "w:gz") as tar:  # as `tar -rf` appending a second copy would leave it
            for name in ("m_0.safetensors", "m_1.safetensors", "m_2.safetensors", "m_1.safetensors"):
                tar.add(folder / name, arcname=f"zoo/{name}")
    else:
        with zipfile.ZipFile(archive, "w") as zf, pytest.warns(UserWarning, match="Duplicate name"):
            for name in ("m_0.safetensors", "m_1.safetensors", "m_2.safetensors", "m_1.safetensors"):
                zf.write(folder / name, f"zoo/{name}")
    with pytest.raises(CheckpointError, match=r"1 member name\(s\) appear more than once in the archive: "
                                              r"'zoo/m_1.safetensors' \(2 times\).*repack the archive"):
        import_zoo.planned(experiment(tmp_path, archive))
    assert not (tmp_path / "store").exists()


def test_members_left_out_are_logged(tmp_path, caplog):
    folder = tmp_path / "zoo"
    optunet_files(folder, 2)
    (folder / "README.md").write_text("released zoo")
    archive = tmp_path / "zoo.tar"
    with tarfile.open(archive, "w") as tar:
        for name in ("m_0.safetensors", "m_1.safetensors", "README.md"):
            tar.add(folder / name, arcname=name)
        link = tarfile.TarInfo("m_2.safetensors")
        link.type, link.linkname = tarfile.SYMTYPE, "m_0.safetensors"
        tar.addfile(link)
        tar.add(folder / "m_1.safetensors", arcname="._m_3.safetensors")  # macOS metadata beside a file
    exp = experiment(tmp_path, archive)
    with caplog.at_level("WARNING", logger="benchmark.stages.import_zoo"):
        assert import_zoo.run(exp).imported == [0, 1]
    lines = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert len(lines) == 1 and "3 entries" in lines[0]
    assert "README.md (not a checkpoint file" in lines[0] and "._m_3.safetensors (a hidden file)" in lines[0]
    assert "m_2.safetensors (a symbolic link to 'm_0.safetensors', not followed" in lines[0]


class CountingFile(io.FileIO):
    """A file that counts the bytes read from it."""

    def __init__(self, path):
        super().__init__(path, "rb")
        self.bytes_read = 0

    def read(self, size=-1):
        data = super().read(size)
        self.bytes_read += len(data)
        return data

    def readinto(self, buffer):
        count = super().readinto(buffer)
        self.bytes_read += count or 0
        return count


def test_a_tgz_is_read_in_one_pass_in_its_own_order(tmp_path, monkeypatch):
    """Members read in archive order, each once, and the compressed file read about twice (one
    listing, one reading) whatever the order of the names: before, natural order seeked backwards
    through the gzip stream, which decompresses it again from the start every time."""
    count = 24
    folder = tmp_path / "zoo"
    states = optunet_files(folder, count)
    order = [f"m_{i}.safetensors" for i in torch.randperm(count, generator=torch.Generator().manual_seed(0)).tolist()]
    archive = tgz(tmp_path / "zoo.tgz", folder, order)  # as `tar czf` writes a folder: directory order, not sorted
    opened, extracted = [], []
    real_open, real_extract = tarfile.open, tarfile.TarFile.extractfile

    def counting_open(name=None, mode="r", fileobj=None, **kwargs):
        if fileobj is None and name is not None and str(name) == str(archive):
            fileobj = CountingFile(name)
            opened.append(fileobj)
        return real_open(name, mode, fileobj, **kwargs)

    def recording_extract(self, member):
        extracted.append(member if isinstance(member, str) else member.name)
        return real_extract(self, member)

    monkeypatch.setattr(tarfile, "open", counting_open)
    monkeypatch.setattr(tarfile.TarFile, "extractfile", recording_extract)
    exp = experiment(tmp_path, archive)
    summary = import_zoo.run(exp)
    assert summary.imported == list(range(count))
    assert extracted == order  # archive order, each member once
    size = archive.stat().st_size
    assert sum(f.bytes_read for f in opened) <= 3 * size, (sum(f.bytes_read for f in opened), size)
    for seed in range(count):  # seeds still follow the natural order of the names
        stored, meta = load_checkpoint(exp.store.checkpoint_path(seed), exp.model())
        assert meta["source_file"] == f"m_{seed}.safetensors"
        assert torch.equal(stored["fc1.weight"], states[f"m_{seed}.safetensors"]["fc1.weight"])


def test_chance_level_and_margin():
    # the best constant guess: the most frequent class, at least 1/classes
    assert import_zoo.chance_level(torch.tensor([0, 0, 1, 2]), 10) == 0.5
    assert import_zoo.chance_level(torch.arange(200).repeat(50), 200) == pytest.approx(1 / 200)
    # a few points on a full test split; 3 standard errors of a chance accuracy on a small one
    assert import_zoo.near_chance_margin(0.1, 10_000, 0.05) == 0.05
    assert import_zoo.near_chance_margin(0.25, 8, 0.05) == pytest.approx(3 * (0.25 * 0.75 / 8) ** 0.5)


def test_an_imported_heldout_pool_short_of_seeds_asks_for_another_import_and_training_there_warns(tmp_path, caplog):
    """Held-out networks imported into part of seeds.heldout: the sample stage names the import that
    completes the pool, not stage=zoo (which would mix locally trained networks into it), and the zoo
    stage, asked anyway, says in a warning that it mixes them."""
    from benchmark.stages.sample import MissingBasesError, select_bases
    from benchmark.stages.zoo import run_zoo

    folder = tmp_path / "zoo"
    folder.mkdir()
    for i, state in enumerate(nets(optunet, [0, 1, 2])):
        torch.save(state, folder / f"m_{i}.pt")
    overrides = ("zoo_import.range=heldout", "seeds.heldout=[100000,100004]", "train.epochs=1", "train.fail_rule.epoch=1",
                 "train.fail_rule.final_min_accuracy=null", "zoo.crosscheck=0")
    exp = experiment(tmp_path, folder, *overrides)
    assert import_zoo.run(exp).imported == [100000, 100001, 100002]
    with pytest.raises(MissingBasesError) as err:
        select_bases(exp, 2)
    message = str(err.value)
    assert "1 of the 4 seeds of seeds.heldout=[100000, 100004] are not in the store" in message
    assert f"were imported (from {folder.resolve()} (3))" in message and "stage=import" in message
    assert "zoo_import.range=heldout" in message and "mix locally trained networks into the imported pool" in message
    assert "seeds.heldout=[100000,100003]" in message  # or the imported seeds alone, if they suffice
    with caplog.at_level("WARNING"):
        run_zoo(exp, exp.heldout)
    assert "will mix locally trained networks with imported ones" in caplog.text and f"{folder.resolve()} (3)" in caplog.text
