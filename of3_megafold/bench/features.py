"""``of3-megafold bench features``: time per training sample of OF3's data pipeline.

On the demo set (15 PDB entries from the openfold3 wheel, 272 datapoints; see
:mod:`of3_megafold.demo`) at two token budgets (48, the demo's, and 384, a training
crop), in one process, the same datapoints with the same seeds through:

- ``of3``: OF3's ``WeightedPDBDataset.__getitem__``;
- ``kit-store``: ``EvoPipeWeightedPDBDataset`` on a store without conformer pool
  (samples equal OF3's; checked here on every datapoint timed);
- ``kit-store-pool8``: the same with 8 pooled conformers per reference molecule.

Providers are interleaved per datapoint so drift hits all. Rows: mean and median ms
per sample over the datapoints, and the store's build time. The pipeline runs on the
CPU (one core, as in one data-loader worker): the figures are the host's, whatever
GPU is present.
"""

from __future__ import annotations

import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from of3_megafold.bench.common import append_rows, environment_metadata

POOL = 8
TOKEN_BUDGETS = (48, 384)
QUICK_SAMPLES = 6


def _sample(dataset, index: int, seed: int) -> tuple[dict, float]:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    started = time.perf_counter()
    sample = dataset[index]
    return sample, (time.perf_counter() - started) * 1e3


def _same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for key, value in a.items():
        other = b[key]
        if isinstance(value, torch.Tensor):
            if not torch.equal(value, other):
                return False
        elif isinstance(value, dict):
            if not _same(value, other):
                return False
        elif value != other:
            return False
    return True


def run(out_json: Path, quick: bool = False) -> list[dict[str, Any]]:
    """Time the three providers on the demo set at each token budget; append rows
    to ``out_json``.

    ``quick``: the first 6 datapoints (else all of them).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one data-loader worker's share of the host
    try:
        return _run(out_json, quick)
    finally:
        torch.set_num_threads(threads)


def _run(out_json: Path, quick: bool) -> list[dict[str, Any]]:
    from of3_megafold.data.dataset import training_dataset
    from of3_megafold.data.feature_store import build_feature_store
    from of3_megafold.demo.build import demo_dataset_paths, ensure_demo_dataset

    paths = demo_dataset_paths(ensure_demo_dataset())
    meta = environment_metadata("cpu")
    host = {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="of3mf-evopipe-") as tmp:
        stores, build_s = {}, {}
        for provider, pool in (("kit-store", 0), (f"kit-store-pool{POOL}", POOL)):
            started = time.perf_counter()
            stores[provider] = build_feature_store(
                paths["dataset_cache_file"],
                paths["target_structures_directory"],
                Path(tmp) / provider,
                conformers=pool,
                reference_mol_dir=paths["reference_molecule_directory"],
                progress=False,
            )
            build_s[provider] = time.perf_counter() - started
        rows = []
        mismatches = 0
        for budget in TOKEN_BUDGETS:
            datasets = {"of3": training_dataset(paths, "WeightedPDBDataset", budget)}
            for provider, store in stores.items():
                datasets[provider] = training_dataset(
                    paths, "EvoPipeWeightedPDBDataset", budget, feature_store=store
                )
            total = len(datasets["of3"])
            count = min(QUICK_SAMPLES, total) if quick else total
            times: dict[str, list[float]] = {name: [] for name in datasets}
            differ = 0
            for index in range(count):
                samples = {}
                for name, dataset in datasets.items():
                    samples[name], ms = _sample(dataset, index, seed=index)
                    times[name].append(ms)
                differ += not _same(samples["of3"], samples["kit-store"])
            mismatches += differ
            for name, values in times.items():
                row = {
                    "bench": "features",
                    "provider": name,
                    "dataset": "demo",
                    "token_budget": budget,
                    "samples": count,
                    "ms": statistics.mean(values),
                    "median_ms": statistics.median(values),
                    "build_s": build_s.get(name),
                    "conformer_pool": POOL if name.endswith(f"pool{POOL}") else 0,
                    **({"equal_to_of3": differ == 0} if name == "kit-store" else {}),
                    **host,
                    **meta,
                }
                rows.append(row)
                print(
                    f"{budget:4} tokens {name:18} {row['ms']:8.1f} ms/sample "
                    f"(median {row['median_ms']:.1f}) over {count} samples",
                    flush=True,
                )
    append_rows(out_json, rows)
    if mismatches:
        raise AssertionError(
            f"kit-store samples differ from OF3's on {mismatches} datapoints"
        )
    return rows
