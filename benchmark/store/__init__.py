"""The checkpoint store: safetensors files with metadata, atomic writes, validated reads,
layer-at-a-time and column-block reads for zoos too large for memory."""
from benchmark.store.atomic import atomic_path, atomic_write_text
from benchmark.store.checkpoint import (
    check_finite,
    load_checkpoint,
    metadata_float,
    read_metadata,
    save_checkpoint,
    validate_tensors,
)
from benchmark.store.errors import CheckpointError, StoreError
from benchmark.store.layout import ExperimentStore, seed_name
from benchmark.store.locks import try_lock
from benchmark.store.sampleset import (
    SampleSet,
    iter_checkpoint_batches,
    iter_column_chunks,
    iter_layer_column_chunks,
    load_checkpoints_as_sample_set,
    load_layer,
    load_sample_set,
    sample_count,
    sample_set_keys,
    save_sample_set,
    stack_state_dicts,
    unstack,
)
from benchmark.store.sources import CheckpointFiles, SampleSetFile

__all__ = [
    "atomic_path", "atomic_write_text", "check_finite", "load_checkpoint", "metadata_float", "read_metadata",
    "save_checkpoint", "validate_tensors", "CheckpointError", "StoreError", "ExperimentStore", "seed_name",
    "try_lock", "SampleSet", "iter_checkpoint_batches", "iter_column_chunks", "iter_layer_column_chunks",
    "load_checkpoints_as_sample_set", "load_layer", "load_sample_set", "sample_count", "sample_set_keys",
    "save_sample_set", "stack_state_dicts", "unstack", "CheckpointFiles", "SampleSetFile",
]
