"""What the store holds for an experiment, and whether it is usable: the read-only query layer the
stages, the report and the analyses share (none of them asks another stage). Nothing here writes;
the two writes (removing killed writers' temp files, quarantining damaged files) are
``benchmark.inventory.actions``, which only the stages import.

- ``zoo``: the converged seeds of a range, the state of a range (checkpoints, failures,
  quarantined files, accuracies), what is wrong with one seed's files, which checkpoints were
  trained under another recipe config, the one error for damaged checkpoints;
- ``keys``: what a sample unit is keyed by (``unit_expectations``, ``sample_settings_hash``
  narrowed to the method's own code, ``read_seeds``, ``base_digests``, ``chain_key``);
- ``units``: which (method, mode, repetition) units a config asks for (repetitions always come
  from the repetition design, ``benchmark.design``), whether the held-out range can supply them,
  the state of a unit's two files (missing, stale, corrupt), judged on the held-out seeds it read
  (``moved_seeds``: not the range's bounds, so a range grown at its end keeps every unit drawn);
- ``rows``: the rows present, the repetitions a row averages, a row's label;
- ``inputs``: what a stage or an analysis needs from the store and the error naming what is missing.
"""
from benchmark.inventory.inputs import INPUTS, MissingInputsError, input_problem, require_inputs
from benchmark.inventory.keys import (
    SAMPLE_CODE, base_digests, chain_key, read_seeds, sample_code, sample_settings_hash, unit_expectations,
)
from benchmark.inventory.rows import StaleSamplesError, available_rows, describe_store, row_label, row_units
from benchmark.inventory.units import (
    NOT_WRITTEN, UnitState, changed_bases, expected_units, heldout_shortfall, moved_seeds,
    pairing_problem, prediction_rows, unit_state,
)
from benchmark.inventory.zoo import (
    CorruptZooError, RangeState, ReferenceRecipe, checkpoint_staleness, converged, corrupt_zoo_error, incomplete_range,
    quarantined_seeds, range_state, recipe_differences, reference_recipe, reference_seeds, seed_problem, seed_staleness,
    trained_prefix, untrained_seeds,
)

__all__ = [
    "INPUTS", "MissingInputsError", "input_problem", "require_inputs",
    "SAMPLE_CODE", "base_digests", "chain_key", "read_seeds", "sample_code", "sample_settings_hash", "unit_expectations",
    "StaleSamplesError", "available_rows", "describe_store", "row_label", "row_units",
    "NOT_WRITTEN", "UnitState", "changed_bases", "expected_units", "heldout_shortfall", "moved_seeds",
    "pairing_problem", "prediction_rows", "unit_state",
    "CorruptZooError", "RangeState", "ReferenceRecipe", "checkpoint_staleness", "converged", "corrupt_zoo_error",
    "incomplete_range", "quarantined_seeds", "range_state", "recipe_differences", "reference_recipe", "reference_seeds",
    "seed_problem", "seed_staleness", "trained_prefix", "untrained_seeds",
]
