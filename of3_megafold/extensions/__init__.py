"""One module per extension: its keys, its checks, its patch of OpenFold3.

Importing this package registers every extension in :mod:`of3_megafold.registry`.
Extension modules import OpenFold3 and the kernels lazily, inside their patches.
"""

from of3_megafold.extensions import (
    checkpoint_offload,
    evoflash_attention,
    evofusion_transitions,
    evofusion_triangle_multiplication,
    foreach_loop,
    rollout_graphs,
    sequence_parallel,
    smooth_lddt,
    sync_free_indexing,
    trunk_graphs,
)

__all__ = [
    "checkpoint_offload",
    "evoflash_attention",
    "evofusion_transitions",
    "evofusion_triangle_multiplication",
    "foreach_loop",
    "rollout_graphs",
    "sequence_parallel",
    "smooth_lddt",
    "sync_free_indexing",
    "trunk_graphs",
]
