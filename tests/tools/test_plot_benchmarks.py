import json

import pytest

from tools import plot_benchmarks


@pytest.fixture(scope="module")
def plotter():
    return plot_benchmarks


def _step_row(provider, n_token, ms, peak_gib, mode="step", date="2026-11-29T10:00"):
    return {
        "bench": "step",
        "mode": mode,
        "provider": provider,
        "config": "full",
        "n_token": n_token,
        "n_atom": n_token * 8 + 3,
        "n_msa": 1024,
        "ms": ms,
        "peak_gib": peak_gib,
        "loss": {"loss": 3.0},
        "oom": ms is None,
        "gpu": "NVIDIA H200",
        "commit": "abc",
        "date": date,
    }


@pytest.fixture
def bench_dir(tmp_path):
    step_rows = [
        _step_row("stock", 384, 7540.0, 16.5),
        _step_row("stock", 768, 22510.0, 61.8),
        _step_row("stock-triton", 384, 7050.0, 16.5),
        _step_row("stock-triton", 768, 17680.0, 48.0),
        # Re-measured later: this one must win.
        _step_row("stock-triton", 768, 17000.0, 47.0, date="2026-11-30T10:00"),
        _step_row("stock", 1024, None, None, mode="max_crop_probe"),
        _step_row("stock-triton", 1280, 70100.0, 120.3, mode="max_crop_probe"),
        {
            "bench": "step",
            "mode": "max_crop",
            "provider": "stock",
            "n_token": 768,
            "max_crop": 768,
            "gpu": "NVIDIA H200",
        },
    ]
    (tmp_path / "step.json").write_text(json.dumps(step_rows))
    lddt_rows = [
        {
            "provider": p,
            "dtype": "fp32",
            "n_atom": n,
            "ms": ms,
            "peak_mib": mib,
            "gpu": "NVIDIA H200",
            "date": "2026-11-29",
        }
        for p, n, ms, mib in [
            ("dense", 1262, 2.14, 176),
            ("dense", 4000, 7.13, 1771),
            ("kit", 1262, 0.5, 20),
            ("kit", 4000, 1.1, 60),
        ]
    ]
    (tmp_path / "smooth_lddt.json").write_text(json.dumps(lddt_rows))
    (tmp_path / "transition.json").write_text("{not json")
    return tmp_path


def test_render_writes_a_png_for_each_usable_json(plotter, bench_dir, capsys):
    written = plotter.render(bench_dir)
    assert sorted(p.name for p in written) == ["smooth_lddt.png", "step.png"]
    for png in written:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    err = capsys.readouterr().err
    assert "attention_core.json: no such file" in err
    assert "transition.json: not valid JSON" in err


def test_main_renders_named_benchmarks(plotter, bench_dir):
    assert plotter.main(["smooth_lddt", "--dir", str(bench_dir)]) == 0
    assert (bench_dir / "smooth_lddt.png").exists()
    assert not (bench_dir / "step.png").exists()


def test_step_rows_are_grouped_by_mode_and_provider(plotter, bench_dir):
    rows = plotter.load_rows(bench_dir / "step.json")
    x_field, groups = plotter.prepare(rows)
    assert x_field == "n_token"
    step = groups[(("mode", "step"),)]
    assert step["stock"] == [
        (384.0, 7540.0, 16.5 * 1024),
        (768.0, 22510.0, 61.8 * 1024),
    ]
    # Newest row wins at a point measured twice.
    assert step["stock-triton"][-1] == (768.0, 17000.0, 47.0 * 1024)
    probes = groups[(("mode", "max_crop_probe"),)]
    # The out-of-memory probe and the search summary have no time: left out.
    assert probes == {"stock-triton": [(1280.0, 70100.0, 120.3 * 1024)]}


def test_superseded_rows_are_not_plotted(plotter):
    """A row measuring a defect fixed since (``superseded_by``) stays in the JSON
    but not in the plot, even when it is the newest at its point."""
    rows = [
        {"provider": "kit", "n_token": 384, "ms": 4000.0, "date": "1"},
        {"provider": "kit", "n_token": 768, "ms": 9000.0, "date": "1"},
        {
            "provider": "kit",
            "n_token": 384,
            "ms": 5300.0,
            "date": "2",
            "superseded_by": "the leak fixed since",
        },
    ]
    x_field, groups = plotter.prepare(rows)
    assert x_field == "n_token"
    assert groups[()]["kit"] == [(384.0, 4000.0, None), (768.0, 9000.0, None)]


def test_x_field_is_detected_or_chosen(plotter, bench_dir):
    rows = plotter.load_rows(bench_dir / "smooth_lddt.json")
    x_field, groups = plotter.prepare(rows)
    assert x_field == "n_atom"
    assert set(groups[()]) == {"dense / fp32", "kit / fp32"}
    assert (
        plotter.choose_x_field([{"n_seq": 1, "ms": 1}, {"n_seq": 2, "ms": 1}])
        == "n_seq"
    )
    with pytest.raises(ValueError, match="no row has a numeric 'size'"):
        plotter.choose_x_field(rows, "size")


def test_nothing_to_plot_writes_nothing(plotter, tmp_path):
    (tmp_path / "step.json").write_text(json.dumps([{"provider": "a", "ms": None}]))
    (tmp_path / "smooth_lddt.json").write_text("[]")
    assert plotter.render(tmp_path) == []
    assert list(tmp_path.glob("*.png")) == []


def test_fields_that_only_label_points_do_not_split_panels(plotter):
    """Attention-style rows: the case splits panels; the shape string, S, H and a
    dtype fixed by the provider only restate the x value, case or series."""
    rows = []
    for case, sizes, s_fixed, heads in (
        ("triangle", (256, 512), None, 4),
        ("diffusion", (384, 768), 48, 16),
    ):
        for n in sizes:
            for provider, bias in (("torch", "bfloat16"), ("kit-fp32", "float32")):
                s = s_fixed or n
                rows.append(
                    {
                        "case": case,
                        "provider": provider,
                        "shape": f"1x{s}x{n}",
                        "N": n,
                        "S": s,
                        "H": heads,
                        "bias_dtype": bias,
                        "dtype": "bfloat16",
                        "ms": n / 100,
                        "peak_mib": n,
                    }
                )
    x_field, groups = plotter.prepare(rows)
    assert x_field == "N"
    assert sorted(groups) == [(("case", "diffusion"),), (("case", "triangle"),)]
    triangle = groups[(("case", "triangle"),)]
    assert [p[0] for p in triangle["torch / bfloat16"]] == [256.0, 512.0]
    # A real second case field (here the MSA depth) still gets its own panels.
    for row in rows:
        row["n_msa"] = 16
    rows.append(dict(rows[0], n_msa=1024, ms=9.0))
    rows.append(dict(rows[2], n_msa=1024, ms=9.5))
    _, groups = plotter.prepare(rows)
    assert (("case", "triangle"), ("n_msa", 1024)) in groups


def test_run_metadata_never_splits_panels(plotter):
    """Every field environment_metadata writes names the run (the GPU is a panel of
    its own when rows come from several), so the plotter's lists must know them
    all, or a new one would split every figure into panels."""
    from of3_megafold.bench.common import METADATA_FIELDS, environment_metadata

    known = plotter.IDENTITY_FIELDS | set(plotter.ALWAYS_FACET)
    fields = set(METADATA_FIELDS) | set(environment_metadata("cpu"))
    assert fields <= known, sorted(fields - known)
