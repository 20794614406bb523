"""Triton kernels with their autograd functions and pure-torch references; this
package never imports openfold3 (the extensions import it, never the reverse).

Names differ by folder on purpose: a kernel package is named for the op it
computes, an extension (``of3_megafold/extensions/<name>.py``, its page
``docs/extensions/<name>.md``, its YAML keys in ``of3-megafold info``) for the
feature a user switches on, and a bench command (``of3-megafold bench <command>``)
for what it times. The mapping (``tests/kernels/test_names.py`` checks it against
the tree):

=======================  =================================  =======================
kernel package           extension                          bench command
=======================  =================================  =======================
evoflash                 evoflash_attention                 attention
swiglu_transition        evofusion_transitions              transition
layer_norm               evofusion_transitions              step
layer_norm               evofusion_triangle_multiplication  triangle-multiplication
triangle_multiplication  evofusion_triangle_multiplication  triangle-multiplication
smooth_lddt              smooth_lddt                        smooth-lddt
=======================  =================================  =======================

``bench attention`` runs ``attention-core`` (the kernel) and ``attention-module``
(OF3's attention modules with it); ``bench step`` times a whole training step with
every extension. The extensions without a kernel of their own use shared machinery
instead: ``checkpoint_offload`` uses :mod:`of3_megafold.runtime.host_offload`,
``sequence_parallel`` uses :mod:`of3_megafold.parallel`, and ``rollout_graphs``
captures OF3's own kernels in CUDA graphs; ``bench features`` times the precomputed
feature store of :mod:`of3_megafold.data`. Here too: :mod:`.backend` (device and
Triton-backend checks), :mod:`._launch` (tuned launches) and :mod:`._rounding`.
"""
