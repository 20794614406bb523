import datetime
import json
import math

import numpy as np
import pytest
import torch

from of3_megafold.bench.common import (
    METADATA_FIELDS,
    GpuEvent,
    Timing,
    append_rows,
    benchmark_json,
    environment_metadata,
    launch_counts,
    measure_into,
    read_rows,
    timed_peak,
    wall_ms_per_call,
)


def test_environment_metadata_has_every_field():
    meta = environment_metadata()
    assert set(METADATA_FIELDS) <= set(meta)
    assert meta["torch"] == torch.__version__
    assert meta["openfold3"].startswith("0.5")
    assert meta["gpu"]
    date = datetime.datetime.fromisoformat(meta["date"])
    assert date.tzinfo is not None
    if meta["commit"] is not None:
        assert len(meta["commit"].removesuffix("+dirty")) == 40
    json.dumps(meta)


def test_benchmark_json_names_the_docs_file():
    path = benchmark_json("step")
    assert path.name == "step.json"
    assert path.parent.parts[-2:] == ("docs", "benchmarks")


def test_append_rows_creates_then_appends(tmp_path):
    path = tmp_path / "sub" / "bench.json"
    append_rows(path, [{"provider": "a", "ms": 1.5}])
    append_rows(path, [{"provider": "b", "ms": 2.0}, {"provider": "c", "ms": None}])
    rows = json.loads(path.read_text())
    assert [row["provider"] for row in rows] == ["a", "b", "c"]
    assert rows[2]["ms"] is None
    # Written through a temporary file that is moved into place: none left behind.
    assert sorted(p.name for p in path.parent.iterdir()) == ["bench.json"]


def test_append_rows_converts_numpy_and_tensor_scalars(tmp_path):
    path = tmp_path / "bench.json"
    append_rows(path, [{"n": np.int64(7), "ms": torch.tensor(0.25), "p": tmp_path}])
    (row,) = read_rows(path)
    assert row == {"n": 7, "ms": 0.25, "p": str(tmp_path)}


def test_append_rows_refuses_nan_and_keeps_the_file(tmp_path):
    path = tmp_path / "bench.json"
    append_rows(path, [{"ms": 1.0}])
    before = path.read_text()
    with pytest.raises(ValueError, match="non-finite"):
        append_rows(path, [{"ms": 2.0, "loss": {"total": math.nan}}])
    assert path.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json"]


def test_append_rows_rejects_a_file_that_is_not_a_list(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text('{"ms": 1}')
    with pytest.raises(ValueError, match="expected a JSON list"):
        append_rows(path, [{"ms": 2.0}])


def test_read_rows_of_missing_file_is_empty(tmp_path):
    assert read_rows(tmp_path / "absent.json") == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU timing path")
def test_timed_peak_on_cpu_is_a_wall_clock_median():
    calls = []

    def work():
        calls.append(1)
        torch.randn(64, 64) @ torch.randn(64, 64)

    timing = timed_peak(work, warmup_ms=1, rep_ms=5)
    assert isinstance(timing, Timing)
    assert timing.ms > 0 and math.isfinite(timing.ms)
    assert timing.peak_mib is None
    assert len(calls) >= 4  # at least one warm-up call and three timed calls


def test_wall_ms_per_call_is_the_mean_of_the_timed_calls():
    import time

    calls = []

    def work():
        calls.append(1)
        time.sleep(0.002)

    ms = wall_ms_per_call(work, calls=5, warmup=2)
    assert len(calls) == 7
    assert 2.0 <= ms < 50.0  # each timed call sleeps 2 ms


@pytest.mark.gpu
def test_timed_peak_on_cuda_counts_memory_above_the_start():
    resident = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")

    def work():
        scratch = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
        scratch.fill_(1)

    timing = timed_peak(work, warmup_ms=5, rep_ms=20)
    assert timing.ms > 0
    # The 64 MiB scratch buffer, not the 256 MiB already resident.
    assert 64 <= timing.peak_mib < 128
    del resident


def test_measure_into_times_skips_and_records_out_of_memory():
    calls = []
    row = {}
    timing = measure_into(row, lambda: lambda: calls.append(1))
    assert timing is not None and row == {"ms": timing.ms, "peak_mib": timing.peak_mib}
    assert row["ms"] >= 0 and calls

    row = {}
    assert measure_into(row, lambda: pytest.fail("built"), "no package") is None
    assert row == {"skipped": "no package"}

    def out_of_memory():
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    row = {}
    assert measure_into(row, out_of_memory) is None
    assert row == {"error": "out of memory"}


def test_launch_counts_separate_kernels_from_host_launch_calls():
    events = [
        GpuEvent(True, "triton_poi_fused_add_0", 0, 10),
        GpuEvent(True, "ampere_bf16_s16816gemm", 20, 30),
        GpuEvent(True, "Memcpy HtoD (Pageable -> Device)", 40, 45),
        GpuEvent(True, "Memset (Device)", 50, 51),
        GpuEvent(False, "cudaLaunchKernel", 0, 1),
        GpuEvent(False, "cuLaunchKernelEx", 1, 2),
        GpuEvent(False, "cudaGraphLaunch", 2, 3),  # one replay: one launch
        GpuEvent(False, "cudaMemcpyAsync", 3, 4),
        GpuEvent(False, "aten::mm", 0, 100),
    ]
    counts = launch_counts(events)
    assert (counts["kernels"], counts["host"]) == (2, 3)
    # the GPU events' intervals only; the host's 100 ns aten::mm is not GPU time
    assert counts["gpu_busy_ms"] == pytest.approx(26e-6)


def test_gpu_busy_time_counts_overlapping_streams_once():
    events = [
        GpuEvent(True, "a", 100, 200),
        GpuEvent(True, "b", 150, 180),  # inside a
        GpuEvent(True, "c", 190, 260),  # overlaps a's end
        GpuEvent(True, "d", 300, 310),  # after a gap
        GpuEvent(True, "e", 0, 50),  # listed out of order
    ]
    assert launch_counts(events)["gpu_busy_ms"] == pytest.approx(220e-6)
    assert launch_counts([])["gpu_busy_ms"] == 0
