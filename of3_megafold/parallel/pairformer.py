"""OF3's PairFormer on a pair representation sharded across an SP group.

Each rank of the group holds ``z`` rows ``[B, N/P, N, C_z]`` and the whole single
representation ``s [B, N, C_s]``. The functions here call the sub-modules of OF3's
own ``PairFormerBlock`` (layer norms, projections, gates, ``Attention``, transitions:
same objects, same weights) and insert the collectives of
:mod:`of3_megafold.parallel.comm`. Where OF3's forward has to be restated to put a
collective in the middle of it, the restatement is the few lines around the
collective, in OF3's order of operations.

One block, in OF3's op order (``PairBlock`` then ``PairFormerBlock``)::

    TriMulOut     rows      gather the b projection (N x N x c_mul)
    TriMulIn      columns   swap rows->columns; gather the a projection
    TriAttStart   rows      swap back; gather the bias projection (N x N x H)
    TriAttEnd     columns   swap rows->columns; gather the bias projection
    transition    rows      swap back; pointwise
    APB on s      rows      local query rows of s, all keys; gather the output rows
    transition on s         replicated

The triangle multiplications take the kit's fused kernels on the shard when its key
(``use_evofusion_triangle_multiplication``) is on, else OF3's plain PyTorch path
(OF3's cuEquivariance/Triton trimul kernels take the whole ``z``); the attention kernel
flags (DeepSpeed evo attention, cuEquivariance, Triton, LMA) and chunking are passed
to OF3's ``Attention`` as OF3 does. In-place inference updates are not used.
"""

from __future__ import annotations

from functools import partial

import torch

from of3_megafold.parallel.comm import (
    GroupExchange,
    average_over_sp,
    gather_for_local_use,
    gather_from_sp,
    group_size,
    scatter_to_sp,
    start_gather_for_local_use,
    swap_shard_axis,
)
from of3_megafold.parallel.rng import adopt_first_rank_generators
from of3_megafold.parallel.shards import TokenShards


def _projections(module, z: torch.Tensor, mask: torch.Tensor):
    """The masked, gated ``a`` and ``b`` projections of a triangle multiplication
    (OF3's ``TriangleMultiplicativeUpdate.forward``, both weight layouts)."""
    sigmoid = module.sigmoid
    if hasattr(module, "linear_ab_p"):
        ab = mask * sigmoid(module.linear_ab_g(z)) * module.linear_ab_p(z)
        return ab[..., : module.c_hidden], ab[..., module.c_hidden :]
    a = mask * sigmoid(module.linear_a_g(z)) * module.linear_a_p(z)
    b = mask * sigmoid(module.linear_b_g(z)) * module.linear_b_p(z)
    return a, b


def sharded_triangle_multiplication(
    module, z: torch.Tensor, mask: torch.Tensor, shards: TokenShards
) -> torch.Tensor:
    """The update of OF3's triangle multiplication for this rank's shard.

    Outgoing, ``x_ij = sum_k a_ik b_jk``, on a row shard: every rank needs ``b`` for
    all rows ``j``. Incoming, ``x_ij = sum_k a_ki b_kj``, on a column shard: every
    rank needs ``a`` for all columns ``i``. With the kit's fused kernels on, they
    compute the shard and gather that operand themselves
    (``evofusion_triangle_multiplication.sharded_update``); otherwise it is gathered
    with :func:`start_gather_for_local_use` and the rest is OF3's forward.

    Args:
        module: OF3's ``TriangleMultiplicationOutgoing`` / ``Incoming`` (or the fused
            variants).
        z: ``[*, N/P, N, C_z]`` (outgoing) or ``[*, N, N/P, C_z]`` (incoming).
        mask: ``[*, N/P, N]`` or ``[*, N, N/P]``, the matching pair-mask shard.

    Returns:
        The update, shaped like ``z``.
    """
    from of3_megafold.extensions import evofusion_triangle_multiplication as fused

    group = shards.group
    exchange = GroupExchange(group) if group_size(group) > 1 else None
    update = fused.sharded_update(module, z, mask, exchange)
    if update is not None:
        return update
    mask = mask.unsqueeze(-1)
    z = module.layer_norm_in(z)
    a, b = _projections(module, z, mask)
    # The gather is in flight while the output gate, which does not need it, is
    # computed (the same ops as OF3's, in another order: the same values).
    if module._outgoing:
        pending = start_gather_for_local_use(b, -3, shards.group)
    else:
        pending = start_gather_for_local_use(a, -2, shards.group)
    gate = module.sigmoid(module.linear_g(z))
    if module._outgoing:
        b = pending.wait()
    else:
        a = pending.wait()
    x = module._combine_projections(a, b)
    x = module.linear_z(module.layer_norm_out(x))
    return x * gate


def sharded_triangle_attention(
    module,
    x: torch.Tensor,
    mask: torch.Tensor,
    shards: TokenShards,
    transpose_bias: bool,
    chunk_size: int | None,
    **kernel_flags: bool,
) -> torch.Tensor:
    """OF3's ``TriangleAttention`` (starting node) on this rank's rows of ``x``.

    Row ``i`` attends over its ``j`` with bias ``b_jk`` projected from all of
    ``x``: the bias projection ``[*, N/P, N, H]`` is computed from the local rows
    and gathered (``H`` channels, small next to ``C_z``). OF3's ending-node attention
    is this function on the transposed pair representation with
    ``transpose_bias=True``, as ``PairBlock`` calls it.

    Args:
        module: OF3's ``TriangleAttention`` with ``starting=True``.
        x: ``[*, N/P, N, C_z]`` local rows.
        mask: ``[*, N/P, N]`` their pair mask.
        transpose_bias: OF3's flag (bias ``b_kj`` instead of ``b_jk``).
        chunk_size: OF3's attention chunk size (``None``: unchunked).
        kernel_flags: OF3's ``use_deepspeed_evo_attention``,
            ``use_cueq_triangle_kernels``, ``use_triton_triangle_kernels``,
            ``use_lma``.

    Returns:
        ``[*, N/P, N, C_z]`` the attention update of the local rows.
    """
    if not module.starting:
        raise ValueError(
            "sharded_triangle_attention takes a starting-node TriangleAttention, as "
            "PairBlock holds for both nodes (it transposes z for the ending node)"
        )
    x = module.layer_norm(x)
    mask_bias = (module.inf * (mask - 1))[..., :, None, None, :]
    key_bias = shards.key_padding_bias(module.inf, mask_bias)
    if key_bias is not None:
        mask_bias = mask_bias + key_bias
    projected = gather_for_local_use(module.linear_z(x), -3, shards.group)
    triangle_bias = projected.movedim(-1, -3)  # [*, H, N, N]
    if transpose_bias:
        triangle_bias = triangle_bias.transpose(-1, -2)
    triangle_bias = triangle_bias.unsqueeze(-4)
    biases = [mask_bias, triangle_bias]
    if chunk_size is not None:
        return module._chunk(x, biases, chunk_size, **kernel_flags)
    return module.mha(q_x=x, kv_x=x, biases=biases, **kernel_flags)


def sharded_attention_pair_bias(
    module,
    s: torch.Tensor,
    z: torch.Tensor,
    single_mask: torch.Tensor,
    shards: TokenShards,
) -> torch.Tensor:
    """OF3's ``AttentionPairBias`` on ``s`` with the bias from sharded ``z`` rows.

    Bias rows are query rows, so each rank attends for its own query rows of ``s``
    with all of ``s`` as keys and values, then the rows are gathered. Called as
    ``PairFormerBlock`` calls it (high-precision core, no kernel flags).

    Args:
        module: OF3's ``AttentionPairBias``.
        s: ``[*, N, C_s]`` replicated single representation.
        z: ``[*, N/P, N, C_z]`` local pair rows.
        single_mask: ``[*, N]``.

    Returns:
        ``[*, N, C_s]`` replicated update of ``s``.
    """
    a = module.layer_norm_a(s)
    mask_bias, pair_bias = module._prep_bias(a=a, z=z, mask=single_mask)
    key_bias = shards.key_padding_bias(module.inf, mask_bias)
    if key_bias is not None:
        mask_bias = mask_bias + key_bias
    queries = scatter_to_sp(a, -2, shards.group)
    # Every rank's queries read all keys/values: each rank's gradient on them is
    # P x a partial one; their mean is the true gradient (comm's convention).
    keys = average_over_sp(a, shards.group)
    out = module.mha(
        q_x=queries,
        kv_x=keys,
        biases=[mask_bias, pair_bias],
        use_high_precision=True,
    )
    return gather_from_sp(out, -2, shards.group)


def sharded_pairformer_block(
    block,
    s: torch.Tensor,
    z: torch.Tensor,
    single_mask: torch.Tensor,
    pair_mask: torch.Tensor,
    shards: TokenShards,
    chunk_size: int | None = None,
    use_deepspeed_evo_attention: bool = False,
    use_cueq_triangle_kernels: bool = False,
    use_triton_triangle_kernels: bool = False,
    use_lma: bool = False,
    _mask_trans: bool = True,
    _attn_chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One OF3 ``PairFormerBlock`` with ``z`` sharded by rows across the SP group.

    Args:
        block: OF3's ``PairFormerBlock``.
        s: ``[*, N_pad, C_s]`` replicated.
        z: ``[*, N_pad/P, N_pad, C_z]`` this rank's rows.
        single_mask: ``[*, N_pad]``, pair_mask ``[*, N_pad, N_pad]``: replicated,
            padding tokens 0.
        shards: the token split.
        chunk_size, use_*, _mask_trans, _attn_chunk_size: OF3's block arguments.

    Returns:
        ``s`` (replicated) and ``z`` (local rows), as OF3's block returns them.
    """
    pair = block.pair_stack
    group = shards.group
    rows_mask = shards.local(pair_mask, -2)
    cols_mask = shards.local(pair_mask, -1)
    attention = partial(
        sharded_triangle_attention,
        shards=shards,
        chunk_size=_attn_chunk_size if _attn_chunk_size is not None else chunk_size,
        use_deepspeed_evo_attention=use_deepspeed_evo_attention,
        use_cueq_triangle_kernels=use_cueq_triangle_kernels,
        use_triton_triangle_kernels=use_triton_triangle_kernels,
        use_lma=use_lma,
    )

    def dropout(update):
        return shards.rowwise_dropout(pair.ps_dropout_row_layer, update)

    update = sharded_triangle_multiplication(pair.tri_mul_out, z, rows_mask, shards)
    z = z + dropout(update)
    z = swap_shard_axis(z, -3, -2, group)
    update = sharded_triangle_multiplication(pair.tri_mul_in, z, cols_mask, shards)
    z = z + dropout(update)
    z = swap_shard_axis(z, -2, -3, group)
    z = z + dropout(attention(pair.tri_att_start, z, rows_mask, transpose_bias=False))
    # OF3 runs the ending node on z^T; this rank's columns of z are rows of z^T.
    z_t = swap_shard_axis(z, -3, -2, group).transpose(-2, -3)
    update = attention(
        pair.tri_att_end, z_t, cols_mask.transpose(-1, -2), transpose_bias=True
    )
    z_t = z_t + dropout(update)
    z = swap_shard_axis(z_t.transpose(-2, -3), -2, -3, group)
    z = z + pair.pair_transition(
        z, mask=rows_mask if _mask_trans else None, chunk_size=chunk_size
    )

    s = s + sharded_attention_pair_bias(block.attn_pair_bias, s, z, single_mask, shards)
    s = s + block.single_transition(
        s, mask=single_mask if _mask_trans else None, chunk_size=chunk_size
    )
    return s, z


def _uses_dropout(blocks) -> bool:
    return any(b.training and b.pair_stack.ps_dropout_row_layer.r > 0 for b in blocks)


def sharded_pairformer_forward(
    blocks,
    s: torch.Tensor,
    z: torch.Tensor,
    single_mask: torch.Tensor,
    pair_mask: torch.Tensor,
    group,
    run_blocks=None,
    **block_kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence of OF3 ``PairFormerBlock``\\ s with ``z`` sharded inside.

    Pads the token axis to a multiple of the group size, scatters ``z`` rows on
    entry, runs the blocks sharded, gathers ``z`` and cuts the padding on exit. In
    training mode with dropout, every rank first takes the group's first rank's
    torch generators (:mod:`~of3_megafold.parallel.rng`), so the ranks draw the
    masks one process would.

    Args:
        blocks: OF3 ``PairFormerBlock`` modules, in order.
        s: ``[*, N, C_s]``, z ``[*, N, N, C_z]``, single_mask ``[*, N]``, pair_mask
            ``[*, N, N]``: replicated (the same on every rank of ``group``).
        group: the SP group (``None``: one rank; still the sharded code path, which
            the tests use as a reference for the dropout masks).
        run_blocks: ``run_blocks(block_fns, (s, z)) -> (s, z)``, e.g. OF3's
            ``checkpoint_blocks`` with its checkpointing settings; default: in turn.
        block_kwargs: OF3's block arguments (chunk size, kernel flags, _mask_trans).

    Returns:
        ``s [*, N, C_s]`` and ``z [*, N, N, C_z]``, replicated.
    """
    if _uses_dropout(blocks):
        adopt_first_rank_generators(group, z.device)
    shards = TokenShards.for_tokens(z.shape[-2], group)
    s = shards.pad(s, (-2,))
    z = scatter_to_sp(shards.pad(z, (-3, -2)), -3, group)
    single_mask = shards.pad(single_mask, (-1,))
    pair_mask = shards.pad(pair_mask, (-2, -1))
    block_fns = [
        partial(
            sharded_pairformer_block,
            block,
            single_mask=single_mask,
            pair_mask=pair_mask,
            shards=shards,
            **block_kwargs,
        )
        for block in blocks
    ]
    if run_blocks is None:
        for fn in block_fns:
            s, z = fn(s, z)
    else:
        s, z = run_blocks(block_fns, (s, z))
    z = gather_from_sp(z, -3, group)
    return shards.unpad(s, (-2,)), shards.unpad(z, (-3, -2))
