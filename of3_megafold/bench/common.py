"""Helpers shared by the ``of3-megafold bench`` modules.

Every benchmark writes rows (flat dicts, JSON-serialisable) into
``docs/benchmarks/<what>.json``. A row carries what was measured (``ms``, a peak
memory figure) and the :func:`environment_metadata` fields, so rows from different
machines and commits can sit in one file and still be told apart.

Timing follows the Liger / xformers convention: :func:`timed_peak` times with
``triton.testing.do_bench`` (median, warm-up, L2 flush) on CUDA and measures the
peak memory in a separate call, because ``do_bench`` allocates its own L2-flush
buffer that would otherwise be counted.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import gc
import importlib.metadata
import json
import math
import os
import platform
import statistics
import subprocess
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

MIB = 1024**2
GIB = 1024**3

# Fields every row carries; tools/plot_benchmarks.py keeps its own list of them
# (IDENTITY_FIELDS; a test checks that it covers environment_metadata()).
METADATA_FIELDS = (
    "gpu",
    "torch",
    "triton",
    "openfold3",
    "of3_megafold",
    "commit",
    "date",
)

_PACKAGE_DIR = Path(__file__).resolve().parents[1]


def parse_ints(text: str) -> list[int]:
    """Sizes on a command line: ``384,768`` -> ``[384, 768]``; ``none`` -> ``[]``
    (e.g. ``--tokens none``: no timed sizes, only the largest-crop search).

    Raises:
        ValueError: a part is not an integer (argparse reports it as a bad value).
    """
    if text.strip().lower() == "none":
        return []
    return [int(part) for part in text.split(",") if part.strip()]


def benchmark_dir() -> Path:
    """Default directory of the benchmarks' JSON files: inside a source checkout the
    checkout's ``docs/benchmarks``; for an installed copy ``docs/benchmarks`` of the
    working directory."""
    checkout_docs = _PACKAGE_DIR.parent / "docs" / "benchmarks"
    if checkout_docs.is_dir():
        return checkout_docs
    return Path.cwd() / "docs" / "benchmarks"


def benchmark_json(what: str) -> Path:
    """Default output file of benchmark ``what``: ``<benchmark_dir()>/<what>.json``."""
    return benchmark_dir() / f"{what}.json"


def _distribution_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def _git_commit() -> str | None:
    """Commit of the checkout holding this package, ``+dirty`` if it has edits.

    ``OF3_MEGAFOLD_COMMIT``, when set, wins over git: a GPU machine receives the
    working tree without (or with stale) git metadata, so whoever sends the tree
    names its commit.
    """
    if os.environ.get("OF3_MEGAFOLD_COMMIT"):
        return os.environ["OF3_MEGAFOLD_COMMIT"]
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=_PACKAGE_DIR,
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=_PACKAGE_DIR,
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{commit}+dirty" if status else commit


def device_name(device: torch.device | str | None = None) -> str:
    """``torch.cuda.get_device_name`` for a CUDA device, else ``cpu (<machine>)``."""
    device = torch.device(device) if device is not None else None
    if torch.cuda.is_available() and (device is None or device.type == "cuda"):
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


def environment_metadata(device: torch.device | str | None = None) -> dict[str, Any]:
    """The fields that identify where and with what a row was measured.

    Returns a dict with ``gpu`` (device name), ``torch``, ``triton``, ``openfold3``,
    ``of3_megafold`` (versions; ``None`` if not installed), ``commit`` (git commit of
    the kit's checkout, ``None`` outside one) and ``date`` (UTC, ISO 8601), plus
    ``cuda`` and ``python`` versions and ``alloc_conf`` (``PYTORCH_CUDA_ALLOC_CONF``).
    """
    from of3_megafold import __version__ as kit_version

    return {
        "gpu": device_name(device),
        "torch": torch.__version__,
        "triton": _distribution_version("triton"),
        "openfold3": _distribution_version("openfold3"),
        "of3_megafold": kit_version,
        "commit": _git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"
        ),
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        # Allocator settings change peak memory and the largest crop that fits.
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
    }


class Timing(NamedTuple):
    """Median time of one call in milliseconds, and its peak memory in MiB.

    ``peak_mib`` is ``max_memory_allocated`` during one call minus what was
    allocated before it; ``None`` on CPU, where PyTorch keeps no allocator
    statistics.
    """

    ms: float
    peak_mib: float | None


def peak_mib_of_call(fn: Callable[[], Any]) -> float | None:
    """Peak CUDA memory (MiB) one call of ``fn`` allocates above the memory in use
    before it; ``None`` without CUDA."""
    if not torch.cuda.is_available():
        fn()
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / MIB


def timed_peak(
    fn: Callable[[], Any],
    *,
    warmup_ms: float = 25,
    rep_ms: float = 100,
    grad_to_none: Sequence[torch.Tensor] | None = None,
) -> Timing:
    """Time ``fn`` and measure its peak memory.

    On CUDA: one warm-up call (Triton autotuning and lazy initialisation happen
    there, outside both measurements), one call for the peak memory, then
    ``triton.testing.do_bench(fn, warmup_ms, rep_ms, grad_to_none,
    return_mode="median")``. On CPU: a wall-clock median over calls filling about
    ``rep_ms`` (at least 3) after about ``warmup_ms`` of warm-up.

    Args:
        fn: The work to time; called many times, takes no arguments.
        warmup_ms: Warm-up budget in milliseconds.
        rep_ms: Measurement budget in milliseconds.
        grad_to_none: Tensors whose ``.grad`` is reset between calls (CUDA only,
            as in ``do_bench``), so backward passes do not accumulate.
    """
    if torch.cuda.is_available():
        import triton.testing

        fn()
        peak = peak_mib_of_call(fn)
        ms = triton.testing.do_bench(
            fn,
            warmup=warmup_ms,
            rep=rep_ms,
            grad_to_none=grad_to_none,
            return_mode="median",
        )
        return Timing(ms=float(ms), peak_mib=peak)

    deadline = time.perf_counter() + warmup_ms / 1e3
    fn()
    while time.perf_counter() < deadline:
        fn()
    times = []
    deadline = time.perf_counter() + rep_ms / 1e3
    while len(times) < 3 or time.perf_counter() < deadline:
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return Timing(ms=statistics.median(times), peak_mib=None)


def wall_ms_per_call(fn: Callable[[], Any], calls: int, warmup: int = 3) -> float:
    """Mean wall time (ms) of ``calls`` back-to-back calls of ``fn`` after ``warmup``
    calls: the device is synchronised before and after the timed calls, not between
    them, so host work that the GPU does not hide counts (the profiling scripts'
    figure, next to the GPU time a profiler reports)."""
    cuda = torch.cuda.is_available()
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - started) / calls * 1e3


TF32_SUFFIX = "-tf32"
"""Provider suffix: ``<provider>-tf32`` is ``<provider>`` with TF32 matmuls for the
whole step (float32 matmul precision ``high``, what OF3's ``--use_tf32`` sets). OF3
trains with IEEE fp32 matmuls by default, and its diffusion module, confidence heads
and losses run in fp32 under bf16 autocast: this is a precision trade, timed beside
the provider without it. Both ``bench step`` and ``bench train`` take it."""


def split_tf32(name: str) -> tuple[str, bool]:
    """``(provider, tf32)``: ``name`` less :data:`TF32_SUFFIX`, and whether it had
    it."""
    if name.endswith(TF32_SUFFIX):
        return name.removesuffix(TF32_SUFFIX), True
    return name, False


@contextlib.contextmanager
def matmul_tf32(enabled: bool):
    """Inside, fp32 matmuls may use TF32 (float32 matmul precision ``high``) if
    ``enabled``; the precision is restored on leaving."""
    before = torch.get_float32_matmul_precision()
    if enabled and before == "highest":
        torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is a CUDA allocation failure (recoverable: free and retry
    smaller)."""
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return True
    # cuBLAS reports a failed workspace allocation as a plain RuntimeError.
    message = str(error)
    return isinstance(error, RuntimeError) and (
        "CUDA out of memory" in message or "CUBLAS_STATUS_ALLOC_FAILED" in message
    )


_OWN_CODE = (f"{os.sep}openfold3{os.sep}", f"{os.sep}of3_megafold{os.sep}")


def out_of_memory_account(error: BaseException) -> dict[str, str]:
    """What an out-of-memory ``error`` says of itself, for a benchmark row:
    ``oom_message``, torch's account of the failed allocation (what it tried to
    allocate, what was free, allocated and reserved but unallocated) without its
    advice; ``oom_raised_in``, the innermost frame of OF3 or the kit
    (``module.function``) or, without one, the innermost frame."""
    message = " ".join(str(error).split())
    message = message.split(" If reserved but unallocated")[0]
    frames = traceback.extract_tb(error.__traceback__)
    ours = [f for f in frames if any(part in f.filename for part in _OWN_CODE)]
    frame = (ours or frames or [None])[-1]
    raised_in = "" if frame is None else f"{Path(frame.filename).stem}.{frame.name}"
    return {"oom_message": message[:400], "oom_raised_in": raised_in}


def free_device_memory() -> None:
    """Collect garbage and hand cached CUDA blocks back to the driver.

    Call it after the exception of an out-of-memory step is gone (outside the
    ``except`` block): until then its traceback keeps the step's tensors alive.
    """
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure_into(
    row: dict[str, Any],
    make_step: Callable[[], Callable[[], Any]],
    skipped: str | None = None,
) -> Timing | None:
    """One benchmark row's measurement: ``ms`` and ``peak_mib`` of the step that
    ``make_step()`` builds (:func:`timed_peak`), or ``skipped`` (why it cannot run
    here, e.g. a missing package) or ``error: out of memory``; then the step's memory
    is freed (:func:`free_device_memory`). Returns the timing, ``None`` when there
    is none."""
    timing = None
    if skipped:
        row["skipped"] = skipped
    else:
        try:
            timing = timed_peak(make_step())
            row.update(ms=timing.ms, peak_mib=timing.peak_mib)
        except torch.cuda.OutOfMemoryError:
            row["error"] = "out of memory"
    free_device_memory()
    return timing


# The CUDA runtime and driver calls that put work on a stream from the host: one
# per kernel launched on its own, one per graph replayed (however many kernels it
# holds). Triton launches through the driver, torch's own kernels through the runtime.
HOST_LAUNCH_CALLS = (
    "cudaLaunchKernel",
    "cudaLaunchKernelExC",
    "cudaLaunchCooperativeKernel",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cuLaunchCooperativeKernel",
    "cudaGraphLaunch",
    "cuGraphLaunch",
)


def count_kernel_launches(fn: Callable[[], Any]) -> dict[str, float] | None:
    """What one call of ``fn`` launches, counted with ``torch.profiler`` (see
    :func:`launch_counts`): kernels run, host launch calls and the GPU's busy time.
    ``None`` without CUDA."""
    if not torch.cuda.is_available():
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    # Counting the raw Kineto events skips building the profiler's op tree, which
    # takes minutes for a full training step.
    return launch_counts(
        GpuEvent(
            event.device_type() == DeviceType.CUDA,
            event.name(),
            event.start_ns(),
            event.end_ns(),
        )
        for event in prof.profiler.kineto_results.events()
    )


class GpuEvent(NamedTuple):
    """One profiler event: on the GPU or the host, its name, start and end (ns)."""

    on_gpu: bool
    name: str
    start_ns: int
    end_ns: int


def launch_counts(events: Iterable[GpuEvent]) -> dict[str, float]:
    """What a profiled call put on the GPU, from its profiler events:

    - ``kernels``: the CUDA kernels that ran (memcpy and memset excluded, a graph's
      kernels included);
    - ``host``: the launch calls the host made (:data:`HOST_LAUNCH_CALLS`; a graph
      replay is one, however many kernels it holds);
    - ``gpu_busy_ms``: the time the GPU had work, the union of every GPU event's
      interval (kernels, copies and fills; overlapping streams counted once).
    """
    kernels = host = 0
    intervals = []
    for event in events:
        if event.on_gpu:
            kernels += not event.name.startswith(("Memcpy", "Memset"))
            intervals.append((event.start_ns, event.end_ns))
        elif event.name.startswith(HOST_LAUNCH_CALLS):
            host += 1
    busy_ns = 0
    covered_to = None
    for start, end in sorted(intervals):
        if covered_to is None or start > covered_to:
            busy_ns += end - start
            covered_to = end
        elif end > covered_to:
            busy_ns += end - covered_to
            covered_to = end
    return {"kernels": kernels, "host": host, "gpu_busy_ms": busy_ns / 1e6}


def _json_default(value: Any) -> Any:
    # numpy scalars and 0-d tensors carry .item(); anything else (Path, dtype) is
    # written as its string form.
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def _check_finite(value: Any, where: str) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"non-finite number {value} in benchmark row at {where}")
    if isinstance(value, dict):
        for key, item in value.items():
            _check_finite(item, f"{where}.{key}")
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            _check_finite(item, f"{where}[{index}]")


def read_rows(path: Path | str) -> list[dict[str, Any]]:
    """Rows stored in a benchmark JSON file; ``[]`` if it does not exist."""
    path = Path(path)
    if not path.exists():
        return []
    rows = json.loads(path.read_text())
    if not isinstance(rows, list):
        raise ValueError(f"{path} holds {type(rows).__name__}, expected a JSON list")
    return rows


def check_rows_readable(path: Path | str) -> None:
    """Refuse to append to a file that is not a JSON list of rows (nothing is
    overwritten: the rows already there are results of record).

    Raises:
        KitError: ``path`` exists and cannot be read as a list of rows.
    """
    from of3_megafold.errors import KitError

    try:
        read_rows(path)
    except (ValueError, OSError) as error:
        raise KitError(
            f"{path} cannot be read as a list of benchmark rows ({error}); "
            "move it aside or repair it, then run again"
        ) from error


def out_dir_option(help: str):
    """A benchmark command's ``--out-dir`` (default :func:`benchmark_dir`)."""
    import click

    return click.option(
        "--out-dir",
        type=click.Path(file_okay=False, path_type=Path),
        default=benchmark_dir,
        show_default="docs/benchmarks of the checkout, else of the working directory",
        help=help,
    )


def append_rows(path: Path | str, rows: Iterable[dict[str, Any]]) -> None:
    """Append ``rows`` to the JSON list in ``path``, creating it if needed.

    The new list is written to a temporary file in the same directory and moved
    over ``path`` with ``os.replace``, so a reader never sees a half-written file
    and an interrupted run leaves the old file intact. Non-finite floats are
    refused (JSON has none; a NaN timing or loss is a bug to report, not to store).
    Two processes appending at the same moment can still lose one's rows: run
    benchmarks writing the same file one after another.
    """
    path = Path(path)
    rows = list(rows)
    for index, row in enumerate(rows):
        _check_finite(row, f"row {index}")
    all_rows = read_rows(path) + rows
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(
        dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"
    )
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(
                all_rows, handle, indent=1, default=_json_default, allow_nan=False
            )
            handle.write("\n")
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
