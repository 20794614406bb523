"""The token axis split across an SP group: padding, local slices, shared dropout.

At the entry of a sharded stack the token count ``N`` is padded to ``N_pad``, a
multiple of the SP size P; each rank then holds rows ``[rank * N_pad / P, (rank + 1)
* N_pad / P)`` of the pair representation (or the same columns, after an axis swap).
Padding tokens get mask 0 in OF3's single and pair masks, which removes them from the
triangle multiplications (the projections are multiplied by the mask); attention
additionally gets a key bias of ``-2 inf`` on padding keys, so a real row whose keys
are all masked (a masked token) still averages over the same ``N`` keys as in a
single process instead of ``N_pad``. The exit cuts the padding off again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from of3_megafold.parallel.comm import Group, group_rank, group_size


@dataclass(frozen=True)
class TokenShards:
    """How the (padded) token axis is split across an SP group.

    Attributes:
        group: the SP group (``None``: one rank, nothing split).
        n_tokens: ``N``, the real token count.
        n_padded: ``N_pad``, ``N`` rounded up to a multiple of the group size.
        dropout_seed: seed of this forward's shared dropout masks (``None`` when no
            dropout mask is drawn, e.g. in eval mode).
    """

    group: Group
    n_tokens: int
    n_padded: int
    dropout_seed: int | None = None

    @classmethod
    def for_tokens(
        cls, n_tokens: int, group: Group, dropout_seed: int | None = None
    ) -> TokenShards:
        size = group_size(group)
        return cls(group, n_tokens, -(-n_tokens // size) * size, dropout_seed)

    @property
    def size(self) -> int:
        return group_size(self.group)

    @property
    def rank(self) -> int:
        return group_rank(self.group)

    @property
    def n_local(self) -> int:
        return self.n_padded // self.size

    def local(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's slice of a replicated, non-differentiable tensor (masks)."""
        return x.narrow(dim, self.rank * self.n_local, self.n_local)

    def pad(self, x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
        """Zero-pad the token axes ``dims`` (negative) from ``N`` to ``N_pad``."""
        extra = self.n_padded - self.n_tokens
        if not extra:
            return x
        widths = [0] * (2 * x.dim())
        for dim in dims:
            widths[2 * (-dim - 1) + 1] = extra
        return F.pad(x, widths)

    def unpad(self, x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
        """Cut the token axes ``dims`` back to ``N``."""
        for dim in dims:
            x = x.narrow(dim, 0, self.n_tokens)
        return x

    def key_padding_bias(self, inf: float, like: torch.Tensor) -> torch.Tensor | None:
        """``[N_pad]``: 0 on real keys, ``-2 inf`` on padding keys (``None`` if no
        padding). Added to OF3's mask bias ``inf * (mask - 1)``."""
        if self.n_padded == self.n_tokens:
            return None
        bias = like.new_zeros(self.n_padded)
        bias[self.n_tokens :] = -2 * inf
        return bias

    def rowwise_dropout(
        self, dropout: torch.nn.Module, x: torch.Tensor, block: int, op: int
    ) -> torch.Tensor:
        """OF3's ``DropoutRowwise`` with a mask shared across the SP group.

        The mask ``[*, 1, N, C]`` (shared along dim -3, as OF3's) is drawn for the
        real ``N`` tokens from a generator seeded with ``dropout_seed`` and the
        ``(block, op)`` position, so every rank of the group draws the same mask and
        activation-checkpoint recomputation draws it again unchanged (a single
        process with the same seed draws the same mask whatever the SP size). The
        mask is 0 on padding positions, which are masked and cut off anyway. A rank
        whose ``x`` holds a column shard (``x.shape[-2] < N_pad``) takes its columns
        of the mask.

        Args:
            dropout: OF3's ``DropoutRowwise`` (its rate ``r`` and ``training``).
            x: ``[*, I, J, C]`` with ``J`` either ``N_pad`` or ``N_pad / P``.
            block, op: position of this dropout in the stack (op in 0..3).
        """
        if not dropout.training or dropout.r == 0:
            return x
        if self.dropout_seed is None:
            raise RuntimeError("training-mode dropout needs TokenShards.dropout_seed")
        generator = torch.Generator(device=x.device)
        generator.manual_seed((self.dropout_seed + 4 * block + op) % 2**63)
        shape = (*x.shape[:-3], 1, self.n_tokens, x.shape[-1])
        keep = torch.empty(shape, device=x.device, dtype=x.dtype)
        keep.bernoulli_(1 - dropout.r, generator=generator)
        mask = self.pad(keep / (1 - dropout.r), (-2,))
        if x.shape[-2] != self.n_padded:
            mask = self.local(mask, -2)
        return x * mask


def shared_seed(group: Group, device: torch.device) -> int:
    """A fresh seed drawn by the group's first rank (from torch's default generator)
    and broadcast to the group: one collective per forward."""
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64).to(device)
    if group_size(group) > 1:
        dist.broadcast(seed, src=dist.get_global_rank(group, 0), group=group)
    return int(seed.item())
