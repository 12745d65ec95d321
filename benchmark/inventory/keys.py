"""What a sample unit is keyed by: the metadata a done unit must hold under the current settings,
code and repetition design (``unit_expectations``, ``sample_settings_hash`` narrowed to the
method's own code by ``sample_code``), the held-out seeds it read (``read_seeds``), the content of
its base networks (``base_digests``), and the key of a chain method's saved chains (``chain_key``).
The held-out range's bounds are in no key: a range grown at its end keeps every unit drawn."""
from __future__ import annotations

from typing import Iterable, Sequence

from benchmark.core.fingerprint import code_fingerprint, stable_hash
from benchmark.core.store import CheckpointError, Unit, read_metadata, stored_checksums
from benchmark.experiment import Experiment
from methods import PosteriorMethod, method_class


SAMPLE_CODE = ("methods.base", "methods.modes", "benchmark.core.models", "benchmark.core.data", "benchmark.core.settings",
               "benchmark.core.store.checkpoint", "benchmark.core.store.sampleset")
"""Code every method's samples and predictions go through besides the method's own module: the
protocol, the modes, every model (reached through the config's model name), the data loaders
(reached through the config's data set), the settings, and the store's readers and writers of
checkpoints and sample sets (the bases read, the samples written). Packages count whole."""


def sample_settings_hash(exp: Experiment, method: str) -> str:
    """Hash of what determines a unit's output besides the repetition and the networks it reads:
    the zoo config, the method's settings, the sample counts, the method's own code (its module
    and what it imports, ``code_fingerprint``) with the code every method goes through
    (``SAMPLE_CODE``), and the library versions. A docstring edit changes nothing; a change to
    ``methods/swag.py`` changes SWAG's hash only. The number of repetitions is not in it: more
    repetitions keep the ones done. Nor is the held-out range: a unit is keyed on the held-out
    seeds it read (``read_seeds``, checked by ``moved_seeds``) and on their content
    (``base_digests``, ``changed_bases``), so a range grown at its end (``seeds.heldout=[a,b]`` to
    ``[a,c]``) keeps every unit drawn, while one whose start or end moves the seeds at a unit's
    block's positions makes that unit stale."""
    design = exp.design
    return stable_hash({
        "zoo": exp.config_hash,
        "method": exp.method_settings(method),
        "sample": {"per_method": design.per_method, "modes_multi": design.modes_multi},
        "code": code_fingerprint(sample_code(method)),
    })


def sample_code(method: str) -> tuple[str, ...]:
    """The roots of the code a unit of ``method`` is keyed by: the method's own module (the one its
    registered class is defined in) and ``SAMPLE_CODE``; ``code_fingerprint`` adds what they import."""
    return (method_class(method).__module__, *SAMPLE_CODE)


def chain_key(exp: Experiment, method: PosteriorMethod, seeds: Iterable[int]) -> str:
    """The key the saved chains of a unit of ``method`` (``ResumableChains``) must have been run
    under: the unit's settings (``sample_settings_hash``: zoo config, settings, sample counts,
    code), the base ``seeds`` its chains start from (what they read of the held-out range: one
    chain per base, none can fail) with their checkpoints' content digests (``base_digests``: a
    base retrained since is another start), and the method's own fingerprint (its data, prior,
    layout: ``method.fingerprint``). Not the held-out range: a range grown at its end keeps the
    chains; a change that gives the unit other bases, or other networks at them, discards them."""
    return stable_hash({"unit": sample_settings_hash(exp, method.name), "bases": base_digests(exp, seeds),
                        "method": method.fingerprint()})


def read_seeds(candidates: Sequence[int], bases: Sequence[int]) -> list[int]:
    """The held-out seeds a unit read, recorded in its files (``read_seeds``): its candidate
    seeds (``ModePlan.candidates``, its block of the converged held-out seeds, ``Design.candidates``)
    up to the last of the ``bases`` it used. ``run_mode`` takes the candidates in order, as many at
    a time as bases are missing, so a unit whose fits cannot fail reads exactly its bases (its
    whole block), and one whose fits can fail (``fits_can_fail``: its block is the whole stride)
    reads its bases and the candidates that failed before them, never a spare after its last base:
    what it drew is fixed by those seeds alone."""
    order = list(candidates)
    return order[: max(order.index(seed) for seed in bases) + 1] if bases else []


def unit_expectations(exp: Experiment, unit: Unit) -> dict[str, str]:
    """The metadata a done unit of a registered method must hold under the current settings and
    code, and the design (``layout``: its candidate block, ``Design.unit_layout``: a unit whose
    block moved was drawn around other bases). What the unit read is checked beside them by
    ``unit_state``: the held-out seeds at its block's positions (``moved_seeds``) and their
    content (``changed_bases``)."""
    return {"method": str(unit.method), "mode": str(unit.mode), "experiment": exp.name,
            "repetition": str(unit.repetition), "settings_hash": sample_settings_hash(exp, str(unit.method)),
            "layout": exp.design.unit_layout(str(unit.method), str(unit.mode), int(unit.repetition))}



def base_digests(exp: Experiment, seeds: Iterable[int]) -> dict[str, str | None]:
    """Base seed -> a digest of the tensors of its stored checkpoint (of their checksums, read from
    its header; its metadata left out: a metadata edit changes no network); ``None`` when it has no
    checksums or cannot be read. What a unit records of the networks it was drawn around."""
    out: dict[str, str | None] = {}
    for seed in seeds:
        path = exp.store.checkpoint_path(seed)
        try:
            checksums = stored_checksums(read_metadata(path), str(path))
        except (CheckpointError, OSError):
            checksums = None
        out[str(int(seed))] = None if checksums is None else stable_hash(checksums)
    return out
