"""The linear benchmark: a CPU smoke run of every provider and mode."""

import json

from of3_megafold.bench import linear


def test_quick_run_times_every_provider_and_mode(tmp_path, interpreted_kernels):
    out = tmp_path / "linear.json"
    rows = linear.run(out, quick=True)
    assert [(r["provider"], r["mode"]) for r in rows] == [
        (p, mode) for p in linear.PROVIDERS for mode in ("fwd", "fwd+bwd")
    ]
    assert all(r["ms"] > 0 and "error" not in r for r in rows)
    # on the CPU every provider computes in fp32: errors at fp32's rounding
    assert all(0 < r["err"] < 1e-6 for r in rows), [r["err"] for r in rows]
    assert json.loads(out.read_text()) == rows
