import pytest

from benchmark.core.store import ExperimentStore, StoreError
from benchmark.core.store.layout import _compact


def test_paths_seeds_and_failures(tmp_path):
    store = ExperimentStore(tmp_path, "exp")
    store.ensure_writable()
    assert store.checkpoint_path(42).name == "seed_000042.safetensors"
    store.checkpoint_path(3).write_bytes(b"x")
    store.record_failure(5, {"reason": "dead units"})
    assert store.completed_seeds() == [3]
    assert store.failed_seeds() == {5: {"seed": 5, "reason": "dead units"}}
    with pytest.raises(StoreError, match=r"no checkpoint for seeds 4-6, 9"):
        store.checkpoint_paths([3, 4, 5, 6, 9])
    with pytest.raises(ValueError, match="reason"):
        store.record_failure(1, {})


def test_unwritable_store_names_the_option(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(StoreError, match=r"store=.*file/sub: cannot write.*Not a directory.*store=/path/to/store"):
        ExperimentStore(blocker / "sub", "exp").ensure_writable()


def test_damaged_failure_records_are_left_out_and_listed(tmp_path):
    store = ExperimentStore(tmp_path, "exp")
    store.ensure_writable()
    store.record_failure(5, {"reason": "dead units"})
    store.failed_path(6).write_text('{"reason": "dead')
    store.failed_path(7).write_text("[1, 2]")
    assert store.failed_seeds() == {5: {"seed": 5, "reason": "dead units"}}
    assert sorted(store.unreadable_failure_records()) == [6, 7]
    assert "seed_000006.json: damaged failure record" in store.unreadable_failure_records()[6]


def test_compact_ranges():
    assert _compact([7, 1, 2, 3, 5]) == "1-3, 5, 7"


def test_the_write_probe_has_a_name_of_its_own(tmp_path):
    """Another node's process with the same pid (pid 1 in containers) probing at the same moment
    must not make this store look unwritable; the probe is removed after use."""
    import os

    store = ExperimentStore(tmp_path, "exp")
    store.claims_dir.mkdir(parents=True)
    (store.claims_dir / f".write-probe-{os.getpid()}").mkdir()  # the other node's probe, in use
    store.ensure_writable()
    assert [p.name for p in store.claims_dir.iterdir()] == [f".write-probe-{os.getpid()}"]


def test_litter_of_killed_processes_is_listed_and_reaped_but_nothing_live(tmp_path, caplog):
    import logging
    import os
    import time

    from benchmark.core.store import try_claim

    store = ExperimentStore(tmp_path, "exp", claim_timeout_s=60, claim_heartbeat_s=30)
    store.ensure_writable()
    for d in (store.reference_dir, store.eval_dir):
        d.mkdir()
    old = [store.claims_dir / "zoo-seed_000001.claim.stale-0123456789ab",
           store.claims_dir / "zoo-seed_000003.claim.0f0f",  # a unique name whose claim is gone
           store.claims_dir / ".clock-node-1-7-deadbeef", store.claims_dir / ".write-probe-node-1-7-deadbeef",
           store.reference_dir / ".canonical.safetensors.tmp-12-abcdef01",
           store.eval_dir / ".swag_one_r0.json.tmp-12-abcdef01",
           store.samples_dir / ".swag_one_r0.safetensors.tmp-12-abcdef01"]
    young = [store.eval_dir / ".laplace_one_r0.json.tmp-13-abcdef01",
             store.claims_dir / "zoo-seed_000002.claim.abc.taken-def"]  # a ticket just taken (its ctime): in use
    claimed_tmp = store.zoo_dir / ".seed_000009.safetensors.tmp-14-abcdef01"  # its unit is claimed
    for path in old + young + [claimed_tmp]:
        path.write_bytes(b"")
    with try_claim(store.claim_path(store.seed_unit(9)), timeout_s=60, heartbeat_s=30) as claim:
        long_ago = time.time() - 600
        live_unique = store.claim_path(store.seed_unit(9)).with_name(f"{store.claim_path(store.seed_unit(9)).name}.{claim.token}")
        for path in old + [claimed_tmp, young[1]]:
            os.utime(path, (long_ago, long_ago))
        assert sorted(store.litter()) == sorted(old)
        with caplog.at_level(logging.INFO):
            store.reap_stale_claims()
        assert "removed 7 file(s) of litter" in caplog.text
        assert not any(p.exists() for p in old) and all(p.exists() for p in young + [claimed_tmp, live_unique])
        assert store.claim_path(store.seed_unit(9)).exists() and not claim.lost


def test_chain_states_and_claims_are_named_by_the_store(tmp_path):
    import os
    import time

    store = ExperimentStore(tmp_path, "exp", claim_timeout_s=60, claim_heartbeat_s=30)
    store.ensure_writable()
    unit = store.sample_unit("hmc", "multi", 2)
    assert store.chain_files(unit).path(7) == tmp_path / "exp" / "chains" / "hmc_multi_r2" / "seed_000007.safetensors"
    with store.chain_claim(unit, 7) as claim, store.chain_claim(unit, 8) as other:
        assert claim is not None and other is not None  # one claim per chain
        assert (store.claims_dir / "sample-hmc-multi-r2-chain-7.claim").exists()
        with store.chain_claim(unit, 7) as again:
            assert again is None  # held here: busy
        with store.claim(unit) as whole:
            assert whole is not None  # the unit's own claim is another one
    with pytest.raises(ValueError, match="zoo seed, not a row"):
        store.seed_unit(3).chain_stem(1)
    killed = store.chains_dir(unit) / ".seed_000007.safetensors.tmp-12-abcdef01"  # a chain-state write killed
    killed.parent.mkdir(parents=True)
    killed.write_bytes(b"")
    assert store.litter() == []  # young: perhaps a live writer's
    os.utime(killed, (time.time() - 600, time.time() - 600))
    assert store.litter() == [killed]
