"""TunedKernel: the autotuner's choice reused, heuristics applied, one entry per key."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from of3_megafold.kernels.backend import interpreter_enabled

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or interpreter_enabled()),
    reason="needs a GPU or TRITON_INTERPRET=1",
)


@triton.jit
def _axpy_kernel(X, Y, n, alpha, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if EVEN:
        x = tl.load(X + offs)
        tl.store(Y + offs, x * alpha + 1.0)
    else:
        x = tl.load(X + offs, mask=offs < n)
        tl.store(Y + offs, x * alpha + 2.0, mask=offs < n)


def _kernels():
    """Fresh wrappers (each test gets its own autotuner cache)."""
    heuristic = triton.heuristics({"EVEN": lambda a: a["n"] % a["BLOCK"] == 0})(
        _axpy_kernel
    )
    tuned = triton.autotune(configs=[triton.Config({"BLOCK": 16})], key=["n"])(
        heuristic
    )
    return heuristic, tuned


def _run(kernel, x: torch.Tensor, alpha: float) -> torch.Tensor:
    y = torch.empty_like(x)
    n = x.numel()
    kernel[lambda meta: (-(-n // meta["BLOCK"]),)](X=x, Y=y, n=n, alpha=alpha)
    return y


def _expected(x: torch.Tensor, alpha: float) -> torch.Tensor:
    return x * alpha + (1.0 if x.numel() % 16 == 0 else 2.0)


@pytest.mark.parametrize("autotuned", [True, False], ids=["autotune", "fixed"])
def test_launches_match_and_reuse_the_choice(autotuned, monkeypatch):
    from of3_megafold.kernels._launch import TunedKernel

    heuristic, tuned = _kernels()
    kernel = TunedKernel(tuned) if autotuned else TunedKernel(heuristic, {"BLOCK": 16})
    device = "cuda" if torch.cuda.is_available() else "cpu"
    inputs = [
        torch.randn(n, device=device, dtype=dtype)
        for n, dtype in ((32, torch.float32), (17, torch.float32), (32, torch.float64))
    ]
    for x in inputs:  # first launch of each key: through Triton's wrappers
        torch.testing.assert_close(_run(kernel, x, 3.0), _expected(x, 3.0))
    # one entry per (autotuning key values, dtypes): n=32 fp32, n=17 fp32, n=32 fp64;
    # a fixed config has no key values: fp32, fp64 (EVEN still differs per launch)
    assert len(kernel._chosen) == (3 if autotuned else 2)

    def no_wrappers(*args, **kwargs):
        raise AssertionError("a tuned key went through Triton's wrappers again")

    monkeypatch.setattr(type(kernel._entry), "run", no_wrappers)
    for x in inputs:  # later launches: the JIT function, heuristics applied here
        torch.testing.assert_close(_run(kernel, x, -0.5), _expected(x, -0.5))


def _preset(block: int) -> dict:
    return {"kwargs": {"BLOCK": block}, "num_warps": 4, "num_stages": 3}


def test_presets_choose_without_tuning():
    """A key the presets list is launched with their configuration, not tuned: two
    candidates and no GPU, so benchmarking them would fail here."""
    from of3_megafold.kernels._launch import TunedKernel

    heuristic, _ = _kernels()
    configs = [triton.Config({"BLOCK": b}, num_warps=4, num_stages=3) for b in (16, 32)]
    tuned = triton.autotune(configs=configs, key=["n"])(heuristic)
    loads = []

    def presets():
        loads.append(1)
        return {(32, "torch.float32", "torch.float32"): _preset(32)}

    kernel = TunedKernel(tuned, presets=presets)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(32, device=device)
    for _ in range(2):
        torch.testing.assert_close(_run(kernel, x, 3.0), _expected(x, 3.0))
    assert kernel.preset_keys == [(32, torch.float32, torch.float32)]
    assert kernel._chosen[kernel.preset_keys[0]][0] == {"BLOCK": 32}
    assert len(loads) == 1


def test_presets_naming_an_unknown_config_are_ignored():
    from of3_megafold.kernels._launch import TunedKernel

    heuristic, tuned = _kernels()  # one candidate: BLOCK 16, 4 warps, 3 stages
    kernel = TunedKernel(
        tuned, presets=lambda: {(32, "torch.float32", "torch.float32"): _preset(64)}
    )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(32, device=device)
    torch.testing.assert_close(_run(kernel, x, 3.0), _expected(x, 3.0))
    assert kernel.preset_keys == []
    assert kernel._chosen[(32, torch.float32, torch.float32)][0] == {"BLOCK": 16}


def test_shipped_evoflash_choices_name_current_candidates():
    """The shipped table was built for the current config lists, and every choice
    in it is one of its kernel's candidates (else the kit ignores the table, or
    the entry, and that GPU tunes again)."""
    import json

    from of3_megafold.kernels.evoflash import configs
    from of3_megafold.kernels.evoflash.tuned import KERNELS, tuned_path

    table = json.loads(tuned_path("NVIDIA H200").read_text())
    assert set(table["kernels"]) == set(KERNELS)
    for kernel, entries in table["kernels"].items():
        assert table["lists"][kernel] == configs.lists_fingerprint(kernel), (
            f"{kernel}'s config list changed since the shipped table was built: "
            "rebuild it with `python -m tools.ship_autotune` from a tuning run over "
            "the new list (--merge keeps the other kernels' entries)"
        )
        assert entries, kernel
        for entry in entries:
            assert any(
                c.kwargs == entry["kwargs"]
                and c.num_warps == entry["num_warps"]
                and c.num_stages == entry["num_stages"]
                for c in configs.CANDIDATES[kernel]
            ), (kernel, entry)


def test_positional_arguments_in_parameter_order():
    from of3_megafold.kernels._launch import TunedKernel

    _, tuned = _kernels()
    kernel = TunedKernel(tuned)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(17, device=device)
    for alpha in (3.0, -0.5):  # first launch (autotuner), then the remembered choice
        y = torch.empty_like(x)
        kernel[lambda meta: (-(-17 // meta["BLOCK"]),)](x, y, 17, alpha=alpha)
        torch.testing.assert_close(y, _expected(x, alpha))
    with pytest.raises(TypeError, match="7 arguments for 6 params"):
        kernel[(1,)](x, y, 17, 1.0, 16, True, 0)


def test_launch_options_of_each_call_are_kept(monkeypatch):
    """A call's ``num_warps`` holds for every later launch with it, and another
    value gets its own entry (they were once dropped after the first launch)."""
    from of3_megafold.kernels._launch import TunedKernel

    heuristic, tuned = _kernels()
    kernel = TunedKernel(heuristic, {"BLOCK": 16})
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(32, device=device)
    seen = []
    if kernel._direct is not None:
        direct = kernel._direct

        def record(grid, args, options, key):
            seen.append(options.get("num_warps"))
            direct(grid, args, options, key)

        monkeypatch.setattr(kernel, "_direct", record)
    else:
        run = kernel._jit.run

        def record(*args, **kwargs):
            seen.append(kwargs.get("num_warps"))
            return run(*args, **kwargs)

        monkeypatch.setattr(kernel._jit, "run", record)
    for warps in (1, 2, 1, 2):
        y = torch.empty_like(x)
        kernel[(2,)](X=x, Y=y, n=32, alpha=3.0, num_warps=warps)
        torch.testing.assert_close(y, _expected(x, 3.0))
    assert seen[-2:] == [1, 2]  # the remembered launches
    assert len(kernel._chosen) == 2
    with pytest.raises(TypeError, match="autotuned kernel's launch options"):
        TunedKernel(tuned)[(1,)](X=x, Y=y, n=32, alpha=1.0, num_warps=2)


def test_entries_built_for_another_list_are_ignored(tmp_path, monkeypatch, caplog):
    """Per kernel: the entries of a kernel whose candidate list changed since the
    table was built are ignored, the others' kept; a table from before per-kernel
    fingerprints (one string) is ignored as a whole."""
    import json

    from of3_megafold.kernels.evoflash import configs, tuned

    fwd, dq = "_evoflash_fwd_kernel", "_evoflash_bwd_dq_kernel"
    entry = {"key": [1024], "kwargs": {"BLOCK_M": 64}, "num_warps": 4, "num_stages": 3}
    kernels = {fwd: [entry], dq: [entry]}
    tables = {
        "mixed": {"lists": {fwd: configs.lists_fingerprint(fwd), dq: "0" * 16},
                  "kernels": kernels},
        "legacy": {"lists": "0" * 16, "kernels": kernels},
    }
    for gpu, table in tables.items():
        (tmp_path / f"{gpu}.json").write_text(json.dumps(table))
    monkeypatch.setattr(tuned, "tuned_path", lambda gpu: tmp_path / f"{gpu}.json")
    tuned._table.cache_clear()
    try:
        with caplog.at_level("WARNING"):
            assert tuned._table("mixed")["kernels"] == {fwd: [entry]}
        assert f"another candidate list of {dq}" in caplog.text
        assert fwd not in caplog.text
        assert tuned._table("legacy")["kernels"] == {}
    finally:
        tuned._table.cache_clear()


def test_the_fingerprint_follows_the_lists(monkeypatch):
    import triton

    from of3_megafold.kernels.evoflash import configs

    fwd, dq = "_evoflash_fwd_kernel", "_evoflash_bwd_dq_kernel"
    before = {name: configs.lists_fingerprint(name) for name in (fwd, dq)}
    widened = dict(configs.CANDIDATES)
    widened[fwd] = widened[fwd] + [
        triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "S_GROUP": 1}, num_warps=2)
    ]
    monkeypatch.setattr(configs, "CANDIDATES", widened)
    assert configs.lists_fingerprint(fwd) != before[fwd]
    assert configs.lists_fingerprint(dq) == before[dq]


@pytest.mark.gpu
def test_gpu_direct_launch_follows_the_specialization():
    """Launches straight to the compiled kernel (``DirectLaunch``) still pick the
    binary Triton's specialization calls for: a pointer off 16-byte alignment, a
    length of 1 or not divisible by 16 each get their own."""
    from of3_megafold.kernels._launch import TunedKernel

    heuristic, _ = _kernels()
    kernel = TunedKernel(heuristic, {"BLOCK": 16})
    assert kernel._direct is not None
    base = torch.randn(96, device="cuda")
    for x in (base[:64], base[1:65], base[:17], base[3:20], base[:1], base[16:80]):
        torch.testing.assert_close(_run(kernel, x, 2.0), _expected(x, 2.0))
    assert len(kernel._direct._kernels) >= 4
