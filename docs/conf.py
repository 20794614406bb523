"""Sphinx configuration (MyST Markdown pages, like OpenFold3's docs)."""

project = "of3-megafold"
author = "of3-megafold developers"
extensions = ["myst_parser"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build", "benchmarks/*.json"]
html_theme = "furo"
myst_heading_anchors = 3
