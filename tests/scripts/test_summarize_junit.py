"""scripts/summarize_junit.py: the line CI ends with, and its exit status."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "summarize_junit.py"
spec = importlib.util.spec_from_file_location("summarize_junit", SCRIPT)
summarize_junit = importlib.util.module_from_spec(spec)
spec.loader.exec_module(summarize_junit)


def _report(path: Path, tests: int, failures: int, errors: int, skipped: int) -> str:
    path.write_text(
        f'<testsuites><testsuite name="pytest" tests="{tests}" failures="{failures}" '
        f'errors="{errors}" skipped="{skipped}"/></testsuites>'
    )
    return str(path)


def test_counts_add_up_over_reports(tmp_path, capsys):
    paths = [
        _report(tmp_path / "a.xml", 10, 0, 0, 2),
        _report(tmp_path / "b.xml", 5, 0, 0, 0),
    ]
    assert summarize_junit.main(paths) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "13 passed, 0 failed, 2 skipped"


def test_failures_and_errors_fail(tmp_path, capsys):
    paths = [_report(tmp_path / "a.xml", 10, 1, 1, 2)]
    assert summarize_junit.main(paths) == 1
    assert capsys.readouterr().out.splitlines()[-1] == "6 passed, 2 failed, 2 skipped"


def test_an_unreadable_report_fails_without_skewing_the_counts(tmp_path, capsys):
    (tmp_path / "broken.xml").write_text("<testsuites")
    paths = [_report(tmp_path / "a.xml", 4, 0, 0, 1), str(tmp_path / "broken.xml")]
    assert summarize_junit.main(paths) == 1
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == "3 passed, 0 failed, 1 skipped, 1 unreadable reports"


def test_no_tests_at_all_fails(tmp_path):
    assert summarize_junit.main([_report(tmp_path / "a.xml", 0, 0, 0, 0)]) == 1
