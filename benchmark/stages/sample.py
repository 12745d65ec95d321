"""Sample stage: each method's weight samples in each mode, and its predictions with them.

``python -m benchmark stage=sample method=<all|name|external> mode=<both|one|multi>``

A unit is one repetition of a (method, mode) (``Unit``). It is skipped when its sample set and
its predictions are in the store and valid for the current settings and code
(``inventory.unit_state``); otherwise, under the unit's claim, the method is fitted around the
mode's base networks (the converged checkpoints of ``seeds.heldout``, in seed order, once every
seed of the range is trained: the stage refuses while any is missing, so the bases never depend
on which seeds happen to be finished; repetition k of every method takes its bases from the
block that starts at ``k x Design.stride`` (``benchmark.design``: the repetition design), so
repetitions never share a base and repetition k of every row starts from the same network: the
rows' differences are paired; the block is part of the unit's key, ``layout``, and so are the
held-out seeds it read, ``read_seeds``, not the range's bounds: a range grown at its end redraws
nothing), and the sample set ``{key: [S, ...]}`` and the
predictions ``{"id": [S, N, C], "ood": [S, M, C]}`` (float32 probabilities on the ID test set and
the OOD set) are written atomically, predictions last, carrying the digest of the sample set
they were computed from (``samples_digest``): a unit counts as done only when both files validate
and belong together, so a killed run redoes at most the unit in flight, and a pair mixed from two
writers is refused and redrawn. Units are claimed across processes
and cluster nodes (``store.claim``).

Markov-chain methods (``ResumableChains``: ``hmc``) run their chains first, one chain per base,
each under its own claim (``store.chain_claim``), up to the method's ``chains_at_once`` chains of
a unit together, with their states saved in the unit's ``ChainFiles`` (``store.chain_files``: the
store names the files, and the states carry the unit's key, ``inventory.chain_key``: the key of its
samples, its bases with their content digests, and the method's own fingerprint of its data; a
state of another key, left by a run before a change of settings, code, data, zoo or bases, is
never resumed and is removed) as they go: a killed run resumes each chain where its last state was saved (bit for bit), and several jobs
share a unit's chains. The job that finds every chain of a unit finished publishes the unit as any
other (its ``fit``/``sample`` read the finished chains); the chain states stay in the store (the
per-chain diagnostics: acceptance, energies, step sizes, divergences). A unit whose chains run
elsewhere is skipped as busy.

Never done while others hold its units: a unit claimed by a live process elsewhere (or whose chains
run elsewhere) is skipped on a pass (``draw``: ``skipped_busy``); the stage (``run``) then waits
for those units (``claims.wait_s``, ``work.finish_busy``) until each is published by its holder,
or its claim is released or goes stale and another pass takes it over; after ``claims.wait_s`` it
fails (``HeldElsewhereError``) naming the units and their holders.

Self-healing: a stored unit whose sample set or predictions fail validation (unreadable,
truncated, checksum mismatch, NaN/Inf, wrong keys or shapes, another experiment's) has the bad
file moved to ``quarantine/`` beside it (one log line naming it) and is redrawn. A unit whose
metadata differ from the current settings or code, or whose base checkpoints changed since
(``base_digests``), is stale: its files are moved to ``quarantine/`` too (``sample.keep_stale``;
false removes them) and it is redrawn.

Every unit is built and checked (``check``) before any training. With ``method=all`` a unit that
fails while fitting (NaN, no base converges) is logged, writes nothing, and the stage goes on,
raising ``SampleStageError`` listing the failures at the end; a named method fails at once.
``method=external`` scores a sample set produced elsewhere (``external.path``).
"""
from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmark.config import ConfigError
from benchmark.core.fingerprint import library_versions
from benchmark.core.training.predict import predict_samples
from benchmark.core.store import (
    ChainFiles, CheckpointError, SampleSet, quarantine, SampleSetMetadata, StoreError, Unit, load_checkpoint, load_sample_set,
    remove_temp_files_of, save_sample_set, validate_tensors,
)
from benchmark.core.training import NonFiniteError
from benchmark.experiment import Experiment
from benchmark.inventory import (
    base_digests, chain_key, converged, corrupt_zoo_error, heldout_shortfall, incomplete_range, read_seeds,
    UnitState, sample_settings_hash, trained_prefix, unit_state, untrained_seeds,
)
from benchmark.core.store.importing import imported_archives
from benchmark.core.store.inference_data import write_inference_data
from benchmark.core.store.claims import HeldElsewhereError  # noqa: F401 (the stage's error)
from benchmark.core.store.work import (  # noqa: F401 (ClaimLostError: the stage's error)
    ClaimLostError, Recheck, WorkSummary, claim_unit, finish_busy as finish_busy_units, publish,
)
from methods import MODES, MethodFitError, PosteriorMethod, ResumableChains, method_class
from methods.modes import ModePlan, run_mode
from metrics.mcmc import predictive_convergence

log = logging.getLogger(__name__)
NAME = "sample"
FIT_ERRORS = (NonFiniteError, MethodFitError)


class SampleStageError(RuntimeError):
    """Some (method, mode) units failed under ``method=all``; the others were written."""


class MissingBasesError(StoreError):
    """Too few converged held-out checkpoints for a mode; the message gives the zoo command."""


@dataclass
class SampleSummary(WorkSummary[str]):
    """What a sample-stage run did, per unit label (``swag/one/r0``): the work-unit loop's
    ``WorkSummary``, and ``written``, ``unavailable`` (methods that cannot run here), ``failed``
    (label -> the fit's error) and ``busy_units`` (the units of ``skipped_busy`` by label, and
    those of this pass that could become busy)."""

    written: list[str] = field(default_factory=list)
    unavailable: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    busy_units: dict[str, Unit] = field(default_factory=dict)

    def busy(self, unit: Unit) -> None:
        """``unit`` is claimed elsewhere (or its chains run elsewhere): skipped on this pass."""
        self.skipped_busy.append(unit.label)
        self.busy_units[unit.label] = unit


@dataclass
class Job:
    """One unit to run: the built method and its plan (candidate bases, bases, samples per base)."""

    unit: Unit
    method: PosteriorMethod
    plan: ModePlan


def needs(exp: Experiment) -> frozenset[str]:
    """The held-out zoo (bases and ensemble members); an external sample set needs nothing stored."""
    return frozenset() if exp.config.method.value == "external" else frozenset({"heldout"})


def produces(exp: Experiment) -> frozenset[str]:
    return frozenset({"samples"})


def check(exp: Experiment, made: frozenset[str] = frozenset()) -> None:
    """Refuse before any work: the data on disk; every selected method x mode (settings, model,
    mode); an external sample set's file; a ``seeds.heldout`` range that cannot supply the bases
    of every repetition at ``seeds.expected_convergence`` (``heldout_shortfall``); and, unless an
    earlier stage of this run trains the held-out zoo, the bases in the store."""
    exp.check_data()
    if exp.config.method.value == "external":
        external_mode(exp)
        load_external(exp)
    else:
        jobs(exp, check_bases="heldout" not in made)


def settings_metadata(exp: Experiment, job: Job, seeds: tuple[int, ...], diagnostics: dict[str, float]) -> SampleSetMetadata:
    """Metadata written with a unit's sample set and predictions (``seeds``: the base seeds used;
    ``diagnostics``: the method's, averaged over its bases)."""
    unit, plan = job.unit, job.plan
    return SampleSetMetadata(
        experiment=exp.name, method=unit.method, label=method_class(str(unit.method)).label, mode=unit.mode,
        repetition=unit.repetition, layout=exp.design.unit_layout(str(unit.method), unit.mode, int(unit.repetition)),
        base_seeds=list(seeds), samples_per_base=plan.samples_per_base,
        n_samples=plan.n_samples, config_hash=exp.config_hash, settings_hash=sample_settings_hash(exp, str(unit.method)),
        diagnostics=diagnostics, versions=library_versions(), base_digests=base_digests(exp, seeds),
        read_seeds=read_seeds(plan.candidates, seeds),
    )


def predictions(exp: Experiment, samples: SampleSet, method: PosteriorMethod | None = None) -> dict[str, torch.Tensor]:
    """Per-sample probabilities ``{"id": [S, N, C], "ood": [S, M, C]}`` (float32) of the plain model
    carrying each sample (``method.predict_weights``: the network the method's samples parameterise)."""
    if method is not None:
        return {"id": method.predict_weights(samples, exp.test_tensors[0]),
                "ood": method.predict_weights(samples, exp.ood_tensors[0])}
    model = exp.model().to(exp.device)
    return {
        "id": predict_samples(model, samples, exp.test_tensors[0]),
        "ood": predict_samples(model, samples, exp.ood_tensors[0]),
    }


def select_bases(exp: Experiment, count: int) -> list[int]:
    """The converged held-out seeds the repetitions may take, in seed order: those of the shortest
    prefix of ``seeds.heldout`` holding ``Design.reach`` converged seeds (every block a repetition
    can read, at the largest count of any method), or of the whole range when it holds fewer, with at least
    ``count`` of them. Every seed of that prefix must be trained (a checkpoint or a failure record),
    so which bases a unit uses is fixed by the range alone, never by which seeds happen to be
    finished; seeds after the prefix are never read, so a pool imported with exactly the seeds the
    repetitions need (``stage=import zoo_import.range=heldout``) is complete.

    Raises ``MissingBasesError`` naming the missing count, the seed range and the command that
    supplies them: the zoo stage for a trained pool (a larger ``seeds.heldout`` when the range is
    exhausted), another import for an imported one (training there would mix locally trained
    networks into it).
    """
    heldout = exp.heldout
    reach = exp.design.reach
    ready, gap = trained_prefix(exp, heldout)
    if len(ready) >= max(count, reach):
        return ready[:reach]
    if gap is not None:
        raise MissingBasesError(_untrained_message(exp, heldout, len(ready), max(count, reach)))
    seeds = ready  # every seed of the range is trained: its converged seeds
    if len(seeds) >= count:
        return seeds
    failed = sum(s in heldout for s in exp.store.failed_seeds())
    missing = count - len(seeds)
    message = (
        f"{exp.store.zoo_dir}: {count} converged held-out base checkpoints needed, {len(seeds)} found in "
        f"seeds.heldout={[heldout.start, heldout.stop]} ({failed} failed); {missing} missing."
    )
    rate = len(seeds) / (len(seeds) + failed) if seeds else exp.config.seeds.expected_convergence
    new_stop = heldout.stop + math.ceil(1.25 * missing / rate)
    override = f"'seeds.heldout=[{heldout.start},{new_stop}]'"
    imported = imported_archives(exp.store.checkpoint_paths(seeds))
    if imported:
        command = (f"python -m benchmark stage=import experiment={exp.name} zoo_import.range=heldout {override} "
                   f"zoo_import.source={next(iter(imported))} zoo_import.skip=<files already imported> "
                   f"zoo_import.limit={math.ceil(1.25 * missing / rate)} zoo_import.seeds_from=order")
        raise MissingBasesError(f"{message} The held-out pool was imported: import more networks with {command}, then "
                                f"pass {override} to the sample stage too (stage=zoo would train them here and mix "
                                "locally trained networks into the imported pool)")
    command = f"python -m benchmark stage=zoo experiment={exp.name} zoo.range=heldout {override}"
    raise MissingBasesError(f"{message} Train them with: {command}, then pass {override} to the sample stage too")


def _untrained_message(exp: Experiment, heldout, ready: int, needed: int) -> str:
    """Why the held-out prefix the repetitions read is not complete, and what completes it."""
    problem = incomplete_range(exp, heldout)
    head = (f"{exp.store.zoo_dir}: the sample stage takes its bases from the converged seeds of seeds.heldout in seed "
            f"order, from a prefix of the range in which every seed is trained (so that they do not depend on which "
            f"seeds are finished): {needed} converged seeds needed, {ready} before the first seed not trained yet; ")
    imported = imported_archives(exp.store.checkpoint_paths(converged(exp, heldout)))
    if not imported:
        return head + problem
    sources = ", ".join(f"{archive} ({n})" for archive, n in imported.items())
    missing = untrained_seeds(exp, heldout)
    return head + (
        f"{len(missing)} of the {len(heldout)} seeds of seeds.heldout={[heldout.start, heldout.stop]} are not in the store, "
        f"and its held-out checkpoints were imported (from {sources}). Import {needed - ready} more with stage=import "
        f"experiment={exp.name} zoo_import.range=heldout (zoo_import.skip/zoo_import.limit past the files already "
        f"imported), or pass 'seeds.heldout=[{heldout.start},{missing[0]}]' if those are all you have and they suffice; "
        f"stage=zoo zoo.range=heldout would train the missing seeds here and mix locally trained networks into the "
        f"imported pool")


def jobs(exp: Experiment, summary: SampleSummary | None = None, check_bases: bool = True) -> list[Job]:
    """Build and check every selected unit (each method x mode, ``Design.repetitions_of`` its method times)
    before any training (``Experiment.planned_methods``). Repetition k takes its bases from the
    converged held-out seeds from ``k x Design.stride`` on (``Design.candidates``).

    Raises ``MethodConfigError`` listing every refused unit (a bad method/model/mode
    combination), and ``MissingBasesError`` when ``seeds.heldout`` cannot supply the repetitions
    (``heldout_shortfall``) or, with ``check_bases``, the store lacks bases.
    Under ``method=all``, methods the experiment marks ``unavailable`` are skipped (logged, and
    listed in ``summary.unavailable``).
    """
    planned, skipped = exp.planned_methods()
    for reason in skipped:
        log.info("%s skipped: %s", *reason.split(": ", 1))
        if summary is not None:
            summary.unavailable.append(reason.split(": ", 1)[0])
    design = exp.design
    out = [Job(exp.store.sample_unit(method.name, plan.mode, r), method, plan)
           for method, plan in planned for r in range(design.repetitions_of(method.name))]
    problem = heldout_shortfall(exp, max((plan.bases for _, plan in planned), default=0))
    if problem:
        raise MissingBasesError(problem)
    if check_bases:
        for job in out:
            seeds = select_bases(exp, design.needed(job.plan.bases))
            candidates = design.candidates(seeds, job.method, job.plan.bases, int(job.unit.repetition))
            job.plan = ModePlan(job.plan.mode, candidates, job.plan.bases, job.plan.samples_per_base)
    return out


def load_base(exp: Experiment, seed: int) -> dict[str, torch.Tensor]:
    """The validated plain state dict of held-out checkpoint ``seed``; a damaged one stops the
    stage with the file and the command that heals the zoo (``CorruptZooError``)."""
    path = exp.store.checkpoint_path(seed)
    try:
        state_dict, metadata = load_checkpoint(path, exp.model(), expect={"experiment": exp.name})
    except CheckpointError as err:
        raise corrupt_zoo_error(exp, {path: str(err)}, "held-out base checkpoint(s)") from err
    trained_with = metadata.get("config_hash")
    if trained_with is not None and trained_with != exp.config_hash:
        log.warning("%s was trained with config hash %s, this run's is %s (model/data/recipe changed since)",
                    path, trained_with, exp.config_hash)
    return state_dict


def advance_chains(exp: Experiment, job: Job) -> bool:
    """Run the unfinished chains of a ``ResumableChains`` unit (one per base of ``job.plan``), up to
    ``chains_at_once`` at a time, each under its claim, saved in ``store.chains_dir(unit)``; True
    when every chain is finished (by this process or another), False when some run elsewhere (or
    a claim was lost). Called before the unit's own claim, so jobs can share a unit's chains."""
    method, unit, plan = job.method, job.unit, job.plan
    assert isinstance(method, ResumableChains)
    seeds = list(plan.candidates[: plan.bases])
    files = exp.store.chain_files(unit, chain_key(exp, method, seeds))
    clear_stale_chains(files, unit)
    method.use_chain_states(files)
    while True:
        todo = [s for s in seeds if not method.chain_finished(files, s, plan.samples_per_base)]
        if not todo:
            return True
        with contextlib.ExitStack() as stack:
            group, claims = [], []
            for seed in todo:
                claim = stack.enter_context(exp.store.chain_claim(unit, seed))
                if claim is None or method.chain_finished(files, seed, plan.samples_per_base):
                    continue  # run elsewhere, or finished meanwhile
                group.append(seed)
                claims.append(claim)
                if len(group) == method.chains_at_once:
                    break
            if not group:
                log.info("%s: chains %s run elsewhere", unit.label, todo)
                return False
            log.info("%s: running chains of bases %s (%d of %d unfinished)", unit.label, group, len(todo), len(seeds))
            if not method.run_chains_in(files, group, lambda seed: load_base(exp, seed), plan.samples_per_base,
                                        lambda: any(c.lost for c in claims)):
                return False


def clear_stale_chains(files: ChainFiles, unit: Unit) -> list[Path]:
    """Remove the chain states of ``unit`` run under another key than ``files.key`` (settings,
    code, data or zoo changed since: never resumed, never published) or unreadable, with one log
    line; the removed files. A state of the current key (another job's, in flight) is left alone."""
    stale = files.stale()
    for path in stale:
        path.unlink(missing_ok=True)
    if stale:
        log.warning("%s: removed %d chain state(s) of another key or damaged (%s)", unit.label, len(stale),
                    "; ".join(stale.values()))
    return list(stale)


def chain_convergence(probs: torch.Tensor, plan: ModePlan, labels: torch.Tensor) -> dict[str, float]:
    """Convergence of a chain unit's predictive on the test split (Izmailov et al. 2021; by ArviZ,
    ``metrics.mcmc.predictive_convergence``): ``probs [S, N, C]`` are the unit's draws grouped by
    chain (``plan.bases`` chains of ``plan.samples_per_base`` draws, in base order); one chain is
    judged by its two halves. Returns ``rhat_loglik``, ``rhat_softmax_median``,
    ``rhat_softmax_max``, ``softmax_converged`` and ``ess_loglik_min`` (the smallest per-chain
    ESS of the test log-likelihood)."""
    chains = probs.reshape(plan.bases, plan.samples_per_base, *probs.shape[1:])
    report = predictive_convergence(chains, labels)
    ess_per_chain = report.pop("ess_loglik")
    return {**{k: float(v) for k, v in report.items()}, "ess_loglik_min": float(ess_per_chain.min())}


def write_job(exp: Experiment, job: Job, claim=None) -> tuple[int, ...]:
    """Fit, sample, predict, and write the unit's two files (atomically, predictions last); return
    the base seeds. ``ClaimLostError`` (nothing written) if ``claim`` was taken over meanwhile,
    ``AlreadyPublishedError`` if another worker published the unit first (``publish_unit``)."""
    samples, seeds, diagnostics = run_mode(job.method, job.plan, lambda seed: load_base(exp, seed),
                                           diagnostic_data=exp.test_tensors)
    preds = predictions(exp, samples, job.method)
    if isinstance(job.method, ResumableChains):
        diagnostics = {**diagnostics, **chain_convergence(preds["id"], job.plan, exp.test_tensors[1])}
    if claim is not None and claim.lost:
        raise ClaimLostError(f"{job.unit.label}: the claim was lost while its samples were drawn")
    metadata = settings_metadata(exp, job, seeds, diagnostics).encode()
    publish_unit(exp, job.unit, samples, preds, metadata, claim)
    return seeds


def keep_stale(exp: Experiment, unit: Unit, why: str) -> list[Path]:
    """Move the files of a stale unit (drawn under other settings or code: ``why``) to
    ``quarantine/`` beside them, with one log line, before it is drawn again (under its claim;
    ``sample.keep_stale=false`` removes them instead); the new paths."""
    moved = []
    for path in exp.store.unit_paths(unit):
        try:
            moved.append(quarantine(path, f"stale: {why}"))
        except FileNotFoundError:
            continue
    if moved:
        log.info("%s: the stale files were moved to %s (sample.keep_stale=false removes them)", unit.label,
                 ", ".join(str(p) for p in moved))
    return moved


def clear_unit(exp: Experiment, unit: Unit) -> None:
    """Remove a unit's stale or half-written files before it is redone (under its claim):
    fenced publication never replaces a file (``AlreadyPublishedError``)."""
    for path in exp.store.unit_paths(unit):
        remove_temp_files_of(path)  # left by a writer killed mid-write
        path.unlink(missing_ok=True)


def publish_unit(exp: Experiment, unit: Unit, samples: SampleSet, preds: dict[str, torch.Tensor],
                 metadata: dict[str, str], claim=None) -> None:
    """Publish the sample set, then the predictions bound to it (``samples_digest``), each fenced
    (``exclusive``): a late writer
    (its claim taken over) never replaces what another worker published. Raises
    ``AlreadyPublishedError`` when the sample set was published first by another worker (this
    copy dropped) and ``ClaimLostError`` when the claim is lost between the two files."""
    digest = save_sample_set(exp.store.samples_path(unit), samples, metadata, exclusive=True)
    if claim is not None and claim.lost:
        raise ClaimLostError(f"{unit.label}: the claim was lost after the sample set was written")
    save_sample_set(exp.store.preds_path(unit), preds, {**metadata, "samples_digest": digest}, exclusive=True)


def fit_together(exp: Experiment, todo: list[Job]) -> None:
    """Fit the bases of every unit in ``todo`` of a method that fits several bases at once (it
    overrides ``PosteriorMethod.prefit``: SWAG, the vBNN) in one call, before any unit is drawn:
    one stack covers every repetition of both modes (a base shared by two units, one-mode's and the
    first multi-mode base of a repetition, is fitted once), and the units' jobs then share that
    method object, whose ``fit`` takes the results. A stacked fit of a base does not depend on the
    bases stacked with it (the methods' tests); SWAG fits every base stacked, so grouping changes
    only its time, while the vBNN trains a round of fewer than ``methods.bnn.MIN_STACK`` bases
    through BLiTZ (the same training up to float rounding).
    Each unit is still claimed, drawn and published on its own; a run killed meanwhile has written
    nothing of the group and fits it again. Markov-chain methods (``ResumableChains``) keep their
    per-chain claims and are left alone. Only the first round of candidates (``plan.bases`` of
    them) is fitted here; a base that fails moves its unit to the next candidate, as in a unit fitted on its own."""
    groups: dict[str, list[Job]] = {}
    for job in todo:
        if type(job.method).prefit is not PosteriorMethod.prefit and not isinstance(job.method, ResumableChains):
            groups.setdefault(job.method.name, []).append(job)
    for name, group in groups.items():
        lead = group[0].method
        for job in group:
            job.method = lead
        seeds = list(dict.fromkeys(s for job in group for s in job.plan.candidates[: job.plan.bases]))
        log.info("method=%s: fitting the %d bases of %d unit(s) together", name, len(seeds), len(group))
        lead.prefit(seeds, lambda seed: load_base(exp, seed))


def run(exp: Experiment) -> SampleSummary:
    """The sample stage: a pass over the units of ``method`` x ``mode`` that the store lacks
    (``draw``, or ``run_external``), then the units other processes held, waited for."""
    once = run_external if exp.config.method.value == "external" else draw
    summary = once(exp)
    finish_busy(exp, summary, once)
    return summary


def finish_busy(exp: Experiment, summary: SampleSummary, once) -> None:
    """Wait for the units of ``summary.skipped_busy`` until each is published by its holder, or its
    claim is released or stale and another pass (``once(exp)``) takes it over (the store's work-unit
    loop, ``work.finish_busy``); raises ``HeldElsewhereError`` after ``claims.wait_s``."""
    store, claims = exp.store, exp.config.claims

    def take_over(free: list[str]) -> list[str]:
        log.info("sample %s: taking over %s (their claims were released or went stale)", exp.name, free)
        again = once(exp)  # a whole pass: every unit is checked again (those done are skipped)
        summary.written += again.written
        summary.quarantined.update(again.quarantined)
        summary.done_elsewhere += [label for label in again.skipped_done if label in free]  # a third process's
        summary.busy_units.update(again.busy_units)
        return again.skipped_busy

    if summary.skipped_busy:
        summary.done_elsewhere += finish_busy_units(
            summary.skipped_busy, lambda label: store.claim_path(summary.busy_units[label]),
            lambda label: unit_state(exp, summary.busy_units[label]).problem is None, take_over, claims.timeout_s,
            claims.wait_s, claims.poll_s, f"sample {exp.name}")
        summary.skipped_busy = []
    if summary.done_elsewhere:
        log.info("sample stage: waited for %s, done elsewhere", summary.done_elsewhere)


def _recheck(exp: Experiment, unit: Unit, checked: dict, expected: dict | None = None) -> Recheck:
    """The unit's state under its claim (``unit_state``; kept in ``checked["state"]``), as the
    work-unit loop reads it: done, or the corrupt files to quarantine."""
    state = checked["state"] = unit_state(exp, unit, expected)
    return Recheck(done=state.problem is None, damaged=state.corrupt)


def draw(exp: Experiment) -> SampleSummary:
    """One pass over the units of ``method`` x ``mode`` that the store lacks (see module doc);
    units claimed elsewhere are left in ``skipped_busy``."""
    single = exp.config.method.value != "all"
    store = exp.store
    store.ensure_writable()
    store.reap_stale_claims()  # claims of runs killed after they wrote their unit
    summary = SampleSummary()
    todo = []
    for job in jobs(exp, summary):
        state = unit_state(exp, job.unit)
        if state.problem is None:
            summary.skipped_done.append(job.unit.label)
            continue
        if state.stale and not state.corrupt:
            log.warning("%s: redoing (%s)", job.unit.label, state.stale)
        todo.append(job)
    fit_together(exp, todo)
    for job in todo:
        unit = job.unit
        if isinstance(job.method, ResumableChains) and not advance_chains(exp, job):
            log.info("%s: chains in progress elsewhere, skipped", unit.label)
            summary.busy(unit)
            continue
        with contextlib.ExitStack() as held:
            summary.busy_units[unit.label] = unit
            checked: dict[str, UnitState] = {}
            claim = claim_unit(store, unit, held, summary, unit.label, lambda: _recheck(exp, unit, checked),
                               f"{unit.label} will be drawn again")
            if claim is None:
                if unit.label in summary.skipped_busy:
                    log.info("%s: in progress elsewhere, skipped", unit.label)
                continue
            state = checked["state"]
            if unit.label not in summary.quarantined and state.stale and exp.config.sample.keep_stale:
                keep_stale(exp, unit, state.stale)
            clear_unit(exp, unit)
            drawn: list[tuple[int, ...]] = []
            try:
                published = publish(claim, unit.label, "drawing", lambda: drawn.append(write_job(exp, job, claim)))
            except FIT_ERRORS as err:
                if single:
                    raise
                log.error("%s stopped: %s (nothing written)", unit.label, err)
                summary.failed[unit.label] = f"{type(err).__name__}: {err}"
                continue
            if not published:
                summary.busy(unit)
                continue
            seeds = drawn[0]
            log.info("%s: %d samples from base seeds %s written", unit.label, job.plan.n_samples, list(seeds))
            summary.written.append(unit.label)
            # a chain unit's draws for ArviZ (.nc); others: none
            write_inference_data(store, unit, exp.test_tensors[1], job.method.chain_layout)
    log.info("sample stage: wrote %s; quarantined and redrew %s; already done %s; busy elsewhere %s",
             summary.written or "nothing", list(summary.quarantined) or "none", summary.skipped_done or "none",
             summary.skipped_busy or "none")
    if summary.failed:
        details = "; ".join(f"{u}: {msg}" for u, msg in summary.failed.items())
        raise SampleStageError(f"{len(summary.failed)} method/mode unit(s) failed and wrote nothing: {details}")
    return summary


def external_mode(exp: Experiment) -> str:
    """The mode an external sample set is reported under (``mode=one`` or ``mode=multi``)."""
    mode = exp.config.mode.value
    if mode not in MODES:
        raise ConfigError(f"mode={mode}: method=external needs mode=one or mode=multi (the table group of its row)")
    return mode


def load_external(exp: Experiment) -> SampleSet:
    """The validated sample set of ``external.path``: the model's keys, each ``[S, *shape]`` with
    one S >= 2, finite floats; errors name the key and the expected shape."""
    path = exp.config.external.path
    if not path:
        raise ConfigError("external.path: missing; method=external needs external.path=/path/to/samples.safetensors")
    if not Path(path).is_file():
        raise ConfigError(f"external.path={path}: no such file")
    samples = load_sample_set(path)
    shapes = exp.shapes()
    validate_tensors(samples, shapes, source=str(path), leading=1)
    counts = {k: int(v.shape[0]) for k, v in samples.items()}
    if len(set(counts.values())) != 1 or min(counts.values()) < 2:
        raise CheckpointError(f"{path}: every key needs the same number S >= 2 of samples [S, ...], got {counts}")
    model_state = exp.model().state_dict()
    for key, value in samples.items():
        if value.dtype != model_state[key].dtype:
            samples[key] = value.to(model_state[key].dtype)
    return samples


def run_external(exp: Experiment) -> SampleSummary:
    """Score a sample set produced elsewhere: validate it against the model, predict with every
    sample, and store it as method ``external.name`` so evaluate and report add its row."""
    external = exp.config.external
    mode = external_mode(exp)
    samples = load_external(exp)
    exp.store.ensure_writable()
    unit = exp.store.sample_unit(external.name, mode, 0)
    source = str(Path(external.path).resolve())
    metadata = SampleSetMetadata(
        experiment=exp.name, method=external.name, label=external.label or external.name, mode=mode, repetition=0,
        n_samples=int(next(iter(samples.values())).shape[0]), source=source, source_size=Path(source).stat().st_size,
        config_hash=exp.config_hash, versions=library_versions(),
    ).encode()
    expected = {k: metadata[k] for k in ("method", "label", "mode", "experiment", "source", "source_size")}
    summary = SampleSummary(busy_units={unit.label: unit})
    with contextlib.ExitStack() as held:
        claim = claim_unit(exp.store, unit, held, summary, unit.label, lambda: _recheck(exp, unit, {}, expected),
                           f"{unit.label} will be scored again")
        if claim is None:
            if unit.label in summary.skipped_busy:
                log.info("%s: in progress elsewhere, skipped", unit.label)
            return summary
        clear_unit(exp, unit)
        preds = predictions(exp, samples)
        if not publish(claim, unit.label, "scoring", lambda: publish_unit(exp, unit, samples, preds, metadata, claim)):
            summary.busy(unit)
            return summary
    log.info("%s: %d external samples from %s written", unit.label, len(preds["id"]), source)
    summary.written.append(unit.label)
    return summary
