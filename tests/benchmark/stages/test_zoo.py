import json
import os
import signal
import threading
import time

import numpy as np
import pytest
import torch

from benchmark.config import ConfigError
from benchmark.experiment import Experiment, SeedRange
from benchmark.stages import zoo
from benchmark.stages.zoo import TrainingDivergedError, run_zoo
from benchmark.core.store import load_checkpoint
from benchmark.core.store.claims import HOST_ENV
from tests.benchmark.core.data import formats
from tests.conftest import TINY_TRAIN, compose_config
from tests.processes import Forked, forked

pytestmark = pytest.mark.slow  # runs stages end to end or trains networks: make test, not make test-fast

FIRST_SIX = SeedRange("reference", 0, 6)


def test_zoo_trains_records_failures_and_resumes(tiny_cfg):
    exp = Experiment(tiny_cfg)
    first = run_zoo(exp, FIRST_SIX)
    store = exp.store
    assert sorted(first.trained + first.failed) == list(range(6))
    assert store.completed_seeds() == sorted(first.trained) and sorted(store.failed_seeds()) == sorted(first.failed)
    for seed in first.trained:
        state, meta = load_checkpoint(store.checkpoint_path(seed), exp.model())
        assert json.loads(meta["seed"]) == seed and meta["experiment"] == "digits_optunet"
        assert meta["config_hash"] == exp.config_hash and 0 <= float(meta["test_accuracy"]) <= 1
        assert "torch" in json.loads(meta["versions"])
    for seed, record in store.failed_seeds().items():
        assert "did not converge" in record["reason"]
    again = run_zoo(exp, FIRST_SIX)
    assert again.trained == [] and again.failed == [] and sorted(again.skipped_done) == list(range(6))
    assert "failure rate" in again.describe()


def test_the_stage_trains_both_ranges_or_the_one_selected(tmp_path):
    common = [f"store={tmp_path}", *TINY_TRAIN, "seeds.reference=[0,2]", "seeds.heldout=[100000,100001]"]

    def seeds_in_store(exp):
        return sorted(exp.store.completed_seeds() + list(exp.store.failed_seeds()))

    exp = Experiment(compose_config([*common, "zoo.range=heldout"]))
    assert len(zoo.run(exp)) == 1 and seeds_in_store(exp) == [100000]
    exp = Experiment(compose_config(common))  # zoo.range=both by default
    summaries = zoo.run(exp)
    assert [sorted(s.trained + s.failed) for s in summaries] == [[0, 1], []]
    assert summaries[1].skipped_done == [100000] and seeds_in_store(exp) == [0, 1, 100000]


def test_diverging_seed_is_not_stored(tiny_cfg):
    tiny_cfg.train.lr = 1e9
    exp = Experiment(tiny_cfg)
    with pytest.raises(TrainingDivergedError, match="NaN/Inf and were not stored: seed 0: .*loss became nan"):
        run_zoo(exp, SeedRange("reference", 0, 1))
    assert exp.store.completed_seeds() == [] and exp.store.failed_seeds() == {}


@pytest.mark.parametrize("value, message", [
    ("[5,2]", r"seeds.reference=\[5, 2\]: expected \[start, stop\) with 0 <= start <= stop"),
    ("[-1,3]", r"seeds.reference=\[-1, 3\]: expected"),
    ("[1,2,3]", r"seeds.reference=\[1, 2, 3\]: expected"),
    ("[0,100005]", r"seeds.reference=\[0, 100005\] and seeds.heldout=\[100000, 101250\] overlap"),
])
def test_bad_seed_ranges_are_refused(value, message):
    with pytest.raises(ConfigError, match=message):
        Experiment(compose_config([f"seeds.reference={value}"]))


@pytest.mark.parametrize(
    "args, message",
    [
        (["stage=train"], "stage: Invalid value 'train', expected one of [zoo, sample, evaluate, report, analyze, all, "
                          "finish, verify, import]"),
        (["stage=zoo", "seeds.reference=[4,2]"], "seeds.reference=[4, 2]: expected [start, stop)"),
        (["stage=zoo", "zoo.shard=3", "zoo.num_shards=2"], "zoo.shard=3: expected an integer in [0, num_shards=2)"),
        (["stage=zoo", "store=/proc/version/x"], "store=/proc/version/x: cannot write"),
        (["stage=zoo", "zoo.max_attempts=0"], "zoo.max_attempts=0: expected a positive integer"),
    ],
)
def test_cli_bad_input_exits_non_zero_with_a_clear_message(cli, args, message):
    code, out = cli(*args)
    assert code != 0 and message in out, out


def _zoo_files(zoo):
    return sorted(p.name for p in zoo.iterdir() if p.is_file()) + sorted(p.name for p in (zoo / "failed").iterdir())


def test_killed_runs_resume_bit_for_bit_with_no_partial_file_or_claim(tmp_path, single_torch_thread):
    overrides = ["seeds.reference=[0,5]", "zoo.range=reference", "train.epochs=3", "train.fail_rule.epoch=null"]
    exp = Experiment(compose_config([f"store={tmp_path / 'store'}", *overrides]))
    zoo = exp.store.zoo_dir
    for kill_at in (2, 3):  # each run killed while writing a seed's checkpoint (temp file written, not renamed)
        with exp.backends():
            code, _ = forked(lambda: run_zoo(exp, exp.reference), kill_at_publish=kill_at)
        assert code == -signal.SIGKILL
    assert any(p.name.startswith(".") for p in zoo.iterdir()), "the kill did not leave the half-written file it should"
    assert list(exp.store.claims_dir.iterdir()), "the killed process's claims stay until a later run reaps them"
    with exp.backends():
        resumed = run_zoo(exp, exp.reference)
    names = _zoo_files(zoo)
    assert {n.split(".")[0] for n in names} == {f"seed_{s:06d}" for s in range(5)}
    assert resumed.trained == [3, 4]  # runs 1 and 2 published seeds 0, then 1 and 2, before their kills
    assert not [n for n in names if n.startswith(".")], "temp files left behind"
    assert not list(exp.store.claims_dir.iterdir()), "claims left behind"
    clean = Experiment(compose_config([f"store={tmp_path / 'clean'}", *overrides]))  # uninterrupted
    with clean.backends():
        run_zoo(clean, clean.reference)
    for name in (n for n in names if n.endswith(".safetensors")):
        assert (zoo / name).read_bytes() == clean.store.checkpoint_path(int(name[5:11])).read_bytes(), name


def test_two_processes_on_two_hosts_with_overlapping_ranges_share_the_work(tmp_path, single_torch_thread):
    store = tmp_path / "store"
    common = [f"store={store}", "zoo.range=reference", *TINY_TRAIN]
    a = Experiment(compose_config([*common, "seeds.reference=[0,6]"]))
    b = Experiment(compose_config([*common, "seeds.reference=[2,8]"]))
    with a.backends():
        runs = [Forked(lambda: run_zoo(a, a.reference), env={HOST_ENV: "node-a"}),
                Forked(lambda: run_zoo(b, b.reference), env={HOST_ENV: "node-b"})]
        (code_a, summary_a), (code_b, summary_b) = (run.result() for run in runs)
    assert code_a == 0 and code_b == 0
    stored = _zoo_files(store / "digits_optunet" / "zoo")
    assert sorted(s.split(".")[0] for s in stored) == [f"seed_{s:06d}" for s in range(8)]  # each seed exactly once
    worked = summary_a.trained + summary_a.failed + summary_b.trained + summary_b.failed
    assert sorted(worked) == list(range(8)), "a seed was trained twice"
    state, _ = load_checkpoint(next((store / "digits_optunet" / "zoo").glob("seed_*.safetensors")))
    assert all(torch.isfinite(v).all() for v in state.values())


def test_a_seed_claimed_on_a_node_that_died_is_trained_after_the_claim_timeout(tmp_path, monkeypatch):
    exp = Experiment(compose_config([f"store={tmp_path / 'store'}", "seeds.reference=[0,2]", "zoo.range=reference",
                                     *TINY_TRAIN, "claims.timeout_s=60", "claims.heartbeat_s=10"]))
    exp.store.ensure_writable()
    claims = [exp.store.claim_path(exp.store.seed_unit(s)) for s in (0, 1)]
    for path in claims:  # node-a holds both seeds' claims, then dies: its heartbeats stop
        path.write_text(json.dumps({"host": "node-a", "pid": 4242, "started": time.time(), "token": "a"}))
    monkeypatch.setenv(HOST_ENV, "node-b")
    with exp.backends():
        first = run_zoo(exp, exp.reference)
        assert first.skipped_busy == [0, 1] and first.trained + first.failed == []  # heartbeats still fresh
        past = time.time() - 61
        for path in claims:
            os.utime(path, (past, past))  # the last heartbeat is now older than claims.timeout_s
        second = run_zoo(exp, exp.reference)
    assert sorted(second.trained + second.failed) == [0, 1] and not any(p.exists() for p in claims)
    assert not [p for p in exp.store.zoo_dir.iterdir() if p.name.startswith(".")]


def test_vectorised_and_one_at_a_time_zoos_hold_the_same_checkpoints(tmp_path):
    common = [*TINY_TRAIN, "seeds.reference=[0,6]", "zoo.range=reference"]
    stores = {}
    for vectorize in ("1", "4"):
        exp = Experiment(compose_config([f"store={tmp_path / vectorize}", f"zoo.vectorize={vectorize}", *common]))
        assert exp.zoo_trainer.stacked == (vectorize != "1") and exp.zoo_trainer.networks == int(vectorize)
        with exp.backends():
            summary = run_zoo(exp, FIRST_SIX)
        stores[vectorize] = exp.store
        assert sorted(summary.trained + summary.failed) == list(range(6))
    one, four = stores["1"], stores["4"]
    assert one.completed_seeds() == four.completed_seeds() and one.failed_seeds().keys() == four.failed_seeds().keys()
    for seed in one.completed_seeds():
        (a, meta_a), (b, meta_b) = load_checkpoint(one.checkpoint_path(seed)), load_checkpoint(four.checkpoint_path(seed))
        assert meta_a["trainer"] == "one at a time" and meta_b["trainer"] == "vectorised"
        assert meta_a["test_accuracy"] == meta_b["test_accuracy"]
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5)


def test_the_stacks_a_process_trains_at_once_are_sized_to_fit_in_memory_together(tmp_path, monkeypatch):
    """One stack per torch thread on a CPU: an explicit K that fits alone but not once per thread
    is refused naming the threads; auto takes the K that fits per stack."""
    import benchmark.core.training.vectorised as vectorised

    common = [f"store={tmp_path / 'store'}", *TINY_TRAIN]
    evaluation = 4 * vectorised.EVAL_ELEMENTS  # bytes of each stack's evaluation buffer
    available = 2 * (100 * 2**20 + evaluation)  # half of it holds one stack of 100 networks of 1 MiB
    monkeypatch.setattr(vectorised, "network_bytes", lambda *a: 2**20)
    monkeypatch.setattr(vectorised, "available_bytes", lambda device: available)
    per_stack = int((available / 4 - evaluation) // 2**20)  # two stacks share the half
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = Experiment(compose_config([*common, "zoo.vectorize=100"])).zoo_trainer
        assert (alone.networks, alone.stacks) == (100, 1)
        torch.set_num_threads(2)
        with pytest.raises(ConfigError, match=f"each of the 2 stacks trained at once .*zoo.vectorize={per_stack} "):
            _ = Experiment(compose_config([*common, "zoo.vectorize=100"])).zoo_trainer
        auto = Experiment(compose_config(common)).zoo_trainer
        assert (auto.networks, auto.stacks) == (per_stack, 2) and 0 < per_stack < 50
    finally:
        torch.set_num_threads(before)


def test_a_process_with_two_threads_trains_two_stacks_at_once_and_the_same_checkpoints(tmp_path, monkeypatch):
    """On a CPU one process trains a stack per torch thread, each on a thread of its own; each
    seed's checkpoint is the one of a process with one thread, to the bit."""
    common = [*TINY_TRAIN, "seeds.reference=[0,9]", "zoo.range=reference", "zoo.vectorize=4"]
    ran: list[tuple[str, list[int]]] = []
    train_stack = zoo._train_stack

    def recorded(exp, stack, *args):
        ran.append((threading.current_thread().name, sorted(stack.claimed)))
        train_stack(exp, stack, *args)

    monkeypatch.setattr(zoo, "_train_stack", recorded)
    stores, before = {}, torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            exp = Experiment(compose_config([f"store={tmp_path / str(threads)}", *common]))
            assert zoo.stacks_at_once(exp.zoo_trainer) == exp.zoo_trainer.stacks == threads
            with exp.backends():
                summary = run_zoo(exp, SeedRange("reference", 0, 9))
            assert sorted(summary.trained + summary.failed) == list(range(9))
            stores[threads] = exp.store
    finally:
        torch.set_num_threads(before)
    assert ran[:3] == [("MainThread", [0, 1, 2, 3]), ("MainThread", [4, 5, 6, 7]), ("MainThread", [8])]
    assert sorted(ran[3:5]) == [("zoo stack 0", [0, 1, 2, 3]), ("zoo stack 1", [4, 5, 6, 7])]
    assert ran[5:] == [("MainThread", [8])] and torch.get_num_threads() == before
    one, two = stores[1], stores[2]
    assert one.completed_seeds() == two.completed_seeds() and one.failed_seeds().keys() == two.failed_seeds().keys()
    for seed in one.completed_seeds():
        (a, meta_a), (b, meta_b) = load_checkpoint(one.checkpoint_path(seed)), load_checkpoint(two.checkpoint_path(seed))
        assert meta_a["test_accuracy"] == meta_b["test_accuracy"]
        assert all(torch.equal(a[key], b[key]) for key in a)


def test_seeds_are_split_into_runs_of_nearly_equal_size():
    assert zoo.split_evenly(list(range(130)), 2) == [list(range(65)), list(range(65, 130))]
    assert [len(run) for run in zoo.split_evenly(list(range(5)), 3)] == [2, 2, 1]
    assert zoo.split_evenly([7], 4) == [[7]] and zoo.split_evenly([], 2) == []


def test_the_zoo_trainer_follows_the_setting_the_architecture_and_the_memory(tmp_path, monkeypatch):
    from benchmark.core.training.vectorised import AUTO_NETWORKS

    exp = Experiment(compose_config([f"store={tmp_path}"]))
    assert exp.zoo_trainer.stacked and exp.zoo_trainer.networks == AUTO_NETWORKS and exp.zoo_trainer.name == "vectorised"
    monkeypatch.setattr("benchmark.core.training.vectorised.available_bytes", lambda device: 2**27)
    fit = Experiment(compose_config([f"store={tmp_path}"])).zoo_trainer.networks
    assert 1 < fit < AUTO_NETWORKS  # auto: the largest K that fits
    too_many = Experiment(compose_config([f"store={tmp_path}", f"zoo.vectorize={fit + 1}"]))
    with pytest.raises(ConfigError, match=rf"zoo.vectorize={fit + 1}: .* GiB available; use zoo.vectorize={fit} "):
        _ = too_many.zoo_trainer
    resnet = Experiment(compose_config([f"store={tmp_path}", "model=resnet18"]))
    assert not resnet.zoo_trainer.stacked and "BatchNorm" in resnet.zoo_trainer.reason  # one at a time
    with pytest.raises(ConfigError, match="zoo.vectorize=8: digits_optunet cannot be trained stacked .*BatchNorm.*"
                                          "use zoo.vectorize=1"):
        _ = Experiment(compose_config([f"store={tmp_path}", "model=resnet18", "zoo.vectorize=8"])).zoo_trainer
    assert Experiment(compose_config([f"store={tmp_path}", "zoo.vectorize=1"])).zoo_trainer.stacked is False
    with pytest.raises(ConfigError, match="zoo.vectorize='many': expected auto or a positive integer"):
        Experiment(compose_config(["zoo.vectorize=many"]))


def test_a_paused_worker_never_replaces_what_the_new_holder_published(tiny_cfg, caplog):
    """Worker A passed its ``claim.lost`` check and was paused (SIGSTOP); B took the unit over and
    published; A resumes: its copy is dropped with one log line, B's file stands."""
    import dataclasses

    exp = Experiment(tiny_cfg)
    result = zoo.train_seed(exp, 0)
    late = dataclasses.replace(result, state_dict={k: v + 1 for k, v in result.state_dict.items()},
                               check_accuracy=0.123)

    class Held:  # A's view: its claim looked fine at its last check
        lost = False

    first, second = zoo.ZooSummary(), zoo.ZooSummary()
    zoo._store_outcome(exp, 0, result, "reference", "one at a time", Held(), first)  # B publishes
    path = exp.store.failed_path(0) if result.failure else exp.store.checkpoint_path(0)
    published = path.read_bytes()
    zoo._store_outcome(exp, 0, late, "reference", "one at a time", Held(), second)  # A, resumed
    assert path.read_bytes() == published and second.skipped_busy == [0] and not (second.trained or second.failed)
    assert "another worker published it first" in caplog.text


def test_a_seed_that_diverges_every_run_is_recorded_as_failed_after_max_attempts(tiny_cfg):
    tiny_cfg.train.lr = 1e9
    tiny_cfg.zoo.max_attempts = 2
    exp = Experiment(tiny_cfg)
    one = SeedRange("reference", 0, 1)
    with pytest.raises(TrainingDivergedError, match="seed 0"):
        run_zoo(exp, one)
    assert exp.store.failed_seeds() == {} and exp.store.divergences(0, exp.config_hash) == 1
    second = run_zoo(exp, one)  # the second run that sees it diverge: recorded, the run succeeds
    record = exp.store.failed_seeds()[0]
    assert second.failed == [0] and record["reason"] == "diverged" and record["attempts"] == 2
    assert "nan" in record["detail"].lower() and not exp.store.attempts_path(0).exists()
    assert run_zoo(exp, one).skipped_done == [0]


def test_an_mnist_format_zoo_trains_vectorised_and_each_seed_equals_one_at_a_time(tmp_path):
    """experiment=mnist_optunet on tiny IDX files written here: MNIST is read into memory, so the zoo
    trains stacked (with the recipe's random crop), and every seed's checkpoint and verdict is the
    one the one-at-a-time loop gives it, up to float rounding over its few steps."""
    rng = np.random.default_rng(7)

    def images(labels):  # noise around a brightness that says the class (OptuNet pools globally)
        return (rng.integers(0, 30, (len(labels), 28, 28)) + 25 * labels[:, None, None]).astype(np.uint8)

    for folder in ("MNIST", "FashionMNIST"):
        formats.write_mnist_like(tmp_path / "data", folder, {
            split: (images(np.arange(n) % 10), np.arange(n) % 10) for split, n in (("train", 160), ("test", 20))})
    overrides = ["experiment=mnist_optunet", f"dataset.data_dir={tmp_path / 'data'}", "train.epochs=3", "train.lr=0.5",
                 "train.milestones=[2]", "train.fail_rule.epoch=2", "seeds.reference=[0,6]", "zoo.range=reference",
                 "zoo.crosscheck=6"]
    stores = {}
    for vectorize in ("auto", "1"):
        exp = Experiment(compose_config([f"store={tmp_path / vectorize}", f"zoo.vectorize={vectorize}", *overrides]))
        assert exp.zoo_trainer.stacked == (vectorize == "auto"), exp.zoo_trainer.reason
        with exp.backends():
            summary = run_zoo(exp, exp.reference)
        assert sorted(summary.trained + summary.failed) == list(range(6))
        stores[vectorize] = exp.store
    assert exp.train_set.augment and len(exp.train_set) == 160 - 10  # 1 of each class's 16 held out
    stacked, alone = stores["auto"], stores["1"]
    assert stacked.completed_seeds() == alone.completed_seeds() and stacked.completed_seeds()
    assert stacked.failed_seeds().keys() == alone.failed_seeds().keys() and stacked.failed_seeds()  # both verdicts occur
    for seed, record in stacked.failed_seeds().items():
        theirs = alone.failed_seeds()[seed]
        assert (record["trainer"], theirs["trainer"]) == ("vectorised", "one at a time")
        assert record["reason"] == theirs["reason"] and record["crosscheck"]["verdict"] == "failed"
    for seed in alone.completed_seeds():
        (a, meta_a), (b, meta_b) = load_checkpoint(alone.checkpoint_path(seed)), load_checkpoint(stacked.checkpoint_path(seed))
        assert (meta_a["trainer"], meta_b["trainer"]) == ("one at a time", "vectorised")
        assert meta_a["validation_accuracy"] == meta_b["validation_accuracy"]
        check = json.loads(meta_b["crosscheck"])  # zoo.crosscheck=6 covers these seeds: trained both ways
        assert check["trainer"] == "one at a time" and check["verdict"] == "converged" and check["max_weight_difference"] < 1e-5
        for key in a:
            torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-6)


def test_the_zoo_summary_counts_trainers_and_the_crosschecked_verdicts_that_differ(tmp_path):
    """zoo.crosscheck=4: the first 4 seeds of the range are also trained one at a time; each record keeps
    that trainer's verdict, and zoo.md counts the seeds whose verdicts differ (one made to differ here)."""
    from benchmark.stages.report import write_zoo_summary
    from benchmark.stages.zoo import train_seed, verdict

    exp = Experiment(compose_config([f"store={tmp_path / 'store'}", f"results={tmp_path / 'results'}", *TINY_TRAIN,
                                     "seeds.reference=[0,6]", "seeds.heldout=[100000,100000]", "zoo.range=reference",
                                     "zoo.vectorize=4", "zoo.crosscheck=4"]))
    with exp.backends():
        run_zoo(exp, exp.reference)
        alone = {seed: verdict(train_seed(exp, seed)) for seed in range(4)}  # independent of the stored records
    store = exp.store
    stored = {seed: "converged" for seed in store.completed_seeds()} | {seed: "failed" for seed in store.failed_seeds()}
    assert sorted(stored) == list(range(6)) and set(stored.values()) == {"converged", "failed"}
    metadata = {seed: load_checkpoint(store.checkpoint_path(seed))[1] for seed in store.completed_seeds()}
    checks = {seed: json.loads(meta["crosscheck"]) for seed, meta in metadata.items() if "crosscheck" in meta}
    checks |= {seed: record["crosscheck"] for seed, record in store.failed_seeds().items() if "crosscheck" in record}
    assert sorted(checks) == [0, 1, 2, 3] and all(checks[s]["verdict"] == alone[s] for s in checks)
    path = write_zoo_summary(exp, tmp_path / "zoo.md")
    differ = [s for s in range(4) if alone[s] != stored[s]]
    assert "Trainers: vectorised 6 (checkpoints and failure records of both ranges)." in path.read_text()
    assert f"the convergence verdicts differ on {len(differ)} of 4 seeds" in path.read_text()
    failed = min(store.failed_seeds())  # make its cross-check disagree: the summary must count it
    record = store.failed_seeds()[failed]
    record["crosscheck"]["verdict"] = "diverged"
    store.failed_path(failed).write_text(json.dumps(record))
    if failed < 4:
        text = write_zoo_summary(exp, tmp_path / "zoo.md").read_text()
        assert f"differ on {len(set(differ) | {failed})} of 4 seeds" in text and str(failed) in text


def test_a_recipe_change_retrains_the_zoo_unless_kept(tiny_cfg):
    """Issue #30, item 2: the zoo stage kept checkpoints trained under another recipe, so a recipe
    change never retrained the reference. They are quarantined and trained again, their config
    recorded; ``zoo.keep_other_recipe=true`` keeps them."""
    import dataclasses

    from benchmark.core.store import quarantined, read_metadata

    two = SeedRange("reference", 0, 2)
    exp = Experiment(tiny_cfg)
    first = run_zoo(exp, two)
    assert sorted(first.trained + first.failed) == [0, 1]
    for seed in first.trained:
        assert json.loads(read_metadata(exp.store.checkpoint_path(seed))["config"])["train"]["epochs"] == 2
    kept = dataclasses.replace(exp.config, train=dataclasses.replace(exp.config.train, epochs=1, milestones=[]),
                               zoo=dataclasses.replace(exp.config.zoo, keep_other_recipe=True))
    assert sorted(run_zoo(Experiment(kept), two).skipped_done) == [0, 1]
    other = Experiment(dataclasses.replace(kept, zoo=exp.config.zoo))
    again = run_zoo(other, two)
    assert sorted(again.trained + again.failed) == [0, 1] and sorted(again.quarantined) == [0, 1]
    if first.trained:  # a failure record holds the config hash, a checkpoint the fields too
        assert "train.epochs: 2 -> 1" in " ".join(again.quarantined.values())
    assert len(quarantined(exp.store.zoo_dir) + quarantined(exp.store.failed_dir, suffix=".json")) == 2
    for seed in again.trained:
        assert read_metadata(other.store.checkpoint_path(seed))["config_hash"] == other.config_hash
    assert sorted(run_zoo(other, two).skipped_done) == [0, 1]


def _claimed_on(exp: Experiment, seeds, host: str = "node-a") -> list:
    """Claims on ``seeds`` written as by a process of ``host`` (pid 4242) that never publishes them."""
    exp.store.ensure_writable()
    paths = [exp.store.claim_path(exp.store.seed_unit(s)) for s in seeds]
    for path in paths:
        path.write_text(json.dumps({"host": host, "pid": 4242, "started": time.time(), "token": f"t{path.stem}"}))
    return paths


def _busy_exp(tmp_path, *overrides: str) -> Experiment:
    return Experiment(compose_config([f"store={tmp_path / 'store'}", "seeds.reference=[0,3]", "zoo.range=reference",
                                      "zoo.vectorize=1", *TINY_TRAIN, *overrides]))


def test_the_stage_waits_for_seeds_claimed_on_another_host_and_takes_them_over_once_stale(tmp_path, monkeypatch,
                                                                                        caplog):
    """Issue 38: a job whose seeds were claimed by a job killed on another host (its claims not yet
    stale) skipped them and ended successfully with them untrained. The stage now waits: it trains
    its own seeds, polls the claims until they go stale (claims.timeout_s) and trains those seeds."""
    import threading

    exp = _busy_exp(tmp_path, "claims.timeout_s=3", "claims.heartbeat_s=1", "claims.wait_s=60")
    claims = _claimed_on(exp, (1, 2))

    def node_a_beats_until_killed():  # node-a's heartbeats go on until the job here has trained seed 0
        end = time.monotonic() + 120
        while time.monotonic() < end and not zoo._published(exp, 0):
            for path in claims:
                os.utime(path)
            time.sleep(0.2)

    heartbeat = threading.Thread(target=node_a_beats_until_killed)
    heartbeat.start()
    monkeypatch.setenv(HOST_ENV, "node-b")
    with exp.backends(), caplog.at_level("INFO"):
        (summary,) = zoo.run(exp)
    heartbeat.join()
    assert sorted(summary.trained + summary.failed) == [0, 1, 2] and summary.skipped_busy == []
    assert not any(p.exists() for p in claims)
    assert sorted(int(p.name[5:11]) for p in exp.store.zoo_dir.rglob("seed_*") if "quarantine" not in str(p)) == [0, 1, 2]
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "waiting for 2 unit(s) claimed by other processes" in text and "seed 1: node-a pid 4242" in text
    assert "taking over seeds [1, 2]" in text


def test_the_stage_fails_naming_seeds_and_hosts_when_claims_stay_live_past_wait_s(tmp_path, monkeypatch, cli):
    """claims.wait_s bounds the wait: a holder whose heartbeat stays fresh (timeout_s=600) keeps its
    seeds; the job trains its own, then exits non-zero naming each held seed and its host."""
    exp = _busy_exp(tmp_path, "claims.timeout_s=600", "claims.wait_s=1")
    _claimed_on(exp, (1, 2))
    monkeypatch.setenv(HOST_ENV, "node-b")
    with exp.backends(), pytest.raises(zoo.HeldElsewhereError,
                                       match=r"2 unit\(s\) this job was asked for are still claimed.*"
                                             r"seed 1: node-a pid 4242, heartbeat \d+ s old; seed 2: node-a pid 4242"):
        zoo.run(exp)
    assert [int(p.name[5:11]) for p in exp.store.zoo_dir.rglob("seed_*")] == [0], "its own seed first"
    code, out = cli("stage=zoo", f"store={tmp_path / 'store'}", "seeds.reference=[0,3]", "zoo.range=reference",
                    "zoo.vectorize=1", *TINY_TRAIN, "claims.timeout_s=600", "claims.wait_s=0", "threads=1")
    assert code == 1 and "HeldElsewhereError: zoo digits_optunet: 2 unit(s)" in out and "seed 2: node-a pid 4242" in out


def test_the_stage_waits_for_a_seed_its_holder_publishes(tmp_path, monkeypatch):
    """A live holder on another host publishes its seed while the job waits: counted as done
    elsewhere, not trained twice, and the job succeeds."""
    import shutil
    import threading

    other = _busy_exp(tmp_path / "other")
    with other.backends():
        run_zoo(other, SeedRange("reference", 1, 2))
    made = next(p for p in (other.store.checkpoint_path(1), other.store.failed_path(1)) if p.exists())
    exp = _busy_exp(tmp_path, "claims.timeout_s=600", "claims.heartbeat_s=1", "claims.wait_s=60")
    (claim,) = _claimed_on(exp, (1,))
    target = exp.store.checkpoint_path(1) if made.suffix == ".safetensors" else exp.store.failed_path(1)

    def holder_publishes():
        time.sleep(2)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(made, target)
        claim.unlink()

    monkeypatch.setenv(HOST_ENV, "node-b")
    thread = threading.Thread(target=holder_publishes)
    thread.start()
    with exp.backends():
        (summary,) = zoo.run(exp)
    thread.join()
    assert summary.done_elsewhere == [1] and 1 not in summary.trained + summary.failed
    assert sorted(summary.trained + summary.failed) == [0, 2] and summary.skipped_busy == []
    assert target.read_bytes() == made.read_bytes()
