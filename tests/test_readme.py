"""README.md stays short and in step with the registry."""

import re
from pathlib import Path

import of3_megafold.extensions  # noqa: F401  (registers the extensions)
from of3_megafold import registry

README = Path(__file__).resolve().parents[1] / "README.md"
KEYS_BLOCK = re.compile(r"<!-- keys:start -->\n(.*?)<!-- keys:end -->", re.DOTALL)


def test_keys_table_is_the_registrys():
    match = KEYS_BLOCK.search(README.read_text())
    assert match, "README.md: no <!-- keys:start --> ... <!-- keys:end --> block"
    expected = registry.keys_markdown() + "\n"
    assert match.group(1) == expected, (
        "README.md's keys table differs from the registry; replace the lines "
        f"between the keys markers with:\n{expected}"
    )


def test_every_key_of_the_registry_is_in_the_table():
    table = registry.keys_markdown()
    for extension in registry.EXTENSIONS.values():
        for key in extension.keys:
            assert key.path[-1] in table, key.yaml_path


def test_headline_table_has_a_row_per_extension():
    text = README.read_text()
    headline = text.split("\n\n")[2]
    names = re.findall(r"^\| `(\w+)` \|", headline, re.MULTILINE)
    assert set(registry.EXTENSIONS) | {"precomputed_features"} == set(names)


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= 160, f"README.md has {len(lines)} lines; keep it to 160"
