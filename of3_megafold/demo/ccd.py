"""A small ``components.cif`` written from biotite's bundled CCD subset.

OF3's preprocessing reads the full PDB Chemical Component Dictionary
(``components.cif``, ~400 MB, downloaded by ``setup_openfold``). The demo set only
needs the few dozen components that occur in the mmCIFs shipped with OF3's tests,
and biotite ships a compressed subset of the CCD with every install, so the demo
writes a ``components.cif`` holding just those entries, one data block per
component, in the layout OF3 indexes (``ccd[comp_id]["chem_comp_atom"]``).

biotite's subset carries ``chem_comp``, ``chem_comp_atom`` and ``chem_comp_bond``;
the descriptor and identifier categories of the full CCD are copied too when the
installed biotite has them. OF3 reads only the first three.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
from biotite.structure.info.ccd import get_from_ccd
from biotite.structure.io import pdbx

CCD_CATEGORIES: tuple[str, ...] = (
    "chem_comp",
    "chem_comp_atom",
    "chem_comp_bond",
    "pdbx_chem_comp_descriptor",
    "pdbx_chem_comp_identifier",
)
"""Categories copied per component, in CCD order. Absent ones are skipped."""

REQUIRED_CATEGORIES: tuple[str, ...] = ("chem_comp", "chem_comp_atom")
"""Without these OF3 cannot clean up or featurise a component."""


class MissingComponentError(LookupError):
    """A component of the demo mmCIFs is not in biotite's bundled CCD."""


def component_ids_in_mmcifs(cif_paths: Iterable[Path]) -> list[str]:
    """Every chemical component named in a set of mmCIF files, sorted.

    Reads ``chem_comp.id`` (which lists every component of an entry, unresolved
    polymer residues included) and ``atom_site.label_comp_id``.

    Args:
        cif_paths: mmCIF files.

    Returns:
        Sorted, de-duplicated CCD identifiers.
    """
    comp_ids: set[str] = set()
    for path in cif_paths:
        block = pdbx.CIFFile.read(str(path)).block
        if "chem_comp" in block:
            comp_ids.update(block["chem_comp"]["id"].as_array(str).tolist())
        comp_ids.update(block["atom_site"]["label_comp_id"].as_array(str).tolist())
    return sorted(comp_ids)


def _text_category(binary_category) -> pdbx.CIFCategory:
    """Turn a biotite ``BinaryCIFCategory`` into a text ``CIFCategory``.

    Missing values keep their CIF meaning ('.' inapplicable, '?' unknown) through
    the column masks.
    """
    columns = {}
    for name in binary_category:
        column = binary_category[name]
        values = column.as_array(str)
        mask = None if column.mask is None else np.asarray(column.mask.array)
        columns[name] = pdbx.CIFColumn(pdbx.CIFData(values), mask)
    return pdbx.CIFCategory(columns)


def write_components_cif(comp_ids: Iterable[str], out_path: Path) -> list[str]:
    """Write a ``components.cif`` with one data block per component.

    Args:
        comp_ids: CCD identifiers, e.g. ``["ALA", "HOH", "SO4"]``.
        out_path: file to write.

    Returns:
        The identifiers written, sorted.

    Raises:
        MissingComponentError: a component (or one of its required categories) is
            not in biotite's bundled CCD. The message names them.
    """
    ccd_file = pdbx.CIFFile()
    missing: list[str] = []
    written: list[str] = []
    for comp_id in sorted(set(comp_ids)):
        block = pdbx.CIFBlock()
        for category in CCD_CATEGORIES:
            binary_category = get_from_ccd(category, comp_id)
            if binary_category is None:
                continue
            block[category] = _text_category(binary_category)
        if any(category not in block for category in REQUIRED_CATEGORIES):
            missing.append(comp_id)
            continue
        ccd_file[comp_id] = block
        written.append(comp_id)
    if missing:
        raise MissingComponentError(
            f"biotite's bundled CCD lacks {', '.join(missing)} (or their "
            f"{'/'.join(REQUIRED_CATEGORIES)} categories). Update biotite "
            "(`pip install -U biotite`) or point OF3 at a full components.cif."
        )
    out_path.parent.mkdir(parents=True, exist_ok=True)
    ccd_file.write(str(out_path))
    return written
