import json

import pytest

from tools import benchmark_tables as bt

CONDITIONS = {
    "gpu": "NVIDIA H200",
    "cuda": "13.0",
    "torch": "2.11.0",
    "triton": "3.6.0",
    "openfold3": "0.5.0",
}


def _row(provider, n, ms, peak_mib=100.0, date="2026-12-01T10:00", **extra):
    return {
        "provider": provider,
        "case": "triangle",
        "n": n,
        "ms": ms,
        "peak_mib": peak_mib,
        "commit": "abcdef0123",
        "date": date,
        **CONDITIONS,
        **extra,
    }


TABLE = bt.Table(
    "tiny",
    "tiny",
    ("case", "n"),
    ("kit", "stock", "rival"),
    ratio=("stock", "kit"),
    labels=("module", "N"),
)


def test_docs_tables_match_the_rows_of_record():
    """docs/benchmarks.md holds exactly what the JSON rows render to."""
    assert bt.main(["--check"]) == 0


def test_render_takes_the_latest_row_per_shape_and_provider():
    rows = [
        _row("kit", 768, 9.0, date="2026-11-30T10:00", commit="1111111"),
        _row("kit", 768, 4.0, peak_mib=2048.0, date="2026-12-02T10:00"),
        _row("stock", 768, 12.0),
        # measured a defect fixed since: not the current figure
        _row("kit", 768, 1.0, superseded_by="2222222"),
        _row("rival", 768, None, skipped="rival: not installed"),
        _row("stock", 1024, None, oom=True),
        _row("kit", 1024, 7.5, peak_mib=512.0),
        _row("kit", 256, 0.5, case="diffusion"),
        _row("other", 768, 0.1),
    ]
    text = bt.render(TABLE, rows)
    lines = text.splitlines()
    assert lines[0] == "| module | N | kit | stock | stock time / kit time |"
    assert "| triangle | 768 | 4.00 / 2.0 GiB | 12.0 / 100 MiB | 3.00x |" in lines
    assert "| triangle | 1024 | 7.50 / 512 MiB | OOM |  |" in lines
    # natural order: diffusion before triangle, 768 before 1024
    body = [line for line in lines if line.startswith(("| diffusion", "| triangle"))]
    assert [line.split(" | ")[1] for line in body] == ["256", "768", "1024"]
    assert "- GPU: NVIDIA H200; CUDA 13.0" in lines
    assert "- date: 2026-12-01 to 2026-12-02" in lines
    # the older kit row is not shown, so its commit is not a condition
    assert "- commit: abcdef0" in lines


def test_rewrite_replaces_only_the_generated_block(tmp_path):
    (tmp_path / "tiny.json").write_text(json.dumps([_row("kit", 768, 4.0)]))
    text = (
        "# Title\n\nhand-written\n\n"
        "<!-- table:tiny:start -->\nstale\n<!-- table:tiny:end -->\n\nmore text\n"
    )
    out = bt.rewrite(text, (TABLE,), tmp_path)
    assert out.startswith("# Title\n\nhand-written\n\n<!-- table:tiny:start -->\n| ")
    assert "stale" not in out
    assert out.endswith("commit: abcdef0\n<!-- table:tiny:end -->\n\nmore text\n")
    assert bt.rewrite(out, (TABLE,), tmp_path) == out


def test_check_fails_on_a_stale_block_and_passes_after_a_rewrite(tmp_path, monkeypatch):
    monkeypatch.setattr(bt, "TABLES", (TABLE,))
    (tmp_path / "tiny.json").write_text(json.dumps([_row("kit", 768, 4.0)]))
    doc = tmp_path / "benchmarks.md"
    doc.write_text("<!-- table:tiny:start -->\nold\n<!-- table:tiny:end -->\n")
    args = ["--doc", str(doc), "--json-dir", str(tmp_path)]
    assert bt.main(["--check", *args]) == 1
    assert "old" in doc.read_text()
    assert bt.main(args) == 0
    assert bt.main(["--check", *args]) == 0
    assert "4.00 / 100 MiB" in doc.read_text()


def test_missing_markers_and_broken_json_name_the_fix(tmp_path):
    with pytest.raises(SystemExit, match="Error: no block for table 'tiny'"):
        bt.rewrite("no markers\n", (TABLE,), tmp_path)
    (tmp_path / "tiny.json").write_text("{not json")
    text = "<!-- table:tiny:start -->\n<!-- table:tiny:end -->\n"
    with pytest.raises(SystemExit, match=r"Error: .*tiny\.json: not valid JSON"):
        bt.rewrite(text, (TABLE,), tmp_path)


@pytest.mark.parametrize(
    ("provider", "precision", "shown"),
    [
        ("kit", "highest", True),
        ("kit", "high", False),  # TF32 under a provider name that does not say so
        ("kit-tf32", "high", True),
        ("kit-tf32", "highest", False),
        ("stock-cueq-tf32", "high", True),
    ],
)
def test_step_rows_of_record_are_in_the_precision_their_provider_names(
    provider, precision, shown
):
    row = {"provider": provider, "mode": "step", "recycles": 3}
    assert bt._step_of_record({**row, "matmul_precision": precision}) is shown


@pytest.mark.parametrize(
    "fields, shown",
    [
        ({"output_gain": 0.1}, True),
        ({"output_gain": 0.1, "pairformer_blocks": 48}, True),
        ({"output_gain": 0.1, "pairformer_blocks": 4}, False),
        ({}, False),
    ],
)
def test_predict_rows_of_record_drew_the_output_layers_and_ran_every_block(
    fields, shown
):
    assert bt._predict_of_record({"provider": "kit", **fields}) is shown
