"""The kernel -> extension -> bench-command table in ``of3_megafold/kernels``'s
docstring matches the tree."""

import re
from pathlib import Path

import of3_megafold.kernels
from of3_megafold.cli import BENCHMARKS

PACKAGE = Path(of3_megafold.kernels.__file__).resolve().parents[1]


def _table() -> list[tuple[str, str, str]]:
    lines = of3_megafold.kernels.__doc__.splitlines()
    rules = [i for i, line in enumerate(lines) if re.fullmatch(r"=+( +=+)+", line)]
    assert len(rules) == 3, "one table: top rule, header rule, bottom rule"
    return [tuple(line.split()) for line in lines[rules[1] + 1 : rules[2]]]


def _kernel_packages() -> set[str]:
    kernels = PACKAGE / "kernels"
    return {p.name for p in kernels.iterdir() if (p / "__init__.py").is_file()}


def _extensions() -> set[str]:
    return {
        p.stem
        for p in (PACKAGE / "extensions").glob("*.py")
        if not p.stem.startswith("_")
    }


def test_rows_name_real_things():
    rows = _table()
    assert len(rows) >= 5 and all(len(row) == 3 for row in rows), rows
    for kernel, extension, command in rows:
        assert kernel in _kernel_packages(), kernel
        assert extension in _extensions(), extension
        assert command in BENCHMARKS or command == "step", command


def test_every_kernel_package_is_listed():
    assert {kernel for kernel, _, _ in _table()} == _kernel_packages()


def test_every_kernel_an_extension_imports_is_listed_with_it():
    listed = {(kernel, extension) for kernel, extension, _ in _table()}
    for extension in _extensions():
        source = (PACKAGE / "extensions" / f"{extension}.py").read_text()
        for kernel in set(re.findall(r"of3_megafold\.kernels\.(\w+)", source)):
            if kernel in _kernel_packages():
                assert (kernel, extension) in listed, (kernel, extension)


def test_each_extension_is_registered_under_its_file_name():
    for extension in _extensions():
        source = (PACKAGE / "extensions" / f"{extension}.py").read_text()
        assert f'\nNAME = "{extension}"\n' in source, extension
