"""The checkpoint store: safetensors files with metadata and content checksums, atomic writes,
validated reads, quarantine of files that fail validation, claims that hold across cluster
nodes, layer-at-a-time and column-block reads for zoos too large for memory."""
from benchmark.core.store.atomic import (
    AlreadyPublishedError, atomic_path, atomic_write_text, broken_link, clear_non_file, remove_temp_files_of, temp_files_of,
)
from benchmark.core.store.checkpoint import (
    check_finite,
    load_checkpoint,
    read_metadata,
    save_checkpoint,
    validate_tensors,
)
from benchmark.core.store.chains import ChainFiles
from benchmark.core.store.checksum import ChecksumError, content_digest, file_format, sealed_json, stored_checksums, unsealed_json
from benchmark.core.store.claims import Claim, ClaimInfo, claims_in, host_name, read_claim as read_claim_info, stale_reason, try_claim
from benchmark.core.store.errors import CheckpointError, StoreError
from benchmark.core.store.metadata import CheckpointMetadata, SampleSetMetadata, encode_metadata
from benchmark.core.store.layout import ExperimentStore
from benchmark.core.store.units import MAX_SEED, MODES, Unit
from benchmark.core.store.quarantine import Quarantined, quarantine, quarantined
from benchmark.core.store.validate import check_file, verify_file_tensors
from benchmark.core.store.sampleset import (
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
from benchmark.core.store.sources import CheckpointFiles, SampleSetFile

__all__ = [
    "AlreadyPublishedError", "ChainFiles", "atomic_path", "broken_link", "clear_non_file", "atomic_write_text", "remove_temp_files_of", "temp_files_of", "check_finite", "load_checkpoint",
    "read_metadata", "save_checkpoint", "validate_tensors", "ChecksumError", "content_digest", "file_format", "sealed_json", "stored_checksums", "unsealed_json",
    "Claim", "ClaimInfo", "claims_in", "host_name", "read_claim_info", "stale_reason", "try_claim", "CheckpointError", "StoreError", "CheckpointMetadata", "SampleSetMetadata", "encode_metadata",
    "ExperimentStore", "MAX_SEED", "MODES", "Unit", "Quarantined", "quarantine", "quarantined", "check_file", "verify_file_tensors",
    "SampleSet", "iter_checkpoint_batches", "iter_column_chunks", "iter_layer_column_chunks",
    "load_checkpoints_as_sample_set", "load_layer", "load_sample_set", "sample_count", "sample_set_keys",
    "save_sample_set", "stack_state_dicts", "unstack", "CheckpointFiles", "SampleSetFile",
]
