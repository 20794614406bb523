"""pixi cannot be installed here: check pixi.toml by reading it.

Every task must run a command that exists once the kit is installed, and the test
task must be the very command CI runs.
"""

import shlex
import shutil
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PIXI = tomllib.loads((ROOT / "pixi.toml").read_text())


def _cli_commands() -> set[str]:
    from of3_megafold.cli import main

    return set(main.commands)


@pytest.mark.parametrize("task", sorted(PIXI["tasks"]))
def test_task_command_exists(task):
    spec = PIXI["tasks"][task]
    command = spec if isinstance(spec, str) else spec["cmd"]
    argv = shlex.split(command)
    program = argv[0]
    if program == "bash":
        assert (ROOT / argv[1]).is_file(), f"{task}: {argv[1]} missing"
    elif program == "of3-megafold":
        assert (
            shutil.which("of3-megafold")
            or (Path(sys.executable).parent / program).exists()
        )
        if len(argv) > 1:
            assert argv[1] in _cli_commands(), f"{task}: no subcommand {argv[1]}"
    else:
        assert shutil.which(program), f"{task}: {program} not found"


def test_required_tasks_and_environments():
    assert {"train", "test", "test-of3", "info", "bench"} <= set(PIXI["tasks"])
    assert {"default", "cuda12", "cuda13"} <= set(PIXI["environments"])


def test_ci_runs_the_test_task():
    ci = (ROOT / ".ci" / "run").read_text()
    assert PIXI["tasks"]["test"] in ci


def test_readme_names_the_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "pixi run test" in readme
    assert PIXI["tasks"]["test"] in readme


def test_editable_install_of_this_project():
    dep = PIXI["pypi-dependencies"]["of3-megafold"]
    assert dep["path"] == "." and "test" in dep["extras"]
