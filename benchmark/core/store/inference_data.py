"""A Markov-chain unit's draws as an ArviZ ``InferenceData`` in NetCDF, for ``az.summary`` and
``az.plot_trace``: ``samples/<method>_<mode>_r<k>.nc`` beside the unit's sample set
(``ExperimentStore.inference_data_path``), written by the sample stage after it publishes the unit.

The stored samples of every chain method are kept chain after chain; the method's ``chain_layout``
(``methods.base.PosteriorMethod.chain_layout``, handed to ``write_inference_data``) reads from a
unit's metadata how many chains of how many draws they are (the report's chain figures,
``benchmark.report.diagnostics.chain_figures``, read them the same way). The file holds, with
dimensions ``chain`` and ``draw`` in that layout:

- ``posterior``: ``layer_norm`` (coordinate ``tensor``: the L2 norm of each floating-point tensor of
  the sample set, by state-dict key) and ``weight`` (coordinate ``coordinate``: ``WEIGHTS`` single
  weights, ``<key>[<flat index>]``, drawn by a generator of seed 0 from the model's shapes alone, so
  every unit of a model shows the same ones);
- ``sample_stats``: ``test_loglik``, the mean over the ID test images of the log-probability of the
  true label under each draw, computed from the unit's stored test predictions as ``chain_figures``
  computes its ``loglik`` (float32 arithmetic, clipped at 1e-30; stored as float64 of those values),
  so ArviZ's R-hat of it is ``chain_split_rhat_test_loglik`` of diagnostics.md for every unit of two
  chains or more (for one chain ``metrics.mcmc.split_rhat`` judges its two halves as two chains).

The training potential per draw is not in the file: neither the sample set nor the predictions hold
it, and computing it would take a forward pass of every draw over the training split.

Attributes: ``experiment``, ``method``, ``mode``, ``repetition``, ``chains``, ``draws_per_chain`` and
``samples_digest`` (the content digest of the sample set the file was computed from, as the
predictions record it), and ArviZ's ``arviz_version``, on both groups (not ArviZ's ``created_at``:
the same unit gives the same bytes). The file is derived from the unit's two files and is not
one of them (``unit_paths``): its absence never makes a unit incomplete; a unit drawn again
replaces it once published (until then a file left from before names, in ``samples_digest``, the
sample set it was computed from). Written atomically (``atomic.atomic_path``).
"""
from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

import numpy as np

from benchmark.core.store.atomic import atomic_path
from benchmark.core.store.checkpoint import read_metadata
from benchmark.core.store.metadata import SampleSetMetadata
from benchmark.core.store.blocks import DTYPE_NAMES, read_header
from benchmark.core.store.sampleset import iter_column_chunks, load_sample_set, sample_set_keys
from benchmark.core.store.units import Unit

if TYPE_CHECKING:
    from benchmark.core.store.layout import ExperimentStore

WEIGHTS = 8
"""Single weights per draw in the ``posterior`` group (fixed by the model's shapes)."""
ChainLayout = Callable[[SampleSetMetadata, int], "tuple[int, int] | None"]
"""``(metadata, n stored samples) -> (chains, draws per chain)`` or None: a method's ``chain_layout``."""


def mean_test_loglik(preds: np.ndarray, labels: np.ndarray, chains: int, per: int) -> np.ndarray:
    """``[chains, per]``: the mean over the ``N`` test images of the log-probability of the true
    label under each of the first ``chains x per`` draws of ``preds [n, N, C]`` (labels ``[N]``), as
    ``chain_figures`` computes its ``loglik``."""
    picked = np.take_along_axis(preds[: chains * per], labels[None, :, None], axis=2)[..., 0]
    return np.log(np.clip(picked, 1e-30, None)).mean(1).reshape(chains, per)


def fixed_weights(shapes: Mapping[str, tuple[int, ...]], count: int = WEIGHTS) -> list[tuple[str, int]]:
    """``count`` (or all, if fewer) ``(key, flat index)`` single weights of the tensors ``shapes``
    (key -> shape of one draw), drawn without replacement by a generator of seed 0 over their
    coordinates in key order, sorted."""
    keys = list(shapes)
    sizes = [math.prod(shapes[k]) for k in keys]
    total = sum(sizes)
    picked = np.sort(np.random.default_rng(0).choice(total, size=min(count, total), replace=False))
    starts = np.cumsum([0, *sizes])
    out = []
    for flat in picked.tolist():
        i = int(np.searchsorted(starts, flat, side="right")) - 1
        out.append((keys[i], flat - int(starts[i])))
    return out


def _arviz() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        import arviz

    return arviz


def draw_summaries(path: Path, kept: int) -> tuple[list[str], np.ndarray, list[tuple[str, int]], np.ndarray]:
    """Of the first ``kept`` samples of the sample set at ``path``: its floating-point keys (in the
    file's order), the L2 norm of each of their tensors per sample ``[kept, keys]`` (float64), the
    ``fixed_weights`` picked from them, and those weights per sample ``[kept, WEIGHTS]``. Read one
    column block at a time (``iter_column_chunks``, each tensor checked against its checksum), so
    memory stays at a block whatever the model's size."""
    dtypes = {name: dtype for dtype, name in DTYPE_NAMES.items()}
    entries = read_header(path).entries
    floats = {k: tuple(e["shape"][1:]) for k, e in entries.items()
              if e["dtype"] in dtypes and dtypes[e["dtype"]].is_floating_point}
    picks = fixed_weights(floats)
    norms, weights = [], {}
    for key in floats:
        wanted = [i for k, i in picks if k == key]
        squares, offset = np.zeros(kept), 0
        for block in iter_column_chunks(path, key, max_columns=2**16):
            block = block[:kept].double()
            squares += block.pow(2).sum(1).numpy()
            for i in wanted:
                if offset <= i < offset + block.shape[1]:
                    weights[(key, i)] = block[:, i - offset].numpy()
            offset += block.shape[1]
        norms.append(np.sqrt(squares))
    return list(floats), np.stack(norms, 1), picks, np.stack([weights[p] for p in picks], 1)


def inference_data(keys: list[str], norms: np.ndarray, picks: list[tuple[str, int]], weights: np.ndarray,
                   loglik: np.ndarray, attrs: Mapping[str, Any] | None = None) -> Any:
    """The ``InferenceData`` of the module doc from ``draw_summaries``' keys, norms
    ``[chains x per, keys]``, picks and weights ``[chains x per, picks]`` and the test
    log-likelihood ``loglik [chains, per]`` (``mean_test_loglik``), the draws chain after chain."""
    chains, per = loglik.shape
    az = _arviz()
    data = az.from_dict(
        posterior={"layer_norm": norms.reshape(chains, per, -1), "weight": weights.reshape(chains, per, -1)},
        sample_stats={"test_loglik": loglik.astype(np.float64)},
        coords={"tensor": keys, "coordinate": [f"{k}[{i}]" for k, i in picks]},
        dims={"layer_norm": ["tensor"], "weight": ["coordinate"]},
        posterior_attrs=dict(attrs or {}), sample_stats_attrs=dict(attrs or {}),
    )
    for group in data.groups():
        getattr(data, group).attrs.pop("created_at", None)  # a clock reading: the file is byte-for-byte reproducible
    return data


def write_inference_data(store: "ExperimentStore", unit: Unit, labels: Any, layout_of: ChainLayout) -> Path | None:
    """Write ``store.inference_data_path(unit)`` (atomically) from the unit's published sample set
    and predictions (``labels [N]``: the ID test labels its predictions were computed on); the path,
    or ``None`` (nothing written) when ``layout_of(metadata, n)``, the unit's method's layout of its
    ``n`` stored samples (``PosteriorMethod.chain_layout``), gives none (not a chain method's, or
    metadata that do not say) or no whole chain."""
    samples_path = store.samples_path(unit)
    meta = SampleSetMetadata.decode(read_metadata(samples_path))
    preds_path = store.preds_path(unit)
    layout = layout_of(meta, sample_set_keys(preds_path)["id"][0])  # the header only
    if layout is None or min(layout) < 1:
        return None
    chains, per = layout
    preds = load_sample_set(preds_path, ["id"])["id"].numpy()
    labels = labels.numpy() if hasattr(labels, "numpy") else np.asarray(labels)
    attrs = {"experiment": unit.experiment, "method": str(unit.method), "mode": str(unit.mode),
             "repetition": int(unit.repetition), "chains": chains, "draws_per_chain": per,
             "samples_digest": str(read_metadata(preds_path).get("samples_digest", ""))}
    loglik = mean_test_loglik(preds, labels, chains, per)
    del preds
    data = inference_data(*draw_summaries(samples_path, chains * per), loglik, attrs)
    target = store.inference_data_path(unit)
    with atomic_path(target) as tmp:
        data.to_netcdf(str(tmp))
    return target
