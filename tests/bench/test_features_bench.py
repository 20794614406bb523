"""``bench features`` on the demo set: rows for the three providers, and the exact
store's samples checked equal to OF3's."""

import json


def test_quick_run_writes_rows(demo_dataset, tmp_path, monkeypatch):
    from of3_megafold.bench.features import run

    monkeypatch.setenv("OF3_MEGAFOLD_CACHE", str(demo_dataset.parent))
    rows = run(tmp_path / "features.json", quick=True)
    providers = ["of3", "kit-store", "kit-store-pool8"]
    assert [(r["token_budget"], r["provider"]) for r in rows] == [
        (budget, name) for budget in (48, 384) for name in providers
    ]
    assert all(r["equal_to_of3"] is True for r in rows if r["provider"] == "kit-store")
    assert all(r["samples"] == 6 and r["ms"] > 0 for r in rows)
    assert len(json.loads((tmp_path / "features.json").read_text())) == 6
