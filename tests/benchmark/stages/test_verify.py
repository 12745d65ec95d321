"""stage=verify: per-experiment report of complete, missing, quarantined, corrupt and stale files;
repair quarantines what is bad so that the next run redoes it; non-zero exit when anything is bad."""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
from safetensors.torch import save_file

from benchmark.config import VerifyScope
from benchmark.experiment import Experiment
from benchmark.stages import verify
from benchmark.stages.sample import run as run_sample
from benchmark.stages.zoo import run_zoo
from benchmark.core.store import load_checkpoint, read_metadata
from tests.benchmark.stages.test_healing import TINY, exp, healthy  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_torch_thread")]
from bench.corruptions import _rewrite, _tensors_and_metadata, corrupt


def _with(exp, **changes):
    return Experiment(dataclasses.replace(exp.config, verify=dataclasses.replace(exp.config.verify, **changes)))


def test_a_healthy_store_passes(exp, caplog):
    with caplog.at_level(logging.INFO, logger="benchmark.stages.verify"):
        (health,) = verify.run(exp)
    assert not health.bad
    assert health.zoo["reference [0, 2)"]["complete"] == 2 and health.zoo["heldout [100000, 100003)"]["complete"] == 3
    assert health.samples["complete"] == 1 and health.samples["missing"] >= 5 and health.samples["corrupt"] == 0
    assert any("nothing corrupt or stale" in r.getMessage() for r in caplog.records)


def test_corrupt_and_stale_files_are_reported_then_repaired_and_redone(exp, caplog):
    corrupt(exp.store.checkpoint_path(1), "bitflip")
    tensors, metadata = _tensors_and_metadata(exp.store.checkpoint_path(100002))
    _rewrite(exp.store.checkpoint_path(100002), tensors, {**metadata, "config_hash": "0123456789abcdef"})
    corrupt(exp.store.preds_path(exp.store.sample_unit("ensemble", "multi")), "truncate")
    old = exp.store.checkpoint_path(100000)
    state, meta = load_checkpoint(old)
    save_file(state, str(old), metadata={k: v for k, v in meta.items() if k not in ("checksums", "format")})  # an older version's file
    with caplog.at_level(logging.INFO, logger="benchmark.stages.verify"):
        with pytest.raises(verify.StoreIntegrityError, match=r"4 corrupt or stale file\(s\) in digits_optunet.*verify.repair=true"):
            verify.run(exp)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "zoo reference [0, 2): 1 complete, 0 missing, 0 failed to converge, 1 corrupt, 0 stale, 0 quarantined" in text
    assert "zoo heldout [100000, 100003): 1 complete, 0 missing, 0 failed to converge, 0 corrupt, 2 stale" in text
    assert "samples: 0 complete" in text and "1 corrupt" in text
    assert "CORRUPT: " + str(exp.store.checkpoint_path(1)) + ": checksum mismatch" in text
    assert "STALE: " + str(exp.store.checkpoint_path(100002)) + ": trained with config_hash 0123456789abcdef" in text
    assert "written before content checksums" in text
    assert list(exp.store.zoo_dir.glob("quarantine/*")) == []  # without repair nothing moves

    caplog.clear()
    with pytest.raises(verify.StoreIntegrityError, match="the corrupt ones were quarantined"):
        verify.run(_with(exp, repair=True))  # corrupt files only
    moved = sorted(p.name for p in exp.store.zoo_dir.glob("quarantine/*.safetensors"))
    assert moved == ["seed_000001.safetensors"]
    assert [p.name for p in exp.store.preds_dir.glob("quarantine/*.safetensors")] == ["ensemble_multi_r0.safetensors"]
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "moved to" in text and "verify.repair=stale quarantines it" in text
    with pytest.raises(verify.StoreIntegrityError, match="quarantined"):
        verify.run(_with(exp, repair="stale"))  # now the stale ones too
    moved = sorted(p.name for p in exp.store.zoo_dir.glob("quarantine/*.safetensors"))
    assert moved == ["seed_000001.safetensors", "seed_100000.safetensors", "seed_100002.safetensors"]

    run_zoo(exp, exp.reference), run_zoo(exp, exp.heldout), run_sample(exp)  # the next run redoes them
    (health,) = verify.run(exp)
    assert not health.bad and health.zoo["heldout [100000, 100003)"]["quarantined"] == 2
    assert health.samples["quarantined"] == 1 and health.samples["complete"] == 1


def test_the_whole_store_is_scanned(exp, tmp_path):
    other = exp.store.root / "someone_elses"
    (other / "zoo").mkdir(parents=True)
    (other / "zoo" / "seed_000004.safetensors").write_bytes(b"\x08" + b"\x00" * 7 + b"{}      ")
    assert [h.name for h in verify.run(_with(exp, scope=VerifyScope.experiment))] == ["digits_optunet"]
    with pytest.raises(verify.StoreIntegrityError, match=r"1 corrupt or stale file\(s\) in someone_elses"):
        verify.run(exp)


def test_the_cli_exits_non_zero_on_a_damaged_store(exp, tmp_path, cli):
    corrupt(exp.store.checkpoint_path(0), "garbage")
    other = exp.store.root / "mnist_optunet" / "zoo" / "seed_000003.safetensors"  # another experiment's folder
    other.parent.mkdir(parents=True)
    other.write_bytes(b"not a checkpoint")
    args = ["stage=verify", f"store={exp.store.root}", *TINY, "threads=1"]
    code, out = cli(*args)
    assert code == 1, out
    assert "CORRUPT: " + str(exp.store.checkpoint_path(0)) + ": corrupt or truncated safetensors header" in out
    assert "StoreIntegrityError: store" in out and "in digits_optunet, mnist_optunet" in out
    assert "mnist_optunet (checked against conf/experiment/mnist_optunet.yaml)" in out
    assert "CORRUPT: " + str(other) + ": corrupt or truncated safetensors header" in out
    code, out = cli(*args, "verify.repair=true")
    assert code == 1 and (exp.store.zoo_dir / "quarantine" / "seed_000000.safetensors").exists()
    assert read_metadata(exp.store.checkpoint_path(1))["experiment"] == "digits_optunet"


def test_repair_is_an_enum_and_make_verify_repair_still_means_corrupt_only(exp):
    from benchmark.config import ConfigError, Repair, resolve_config
    from benchmark.loader import compose_config

    for override, mode in (("verify.repair=true", Repair.corrupt), ("verify.repair=stale", Repair.stale),
                           ("verify.repair=false", Repair.off)):
        assert resolve_config(compose_config([override])).verify.repair_mode is mode
    with pytest.raises(ConfigError, match=r"verify.repair='all': expected false, true or stale"):
        resolve_config(compose_config(["verify.repair=all"]))
    makefile = (Path(__file__).parents[3] / "Makefile").read_text()
    assert "$(if $(REPAIR),verify.repair=$(if $(filter stale,$(REPAIR)),stale,true))" in makefile


def test_checkpoints_without_config_hash_are_not_stale(exp):
    """Imported checkpoints (and other tools') carry no config_hash: verify passes, repair moves nothing."""
    for seed in (0, 100001):
        path = exp.store.checkpoint_path(seed)
        tensors, metadata = _tensors_and_metadata(path)
        _rewrite(path, tensors, {k: v for k, v in metadata.items() if k != "config_hash"})
    (health,) = verify.run(_with(exp, repair="stale"))
    assert not health.bad and health.zoo["reference [0, 2)"]["complete"] == 2
    assert list(exp.store.zoo_dir.glob("quarantine/*")) == []


def test_another_experiments_stale_files_are_reported_never_repaired(exp, caplog):
    """scope=store: another experiment is judged against its yaml defaults, not the overrides it
    was made with; its 'stale' files are reported as possibly stale, never moved, and do not fail."""
    other = Experiment(compose_config_for(exp, "experiment=mnist_optunet"))
    other.store.zoo_dir.mkdir(parents=True)
    tensors, _ = _tensors_and_metadata(exp.store.checkpoint_path(0))
    path = other.store.checkpoint_path(3)
    _rewrite(path, {k: v for k, v in tensors.items()}, {"experiment": "mnist_optunet", "seed": "3",
                                                       "config_hash": "made-with-overrides"})
    with caplog.at_level(logging.INFO, logger="benchmark.stages.verify"):
        reports = verify.run(_with(exp, repair="stale"))
    assert [h.name for h in reports] == ["digits_optunet", "mnist_optunet"] and not any(h.bad for h in reports)
    assert path.exists() and not list(other.store.zoo_dir.glob("quarantine/*"))
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "POSSIBLY STALE: " in text and "reported only" in text


def test_a_file_healed_between_its_check_and_the_repair_is_not_quarantined(exp, monkeypatch):
    """The identity is recorded before the file is read: a concurrent run that replaces the damaged
    file by a good one after verify read it keeps its file."""
    import os
    import shutil

    path = exp.store.checkpoint_path(1)
    good = path.with_name("good-copy")
    shutil.copy(path, good)
    corrupt(path, "bitflip")
    real = verify.seed_problem

    def check_then_heal(target, seed, shapes=None):
        problem = real(target, seed, shapes)
        if seed == 1:
            os.replace(good, path)  # another run's quarantine-and-retrain finishes meanwhile
        return problem

    monkeypatch.setattr(verify, "seed_problem", check_then_heal)
    with pytest.raises(verify.StoreIntegrityError):
        (health,) = verify.run(_with(exp, repair=True))
    assert path.exists() and not list(exp.store.zoo_dir.glob("quarantine/*"))
    load_checkpoint(path)  # the healed file, untouched


def compose_config_for(exp, *overrides):
    from benchmark.loader import compose_config

    return compose_config([f"store={exp.config.store}", f"results={exp.config.results}", *TINY, *overrides])


def test_files_of_store_format_1_are_counted_not_stale(exp, caplog):
    """A checkpoint written by the previous version (tensor checksums, no metadata digest) is
    usable: counted in the report, never stale, never moved."""
    import json as _json

    from benchmark.core.store.checksum import tensor_digest

    path = exp.store.checkpoint_path(0)
    state, meta = load_checkpoint(path)
    old = {k: v for k, v in meta.items() if k not in ("checksums", "format")}
    old["checksums"] = _json.dumps({"algorithm": "xxh3_64", "tensors": {k: tensor_digest(v) for k, v in state.items()}})
    save_file(state, str(path), metadata=old)
    with caplog.at_level(logging.INFO, logger="benchmark.stages.verify"):
        (health,) = verify.run(_with(exp, repair="stale"))
    assert not health.bad and health.metadata_unverified == 1 and path.exists()
    assert any("1 file(s) of store format 1" in r.getMessage() for r in caplog.records)


def test_verify_counts_litter_of_killed_processes_without_calling_it_an_error(tmp_path, caplog):
    import os
    import time

    from benchmark.core.store import ExperimentStore

    store = ExperimentStore(tmp_path, "exp", claim_timeout_s=60, claim_heartbeat_s=30)
    store.ensure_writable()
    for name in ("zoo-seed_000001.claim.stale-0123456789ab", ".clock-node-1-7-deadbeef"):
        (store.claims_dir / name).write_bytes(b"")
        os.utime(store.claims_dir / name, (time.time() - 600, time.time() - 600))
    results = tmp_path / "results" / "exp"
    (results / "figures").mkdir(parents=True)
    killed = [results / ".metrics.csv.tmp-12-abcdef01", results / "figures" / ".toy.png.tmp-3-0badcafe"]
    young = results / ".table1.md.tmp-13-abcdef01"  # a live writer's
    for path in (*killed, young):
        path.write_bytes(b"")
    for path in killed:
        os.utime(path, (time.time() - 600, time.time() - 600))
    health = verify.ExperimentHealth("exp", "test")
    with caplog.at_level(logging.INFO):
        verify.check_leftovers(store, health, results)
    assert "exp: 2 file(s) of litter left by killed processes (reaped by the next run)" in caplog.text
    assert f"exp: 2 temp file(s) of killed writers in {results}" in caplog.text
    assert sorted(store.results_litter(results)) == sorted(killed)
    assert not health.bad and all(r.levelno == logging.INFO for r in caplog.records)


def test_a_dangling_symlink_and_a_loop_in_place_of_checkpoints_are_named_repaired_and_retrained(exp, caplog):
    """Issue #30, item 5: a dangling symlink in place of a checkpoint made ``stage=zoo`` exit 0
    and leave it, evaluate say "no checkpoint", and verify's repair say "already gone"; a symlink
    loop made verify crash with ``OSError: [Errno 40]``. Each is one line naming it; repair
    quarantines the link itself; the zoo retrains the seed."""
    from benchmark.stages.evaluate import run as run_evaluate

    dangling, loop = exp.store.checkpoint_path(1), exp.store.checkpoint_path(100001)
    original = dangling.read_bytes()
    dangling.unlink()
    dangling.symlink_to(exp.store.zoo_dir / "gone.safetensors")
    loop.unlink()
    loop.symlink_to(loop)
    with pytest.raises(Exception, match=r"seed_000001.safetensors: a symlink that leads nowhere"):
        run_evaluate(exp)
    with caplog.at_level(logging.INFO, logger="benchmark.stages.verify"):
        with pytest.raises(verify.StoreIntegrityError, match=r"2 corrupt or stale file\(s\)"):
            verify.run(exp)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert f"CORRUPT: {dangling}: a symlink that leads nowhere" in text
    assert f"CORRUPT: {loop}: a symlink that leads nowhere" in text and "Too many levels of symbolic links" in text
    with pytest.raises(verify.StoreIntegrityError, match="quarantined"):
        verify.run(_with(exp, repair=True))
    assert not dangling.is_symlink() and not loop.is_symlink()
    assert sorted(p.name for p in exp.store.zoo_dir.glob("quarantine/*.safetensors")) == [dangling.name, loop.name]
    run_zoo(exp, exp.reference), run_zoo(exp, exp.heldout)
    assert dangling.read_bytes() == original
    (health,) = verify.run(exp)
    assert not health.bad


def test_the_zoo_stage_retrains_a_seed_whose_checkpoint_is_a_dangling_symlink(exp):
    path = exp.store.checkpoint_path(0)
    original = path.read_bytes()
    path.unlink()
    path.symlink_to(exp.store.zoo_dir / "gone.safetensors")
    summary = run_zoo(exp, exp.reference)
    assert summary.trained == [0] and "symlink that leads nowhere" in summary.quarantined[0]
    assert path.read_bytes() == original


def test_verify_checks_the_reference_and_number_caches_and_removes_orphaned_folders(exp, tmp_path, caplog):
    """Issue #30, item 4: ``stage=verify`` did not check ``reference/``, and old ``canonical-<key>/``
    folders stayed for good. Damaged caches are named (bad), orphaned form folders reported with
    their size; ``verify.repair=true`` removes both; evaluate then rebuilds what it needs."""
    import shutil

    from bench.corruptions import corrupt
    from benchmark.stages.evaluate import run as run_evaluate

    streamed = Experiment(dataclasses.replace(exp.config, evaluate=dataclasses.replace(exp.config.evaluate,
                                                                                         max_in_memory_gb=1e-6)))
    first = run_evaluate(streamed)
    (form,) = exp.store.reference_dir.glob("canonical-*")
    old = form.with_name("canonical-0123456789abcdef0123")  # a key of an older version of the code
    shutil.copytree(form, old)
    corrupt(sorted(form.glob("seed_*"))[1], "bitflip")
    (number,) = sorted(exp.store.eval_dir.glob("*.json"))[:1]
    number.write_text(number.read_text().replace('"key"', '"kee"'))
    with caplog.at_level(logging.INFO, logger="benchmark.stages.verify"):
        with pytest.raises(verify.StoreIntegrityError, match=r"2 corrupt or stale file\(s\)"):
            verify.run(streamed)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "1 orphaned cache folder(s)" in text and f"ORPHANED CACHE: {old} (" in text
    assert f"CORRUPT CACHE: {sorted(form.glob('seed_*'))[1]}: checksum mismatch" in text
    assert f"CORRUPT CACHE: {number}" in text
    with pytest.raises(verify.StoreIntegrityError):
        verify.run(_with(streamed, repair=True))
    assert not old.exists() and not number.exists() and len(list(form.glob("seed_*"))) == 1
    pd_first = first.drop(columns=[c for c in first.columns if c.endswith("_hw")])
    again = run_evaluate(streamed)
    assert pd_first.equals(again.drop(columns=[c for c in again.columns if c.endswith("_hw")]))
    (health,) = verify.run(streamed)
    assert not health.bad and not health.orphans


def test_an_incomplete_store_fails_naming_what_is_missing_its_claims_and_the_commands(exp, cli, monkeypatch, caplog):
    """Issue 38: verify reported "5 missing ... claims: 8 live", exited 0 and ended "nothing corrupt or
    stale". Missing seeds and units of the current experiment now fail it, each named with its claim
    (live: in progress elsewhere; stale: a dead holder) and the command that makes it."""
    import json
    import os
    import time

    from benchmark.core.store.claims import HOST_ENV

    monkeypatch.setenv(HOST_ENV, "node-b")
    for seed in (1, 100001):
        exp.store.checkpoint_path(seed).unlink()
    for seed, age in ((1, 0), (100001, 3600)):  # node-a: one claim live, one whose heartbeat stopped an hour ago
        path = exp.store.claim_path(exp.store.seed_unit(seed))
        path.write_text(json.dumps({"host": "node-a", "pid": 4242, "started": time.time(), "token": f"t{seed}"}))
        os.utime(path, (time.time() - age, time.time() - age))
    exp.store.preds_path(exp.store.sample_unit("ensemble", "multi", 0)).unlink()
    with caplog.at_level(logging.INFO, logger="benchmark.stages.verify"):
        with pytest.raises(verify.StoreIncompleteError, match=r"nothing corrupt or stale, but digits_optunet is "
                                                              r"incomplete: zoo reference \[0, 2\): 1 seed\(s\) missing"):
            verify.run(exp)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert ("INCOMPLETE: zoo reference [0, 2): 1 seed(s) missing (seed 1) [in progress elsewhere (live claims): "
            "seed 1 (node-a pid 4242, heartbeat 0 s old); wait for them] -> python -m benchmark stage=zoo "
            "experiment=digits_optunet") in text
    assert ("INCOMPLETE: zoo heldout [100000, 100003): 1 seed(s) missing (seed 100001) [claimed by dead holders "
            "(stale claims): seed 100001 (node-a pid 4242, heartbeat 3600 s old, stale: heartbeat 3600 s old "
            "(timeout 300 s)); the next run takes them over]") in text
    assert ("INCOMPLETE: samples: 1 unit(s) of method=ensemble mode=both missing (ensemble/multi/r0) -> python -m "
            "benchmark stage=sample experiment=digits_optunet method=ensemble mode=both") in text
    assert "nothing corrupt or stale" not in text
    code, out = cli("stage=verify", f"store={exp.store.root}", *TINY, "threads=1")
    assert code == 1 and "StoreIncompleteError: store" in out and "INCOMPLETE: zoo heldout" in out, out
