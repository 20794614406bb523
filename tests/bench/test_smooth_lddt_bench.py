"""The smooth lDDT benchmark's inputs match OF3's batch conventions."""

import torch

from of3_megafold.bench.smooth_lddt import make_inputs, of3_batch


def test_bf16_inputs_keep_float32_masks_that_count_every_atom():
    # 50,000 ones summed in bf16 give 49,920; OF3's broadcast_token_feat_to_atoms
    # then fails to reshape (seen on the GPU at N=50000 in bf16).
    from openfold3.core.utils.atomize_utils import broadcast_token_feat_to_atoms

    n_atom = 50_000
    inputs = make_inputs(n_atom, torch.bfloat16, torch.device("cpu"))
    assert inputs["x"].dtype == torch.bfloat16
    assert inputs["atom_mask"].dtype == torch.float32
    assert inputs["is_nucleotide"].dtype == torch.float32
    batch, _ = of3_batch(inputs)
    atoms = broadcast_token_feat_to_atoms(
        token_mask=batch["token_mask"],
        num_atoms_per_token=batch["num_atoms_per_token"],
        token_feat=batch["is_dna"],
    )
    assert atoms.shape[-1] == n_atom
