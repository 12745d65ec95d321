"""stage=verify: per-experiment report of complete, missing, quarantined, corrupt and stale files;
repair quarantines what is bad so that the next run redoes it; non-zero exit when anything is bad."""
from __future__ import annotations

import dataclasses
import logging

import pytest
from safetensors.torch import save_file

from benchmark.config import VerifyScope
from benchmark.experiment import Experiment
from benchmark.stages import verify
from benchmark.stages.sample import run as run_sample
from benchmark.stages.zoo import run_zoo
from benchmark.core.store import load_checkpoint, read_metadata
from tests.benchmark.stages.test_healing import TINY, exp, healthy  # noqa: F401 (fixtures)

pytestmark = pytest.mark.usefixtures("single_torch_thread")
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
    save_file(state, str(old), metadata={k: v for k, v in meta.items() if k != "checksums"})  # an older version's file
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
    with pytest.raises(verify.StoreIntegrityError, match="quarantined"):
        verify.run(_with(exp, repair=True))
    moved = sorted(p.name for p in exp.store.zoo_dir.glob("quarantine/*.safetensors"))
    assert moved == ["seed_000001.safetensors", "seed_100000.safetensors", "seed_100002.safetensors"]
    assert [p.name for p in exp.store.preds_dir.glob("quarantine/*.safetensors")] == ["ensemble_multi_r0.safetensors"]
    assert "moved to" in "\n".join(r.getMessage() for r in caplog.records)

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


def test_verify_counts_litter_of_killed_processes_without_calling_it_an_error(tmp_path, caplog):
    import os
    import time

    from benchmark.core.store import ExperimentStore

    store = ExperimentStore(tmp_path, "exp", claim_timeout_s=60, claim_heartbeat_s=30)
    store.ensure_writable()
    for name in ("zoo-seed_000001.claim.stale-0123456789ab", ".clock-node-1-7-deadbeef"):
        (store.claims_dir / name).write_bytes(b"")
        os.utime(store.claims_dir / name, (time.time() - 600, time.time() - 600))
    health = verify.ExperimentHealth("exp", "test")
    with caplog.at_level(logging.INFO):
        verify.check_leftovers(store, health)
    assert "exp: 2 file(s) of litter left by killed processes (reaped by the next run)" in caplog.text
    assert not health.bad and all(r.levelno == logging.INFO for r in caplog.records)
