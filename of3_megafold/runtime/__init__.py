"""Non-kernel machinery the extensions share (no Triton here): host offload of saved
activations. Like :mod:`of3_megafold.kernels`, it never imports openfold3."""
