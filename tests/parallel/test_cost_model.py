"""The paper model of SP communication against compute (no measurement here)."""

import pytest

from of3_megafold.parallel import cost_model as cm


def test_block_flops_count_the_cubic_and_quadratic_terms():
    dims = cm.PairformerDims()
    n = 100
    cubic = 2 * 2 * n**3 * 128 + 2 * 4 * n**3 * 128  # trimul x2, triatt x2
    quadratic = n**2 * (
        2 * 2 * (4 * 128 * 128 + 2 * 128 * 128)  # trimul projections
        + 2 * 2 * (5 * 128 * 128 + 128 * 4)  # triatt projections
        + 2 * 12 * 128 * 128  # pair transition
        + 4 * 16 * 24  # attention with pair bias
        + 2 * 128 * 16  # its bias projection
    )
    assert cm.block_flops(n, dims) == cubic + quadratic
    # Doubling N: the N^3 terms take over.
    assert 4 < cm.block_flops(2 * n) / cm.block_flops(n) < 8


def test_received_volume():
    n = 64
    assert cm.block_received_elements(n, 1) == 0
    # P = 2: half of the b and a gathers (128 each), the two bias gathers (4
    # heads each) and four swaps of a half-size shard.
    expected = 0.5 * (n**2 * (2 * 128 + 2 * 4) + 4 * n**2 * 128 / 2)
    assert cm.block_received_elements(n, 2) == pytest.approx(expected)


def test_step_estimates():
    hw = cm.Hardware(peak_flops=1e15, efficiency=0.5, link_bytes_per_s=1e11)
    one = cm.estimate_stack(1024, 1, hw)
    assert one.comm_s == 0 and one.efficiency == pytest.approx(1.0)
    two = cm.estimate_stack(1024, 2, hw)
    assert two.compute_s == pytest.approx(one.compute_s / 2)
    assert two.serial_s == pytest.approx(two.compute_s + two.comm_s)
    expected_gb = 3 * 48 * cm.block_received_elements(1024, 2) * 2 / 1e9
    assert two.gbyte == pytest.approx(expected_gb)
    assert two.efficiency == pytest.approx(one.serial_s / (2 * two.serial_s))
    assert two.efficiency < two.overlap_efficiency <= 1.0
    # Compute grows as N^3, communication as N^2: larger crops scale better,
    # larger groups worse.
    effs = [cm.estimate_stack(n, 4, hw).efficiency for n in (768, 1536, 4096)]
    assert effs == sorted(effs)
    by_size = [cm.estimate_stack(2048, p, hw).efficiency for p in (2, 4, 8)]
    assert by_size == sorted(by_size, reverse=True)
    # Without checkpointing: 3 forwards' FLOPs, 2 forwards' volume.
    plain = cm.estimate_stack(1024, 2, hw, checkpointing=False)
    assert plain.tflop == pytest.approx(two.tflop * 3 / 4)
    assert plain.gbyte == pytest.approx(two.gbyte * 2 / 3)


def test_kit_schedule_hides_what_its_gemms_cover():
    """Hand count for one case: 1 TFLOP/s, 1 GB/s, N = 8, c = 1 channel, SP 2."""
    hw = cm.Hardware(peak_flops=1e12, efficiency=1.0, link_bytes_per_s=1e9)
    dims = cm.PairformerDims(c_z=1, c_mul=1, tri_heads=1, blocks=1, bytes_per_element=1)
    share = 0.5 / 1e9  # (P-1)/P of an element, in seconds
    gather, bias, swap = 64 * share, 64 * share, 32 * share
    own_block, whole_share = 2 * 16 * 8 / 1e12, 2 * 512 / 2 / 1e12
    forward = 2 * (gather - own_block) + 2 * bias + 4 * swap
    backward = 4 * (gather - whole_share) + 2 * bias + 4 * swap
    got = cm.kit_exposed_comm_s(8, 2, hw, dims)
    assert got == pytest.approx(2 * forward + backward)
    assert cm.kit_exposed_comm_s(8, 2, hw, dims, checkpointing=False) == (
        pytest.approx(forward + backward)
    )
    assert cm.kit_exposed_comm_s(8, 1, hw, dims) == 0
    # GEMMs longer than the gathers hide them; the bias gathers and swaps stay.
    fast_link = cm.Hardware(peak_flops=1e12, efficiency=1.0, link_bytes_per_s=1e15)
    rest = 3 * (2 * bias + 4 * swap) * 1e9 / 1e15
    assert cm.kit_exposed_comm_s(8, 2, fast_link, dims) == pytest.approx(rest)
    e = cm.estimate_stack(8, 2, hw, dims)
    assert e.kit_s == pytest.approx(e.compute_s + got)
    assert e.kit_efficiency == pytest.approx(
        cm.estimate_stack(8, 1, hw, dims).kit_s / (2 * e.kit_s)
    )


def test_markdown_table_has_a_row_per_case():
    table = cm.markdown_table(tokens=(768, 2048), sizes=(2, 4))
    rows = table.splitlines()[2:]
    assert len(rows) == 2 * 3
    assert rows[0].startswith("| 768 | 1 |") and rows[-1].startswith("| 2048 | 4 |")


def test_the_docs_show_the_models_table():
    from pathlib import Path

    doc = Path(__file__).resolve().parents[2] / "docs/extensions/sequence_parallel.md"
    assert cm.markdown_table() in doc.read_text()
