"""The token axis split across an SP group: padding, local slices, dropout.

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
import torch.nn.functional as F

from of3_megafold.parallel.comm import Group, group_rank, group_size


@dataclass(frozen=True)
class TokenShards:
    """How the (padded) token axis is split across an SP group.

    Attributes:
        group: the SP group (``None``: one rank, nothing split).
        n_tokens: ``N``, the real token count.
        n_padded: ``N_pad``, ``N`` rounded up to a multiple of the group size.
    """

    group: Group
    n_tokens: int
    n_padded: int

    @classmethod
    def for_tokens(cls, n_tokens: int, group: Group) -> TokenShards:
        size = group_size(group)
        return cls(group, n_tokens, -(-n_tokens // size) * size)

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
        self, dropout: torch.nn.Module, x: torch.Tensor
    ) -> torch.Tensor:
        """OF3's ``DropoutRowwise`` with the mask one process would draw.

        The mask ``[*, 1, N, C]`` (shared along dim -3, as OF3's) is drawn for the
        real ``N`` tokens exactly as OF3's module draws it (its ``nn.Dropout`` on
        ones, from torch's default generator), so with the group on its first
        rank's generators (:mod:`of3_megafold.parallel.rng`) every rank draws the
        one-process mask, and activation-checkpoint recomputation (which restores
        the generator) draws it again. The mask is 0 on padding positions, which
        are masked and cut off anyway. A rank whose ``x`` holds a column shard
        (``x.shape[-2] < N_pad``) takes its columns of the mask.

        Args:
            dropout: OF3's ``DropoutRowwise`` (its rate ``r``, ``training`` and
                ``nn.Dropout``).
            x: ``[*, I, J, C]`` with ``J`` either ``N_pad`` or ``N_pad / P``.
        """
        if not dropout.training:
            return x
        shape = (*x.shape[:-3], 1, self.n_tokens, x.shape[-1])
        mask = self.pad(dropout.dropout(x.new_ones(shape)), (-2,))
        if x.shape[-2] != self.n_padded:
            mask = self.local(mask, -2)
        return x * mask
