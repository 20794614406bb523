"""The kit's errors as a command's one line."""

import click
import pytest

from of3_megafold.errors import KitConfigError, one_line_errors

WORKER_MESSAGE = (
    "Caught KitConfigError in DataLoader worker process 0.\n"
    "Original Traceback (most recent call last):\n"
    '  File "worker.py", line 1, in <module>\n'
    "of3_megafold.errors.KitConfigError: the store at /x is damaged\n"
)


@pytest.mark.parametrize(
    "raised", ["the store at /x is damaged", WORKER_MESSAGE], ids=["main", "worker"]
)
def test_a_kit_error_becomes_one_line_after_before_runs(raised):
    calls = []
    with (
        pytest.raises(click.ClickException) as err,
        one_line_errors(before=lambda: calls.append("before")),
    ):
        raise KitConfigError(raised)
    assert err.value.message == "the store at /x is damaged"
    assert err.value.exit_code == 1
    assert calls == ["before"]


def test_other_errors_pass_through_and_before_does_not_run():
    calls = []
    with (
        pytest.raises(ZeroDivisionError),
        one_line_errors(before=lambda: calls.append("before")),
    ):
        raise ZeroDivisionError
    assert calls == []
