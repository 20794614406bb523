"""Whether a fused kernel would pay at ``CrossAttentionPairBias`` (atom attention).

    python scripts/gpu_cross_attention.py [--atoms 4480 8976] [--samples 48]

EvoFlash leaves OF3's local atom attention on OF3's path (its kernel takes equal query
and key lengths; these blocks are 32 queries against 128 keys). This measures what
that path costs, to say whether a kernel for it would pay: OF3's own
``CrossAttentionPairBias`` (the diffusion atom transformer's: c_atom 128, 4 heads x 32,
c_atompair 16, ``use_high_precision_attention=True`` as the diffusion module calls it)
forward + backward under bf16 autocast on ``[1, S, n_atom, 128]``, once as OF3 runs it
and once with OF3's ``_attention`` core swapped for torch's
``scaled_dot_product_attention`` (fused, never materialising the logits: the nearest
stand-in for a kernel, with a handicap a kit kernel would not have: its mask is 4-D,
so the pair bias is materialised over the samples and its gradient comes back at that
size). Per variant: median ms, peak MiB above the inputs, and
the MiB the forward keeps for the backward. The step at those crops calls this module
six times with gradients (3 encoder + 3 decoder blocks, 48 samples); the mini rollout
calls it forward-only, with one sample. Diagnostic only: no kit code is involved.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics

import torch
import torch.nn.functional as F
from openfold3.core.model.layers.attention_pair_bias import CrossAttentionPairBias
from openfold3.core.model.primitives import attention as of3_attention

N_QUERY, N_KEY, C_ATOM, C_PAIR, HEADS, C_HIDDEN = 32, 128, 128, 16, 4, 32


def _sdpa_core(query, key, value, biases, use_high_precision=False):
    """OF3's ``_attention`` contract (``[*, H, Q, C]``, q already scaled, additive
    biases) on torch's fused attention; fp32 when ``use_high_precision``."""
    dtype = torch.float32 if use_high_precision else query.dtype
    batch = query.shape[:-3]
    bias = sum(biases[1:], biases[0]).to(dtype)
    bias = bias.expand(*query.shape[:-1], key.shape[-2])
    q, k, v = (t.to(dtype).reshape(-1, *t.shape[-3:]) for t in (query, key, value))
    o = F.scaled_dot_product_attention(
        q, k, v, attn_mask=bias.reshape(-1, *bias.shape[-3:]), scale=1.0
    )
    return o.reshape(*batch, *o.shape[-3:]).to(query.dtype)


@contextlib.contextmanager
def _core(name: str):
    if name == "of3":
        yield
        return
    original = of3_attention._attention
    of3_attention._attention = _sdpa_core
    try:
        yield
    finally:
        of3_attention._attention = original


def _inputs(n_atom: int, samples: int, device):
    blocks = -(-n_atom // N_QUERY)
    a = torch.randn(1, samples, n_atom, C_ATOM, device=device, requires_grad=True)
    s = torch.randn(1, 1, n_atom, C_ATOM, device=device, requires_grad=True)
    z = torch.randn(1, 1, blocks, N_QUERY, N_KEY, C_PAIR, device=device,
                    requires_grad=True)
    mask = torch.ones(1, n_atom, device=device)  # the batch's atom mask: no sample dim
    mask[..., n_atom - n_atom // 10:] = 0  # the padding a crop leaves
    return a, s, z, mask


def measure(module, n_atom: int, samples: int, variant: str, repeats: int) -> dict:
    device = next(module.parameters()).device
    a, s, z, mask = _inputs(n_atom, samples, device)
    grad = torch.randn_like(a)
    times, peak, kept = [], 0, 0
    with _core(variant):
        for i in range(repeats + 2):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = module(a, z, s, mask, use_high_precision_attention=True)
            kept = (torch.cuda.memory_allocated() - base
                    - out.numel() * out.element_size())
            out.backward(grad)
            end.record()
            torch.cuda.synchronize()
            if i >= 2:  # two warm-ups
                times.append(start.elapsed_time(end))
                peak = max(peak, torch.cuda.max_memory_allocated() - base)
            del out
            for t in (a, s, z):
                t.grad = None
            module.zero_grad(set_to_none=True)
    return {"ms": statistics.median(times), "peak_mib": peak / 2**20,
            "kept_mib": kept / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--atoms", type=int, nargs="+", default=[4480, 8976])
    parser.add_argument("--samples", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    torch.manual_seed(0)
    module = CrossAttentionPairBias(
        c_q=C_ATOM, c_k=C_ATOM, c_v=C_ATOM, c_s=C_ATOM, c_z=C_PAIR,
        c_hidden=C_HIDDEN, no_heads=HEADS, n_query=N_QUERY, n_key=N_KEY, gating=True,
    ).cuda()
    print(torch.cuda.get_device_name(), torch.__version__)
    for n_atom in args.atoms:
        rows = {v: measure(module, n_atom, args.samples, v, args.repeats)
                for v in ("of3", "sdpa")}
        for variant, r in rows.items():
            print(f"n_atom={n_atom:6} S={args.samples} {variant:5} "
                  f"{r['ms']:8.3f} ms  peak {r['peak_mib']:7.0f} MiB  "
                  f"kept {r['kept_mib']:7.0f} MiB", flush=True)
        saved = rows["of3"]["ms"] - rows["sdpa"]["ms"]
        print(f"n_atom={n_atom:6}: the SDPA core saves {saved:.3f} ms and "
              f"{rows['of3']['kept_mib'] - rows['sdpa']['kept_mib']:.0f} MiB kept per "
              f"call; x6 calls a step: {6 * saved:.1f} ms")


if __name__ == "__main__":
    main()
