"""Sequence parallelism for OF3's pairformer: process groups, autograd collectives,
the sharded PairFormer block and stack."""
