"""Rollout: a batched, KV-cached sampler built to decode at the memory-bandwidth floor.

RL for LLMs spends most of its time here. Decoding one token for B sequences reads every weight once
(4.76 GB a step for Qwen2.5-7B in NVFP4, 14.1 GB in bf16) and does ~2 FLOPs per weight per sequence,
so up to B ~ 100 a step is memory-bound: its floor is bytes / bandwidth, and everything else (kernel
launches, Python, reading padding in the cache) is overhead to remove. This file is that sampler.

    generate(model, prompts, n=G, max_new_tokens, temperature, top_p, top_k, stop_ids, seed) -> Rollout

The layout, for P prompts of lengths l_i, n samples each (N = P·n rows, row r = i·n + j):

    cache k, v      (L, N, Hkv, S, D)   allocated once per (N, S) and reused across calls
    prompts         left-padded to Lp = max l_i, so every row writes the same column at every step
                    (for a short prefill on the GPU, Lp rounded up to a multiple of PREFILL_BUCKET)
    positions       row i's real tokens sit at positions 0 … l_i − 1 whatever its padding pad_i = Lp − l_i
    prefill         each distinct prompt ONCE (P rows, the model's forward through the step's fused
                    projections and kernels), its K/V written to its n rows of the cache; the first token
                    of each row is sampled from those logits. Up to PREFILL_GRAPH_TOKENS prompt tokens it is a
                    CUDA graph per (P, Lp), captured the first time the shape comes
    decode step t   token t−1 of every row enters at column Lp + t − 1, position l_i + t − 1; the row
                    attends to columns [pad_i, Lp + t − 1]; one token per row is sampled

Attention reads only the columns that exist. The decode-attention kernel takes the current column
from a device counter and splits the sequence into chunks (flash-decoding: one program per (row, kv
head, chunk), then a combine), so a step costs in proportion to the tokens present, not to the
cache's capacity S; a finished row reads nothing. The grouped-query heads of one kv head share each
K/V load (a 16-row tl.dot). The n samples of a prompt hold the same prompt in their cache rows, so
the programs of every few rows of a group also take a slice of the prompt for the query heads of those
rows (up to SHARED_HEADS in one tl.dot), read once from the group's first row; each row's own programs
start after the prompt.

One decode step is one CUDA graph. Everything in it reads fixed addresses: the token buffer, the
counters (current column and step), the cache, the sampler's outputs. So the host replays the graph
max_new_tokens − 1 times and looks at the device only every few steps (to stop early once every row
has finished). The step per layer, with the launches it costs:

    h       = add_rmsnorm(x, delta, w1)              1   residual add + RMSNorm (Triton)
    qkv, a  = fused q|k|v GEMM (+ bias),             1   QuantLinear.concat, or one cat'ed bf16 weight;
              a = h @ [A_q; A_k; A_v]^T             (+1)  the three LoRA A's side by side: in the GEMM's
                                                         launch (NVFP4 on mma), else beside it
    q, k, v = rope_write(qkv + a·B^T)                1   LoRA B, rotary embedding, K/V into the cache
    o       = attention(q, cache) (split + combine)  2
    delta   = o_proj(o) + (o @ A_o^T) @ B_o^T      2 (+1) base GEMM with LoRA A, then LoRA B added in
                                                         place (Triton)
    h       = add_rmsnorm(x, delta, w2)              1
    gu, a   = fused gate|up GEMM, h @ [A_g; A_u]^T   1 (+1)
    act     = silu_mul(gu + a·B^T)                   1   LoRA B, SiLU, product
    delta   = down(act) + LoRA                     2 (+1)

so 12 launches a layer where fp4_gemm's plan runs its mma kernel (one row on a Hopper GPU, up to 8
elsewhere), whose launch also computes the GEMM's LoRA A product (fp4_gemm.fp4_linear_side). The (+1)s:
everywhere else (a bf16 base; NVFP4 on the other kernels) the LoRA A products are cuBLAS launches on a
second stream, which runs them while the GEMM runs and rejoins before the LoRA B kernel reads them. For
NVFP4 at 2-32 rows on a Hopper GPU each wgmma GEMM first puts x in its K order in a launch of its own
(fp4_gemm.k_ordered); from 33 rows the op before the GEMM stores x in that order itself
(fp4_gemm.x_k_order, k_ordered_tile), and the LoRA A product reads A's columns in the same order. The
second stream runs cuBLAS only: fp4_gemm's split-K kernels share one buffer of ticket counters, and two
of them side by side would corrupt each other's sums.

Launches overlap. On a Hopper GPU every Triton kernel of the step uses programmatic dependent launch
(fp4_gemm.pdl_opts): it may be scheduled while the kernel before it finishes, and waits for it on the GPU
(fp4_gemm.pdl_wait) before it reads anything that kernel writes. What no kernel of the step writes (LoRA
B's, a norm's weight, the one-row GEMM's first codes) is loaded before the wait, so those loads overlap
the kernel before. The kernels just before a GEMM (add_rmsnorm, the attention combine, silu_mul) and
the LoRA B kernel let their successor launch first thing; the GEMMs let it launch once past their k
loop. The step's first kernel, the embedding lookup, is a plain launch, so whatever came before the step
(the copies of the adapters, say) has finished by then. On the H200 each of these took 1-7% off the
step (results/rollout_h200.md, sessions 8 and 15-19, with the variants that measured slower).

LoRA stays unmerged (the adapters change every RL step; merging would mean re-quantizing the base):
its A's and B's are copied at the start of every generate() call, in the model's dtype and with
alpha/r folded into B, into buffers the graph reads. AQN (aqn.py) perturbs the RMSNorm weights in
place; the step reads those weights where they live, so the noise is active in the graph too. The
base GEMMs are fp4_gemm's kernels (or cuBLAS for a bf16 base), unchanged.

Sampling, inside the graph. With z = logits / T (float32):

    logprob(token) = z[token] − logsumexp(z)            the distribution BEFORE top-p / top-k
    token = argmax_v { z[v] + g[v] : v in the kept set }   g[v] ~ Gumbel(0, 1)   (Gumbel-max)

Gumbel-max draws exactly from softmax(z) restricted to the kept set (top-k: the k largest z; top-p:
the smallest prefix of the sorted distribution whose mass reaches p), i.e. from the truncated,
renormalized distribution, as HF's warpers do. The logprob is the one the trainer recomputes from
a full forward (log_softmax(logits / T)); it is not the truncated distribution's. Temperature 0 is
greedy (argmax of the logits) and its logprobs are those of softmax(logits), T = 1.

The Gumbel noise comes from a counter-based hash of (seed, row, step, vocab index) (lowbias32, two
rounds), computed in the kernel: no RNG state to carry through a graph, the same seed gives the
same tokens on every call, and the CPU path draws the same numbers (up to log() rounding).

Finished rows. A row that samples a stop token is done: later steps write pad_id and logprob 0 for
it and its attention reads nothing. Its GEMM rows are not free, though (a 7B NVFP4 step takes 2.4 ms
at one row and 4.1 at 64). So when the host looks (every `check_every` steps, which costs one sync) and
the live rows fit in half the batch or less, it moves them to the front (their cache up to the current
column, their row state; the finished rows' outputs stay behind them) and goes on with a smaller state
over the first 2^k rows of the same buffers (_State with a parent: views, with its own graph, captured
the first time, mid-call, and kept for later calls: Decoder.shrink). A row keeps its row key and so
draws the same noise as in the whole batch: the rollout is the same up to rounding (a GEMM of fewer rows
may sum in another order, which can flip a near-tie). The host stops the loop when every row is done.

Prefill. It runs through the decode step's fused projections and its add_rmsnorm and rope_write
kernels, with SDPA reading the kv heads unexpanded. Eagerly a short prefill is bound by the host (one
256-token prompt: 66-116 ms, of which ~11 ms are GPU work), so up to PREFILL_GRAPH_TOKENS prompt tokens
it replays a CUDA graph per (prompts, length) shape, the length rounded up to a multiple of
PREFILL_BUCKET so that nearby lengths share a graph; the first call of a shape runs eagerly and captures.

On the CPU (tests) the same step runs eagerly with torch ops in place of the Triton kernels; each
fused op below has its torch reference next to its kernel, and the tests run both (the kernels
through Triton's interpreter).

Where a step's time goes (H200, Qwen2.5-7B shape, NVFP4 + LoRA r32 + AQN; results/rollout_h200.md has
each profile). Batch 1 takes 2.36 ms against a floor of 1.12 ms (4.76 GB at the 4.24 TB/s a device
copy reaches): of ~2.6 ms of kernel time, fp4_gemm's
GEMMs (with the LoRA A products riding in them) take 1.78 (~2.1 TB/s), cuBLAS's lm_head 0.26, and this
file's kernels ~0.55 (attention, LoRA B, silu_mul, add_rmsnorm, rope_write, 0.09-0.15 ms each); the
graph overlaps them in part. Batch 64 takes 4.14 ms: the wgmma GEMMs 2.73, cuBLAS 0.82 (lm_head and the
LoRA A products on the second stream) and its split-K reduces 0.19, attention 0.54 at 256 columns and
1.07 at 768 (2.6 TB/s), the small kernels ~0.55. So what remains is the GEMMs, at about half the bandwidth a plain read reaches
(see fp4_gemm.py). Without the graph a step costs ~70 ms of Python and launches.

Departures. vLLM (which the official QeRL code uses) pages its KV cache and batches continuously;
here a batch is static and every row shares the cache's column index (left padding), which keeps the
kernels simple and the graph fixed. LoRA is computed in the model's dtype with fp32 accumulation, as
lora.py's forward does (its fp32 adapters are the master copy, cast per call): sampler and trainer
differ only in summation order and where bf16 rounds. The base weights of q/k/v and gate/up are
stacked into one tensor each, once per model; the separate linears keep views of their rows, so the
stacking costs no memory (`release(model)` frees the caches and graphs).

    python rollout.py --model qwen2.5-7b --prompt "What is 17 * 23?" --quant nvfp4
    python rollout.py --bench                  # the H200 table in results/rollout_h200.md
    python rollout.py --bench --batches 64 --new-tokens 1024 --early-stop 256   # rows that stop early
"""
import argparse
import gc
import math
import sys
import time
import weakref
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

import fp4_gemm  # imported before triton: on a CPU-only machine it switches Triton's interpreter on
import lora
from model import (Transformer, apply_rope, load_tokenizer, qwen25_config, read_config, resolve_device,
                   stop_on_bad_input, stop_token_ids)

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch path still works; kernels="triton" will refuse
    triton = None
    tl = SimpleNamespace(constexpr=None)


# ---------------------------------------------------------------------------------------------
# The result
# ---------------------------------------------------------------------------------------------

@dataclass
class Rollout:
    """N = len(prompts) * n completions; row i*n + j is sample j of prompt i.

    tokens    (N, T) int64    completions, right-padded with pad_id; a stop token is included
    logprobs  (N, T) float32  log-prob of each sampled token under softmax(logits / T), before top-p /
                              top-k truncation (what the trainer recomputes); 0 at padding
    lengths   (N,)   int64    completion lengths (stop token included)
    finish    list of "stop" (a stop token was sampled) or "length" (max_new_tokens reached)
    prompt_index (N,) int64   which prompt each row continues
    stats     timings and what ran (prefill_s, decode_s, steps, graphs, kernels, prefill: eager |
              captured | replayed, shrinks: [(step, rows)] where the live rows moved to fewer, ...)
    """
    tokens: torch.Tensor
    logprobs: torch.Tensor
    lengths: torch.Tensor
    finish: list
    prompt_index: torch.Tensor
    stats: dict = field(default_factory=dict)

    @property
    def mask(self):
        """(N, T) bool: True at completion tokens, False at padding."""
        return torch.arange(self.tokens.shape[1], device=self.lengths.device)[None] < self.lengths[:, None]

    def texts(self, tokenizer, skip_special_tokens=True):
        """The completions decoded (the stop token dropped with skip_special_tokens if it is special)."""
        return [tokenizer.decode(self.tokens[i, : int(self.lengths[i])].tolist(), skip_special_tokens=skip_special_tokens)
                for i in range(self.tokens.shape[0])]


# ---------------------------------------------------------------------------------------------
# Sampling: the counter-based RNG and the torch reference sampler
# ---------------------------------------------------------------------------------------------

M32 = 0xFFFFFFFF


def _mul32(x, c):
    """(x * c) mod 2^32 for int64 tensors x in [0, 2^32) and a constant c < 2^32, without overflowing
    int64 (the product is split at 16 bits)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & M32


def mix32(x):
    """lowbias32 (Chris Wellons' integer hash): a bijection on 32-bit values with good avalanche."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def row_keys(seed, rows):
    """One 32-bit key per row (int64 tensor of row ids) from a 64-bit seed."""
    s = mix32(torch.tensor((seed & M32) ^ 0x9E3779B9, dtype=torch.int64))
    s = mix32(s ^ ((seed >> 32) & M32))
    return mix32((s + rows) & M32)


def gumbel_noise(rowkey, step, V):
    """(N, V) float32 Gumbel(0, 1) noise for one sampling step: a pure function of (row key, step, v).
    The Triton sampler computes the same bits."""
    ka = mix32((rowkey + step) & M32)  # (N,)
    kb = mix32(ka ^ 0x68E31DA4)
    v = torch.arange(V, device=rowkey.device)
    h = mix32(mix32((v[None] + ka[:, None]) & M32) ^ kb[:, None])  # (N, V)
    u = ((h >> 8).float() + 0.5) * 2.0 ** -24  # uniform in (0, 1), 24 random bits
    return -torch.log(-torch.log(u))


def truncation_threshold(z, top_p, top_k):
    """z (N, V) = logits / T → (N,) float32: the smallest z a token may have to be sampled (−inf: all).
    top-k keeps the k largest; top-p the shortest prefix of the sorted distribution whose mass
    reaches top_p (a token is kept when the mass strictly before it is < top_p). Ties at the
    threshold are all kept."""
    thr = torch.full(z.shape[:1], float("-inf"), device=z.device)
    if top_k and top_k < z.shape[-1]:
        thr = torch.topk(z, top_k, dim=-1).values[:, -1]
    if top_p < 1.0:
        zs = torch.sort(z, dim=-1, descending=True).values  # (N, V)
        p = torch.softmax(zs, dim=-1)
        before = torch.cumsum(p, dim=-1) - p  # mass strictly before each sorted token
        count = (before < top_p).sum(-1).clamp(min=1)  # (N,)
        thr = torch.maximum(thr, zs.gather(1, (count - 1)[:, None])[:, 0])
    return thr.contiguous()  # (N,): the Triton sampler reads it with stride 1


def sample_reference(logits, rowkey, step, temperature=1.0, top_p=1.0, top_k=0):
    """The sampler's math on full rows, in torch: logits (N, V) → tokens (N,), logprobs (N,)."""
    greedy = temperature == 0
    z = logits.float() * (1.0 if greedy else 1.0 / temperature)  # (N, V)
    lse = torch.logsumexp(z, dim=-1)
    if greedy:
        tok = z.argmax(-1)
    else:
        cand = z + gumbel_noise(rowkey, step, z.shape[-1])
        if top_p < 1.0 or top_k:
            cand = torch.where(z >= truncation_threshold(z, top_p, top_k)[:, None], cand, float("-inf"))
        tok = cand.argmax(-1)
    return tok, z.gather(1, tok[:, None])[:, 0] - lse


# ---------------------------------------------------------------------------------------------
# Triton kernels (each mirrors a torch reference in Decoder below)
# ---------------------------------------------------------------------------------------------

def _jit(fn):
    return triton.jit(fn) if triton is not None else fn


@_jit
def _add_rmsnorm_kernel(x_ptr, d_ptr, w_ptr, xout_ptr, out_ptr, H, eps,
                        HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr, K_STEP: tl.constexpr, PDL: tl.constexpr):
    """One row: x += delta (rounded to the model dtype, as the model's residual add), then RMSNorm (stored
    in the next GEMM's K order if K_STEP: see Decoder.gemm)."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    m = offs < H
    fp4_gemm.pdl_launch_next(PDL)  # the GEMM after this one may start loading its weights
    w = tl.load(w_ptr + offs, mask=m, other=0.0)  # (no kernel of the step writes it: loaded before the wait)
    fp4_gemm.pdl_wait(PDL)
    x = tl.load(x_ptr + row * H + offs, mask=m, other=0.0)
    if HAS_DELTA:
        dx = tl.load(d_ptr + row * H + offs, mask=m, other=0.0)
        x = (x.to(tl.float32) + dx.to(tl.float32)).to(xout_ptr.dtype.element_ty)
        tl.store(xout_ptr + row * H + offs, x, mask=m)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / H
    y = (xf * tl.rsqrt(var + eps) * w).to(out_ptr.dtype.element_ty)
    if K_STEP:  # (H a multiple of K_STEP: the padding past H stays past H)
        y = tl.reshape(fp4_gemm.k_ordered_tile(tl.reshape(y, (1, BLOCK)), 1, BLOCK, K_STEP), (BLOCK,))
    tl.store(out_ptr + row * H + offs, y, mask=m)


@_jit
def _rope_write_kernel(qkv_ptr, a_ptr, b_ptr, cos_ptr, sin_ptr, pad_ptr, counters_ptr, q_ptr, kc_ptr, vc_ptr,
                       M, S, Hq, Hkv, A_STRIDE, T, COPIES, ROW0, D: tl.constexpr, R: tl.constexpr, BM: tl.constexpr,
                       HAS_LORA: tl.constexpr, PREC: tl.constexpr, PROMPT: tl.constexpr, PDL: tl.constexpr):
    """Program (row block, head j of q|k|v): add the head's LoRA B product, rotate q and k by their
    positions, store q to q_ptr (M, Hq, D) and k / v into this layer's cache. A decode step (PROMPT false):
    row m is sequence m, its token at the current column. A prefill (PROMPT): row m is token t = m % T of
    prompt p = m // T (left-padded by pad[p]) at column t, its k / v into cache rows ROW0 + p·COPIES ...
    + COPIES − 1 (the prompt's samples)."""
    pm = tl.program_id(0)
    j = tl.program_id(1)
    HALF: tl.constexpr = D // 2
    rows = pm * BM + tl.arange(0, BM)
    rm = rows < M
    if PROMPT:
        p = rows // T
        t = rows % T
    else:
        p = rows
        t = rows * 0  # (the column is the current one for every row)
    d = tl.arange(0, HALF)
    nqkv = (Hq + 2 * Hkv) * D
    c0 = j * D
    r = tl.arange(0, R)
    if HAS_LORA:  # B^T for this head's two halves (R, HALF): no kernel of the step writes it, so before the wait
        b1 = tl.load(b_ptr + (c0 + d)[None, :] * R + r[:, None])
        b2 = tl.load(b_ptr + (c0 + HALF + d)[None, :] * R + r[:, None])
    fp4_gemm.pdl_wait(PDL)
    x1 = tl.load(qkv_ptr + rows[:, None] * nqkv + c0 + d[None, :], mask=rm[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(qkv_ptr + rows[:, None] * nqkv + c0 + HALF + d[None, :], mask=rm[:, None], other=0.0).to(tl.float32)
    if HAS_LORA:
        sec = (j >= Hq).to(tl.int32) + (j >= Hq + Hkv).to(tl.int32)  # which of A_q, A_k, A_v fed this head
        a = tl.load(a_ptr + rows[:, None] * A_STRIDE + sec * R + r[None, :], mask=rm[:, None], other=0.0)  # (BM, R)
        x1 += tl.dot(a, b1, input_precision=PREC)
        x2 += tl.dot(a, b2, input_precision=PREC)
    dt = q_ptr.dtype.element_ty
    x1 = x1.to(dt).to(tl.float32)  # the projection's output in the model dtype, as the model rounds it
    x2 = x2.to(dt).to(tl.float32)
    col = t if PROMPT else t + tl.load(counters_ptr)  # (BM,)
    if j < Hq + Hkv:  # q and k are rotated: (x1, x2) → (x1 cos − x2 sin, x2 cos + x1 sin)
        pos = tl.maximum(col - tl.load(pad_ptr + p, mask=rm, other=0), 0)  # (a prompt's padding: position 0)
        c = tl.load(cos_ptr + pos[:, None] * HALF + d[None, :], mask=rm[:, None], other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + pos[:, None] * HALF + d[None, :], mask=rm[:, None], other=0.0).to(tl.float32)
        y1 = (x1 * c - x2 * s).to(dt)
        y2 = (x2 * c + x1 * s).to(dt)
    else:
        y1 = x1.to(dt)
        y2 = x2.to(dt)
    if j < Hq:
        dst = q_ptr + rows[:, None] * (Hq * D) + j * D
        tl.store(dst + d[None, :], y1, mask=rm[:, None])
        tl.store(dst + HALF + d[None, :], y2, mask=rm[:, None])
    else:
        cache = kc_ptr
        h = j - Hq
        if j >= Hq + Hkv:
            cache = vc_ptr
            h = j - Hq - Hkv
        for c in range(COPIES):
            dst = cache + ((((ROW0 + p * COPIES + c) * Hkv + h) * S + col) * D)[:, None]
            tl.store(dst + d[None, :], y1, mask=rm[:, None])
            tl.store(dst + HALF + d[None, :], y2, mask=rm[:, None])


SHARE_PROMPTS = True  # the n samples of a prompt attend over it together (False: each row alone, for comparisons)
# the kernels before a warp-specialized wgmma GEMM store its x in the GEMM's K order (False: fp4_gemm's own
# launch orders it, for comparisons; see Decoder.gemm)
ORDER_X = True
# query heads (rows of a group x heads of a kv head) one program takes over a shared prompt: 32 and 64 ran at
# the same speed (results/rollout_h200.md, session 16), 64 with register spills
SHARED_HEADS = 32
# A prefill of at most this many prompt tokens (prompts x padded length) is bound by the host, or its time
# swings with the host's (one eager 256-token prompt: 66-116 ms for ~11 ms of GPU work on the H200; eight:
# 60-104 ms for 55), so on the GPU it runs as a CUDA graph, one per (prompts, length) shape; its length is
# rounded up to a multiple of PREFILL_BUCKET so that prompts of nearby lengths share a graph. Larger
# prefills keep the GPU busy eagerly. 0: always eager.
PREFILL_GRAPH_TOKENS = 2048
PREFILL_BUCKET = 64
# An eager prefill runs this many prompt tokens at a time at most (whole prompts), so that its activations
# (a gate|up output of 16384 tokens is 1.2 GB for a 7B model) stay a small part of the memory
PREFILL_CHUNK_TOKENS = 16384


@_jit
def _attn_part(q_ptr, kc_ptr, vc_ptr, m_ptr, l_ptr, acc_ptr, qrow, qm, base, lo, hi, out, sm_scale,
               QP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr):
    """Online softmax of the QP query rows `qrow` (mask qm) over the cache columns [lo, hi) at `base` (one
    row's one kv head); its max, sum and weighted values stored at `out` (the values only if a column was
    read: the combine does not read them from an empty slot)."""
    d = tl.arange(0, D)
    q = tl.load(q_ptr + qrow[:, None] * D + d[None, :], mask=qm[:, None], other=0.0)  # (QP, D)
    m_i = tl.full([QP], float("-inf"), tl.float32)
    l_i = tl.zeros([QP], tl.float32)
    acc = tl.zeros([QP, D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nm = n < hi
        k = tl.load(kc_ptr + base + n[:, None] * D + d[None, :], mask=nm[:, None], other=0.0)  # (BLOCK_N, D)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * sm_scale  # (QP, BLOCK_N)
        s = tl.where(nm[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(vc_ptr + base + n[:, None] * D + d[None, :], mask=nm[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new
    tl.store(m_ptr + out, m_i, mask=qm)
    tl.store(l_ptr + out, l_i, mask=qm)
    tl.store(acc_ptr + out[:, None] * D + d[None, :], acc, mask=qm[:, None] & (hi > lo))


@_jit
def _attn_chunk(start, end, split, BLOCK_N: tl.constexpr):
    """Columns [lo, hi) of chunk `split` of num_programs(1) over [start, end): whole blocks of BLOCK_N,
    as even as that allows (the last chunks may be short or empty)."""
    per = tl.cdiv(tl.cdiv(end - start, tl.num_programs(1)), BLOCK_N) * BLOCK_N
    lo = start + split * per
    return lo, tl.minimum(lo + per, end)


@_jit
def _attn_partial_kernel(q_ptr, kc_ptr, vc_ptr, pad_ptr, done_ptr, counters_ptr, shared_ptr, m_ptr, l_ptr, acc_ptr,
                         sm_scale, S, Hkv, STRIDE, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                         BLOCK_N: tl.constexpr, N_GROUP: tl.constexpr, ROWS: tl.constexpr, Q_PAD: tl.constexpr,
                         PREC: tl.constexpr, PDL: tl.constexpr):
    """Program (row b, kv head h, chunk c of C): online softmax of the G query heads of h over chunk c of
    the row's own cache columns [start, col] (start = max(pad_b, shared), C chunks of whole blocks of
    BLOCK_N, as even as that allows: they follow the current column, so every program has work from
    the first step to the last); writes its partial max, sum and weighted values to slot c of each
    query head. Columns past the current one are never read; a finished row reads nothing.

    The N_GROUP rows of a group (the samples of one prompt; N_GROUP = 1: no groups) hold the same prompt
    in columns [pad, shared). Those are read from the group's first row, once for every ROWS rows: the
    program of every ROWS-th row of a group also takes slice c of them for the query heads of h of that
    row and the ROWS - 1 after it (Q_PAD >= ROWS·G query rows, a larger tile), into slot C + c."""
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // Hkv
    h = bh % Hkv
    fp4_gemm.pdl_wait(PDL)
    shared = tl.load(shared_ptr)
    if N_GROUP > 1:
        if (b % N_GROUP) % ROWS == 0:
            first = b - b % N_GROUP
            pad = tl.load(pad_ptr + first)
            lo, hi = _attn_chunk(pad, shared, split, BLOCK_N)
            j = tl.arange(0, Q_PAD)
            i = j // G  # (row b + i, query head h·G + j % G)
            qrow = (b + i) * (Hkv * G) + h * G + j % G
            ok = (j < ROWS * G) & (b % N_GROUP + i < N_GROUP)
            _attn_part(q_ptr, kc_ptr, vc_ptr, m_ptr, l_ptr, acc_ptr, qrow, ok, (first * Hkv + h).to(tl.int64) * S * D,
                       lo, hi, qrow * STRIDE + tl.num_programs(1) + split, sm_scale, Q_PAD, D, BLOCK_N, PREC)
    lo, hi = _attn_chunk(tl.maximum(tl.load(pad_ptr + b), shared), tl.load(counters_ptr) + 1, split, BLOCK_N)
    hi = tl.where(tl.load(done_ptr + b) != 0, lo, hi)
    g = tl.arange(0, G_PAD)
    qrow = b * (Hkv * G) + h * G + g  # (G_PAD,) rows of q (M·Hq, D)
    _attn_part(q_ptr, kc_ptr, vc_ptr, m_ptr, l_ptr, acc_ptr, qrow, g < G, (b * Hkv + h).to(tl.int64) * S * D,
               lo, hi, qrow * STRIDE + split, sm_scale, G_PAD, D, BLOCK_N, PREC)


@_jit
def _attn_combine_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, NSPLIT, STRIDE, NS_PAD: tl.constexpr, D: tl.constexpr,
                         HEADS: tl.constexpr, K_STEP: tl.constexpr, PDL: tl.constexpr):
    """Program p: HEADS (row, q head) pairs p·HEADS … of the flattened (rows, Hq): merge the partial
    softmaxes of each one's first NSPLIT slots into the attention output (HEADS·D columns of a row, stored
    in the o GEMM's K order if K_STEP)."""
    row = tl.program_id(0) * HEADS + tl.arange(0, HEADS)
    fp4_gemm.pdl_launch_next(PDL)  # the o GEMM may start loading its weights
    fp4_gemm.pdl_wait(PDL)
    s = tl.arange(0, NS_PAD)
    sm = s[None, :] < NSPLIT
    d = tl.arange(0, D)
    slot = row[:, None] * STRIDE + s[None, :]  # (HEADS, NS_PAD)
    m = tl.load(m_ptr + slot, mask=sm, other=float("-inf"))
    mx = tl.max(m, 1)
    w = tl.where(m > float("-inf"), tl.exp(m - mx[:, None]), 0.0)  # empty chunks (and finished rows) weigh 0
    den = tl.sum(tl.load(l_ptr + slot, mask=sm, other=0.0) * w, 1)
    full = sm & (m > float("-inf"))  # (an empty slot's values were not written)
    acc = tl.load(acc_ptr + slot[:, :, None] * D + d[None, None, :], mask=full[:, :, None], other=0.0)
    o = tl.sum(acc * w[:, :, None], 1) / tl.maximum(den, 1e-30)[:, None]  # (HEADS, D)
    o = tl.reshape(o.to(out_ptr.dtype.element_ty), (1, HEADS * D))
    if K_STEP:  # (HEADS·D a multiple of K_STEP)
        o = fp4_gemm.k_ordered_tile(o, 1, HEADS * D, K_STEP)
    tl.store(out_ptr + tl.program_id(0) * HEADS * D + tl.arange(0, HEADS * D)[None, :], o)


@_jit
def _silu_mul_kernel(gu_ptr, a_ptr, b_ptr, out_ptr, M, I, A_STRIDE, R: tl.constexpr, BM: tl.constexpr,
                     BN: tl.constexpr, HAS_LORA: tl.constexpr, PREC: tl.constexpr, K_STEP: tl.constexpr,
                     PDL: tl.constexpr):
    """Tile (rows, cols) of silu(gate) * up, with gate|up = the fused GEMM's output + LoRA B products (stored
    in the down GEMM's K order if K_STEP)."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    rm = rows < M
    cm = cols < I
    mk = rm[:, None] & cm[None, :]
    r = tl.arange(0, R)
    fp4_gemm.pdl_launch_next(PDL)  # the down GEMM may start loading its weights
    if HAS_LORA:  # the B's (R, BN): no kernel of the step writes them, so before the wait
        bg = tl.load(b_ptr + cols[None, :] * R + r[:, None], mask=cm[None, :], other=0.0)
        bu = tl.load(b_ptr + (I + cols)[None, :] * R + r[:, None], mask=cm[None, :], other=0.0)
    fp4_gemm.pdl_wait(PDL)
    g = tl.load(gu_ptr + rows[:, None] * (2 * I) + cols[None, :], mask=mk, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + rows[:, None] * (2 * I) + I + cols[None, :], mask=mk, other=0.0).to(tl.float32)
    if HAS_LORA:
        ag = tl.load(a_ptr + rows[:, None] * A_STRIDE + r[None, :], mask=rm[:, None], other=0.0)  # (BM, R)
        au = tl.load(a_ptr + rows[:, None] * A_STRIDE + R + r[None, :], mask=rm[:, None], other=0.0)
        g += tl.dot(ag, bg, input_precision=PREC)
        u += tl.dot(au, bu, input_precision=PREC)
    dt = out_ptr.dtype.element_ty
    g = g.to(dt).to(tl.float32)
    u = u.to(dt).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)  # F.silu in the model dtype, then the product
    out = (act * u).to(dt)
    if K_STEP:  # (BN a multiple of K_STEP)
        out = fp4_gemm.k_ordered_tile(out, BM, BN, K_STEP)
    tl.store(out_ptr + rows[:, None] * I + cols[None, :], out, mask=mk)


@_jit
def _lora_b_kernel(y_ptr, a_ptr, b_ptr, M, N, A_STRIDE, R: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   PREC: tl.constexpr, PDL: tl.constexpr):
    """Tile (rows, cols) of y += a @ B^T in place, in fp32 and rounded once to y's dtype (as addmm): the
    LoRA B product of a single-linear group (o, down)."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    rm = rows < M
    cm = cols < N
    mk = rm[:, None] & cm[None, :]
    r = tl.arange(0, R)
    fp4_gemm.pdl_launch_next(PDL)  # add_rmsnorm, which follows, may start loading its weight
    b = tl.load(b_ptr + cols[None, :] * R + r[:, None], mask=cm[None, :], other=0.0)  # (R, BN), before the wait
    fp4_gemm.pdl_wait(PDL)
    a = tl.load(a_ptr + rows[:, None] * A_STRIDE + r[None, :], mask=rm[:, None], other=0.0)  # (BM, R)
    y = tl.load(y_ptr + rows[:, None] * N + cols[None, :], mask=mk, other=0.0).to(tl.float32)
    y += tl.dot(a, b, input_precision=PREC)
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mk)


@_jit
def _mix32_tl(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@_jit
def _sample_partial_kernel(logits_ptr, V, inv_t, thr_ptr, rowkey_ptr, counters_ptr, pm_ptr, ps_ptr, pbest_ptr,
                           pidx_ptr, NSPLIT, CHUNK: tl.constexpr, BLOCK: tl.constexpr, GREEDY: tl.constexpr,
                           TRUNC: tl.constexpr, PDL: tl.constexpr):
    """Program (row b, vocab chunk): running max and sum of exp(z) over the chunk (for logsumexp) and
    the chunk's best candidate, argmax of z + Gumbel noise (of z when greedy) over the kept tokens."""
    b = tl.program_id(0)
    sp = tl.program_id(1)
    fp4_gemm.pdl_wait(PDL)
    step = tl.load(counters_ptr + 1)
    ka = _mix32_tl(((tl.load(rowkey_ptr + b) + step) & 0xFFFFFFFF).to(tl.uint32))
    kb = _mix32_tl(ka ^ 0x68E31DA4)
    if TRUNC:
        thr = tl.load(thr_ptr + b)
    m = tl.full([], float("-inf"), tl.float32)
    ssum = tl.zeros([], tl.float32)
    best = tl.full([], float("-inf"), tl.float32)
    best_i = tl.zeros([], tl.int32)
    for off in range(0, CHUNK, BLOCK):
        idx = sp * CHUNK + off + tl.arange(0, BLOCK)
        vm = idx < V
        z = tl.load(logits_ptr + b.to(tl.int64) * V + idx, mask=vm, other=float("-inf")).to(tl.float32) * inv_t
        m_new = tl.maximum(m, tl.max(z, 0))
        safe = m_new > float("-inf")
        ssum = tl.where(safe, ssum * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), 0), 0.0)
        m = m_new
        cand = z
        if not GREEDY:
            hsh = _mix32_tl(_mix32_tl(idx.to(tl.uint32) + ka) ^ kb)
            u = ((hsh >> 8).to(tl.float32) + 0.5) * 5.9604644775390625e-08  # 2^-24
            cand = z - tl.log(-tl.log(u))
            if TRUNC:
                cand = tl.where(z >= thr, cand, float("-inf"))
        cand = tl.where(vm, cand, float("-inf"))
        cb = tl.max(cand, 0)
        ci = tl.argmax(cand, 0, tie_break_left=True).to(tl.int32) + sp * CHUNK + off
        better = cb > best
        best_i = tl.where(better, ci, best_i)
        best = tl.where(better, cb, best)
    o = b * NSPLIT + sp
    tl.store(pm_ptr + o, m)
    tl.store(ps_ptr + o, ssum)
    tl.store(pbest_ptr + o, best)
    tl.store(pidx_ptr + o, best_i)


@_jit
def _sample_final_kernel(logits_ptr, V, inv_t, pm_ptr, ps_ptr, pbest_ptr, pidx_ptr, NSPLIT, counters_ptr,
                         done_ptr, stopped_ptr, lengths_ptr, stops_ptr, pad_id, tok_ptr, out_tok_ptr, out_lp_ptr,
                         OUT_STRIDE, NS_PAD: tl.constexpr, NSTOP: tl.constexpr, PDL: tl.constexpr):
    """Program (row b): merge the chunks (token = best candidate, logprob = z[token] − logsumexp),
    then the row's bookkeeping: output slot `step`, next input token, stop / done flags, length."""
    b = tl.program_id(0)
    fp4_gemm.pdl_wait(PDL)
    s = tl.arange(0, NS_PAD)
    sm = s < NSPLIT
    m = tl.load(pm_ptr + b * NSPLIT + s, mask=sm, other=float("-inf"))
    mx = tl.max(m, 0)
    tot = tl.sum(tl.where(m > float("-inf"), tl.load(ps_ptr + b * NSPLIT + s, mask=sm, other=0.0) * tl.exp(m - mx), 0.0), 0)
    lse = mx + tl.log(tot)
    best = tl.load(pbest_ptr + b * NSPLIT + s, mask=sm, other=float("-inf"))
    jb = tl.argmax(best, 0, tie_break_left=True)
    tok = tl.sum(tl.where(s == jb, tl.load(pidx_ptr + b * NSPLIT + s, mask=sm, other=0), 0), 0).to(tl.int64)
    lp = tl.load(logits_ptr + b.to(tl.int64) * V + tok).to(tl.float32) * inv_t - lse
    step = tl.load(counters_ptr + 1)
    done = tl.load(done_ptr + b)
    stops = tl.load(stops_ptr + tl.arange(0, NSTOP))
    hit = tl.sum((stops == tok).to(tl.int32), 0) > 0
    tok = tl.where(done != 0, pad_id, tok)
    lp = tl.where(done != 0, 0.0, lp)
    tl.store(out_tok_ptr + b * OUT_STRIDE + step, tok)
    tl.store(out_lp_ptr + b * OUT_STRIDE + step, lp)
    tl.store(tok_ptr + b, tok)
    new_stop = hit & (done == 0)
    tl.store(stopped_ptr + b, tl.where(new_stop, 1, tl.load(stopped_ptr + b)))
    tl.store(lengths_ptr + b, tl.where(done != 0, tl.load(lengths_ptr + b), step + 1))
    tl.store(done_ptr + b, tl.where(new_stop, 1, done))


# ---------------------------------------------------------------------------------------------
# The decode plan: per layer, the model's linears regrouped by shared input
# ---------------------------------------------------------------------------------------------

NATURAL = (0, 0)  # an op's output as it is: (k_step, rows) = no K order, M rows (Decoder.x_orders)


def _output(M, K, order, like):
    """An op's output (M, K): the first M rows of a buffer of order[1] rows where that is more."""
    return torch.empty(max(M, order[1]), K, dtype=like.dtype, device=like.device)[:M]


def _in_k_order(t, k_step):
    """t (M, K) with its columns in fp4_gemm's K order for k-steps of k_step (what the kernels store with
    K_STEP), or t itself for k_step 0."""
    return t[:, fp4_gemm.wgmma_k_order(t.shape[1], k_step, t.device)] if k_step else t


def _pow2(x):
    return 1 << max(0, math.ceil(math.log2(max(1, x))))


def _attn_per_sm(stages, D, itemsize):
    """Programs of _attn_partial_kernel an SM holds at `stages` pipeline stages: Triton keeps stages - 1
    blocks of 64 columns of K and of V in shared memory, plus ~6 KB (the compiled kernel: 38, 70 and
    102 KB at 2, 3 and 4 stages, D = 128, bf16; triton 3.6 on the H200, sessions 29 and 33, with 90-93
    registers a thread), and an SM has 228 KB: 5, 3 or 2 programs."""
    return 228 * 1024 // ((stages - 1) * 2 * 64 * D * itemsize + 8 * 1024)


def _attn_grid(pairs, S, sms, D, itemsize):
    """(split, num_stages) of _attn_partial_kernel for `pairs` (row, kv head) programs of a split each
    over at most S columns. The split: about 2 programs an SM, at most one per 64 columns (against 4 an
    SM, us a layer at 513 columns: 25.0-25.4 against 29.3-29.5 at 64 rows; session 13). Then the
    deepest pipeline (4, 3 or 2 stages) under which the whole grid fits on the GPU at once: a deeper
    one keeps more loads in flight, but a grid that does not fit runs a second wave, which costs more
    (28 layers' attention, 768 columns: 64 rows 1020 -> 920 us at 2 stages instead of 3, 128 rows
    1814 -> 1629; results/rollout_h200.md, session 29). Where a split of 2 or more still fits at 4
    stages it is cut to what fits (32 rows: 2 chunks a pair instead of 3, 605 -> 557 us there): the
    decode step at 32 rows 3.61 -> 3.56 ms; 8 and 16 rows within the noise (session 30)."""
    split = min(max(1, math.ceil(2 * sms / pairs)), math.ceil(S / 64))
    fits = sms * _attn_per_sm(4, D, itemsize) // pairs
    if fits >= 2:
        split = min(split, fits)
    stages = next((s for s in (4, 3) if pairs * split <= sms * _attn_per_sm(s, D, itemsize)), 2)
    return split, stages


class _Group:
    """Linears that read the same input (q|k|v, gate|up, o, down): one GEMM over their stacked base
    weights, and their LoRA adapters side by side: a = x @ A^T (M, sections·R), then output rows of
    section s add a[:, s·R:(s+1)·R] @ B_s^T, with B (N_total, R) holding scaling · lora_B (zero-padded
    to a common rank R ≥ 16, a power of two, for tl.dot)."""

    def __init__(self, mods, dtype):
        self.loras = [m if isinstance(m, lora.LoRALinear) else None for m in mods]
        bases = [m.base if isinstance(m, lora.LoRALinear) else m for m in mods]
        self.sizes = [b.out_features for b in bases]
        self.gemm = self._fuse(bases)
        ranks = [l.rank for l in self.loras if l is not None]
        self.R = max(16, _pow2(max(ranks))) if ranks else 0
        if self.R:
            dev = bases[0].weight_packed.device if hasattr(bases[0], "weight_packed") else next(bases[0].parameters()).device
            K = bases[0].in_features
            self.A = torch.zeros(len(mods) * self.R, K, dtype=dtype, device=dev)  # (sections·R, K)
            self.B = torch.zeros(sum(self.sizes), self.R, dtype=dtype, device=dev)  # (N_total, R)
        self.A_k = None  # A's columns in its GEMM's K order (k_ordered_A)

    @staticmethod
    def _fuse(bases):
        """One GEMM for linears that share their input. Their weights are stacked into one tensor once
        per model, and each linear's own weight becomes a view of its rows: no second copy (for the
        Qwen2.5-7B q|k|v and gate|up that would be 2.4 GB in NVFP4, 8.5 GB in bf16), and training, which
        runs the separate linears, reads the same memory."""
        if len(bases) == 1:
            return bases[0]
        rows = [0]
        for b in bases:
            rows.append(rows[-1] + b.out_features)
        if all(type(b) is nn.Linear for b in bases):
            w = torch.cat([b.weight.detach() for b in bases])  # (N_total, K)
            bias = None
            if any(b.bias is not None for b in bases):
                bias = torch.cat([b.bias.detach() if b.bias is not None else w.new_zeros(b.out_features) for b in bases])
            for b, lo, hi in zip(bases, rows, rows[1:]):
                b.weight.data = w[lo:hi]
                if b.bias is not None:
                    b.bias.data = bias[lo:hi]
            return lambda x: F.linear(x, w, bias)
        if all(isinstance(b, fp4_gemm.QuantLinear) for b in bases):
            fused = fp4_gemm.QuantLinear.concat(bases)
            for b, lo, hi in zip(bases, rows, rows[1:]):
                b.weight_packed = fused.weight_packed[lo:hi]  # (registered buffers: replaced in place)
                b.weight_scale = fused.weight_scale[lo:hi]
                if b.bias is not None:
                    b.bias.data = fused.bias.data[lo:hi]
            return fused
        return lambda x: torch.cat([b(x) for b in bases], -1)  # unknown modules: correct, not fused

    @torch.no_grad()
    def refresh(self):
        """Copy the adapters' current values (the optimizer moved them since the last call)."""
        if not self.R:
            return
        self.A.zero_()
        self.B.zero_()
        row = 0
        for s, (lo, n) in enumerate(zip(self.loras, self.sizes)):
            if lo is not None and not lo.disabled:
                r = lo.rank
                self.A[s * self.R: s * self.R + r].copy_(lo.lora_A.weight)
                self.B[row: row + n, :r].copy_(lo.lora_B.weight * lo.scaling)
            row += n
        if self.A_k is not None:
            self.A_k.copy_(self.A[:, self.k_order])

    def k_ordered_A(self, k_step):
        """A with its columns in fp4_gemm's K order for k-steps of k_step (x_ordered @ A_k^T = x @ A^T), for
        x stored in that order; refresh keeps it up to date from then on."""
        if self.A_k is None:
            self.k_step, self.k_order = k_step, fp4_gemm.wgmma_k_order(self.A.shape[1], k_step, self.A.device)
            self.A_k = self.A[:, self.k_order]
        if k_step != self.k_step:
            raise ValueError(f"one K order a group: k-steps of {self.k_step}, then {k_step}")
        return self.A_k


class _Layer:
    def __init__(self, block, dtype):
        att, mlp = block.self_attn, block.mlp
        self.ln1, self.ln2 = block.input_layernorm, block.post_attention_layernorm  # read in place (AQN)
        self.qkv = _Group([att.q_proj, att.k_proj, att.v_proj], dtype)
        self.o = _Group([att.o_proj], dtype)
        self.gu = _Group([mlp.gate_proj, mlp.up_proj], dtype)
        self.down = _Group([mlp.down_proj], dtype)
        self.groups = (self.qkv, self.o, self.gu, self.down)


class _State:
    """Everything one (N rows, S columns) shape needs, allocated once: the cache, the step's inputs and
    outputs, and the scratch of the split kernels. A CUDA graph reads exactly these addresses.
    With `parent`, a smaller state for the first N rows of the parent's (Decoder.shrink): its per-row
    tensors, counters, stop list and rotary tables are views of the parent's, its scratch and graphs its
    own. The parent keeps them in `subs`, one per row count."""

    ROW_TENSORS = ("tok", "pad", "rowkey", "done", "stopped", "lengths", "out_tok", "out_lp")

    def __init__(self, dec, N, S, parent=None):
        cfg, dev, dt = dec.cfg, dec.device, dec.dtype
        self.N, self.S = N, S
        L, Hkv, D, V = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size
        self.subs = {}
        i64 = dict(dtype=torch.int64, device=dev)
        if parent is not None:
            self.k, self.v = parent.k[:, :N], parent.v[:, :N]  # (L, N, Hkv, S, D); each layer's is contiguous
            for name in self.ROW_TENSORS:
                setattr(self, name, getattr(parent, name)[:N])
            self.counters, self.stops, self.cos, self.sin = parent.counters, parent.stops, parent.cos, parent.sin
        else:
            # zeros, not empty: the torch attention multiplies masked garbage by 0, and 0 * NaN is NaN
            self.k = torch.zeros(L, N, Hkv, S, D, dtype=dt, device=dev)  # (L, N, Hkv, S, D)
            self.v = torch.zeros(L, N, Hkv, S, D, dtype=dt, device=dev)
            self.tok = torch.zeros(N, **i64)  # the token entering the next step
            self.counters = torch.zeros(2, **i64)  # [cache column of that token, output step it samples]
            self.pad = torch.zeros(N, **i64)  # left padding of each row = its first valid column
            self.rowkey = torch.zeros(N, **i64)
            self.done = torch.zeros(N, dtype=torch.int32, device=dev)
            self.stopped = torch.zeros(N, dtype=torch.int32, device=dev)
            self.lengths = torch.zeros(N, **i64)
            self.out_tok = torch.zeros(N, S, **i64)
            self.out_lp = torch.zeros(N, S, dtype=torch.float32, device=dev)
            self.stops = torch.full((16,), -1, **i64)
            pos = torch.arange(S, device=dev)[:, None].float() * dec.model.inv_freq[None]  # (S, D/2), as rope_cos_sin
            self.cos, self.sin = pos.cos().to(dt), pos.sin().to(dt)
        self.attn_split, self.attn_stages = _attn_grid(N * Hkv, S, dec.sms, D, dt.itemsize)
        # the prompt that the n rows of a group share: columns [pad, shared) of each row (shared = 0: none),
        # read for several rows at once, its slices into slots attn_split ... 2·attn_split - 1
        # (_attn_partial_kernel)
        self.n = 1
        self.shared = torch.zeros(1, **i64)
        rows = N * cfg.num_heads
        self.attn_m = torch.zeros(rows, 2 * self.attn_split, dtype=torch.float32, device=dev)
        self.attn_l = torch.zeros_like(self.attn_m)
        self.attn_acc = torch.zeros(rows, 2 * self.attn_split, D, dtype=torch.float32, device=dev)
        # sampler split over the vocabulary: about 2 programs per SM
        self.v_block = 1024
        self.v_chunk = self.v_block * math.ceil(V / max(1, math.ceil(2 * dec.sms / N)) / self.v_block)
        self.v_split = math.ceil(V / self.v_chunk)
        self.sm_m = torch.zeros(N, self.v_split, dtype=torch.float32, device=dev)
        self.sm_s = torch.zeros_like(self.sm_m)
        self.sm_best = torch.zeros_like(self.sm_m)
        self.sm_idx = torch.zeros(N, self.v_split, dtype=torch.int32, device=dev)
        self.host_col = None  # the current column when known on the host (eager steps), else None
        self.graphs = {}  # decode steps, per sampling setup
        self.prefills = OrderedDict()  # prefills, per (prompts, length): Decoder.capture_prefill
        self.x_orders = [dec.x_orders(L, N) for L in dec.layers]  # per layer: (q|k|v, o, gate|up, down)
        for L, orders in zip(dec.layers, self.x_orders):
            for grp, (k_step, _) in zip(L.groups, orders):
                if k_step and grp.R:
                    grp.k_ordered_A(k_step)  # (allocated here, filled by every refresh)

    def rope_at(self, pos):
        """The rotary cos, sin (*pos.shape, D) at positions pos, from the tables (as model.rope_cos_sin)."""
        return tuple(torch.cat([t[pos], t[pos]], -1) for t in (self.cos, self.sin))


class _PrefillCache:
    """The attention of the prefill of P distinct prompts (Decoder.prompt_hidden), tokens (P, Lp) left-padded
    by pad (P,): their K/V in the n cache rows of each prompt's samples from row row0 on, at columns
    [0, Lp) (Decoder.prompt_rope_write), and each prompt's queries over its own columns (causal, padding
    masked)."""

    def __init__(self, st, row0, n, pad, Lp):
        self.st, self.row0, self.n, self.pad, self.Lp = st, row0, n, pad, Lp
        kpos = torch.arange(Lp, device=pad.device)
        qpos = kpos[:, None]
        # a padding query sees only itself, so that no row of the mask is empty (NaN)
        self.mask = (kpos[None, None] <= qpos) & ((kpos[None, None] >= pad[:, None, None]) | (kpos == qpos))
        self.mask = self.mask[:, None]  # (P, 1, Lp, Lp)

    @cached_property
    def cos_sin(self):
        """The rotary cos / sin (P, 1, Lp, D) at the prompts' positions (padding at position 0), for the torch
        path (the kernel reads the state's tables itself)."""
        positions = (torch.arange(self.Lp, device=self.pad.device)[None] - self.pad[:, None]).clamp(min=0)
        return tuple(t[:, None] for t in self.st.rope_at(positions))

    def rows(self, P):
        """The cache rows of P prompts' samples, and (every n-th) those of the prompts' first samples."""
        return slice(self.row0, self.row0 + P * self.n), slice(self.row0, self.row0 + P * self.n, self.n)

    def attend(self, layer, q):  # q (P, Hq, Lp, D) → (P·Lp, Hq·D)
        P, Hq, Lp, D = q.shape
        first = self.rows(P)[1]
        k, v = self.st.k[layer, first, :, :Lp], self.st.v[layer, first, :, :Lp]  # (P, Hkv, Lp, D)
        # (on the H200, 64 prompts of 256 tokens, 7B heads, us: 263 with enable_gqa, 520 with K/V expanded to
        # every query head first; SDPA's output keeps q's (P, Lp, Hq, D) layout, so the reshape is a view)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, enable_gqa=True)  # (P, Hq, Lp, D)
        return out.transpose(1, 2).reshape(P * Lp, Hq * D)


# ---------------------------------------------------------------------------------------------
# The decoder: the fused step (torch reference | Triton), graph capture, the generation loop
# ---------------------------------------------------------------------------------------------

class Decoder:
    """The sampler for one model. Built once per model (generate() keeps it on the model; release()
    drops it): regroups the linears, then per (rows, columns) shape keeps a _State and its graphs."""

    def __init__(self, model, kernels="auto", graphs="auto", max_states=2):
        if kernels not in ("auto", "triton", "torch") or graphs not in ("auto", True, False):
            raise ValueError(f"kernels must be auto|triton|torch and graphs auto|True|False, got {kernels!r}, {graphs!r}")
        # The model keeps its decoder (generate); a strong reference back would make a cycle, and only the
        # garbage collector would free the two (the caches and graphs with them), whenever it runs.
        self._model, self.cfg = weakref.ref(model), model.config
        self.opts = (kernels, graphs)
        self.device, self.dtype = model.device, model.dtype
        if kernels == "triton" and triton is None:
            raise RuntimeError("kernels='triton' but triton is not installed")
        self.triton = kernels == "triton" or (kernels == "auto" and triton is not None and self.device.type == "cuda")
        if self.triton and (self.cfg.head_dim < 32 or self.cfg.head_dim != _pow2(self.cfg.head_dim)):
            if kernels == "triton":  # the kernels need a power-of-two head_dim >= 32 (tl.arange, tl.dot)
                raise ValueError(f"kernels='triton' needs a power-of-two head_dim >= 32, got {self.cfg.head_dim}")
            self.triton = False
        if graphs is True and self.device.type != "cuda":
            raise ValueError(f"graphs=True needs a model on a CUDA GPU, this one is on {self.device.type}: use "
                             "graphs='auto' or False")
        self.graphs = self.device.type == "cuda" if graphs == "auto" else graphs
        self.sms = torch.cuda.get_device_properties(self.device).multi_processor_count if self.device.type == "cuda" else 4
        self.prec = "ieee" if self.dtype == torch.float32 else "tf32"
        self.pdl = fp4_gemm.pdl_opts(self.device) if self.triton else {}  # (programmatic dependent launch)
        # the LoRA A products that no fp4 launch carries run here, beside the GEMMs (see gemm)
        self.side_stream = torch.cuda.Stream(self.device) if self.triton and self.device.type == "cuda" else None
        self.layers = [_Layer(b, self.dtype) for b in model.layers]
        self.fingerprint = _fingerprint(model)
        self.states = OrderedDict()
        self.max_states = max_states
        self.pool = None

    @property
    def model(self):
        return self._model()

    def x_orders(self, layer, N):
        """For N rows, per group of a layer (q|k|v, o, gate|up, down): how the op before the group's GEMM
        stores x for it, (k_step, rows) (fp4_gemm.x_k_order: for the warp-specialized wgmma kernel, 33-256
        rows on Hopper, in the K order of its k-steps, as the first N rows of a buffer of `rows`), or
        NATURAL (x as it is)."""
        if not (ORDER_X and self.triton and self.device.type == "cuda"):
            return (NATURAL,) * len(layer.groups)
        return tuple(fp4_gemm.x_k_order(N, g.gemm.q, self.dtype, self.device)
                     if isinstance(g.gemm, fp4_gemm.QuantLinear) else NATURAL for g in layer.groups)

    # --- the fused ops; each has its torch reference (CPU) and its Triton kernel --------------
    # (order = (k_step > 0, rows): the op stores its output in fp4_gemm's K order for the GEMM that reads
    # it, see gemm)

    def add_rmsnorm(self, x, delta, norm, order=NATURAL):
        """x + delta (the residual stream, model dtype) and RMSNorm of it → (new x, normed)."""
        w, eps = norm.weight, norm.eps
        if self.triton:
            M, H = x.shape
            xo = torch.empty_like(x) if delta is not None else x
            out = _output(M, H, order, x)
            _add_rmsnorm_kernel[(M,)](x, delta if delta is not None else x, w, xo, out, H, eps,
                                      HAS_DELTA=delta is not None, BLOCK=_pow2(H), K_STEP=order[0],
                                      num_warps=8 if H > 2048 else 4, **self.pdl)
            return xo, out
        if delta is not None:
            x = x + delta
        return x, _in_k_order(norm(x), order[0])

    def step_terms(self, st):
        """What the torch path's layers share within a step, computed once: the rotary cos / sin at each
        row's position (M, 1, D) and the attention mask over the cache columns (M, S). Eagerly the host
        knows the length; inside a graph the mask must cover the whole cache."""
        pos = st.counters[0] - st.pad  # (M,)
        cos, sin = (t[:, None] for t in st.rope_at(pos))  # (M, 1, D)
        kpos = torch.arange(st.host_col + 1 if st.host_col is not None else st.S, device=pos.device)
        valid = (kpos[None] >= st.pad[:, None]) & (kpos[None] <= st.counters[0])  # (M, S)
        return cos, sin, valid

    def rope_write(self, qkv, a, grp, st, layer, terms):
        """qkv (M, (Hq+2Hkv)·D) + LoRA → q (M, Hq, D) rotated; k (rotated) and v stored at the current column.
        terms: step_terms(st) on the torch path (None with the kernels)."""
        cfg = self.cfg
        M, Hq, Hkv, D = qkv.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if self.triton:
            q = torch.empty(M, Hq, D, dtype=qkv.dtype, device=qkv.device)
            self._rope_write(qkv, a, grp, st, layer, q, st.pad)
            return q
        q, k, v = self.add_b(grp, qkv, a).split([Hq * D, Hkv * D, Hkv * D], -1)
        cos, sin, _ = terms
        q, k = q.reshape(M, Hq, D), k.reshape(M, Hkv, D)
        q, k = apply_rope(q, k, cos, sin)
        col = st.counters[:1]
        st.k[layer].index_copy_(2, col, k[:, :, None])
        st.v[layer].index_copy_(2, col, v.reshape(M, Hkv, 1, D))
        return q

    def prompt_rope_write(self, qkv, a, grp, cache, layer):
        """rope_write for a prefill: qkv (P·T, (Hq+2Hkv)·D) + LoRA → q (P, Hq, T, D) rotated at the prompts'
        positions (on the GPU a view of (P, T, Hq, D)); k (rotated) and v stored in the cache rows of each
        prompt's samples (see _PrefillCache)."""
        cfg = self.cfg
        Hq, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        P, T = cache.pad.shape[0], cache.Lp
        if self.triton:
            q = torch.empty(P * T, Hq, D, dtype=qkv.dtype, device=qkv.device)
            self._rope_write(qkv, a, grp, cache.st, layer, q, cache.pad, prompt=(T, cache.n, cache.row0))
            return q.view(P, T, Hq, D).transpose(1, 2)
        q, k, v = self.add_b(grp, qkv, a).split([Hq * D, Hkv * D, Hkv * D], -1)
        heads = lambda t, H: t.reshape(P, T, H, D).transpose(1, 2)  # (P·T, H·D) → (P, H, T, D)
        q, k = apply_rope(heads(q, Hq), heads(k, Hkv), *cache.cos_sin)
        both, n = cache.rows(P)[0], cache.n
        for c, t in ((cache.st.k, k), (cache.st.v, heads(v, Hkv))):
            c[layer, both, :, :T] = t.repeat_interleave(n, 0) if n > 1 else t
        return q

    def _rope_write(self, qkv, a, grp, st, layer, q, pad, prompt=None):
        """Launch _rope_write_kernel: a decode step's (pad of each row), or with prompt = (tokens a prompt,
        cache rows a prompt, first row) a prefill's (pad of each prompt)."""
        cfg = self.cfg
        Hq, Hkv, D, R, M = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, grp.R, qkv.shape[0]
        _rope_write_kernel[(triton.cdiv(M, 16), Hq + 2 * Hkv)](
            qkv, a if R else qkv, grp.B if R else qkv, st.cos, st.sin, pad, st.counters, q, st.k[layer], st.v[layer],
            M, st.S, Hq, Hkv, a.shape[1] if R else 0, *(prompt or (1, 1, 0)), D=D, R=max(R, 16), BM=16, HAS_LORA=R > 0,
            PREC=self.prec, PROMPT=prompt is not None, num_warps=4, **self.pdl)

    def attention(self, q, st, layer, terms, order=NATURAL):
        """q (M, Hq, D) against this layer's cache columns [pad_b, col] → (M, Hq·D)."""
        M, Hq, D = q.shape
        Hkv = self.cfg.num_kv_heads
        if self.triton:
            G = Hq // Hkv
            rows = min(st.n, max(1, SHARED_HEADS // G))  # rows of a group a program takes over their prompt
            _attn_partial_kernel[(M * Hkv, st.attn_split)](
                q, st.k[layer], st.v[layer], st.pad, st.done, st.counters, st.shared, st.attn_m, st.attn_l,
                st.attn_acc, 1.0 / math.sqrt(D), st.S, Hkv, st.attn_m.shape[1], G=G, G_PAD=max(16, _pow2(G)), D=D,
                BLOCK_N=64, N_GROUP=st.n, ROWS=rows, Q_PAD=max(16, _pow2(rows * G)), PREC=self.prec, num_warps=4,
                num_stages=st.attn_stages, **self.pdl)
            slots = st.attn_split * (2 if st.n > 1 else 1)
            out = _output(M, Hq * D, order, q)
            k_step = order[0]
            heads = max(1, k_step // D)  # (a program stores whole k-steps)
            _attn_combine_kernel[(M * Hq // heads,)](st.attn_m, st.attn_l, st.attn_acc, out, slots,
                                                     st.attn_m.shape[1], NS_PAD=_pow2(slots), D=D, HEADS=heads,
                                                     K_STEP=k_step, num_warps=4, **self.pdl)
            return out
        valid = terms[2]  # (M, S)
        S = valid.shape[1]
        out = F.scaled_dot_product_attention(q[:, :, None], st.k[layer, :, :, :S], st.v[layer, :, :, :S],
                                             attn_mask=valid[:, None, None], enable_gqa=True)  # (M, Hq, 1, D)
        return _in_k_order(out.reshape(M, Hq * D), order[0])

    @staticmethod
    def add_b(grp, y, a):
        """y + each section's LoRA B product, a[:, s·R:(s+1)·R] @ B_s^T, in torch (y (M, N_total))."""
        if not grp.R:
            return y
        return y + torch.cat([a[:, s * grp.R:(s + 1) * grp.R] @ b.t() for s, b in enumerate(grp.B.split(grp.sizes))], -1)

    def silu_mul(self, gu, a, grp, order=NATURAL):
        """gate|up (M, 2I) + LoRA → silu(gate) * up (M, I)."""
        M, I = gu.shape[0], gu.shape[1] // 2
        if self.triton:
            out = _output(M, I, order, gu)
            R, k_step = grp.R, order[0]
            bn = max(128, k_step)  # (a tile stores whole k-steps)
            _silu_mul_kernel[(triton.cdiv(M, 16), triton.cdiv(I, bn))](
                gu, a if R else gu, grp.B if R else gu, out, M, I, a.shape[1] if R else 0, R=max(R, 16), BM=16,
                BN=bn, HAS_LORA=R > 0, PREC=self.prec, K_STEP=k_step, num_warps=4, **self.pdl)
            return out
        g, u = gu.split(I, -1)
        if grp.R:
            bg, bu = grp.B.split(I)
            g = g + a[:, : grp.R] @ bg.t()
            u = u + a[:, grp.R:] @ bu.t()
        return _in_k_order(F.silu(g) * u, order[0])

    def gemm(self, grp, x, order=NATURAL):
        """A group's base GEMM and a = x @ A^T (M, sections·R) of its adapters (None without LoRA). An
        NVFP4 group whose GEMM can carry it (the mma kernel: fp4_gemm.side_rides_along)
        computes a in the GEMM's own launch (fp4_gemm.fp4_linear_side).
        Otherwise, on the GPU, cuBLAS computes a on a second stream while the GEMM runs, and the stream
        rejoins before a is read.
        order[0] = k_step > 0: x comes in the K order of the group's warp-specialized wgmma kernel
        (x_orders), as the op before stored it, so fp4_gemm skips its own launch that orders x, and a
        reads A's columns in the same order."""
        k_step = order[0]
        base, A = grp.gemm, grp.A if grp.R else None
        if k_step:
            base = lambda x: fp4_gemm.fp4_linear_k_ordered(x, grp.gemm.q, grp.gemm.bias)
            A = grp.k_ordered_A(k_step) if grp.R else None
        if not grp.R:
            return base(x), None
        if not self.triton:
            return base(x), F.linear(x, A)
        if not k_step and isinstance(grp.gemm, fp4_gemm.QuantLinear) and (
                self.side_stream is None or fp4_gemm.side_rides_along(x, grp.gemm.q)):
            return fp4_gemm.fp4_linear_side(x, grp.gemm.q, grp.gemm.bias, A)
        if self.side_stream is None:  # (CPU tensors: Triton's interpreter)
            return base(x), fp4_gemm.side_linear(x, A)
        main = torch.cuda.current_stream(x.device)
        a = torch.empty(x.shape[0], A.shape[0], dtype=x.dtype, device=x.device)  # (allocated on main)
        self.side_stream.wait_stream(main)
        with torch.cuda.stream(self.side_stream):  # cuBLAS: no split-K counters shared with fp4_gemm's kernels
            torch.matmul(x, A.t(), out=a)
        y = base(x)
        main.wait_stream(self.side_stream)
        return y, a

    def project(self, grp, x, order=NATURAL):
        """A single-linear group (o, down): base GEMM + LoRA, the B product added in place."""
        y, a = self.gemm(grp, x, order)
        if not grp.R:
            return y
        if self.triton:
            M, N = y.shape  # tiles of 16 x 64: at 64 rows of 3584 columns 224 programs, not 112 for 132 SMs
            # (the 64-row step 4.085 -> 4.050 ms, session 30)
            _lora_b_kernel[(triton.cdiv(M, 16), triton.cdiv(N, 64))](y, a, grp.B, M, N, a.shape[1], R=grp.R, BM=16,
                                                                     BN=64, PREC=self.prec, num_warps=4, **self.pdl)
            return y
        return torch.addmm(y, a, grp.B.t())

    def sample(self, logits, st, sp):
        """logits (N, V) → the step's token and logprob into st.out_*, next input st.tok, stop flags."""
        N, V = logits.shape
        greedy = sp.temperature == 0
        inv_t = 1.0 if greedy else 1.0 / sp.temperature
        if self.triton:
            trunc = not greedy and (sp.top_p < 1.0 or sp.top_k > 0)
            thr = truncation_threshold(logits.float() * inv_t, sp.top_p, sp.top_k) if trunc else None
            logits = logits.contiguous()
            _sample_partial_kernel[(N, st.v_split)](
                logits, V, inv_t, thr if trunc else st.sm_m, st.rowkey, st.counters, st.sm_m, st.sm_s, st.sm_best,
                st.sm_idx, st.v_split, CHUNK=st.v_chunk, BLOCK=st.v_block, GREEDY=greedy, TRUNC=trunc, num_warps=4,
                **self.pdl)
            _sample_final_kernel[(N,)](
                logits, V, inv_t, st.sm_m, st.sm_s, st.sm_best, st.sm_idx, st.v_split, st.counters, st.done,
                st.stopped, st.lengths, st.stops, sp.pad_id, st.tok, st.out_tok, st.out_lp, st.S,
                NS_PAD=_pow2(st.v_split), NSTOP=st.stops.numel(), num_warps=1, **self.pdl)
            return
        tok, lp = sample_reference(logits, st.rowkey, st.counters[1], sp.temperature, sp.top_p, sp.top_k)
        done = st.done.bool()
        hit = (tok[:, None] == st.stops[None]).any(-1)
        tok = torch.where(done, sp.pad_id, tok)
        lp = torch.where(done, 0.0, lp)
        step = st.counters[1:]
        st.out_tok.index_copy_(1, step, tok[:, None])
        st.out_lp.index_copy_(1, step, lp[:, None])
        st.tok.copy_(tok)
        st.stopped.copy_(torch.where(hit & ~done, 1, st.stopped))
        st.lengths.copy_(torch.where(done, st.lengths, step + 1))
        st.done.copy_(torch.where(hit, 1, st.done))

    # --- one decode step ------------------------------------------------------------------------

    def step(self, st, sp):
        """Token st.tok of every row in at column counters[0]; one token per row sampled; counters + 1."""
        m = self.model
        x = m.embed_tokens(st.tok)  # (N, H)
        delta = None
        terms = None if self.triton else self.step_terms(st)
        for i, L in enumerate(self.layers):
            to_qkv, to_o, to_gu, to_down = st.x_orders[i]  # how each GEMM's x is stored (x_orders)
            x, h = self.add_rmsnorm(x, delta, L.ln1, to_qkv)
            q = self.rope_write(*self.gemm(L.qkv, h, to_qkv), L.qkv, st, i, terms)  # (N, Hq, D)
            delta = self.project(L.o, self.attention(q, st, i, terms, to_o), to_o)  # (N, H)
            x, h = self.add_rmsnorm(x, delta, L.ln2, to_gu)
            act = self.silu_mul(*self.gemm(L.gu, h, to_gu), L.gu, to_down)  # (N, I)
            delta = self.project(L.down, act, to_down)
        _, h = self.add_rmsnorm(x, delta, m.norm)
        self.sample(m.lm_head(h), st, sp)
        st.counters.add_(1)

    def capture(self, st, sp, key, mid_call=False):
        """Record one step as a CUDA graph (after two eager warm-up steps that compile the kernels). The
        warm-up steps run on rows marked finished (no attention reads) and write their K/V and outputs
        where later steps overwrite them: before a call at cache column 0 and output step 0, mid-call (a
        smaller state's first step, Decoder.shrink) at the current column and step. The counters and the
        row state they change are put back."""
        t0 = time.perf_counter()
        changed = (st.tok, st.done, st.stopped, st.lengths, st.counters)
        kept = [t.clone() for t in changed]
        if not mid_call:
            st.counters.zero_()
        st.done.fill_(1)
        st.host_col = None
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.step(st, sp)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with self.recording(g):
            self.step(st, sp)
        for t, v in zip(changed, kept):
            t.copy_(v)
        torch.cuda.synchronize()
        st.graphs[key] = g
        return time.perf_counter() - t0

    @contextmanager
    def recording(self, graph):
        """Capture into `graph`, from the memory pool that every graph of this decoder allocates from (they
        never run at the same time). The decoder holds the pool (a MemPool), so that it outlives its graphs:
        were the last one dropped (a new stop list, an evicted state), a capture into the same pool would
        trip the allocator. Python's garbage collector is off meanwhile: graphs that it freed mid-capture (a
        decoder in a reference cycle, as when it held its model) would be destroyed, which CUDA forbids while
        a stream captures."""
        if self.pool is None:
            self.pool = torch.cuda.MemPool() if hasattr(torch.cuda, "MemPool") else torch.cuda.graph_pool_handle()
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=getattr(self.pool, "id", self.pool)):
                yield
        finally:
            if collecting:
                gc.enable()

    def state(self, N, S):
        key = (N, S)
        if key in self.states:
            self.states.move_to_end(key)
        else:
            while len(self.states) >= self.max_states:
                self.states.popitem(last=False)
            self.states[key] = _State(self, N, S)
        return self.states[key]

    # --- generation -------------------------------------------------------------------------------

    def prefill(self, st, prompts, n, Lp, sp, graphed=False):
        """Each distinct prompt once (in chunks of ~PREFILL_CHUNK_TOKENS tokens), K/V into its n rows, and the
        first token of every row sampled from its prompt's last logits. Returns how the prompts ran:
        "eager", or where `graphed` (run decides: PREFILL_GRAPH_TOKENS), "captured" (eagerly, then recorded
        as a CUDA graph for the next calls of the shape) or "replayed"."""
        dev = self.device
        P = len(prompts)
        tokens = torch.full((P, Lp), sp.pad_id, dtype=torch.int64)
        for i, p in enumerate(prompts):
            tokens[i, Lp - len(p):] = torch.as_tensor(p, dtype=torch.int64)
        tokens = tokens.to(dev)
        pad = torch.tensor([Lp - len(p) for p in prompts], dtype=torch.int64, device=dev)
        how = "eager"
        if graphed:
            if (P, Lp) in st.prefills:
                st.prefills.move_to_end((P, Lp))
                graph, tokens_in, pad_in, logits = st.prefills[(P, Lp)]
                tokens_in.copy_(tokens)
                pad_in.copy_(pad)
                graph.replay()
                how = "replayed"
            else:  # the eager run compiles every kernel the capture records
                logits = self.prompt_logits(st, tokens, pad, 0, n)
                while len(st.prefills) >= 8:  # the 8 latest shapes (their memory is the pool's, shared)
                    st.prefills.popitem(last=False)
                st.prefills[(P, Lp)] = self.capture_prefill(st, tokens, pad, n)
                how = "captured"
        else:
            chunk = max(1, PREFILL_CHUNK_TOKENS // Lp)
            logits = torch.cat([self.prompt_logits(st, tokens[c0:c0 + chunk], pad[c0:c0 + chunk], c0 * n, n)
                                for c0 in range(0, P, chunk)])  # (P, V)
        st.pad.copy_(pad.repeat_interleave(n))
        st.counters.zero_()  # sampling output step 0
        self.sample(logits.repeat_interleave(n, 0) if n > 1 else logits, st, sp)
        st.counters.copy_(torch.tensor([Lp, 1], device=dev))
        return how

    def prompt_logits(self, st, tokens, pad, row0, n):
        """The last logits (p, V) of prompts tokens (p, Lp) left-padded by pad (p,); their K/V into the n
        cache rows of each, from row row0 on."""
        cache = _PrefillCache(st, row0, n, pad, tokens.shape[1])
        return self.model.lm_head(self.prompt_hidden(tokens, cache))

    def capture_prefill(self, st, tokens, pad, n):
        """prompt_logits for this shape recorded as a CUDA graph: (graph, its inputs tokens and pad, its
        logits). Its memory comes from the decode graphs' pool, where it reuses what they free."""
        inputs = tokens.clone(), pad.clone()
        graph = torch.cuda.CUDAGraph()
        with self.recording(graph):
            logits = self.prompt_logits(st, *inputs, 0, n)
        return (graph, *inputs, logits)

    def prompt_hidden(self, tokens, cache):
        """The final-normed hidden state at the last position of each prompt, tokens (P, T) → (P, H): the
        model's forward (Transformer.hidden) through the decode step's ops (q|k|v and gate|up one GEMM each,
        the LoRA adapters side by side; the residual add fused with the norm, the rotary embedding with the
        cache write), which cost half as many launches and host calls as the model's seven linears and their
        adapters and fewer passes over the activations (8-64 prompts of 256 tokens, 7B on the H200: 11-13%
        less time than with the model's norms, adds and rotary embedding); `cache` attends over the prompts
        and keeps their K/V."""
        m = self.model
        P, T = tokens.shape
        x, delta = m.embed_tokens(tokens).flatten(0, 1), None  # (P·T, H)
        for i, L in enumerate(self.layers):
            x, h = self.add_rmsnorm(x, delta, L.ln1)
            q = self.prompt_rope_write(*self.gemm(L.qkv, h), L.qkv, cache, i)  # (P, Hq, T, D)
            delta = self.project(L.o, cache.attend(i, q))
            x, h = self.add_rmsnorm(x, delta, L.ln2)
            act = self.silu_mul(*self.gemm(L.gu, h), L.gu)  # (P·T, I)
            delta = self.project(L.down, act)
        last = lambda t: t.view(P, T, -1)[:, -1]
        return m.norm(last(x) + last(delta))

    @torch.no_grad()
    def run(self, prompts, n, max_new_tokens, sp, seed, stream=None, check_every=16, compact=True):
        P, dev = len(prompts), self.device
        N = P * n
        Lp = max(len(p) for p in prompts)
        bucket = PREFILL_BUCKET * math.ceil(Lp / PREFILL_BUCKET)
        graphed_prefill = self.graphs and P * bucket <= PREFILL_GRAPH_TOKENS
        if graphed_prefill:  # nearby prompt lengths share one prefill graph
            Lp = bucket
        S = 128 * math.ceil((Lp + max_new_tokens) / 128)  # rounded so that later calls reuse the graphs
        st = self.state(N, S)
        nstop = max(16, _pow2(len(sp.stop_ids)))
        if st.stops.numel() != nstop:
            st.stops = torch.full((nstop,), -1, dtype=torch.int64, device=dev)
            st.graphs.clear()
            st.subs.clear()  # (they read the stop list they were made with)
        st.n = n if SHARE_PROMPTS else 1  # rows that share their prompt (the attention launches depend on it)
        st.shared.fill_(Lp if st.n > 1 else 0)
        key = (sp.temperature, sp.top_p, sp.top_k, sp.pad_id, st.n)
        for L in self.layers:
            for grp in L.groups:
                grp.refresh()
        stats = dict(kernels="triton" if self.triton else "torch", graphs=False, capture_s=0.0, rows=N,
                     prefill_rows=P, prompt_len=Lp, cache_columns=S)
        graph = None
        if self.graphs:
            if key not in st.graphs:
                stats["capture_s"] = self.capture(st, sp, key)
            graph = st.graphs[key]
            stats["graphs"] = True
        # reset the per-call state
        st.stops.fill_(-1)
        if sp.stop_ids:
            st.stops[: len(sp.stop_ids)] = torch.tensor(sorted(sp.stop_ids), dtype=torch.int64, device=dev)
        st.done.zero_()
        st.stopped.zero_()
        st.lengths.zero_()
        st.out_tok.fill_(sp.pad_id)
        st.out_lp.zero_()
        st.rowkey.copy_(row_keys(seed, torch.arange(N)).to(dev))
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        stats["prefill"] = self.prefill(st, prompts, n, Lp, sp, graphed=graphed_prefill)
        sync()
        t1 = time.perf_counter()
        steps = 1
        if stream is not None:
            stream(0, st.out_tok[:, 0].cpu())
        root, order, shrinks = st, torch.arange(N), []  # order: the call's row that each of root's rows holds
        for t in range(1, max_new_tokens):
            if graph is not None:
                graph.replay()
            else:
                st.host_col = Lp + t - 1
                self.step(st, sp)
                st.host_col = None
            steps += 1
            if stream is not None:
                stream(t, st.out_tok[:, t].cpu())
            if sp.stop_ids and (stream is not None or graph is None or t % check_every == 0):
                done = st.done.bool().cpu()
                if bool(done.all()):
                    break
                if compact and stream is None and max_new_tokens - 1 - t >= check_every:
                    smaller, capture_s = self.shrink(root, st, order, done, Lp + t, sp, key)
                    if smaller is not st:
                        st = smaller
                        graph = st.graphs.get((*key[:-1], st.n)) if self.graphs else None
                        shrinks.append((t, st.N))
                        stats["capture_s"] += capture_s
        sync()
        t2 = time.perf_counter()
        back = torch.argsort(order).to(dev) if shrinks else slice(None)  # the call's row r is root's row back[r]
        lengths = root.lengths[back].clone()
        T = max(1, int(lengths.max()))
        stopped = root.stopped[back].tolist()
        stats.update(prefill_s=t1 - t0, decode_s=t2 - t1, steps=steps, shrinks=shrinks)
        return Rollout(tokens=root.out_tok[back, :T].clone(), logprobs=root.out_lp[back, :T].clone(), lengths=lengths,
                       finish=["stop" if s else "length" for s in stopped],
                       prompt_index=torch.arange(P, device=dev).repeat_interleave(n), stats=stats)

    def shrink(self, root, st, order, done, column, sp, key):
        """Finished rows stop costing GEMM rows: if st's live rows (done: st's flags, on the host) fit in at
        most half of its rows, rounded up to a power of two, move them to the front of root's rows (their
        K/V up to `column`, the next step's) and return the smaller state of root over them (_State with a
        parent; its step's graph captured the first time) and the seconds that capture took; otherwise st
        and 0. A row keeps its row key, so it samples the same noise in any state. order (root's rows:
        which row of the call each holds) moves along."""
        live = (~done).nonzero()[:, 0]
        N2 = _pow2(live.numel())
        if N2 > st.N // 2:
            return st, 0.0
        keep = torch.cat([live, done.nonzero()[:, 0]])  # st's rows, the live ones first, then the finished
        on_dev = keep.to(self.device)
        for name in _State.ROW_TENSORS:  # the finished rows' outputs are kept, behind the live rows
            t = getattr(st, name)
            t.copy_(t[on_dev])
        rows = on_dev[: live.numel()]
        for cache in (root.k, root.v):
            for layer in range(cache.shape[0]):  # (a layer at a time: the gather's copy stays small)
                cache[layer, : rows.numel(), :, :column] = cache[layer, rows, :, :column]
        order[: st.N] = order[: st.N][keep]
        sub = root.subs.get(N2)
        if sub is None:
            sub = root.subs[N2] = _State(self, N2, root.S, parent=root)
        key = (*key[:-1], sub.n)
        capture_s = self.capture(sub, sp, key, mid_call=True) if self.graphs and key not in sub.graphs else 0.0
        return sub, capture_s


def _fingerprint(model):
    """Addresses of every base tensor the decoder depends on: if any moved (weights reloaded, the
    model moved, a norm weight replaced instead of updated in place), the decoder is rebuilt."""
    return tuple((n, t.data_ptr()) for n, t in list(model.named_parameters()) + list(model.named_buffers())
                 if ".lora_" not in n)


def _decoder(model, kernels, graphs):
    dec = model.__dict__.get("_rollout_decoder")
    if dec is None or dec.opts != (kernels, graphs) or dec.fingerprint != _fingerprint(model) \
            or dec.device != model.device or dec.dtype != model.dtype:
        release(model)
        dec = Decoder(model, kernels, graphs)
        model.__dict__["_rollout_decoder"] = dec
    return dec


def release(model):
    """Drop the decoder generate() keeps on `model` (KV caches, CUDA graphs, LoRA buffers)."""
    dec = model.__dict__.pop("_rollout_decoder", None)
    if dec is not None and model.device.type == "cuda":
        del dec
        torch.cuda.empty_cache()


def generate(model, prompts, *, n=1, max_new_tokens=256, temperature=1.0, top_p=1.0, top_k=0, stop_ids=(),
             seed=None, pad_id=0, kernels="auto", graphs="auto", stream=None, compact=True):
    """Sample n completions of each prompt (lists of token ids) → Rollout (see its docstring).

    temperature 0 is greedy; top_p / top_k truncate the sampling set (the logprobs stay those of the
    untruncated softmax(logits / temperature)); stop_ids end a row (the stop token is kept); seed
    makes the call reproducible (None: drawn from torch's global RNG). kernels: "triton" (default on
    CUDA) or "torch" (default elsewhere); graphs: CUDA graphs for the decode step and short prefills
    (PREFILL_GRAPH_TOKENS; default on CUDA, True only there).
    stream(step, tokens (N,)) is called after every step (it forces a sync per step). compact: as rows
    finish, the live ones move into a state of half the rows or fewer (Decoder.shrink; not with stream)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs at least one prompt, and every prompt at least one token")
    if n < 1 or max_new_tokens < 1:
        raise ValueError(f"n and max_new_tokens must be >= 1, got n={n}, max_new_tokens={max_new_tokens}")
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
        raise ValueError(f"need temperature >= 0, 0 < top_p <= 1, top_k >= 0; got {temperature}, {top_p}, {top_k}")
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)))
    sp = SimpleNamespace(temperature=float(temperature), top_p=float(top_p), top_k=int(top_k),
                         stop_ids=tuple(int(s) for s in stop_ids), pad_id=int(pad_id))
    was_training = model.training
    model.eval()
    try:
        return _decoder(model, kernels, graphs).run([list(p) for p in prompts], n, max_new_tokens, sp, int(seed), stream,
                                                    compact=compact)
    finally:
        model.train(was_training)


# ---------------------------------------------------------------------------------------------
# Benchmark and CLI
# ---------------------------------------------------------------------------------------------

def _add_lora(model, rank, seed=0):
    """LoRA rank `rank` on all seven projections, with nonzero B (B = 0 would still cost the same, but
    a nonzero adapter proves the step really adds it)."""
    lora.apply_lora(model, rank=rank, alpha=2 * rank, dtype=torch.float32)
    gen = torch.Generator(device=model.device).manual_seed(seed)
    with torch.no_grad():
        for m in lora.lora_modules(model).values():
            m.lora_B.weight.normal_(0, 1e-3, generator=gen)


def random_stop_ids(vocab, mean_len, gen):
    """A stop list that ends a random-weights rollout's rows after ~mean_len tokens on average: such a model
    picks nearly uniform tokens, so vocab / mean_len random ids (drawn with `gen`) end a row with that
    chance a token, geometrically (a long tail, as real completions have). For the benchmarks."""
    return torch.randperm(vocab, generator=gen)[: max(1, round(vocab / mean_len))].tolist()


def mean_length(text):
    """argparse type of --early-stop: a mean completion length in tokens (>= 1), or 0 for none."""
    value = float(text)
    if value and value < 1:
        raise argparse.ArgumentTypeError(f"a mean completion length in tokens (>= 1), or 0 for none; got {value:g}")
    return value


def _bench_one(model, batch, prompt_len, new_tokens, seed, **kw):
    V = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, V, (batch, prompt_len), generator=gen).tolist()
    warm = generate(model, prompts, max_new_tokens=new_tokens, stop_ids=(), seed=seed, **kw)  # compile + capture
    r = generate(model, prompts, max_new_tokens=new_tokens, stop_ids=(), seed=seed + 1, **kw)
    s = r.stats
    assert int(r.lengths.min()) == new_tokens, "a row stopped early in the forced-length benchmark"
    return dict(batch=batch, tok_s=batch * new_tokens / (s["prefill_s"] + s["decode_s"]),
                ms_step=1e3 * s["decode_s"] / max(1, s["steps"] - 1), prefill_ms=1e3 * s["prefill_s"],
                prefill=s["prefill"], first_prefill_ms=1e3 * warm.stats["prefill_s"], capture_s=warm.stats["capture_s"],
                graphs=s["graphs"], kernels=s["kernels"])


def _bench_early_stop(model, batch, prompt_len, new_tokens, mean_len, seed, rounds=3, **kw):
    """Rows that stop after ~mean_len tokens on average (random_stop_ids). The same `rounds` rollouts (seeds)
    with and without moving the live rows into
    smaller states (generate's compact), each timed after a first call with its seed, which compiles and
    captures what that rollout needs. How long a rollout runs is set by its longest row, which differs
    between the two ways (their GEMMs of fewer rows round differently, and a near-tie flips): the rounds
    average some of that out. Returns {compact: totals over the rounds}."""
    V = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, V, (batch, prompt_len), generator=gen).tolist()
    stops = random_stop_ids(V, mean_len, gen)
    res = {}
    for compact in (False, True):
        def rollouts():
            return [generate(model, prompts, max_new_tokens=new_tokens, stop_ids=stops, seed=seed + 1 + i,
                             compact=compact, **kw) for i in range(rounds)]
        rollouts()  # compiles and captures
        rs = rollouts()
        secs = sum(r.stats["prefill_s"] + r.stats["decode_s"] for r in rs)
        lengths = torch.cat([r.lengths.cpu() for r in rs])
        res[compact] = dict(s=secs / rounds, tok_s=int(lengths.sum()) / secs, steps=[r.stats["steps"] for r in rs],
                            shrinks=rs[0].stats["shrinks"], mean=float(lengths.float().mean()),
                            longest=[int(r.lengths.max()) for r in rs], stopped=sum(r.finish.count("stop") for r in rs))
    return res


def _check(model):
    """On the GPU, at the real shape: the graphed Triton step against the eager torch step (same seed)
    and both against one full forward pass over the finished sequences (with fp4_gemm's kernels and
    with its torch reference path); for an NVFP4 model also the fused q|k|v GEMM against the separate
    layers and the dequantized reference. Returns lines to print."""
    V = model.config.vocab_size
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, V, (n,), generator=gen).tolist() for n in (37, 100, 5)]
    kw = dict(n=2, max_new_tokens=48, temperature=1.0, top_p=0.95, seed=3)
    fast = generate(model, prompts, **kw)
    ref = generate(model, prompts, kernels="torch", graphs=False, **kw)
    release(model)
    lines = [f"check: graphed Triton step vs eager torch step, same seed: "
             f"{100 * (fast.tokens == ref.tokens).float().mean().item():.1f}% of tokens equal"]

    def full_lp(r, backend):
        out = []
        for i in range(r.tokens.shape[0]):
            comp, p = r.tokens[i, : int(r.lengths[i])].tolist(), prompts[i // 2]
            with torch.no_grad(), fp4_gemm.backend(backend):
                z = model(torch.tensor([p + comp], device=model.device))[0, len(p) - 1: len(p) - 1 + len(comp)].float()
            out.append(torch.log_softmax(z, -1).gather(1, torch.tensor(comp, device=z.device)[:, None])[:, 0])
        return out

    for name, r in (("graphed Triton", fast), ("eager torch", ref)):
        for backend in ("auto", "torch"):
            d = [(r.logprobs[i, : len(x)] - x).abs() for i, x in enumerate(full_lp(r, backend))]
            first, rest = torch.stack([x[0] for x in d]), torch.cat([x[1:] for x in d])
            lines.append(f"    {name} step vs full forward (fp4 backend {backend}): |dlogprob| first token "
                         f"mean {first.mean():.2e}, later tokens mean {rest.mean():.2e} max {rest.max():.2e}")
    att = model.layers[0].self_attn
    mods = [getattr(att, n) for n in ("q_proj", "k_proj", "v_proj")]
    bases = [m.base if isinstance(m, lora.LoRALinear) else m for m in mods]
    if all(isinstance(b, fp4_gemm.QuantLinear) for b in bases):
        fused = fp4_gemm.QuantLinear.concat(bases)
        w = torch.cat([b.dequantized_weight(torch.float32) for b in bases])  # (N, K)
        bias = torch.cat([b.bias.float() for b in bases]) if bases[0].bias is not None else 0
        for M in (1, 6, 64, 300, 2048):
            x = torch.randn(M, w.shape[1], device=w.device, dtype=model.dtype)
            y = x.float() @ w.t() + bias
            err = lambda t: ((t.float() - y).norm() / y.norm()).item()
            with torch.no_grad():
                sep = torch.cat([b(x) for b in bases], -1)
                lines.append(f"    fp4 layer-0 q|k|v, M={M}: rel err fused {err(fused(x)):.1e}, separate {err(sep):.1e}")
    return "\n".join(lines)


def _step_bytes(model):
    """Bytes one decode step must read at least: every weight the step touches once (embeddings:
    one row, ignored), LoRA adapters in the model dtype."""
    n = 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.startswith("embed_tokens") and not model.config.tie_word_embeddings:
            continue
        n += t.numel() * (model.dtype.itemsize if ".lora_" in name else t.element_size())
    return n


def _profile(model, batch, prompt_len, steps=4):
    """GPU time per kernel over a few eager decode steps (prefill excluded), grouped: where a step goes."""
    from torch.profiler import ProfilerActivity, profile

    V = model.config.vocab_size
    prompts = torch.randint(0, V, (batch, prompt_len), generator=torch.Generator().manual_seed(0)).tolist()
    generate(model, prompts, max_new_tokens=2, graphs=False, stop_ids=(), seed=0)  # compiles; leaves a filled cache
    dec = model.__dict__["_rollout_decoder"]
    st = next(reversed(dec.states.values()))
    sp = SimpleNamespace(temperature=1.0, top_p=1.0, top_k=0, pad_id=0, stop_ids=())
    with torch.no_grad():
        dec.step(st, sp)  # continue the rollout eagerly, one step outside the profile
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                dec.step(st, sp)
            torch.cuda.synchronize()
    groups = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t <= 0 or e.key.startswith(("Memcpy", "Memset")) or "aten::" in e.key:
            continue
        k = e.key
        name = ("fp4 gemm" if k.startswith(("_mma_kernel", "_wgmma_kernel", "_wgmma_ws_kernel", "_gemv_kernel",
                                            "_tiled_kernel", "_splitk_reduce", "_dequant_kernel")) else
                "fp4 gemm: x in K order" if k.startswith("_k_order_kernel") else
                "LoRA A (small_linear)" if k.startswith("_small_kernel") else
                "attention" if "_attn_" in k else "rope+write" if "rope" in k else "silu_mul" if "silu" in k else
                "add_rmsnorm" if "rmsnorm" in k else "sampler" if "sample" in k else "LoRA B" if "lora_b" in k else
                "cuBLAS (lm_head, LoRA, bf16 base)" if "gemm" in k.lower() or "gemv" in k.lower() or "cutlass" in k
                or "sm90" in k or "xmma" in k else "cuBLAS split-K reduces" if "splitKreduce" in k
                else "other: " + k[:40])
        g = groups.setdefault(name, [0.0, 0])
        g[0] += t / steps / 1e3
        g[1] += e.count / steps
    total = sum(v[0] for v in groups.values())
    lines = [f"profile batch {batch}: kernel time per step {total:.3f} ms in {sum(v[1] for v in groups.values()):.0f} launches"]
    for k, (ms, c) in sorted(groups.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"    {k:<40} {ms:7.3f} ms  {c:5.0f} launches")
    return "\n".join(lines)


def bench(args):
    """The issue's table: Qwen2.5-7B shape (random weights), prompt 256, 512 new tokens forced,
    NVFP4 + LoRA r32 (unmerged) vs bf16 + the same LoRA, batch 1/8/64; then 32B NVFP4 batch 1."""
    import gc

    import aqn

    if not torch.cuda.is_available():
        raise SystemExit("rollout.py --bench needs a CUDA GPU")
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    print(f"# {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}, "
          f"triton {triton.__version__ if triton else None}")
    print(f"# prompt {args.prompt_len} tokens, {args.new_tokens} new tokens forced, LoRA rank {args.rank} "
          f"unmerged on q,k,v,o,gate,up,down, AQN sigma {args.aqn_sigma:g} on the decoder norms", flush=True)
    rows, notes = [], []
    models = [("7b", q) for q in args.quants] + ([("32b", "nvfp4")] if args.big else [])
    for size, quant in models:
        gc.collect()
        torch.cuda.empty_cache()
        t0 = time.perf_counter()
        model = Transformer.from_random(qwen25_config(size), torch.bfloat16, dev, quantize=quant == "nvfp4", seed=0)
        _add_lora(model, args.rank)
        torch.cuda.synchronize()
        step_gb = _step_bytes(model) / 1e9
        floor = step_gb / 4.24  # ms: GB / (TB/s)
        print(f"# built {size} {quant} + LoRA in {time.perf_counter() - t0:.1f} s, "
              f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB; a step reads >= {step_gb:.2f} GB "
              f"of weights: floor {floor:.2f} ms at 4.24 TB/s", flush=True)
        notes.append(f"{size} {quant}: weights read per step {step_gb:.2f} GB, floor {floor:.2f} ms/step")
        runs = [(b, {}) for b in (args.batches if size == "7b" else [1])]
        if args.variants and (size, quant) == ("7b", "nvfp4"):
            runs += [(1, dict(graphs=False)), (1, dict(kernels="torch")), (64, dict(kernels="torch"))]
        with aqn.noise(model, args.aqn_sigma, torch.Generator(dev).manual_seed(0)):
            if args.check and size == "7b":
                try:
                    line = f"{size} {quant} {_check(model)}"
                except Exception as e:
                    line = f"{size} {quant} check failed: {type(e).__name__}: {e}"
                print(line, flush=True)
                notes.append(line)
            for batch, kw in runs:
                kw = {"kernels": args.kernels, "graphs": args.graphs, **kw}
                tokens = args.new_tokens if kw["graphs"] is not False else 64  # eager is slow: fewer steps
                try:
                    res = _bench_one(model, batch, args.prompt_len, tokens, seed=batch, **kw)
                except Exception as e:  # keep the rest of the table
                    line = f"{size} {quant} batch {batch} {kw} failed: {type(e).__name__}: {e}"
                    print(line, flush=True)
                    notes.append(line)
                    continue
                res.update(size=size, quant=quant)
                line = (f"{size:>4} {quant:>6} batch {batch:>3}: {res['tok_s']:9.0f} tok/s  decode {res['ms_step']:6.2f} "
                        f"ms/step  prefill {res['prefill_ms']:7.1f} ms ({res['prefill']}; the shape's first "
                        f"{res['first_prefill_ms']:.0f})  compile+capture {res['capture_s']:.1f} s  "
                        f"(kernels {res['kernels']}, graphs {res['graphs']})")
                print(line, flush=True)
                if kw == {"kernels": args.kernels, "graphs": args.graphs}:
                    rows.append(res)
                else:
                    notes.append("variant " + line)
            for batch in (args.batches if args.early_stop and size == "7b" else []):
                kw = {"kernels": args.kernels, "graphs": args.graphs}
                r = _bench_early_stop(model, batch, args.prompt_len, args.new_tokens, args.early_stop, seed=batch, **kw)
                off, on = r[False], r[True]
                how = lambda x: (f"{x['s']:.2f} s a rollout ({x['tok_s']:.0f} tok/s; {x['stopped']} rows stopped, mean "
                                 f"{x['mean']:.0f} tokens, longest {x['longest']}, steps {x['steps']})")
                line = (f"{size:>4} {quant:>6} batch {batch:>3}, rows stopping early, {len(off['steps'])} rollouts each "
                        f"way: {how(off)} as one batch, {how(on)} moving the live rows to fewer (the first: after "
                        f"step, rows {on['shrinks']}): {on['tok_s'] / off['tok_s']:.2f}x the tok/s")
                print(line, flush=True)
                notes.append(line)
            if args.profile and (size, quant) == ("7b", "nvfp4"):
                for b in args.profile:
                    try:
                        line = f"{size} {quant} " + _profile(model, b, args.prompt_len)
                    except Exception as e:
                        line = f"{size} {quant} profile failed: {type(e).__name__}: {e}"
                    print(line, flush=True)
                    notes.append(line)
        release(model)
        del model
    table = _table(rows)
    print(table)
    if args.bench_out:
        with open(args.bench_out, "w") as f:
            f.write(table + "\n\n" + "\n".join(notes) + "\n")
    return rows


def _table(rows):
    by = {(r["size"], r["quant"], r["batch"]): r for r in rows}
    lines = ["| model | batch | NVFP4+LoRA tok/s | ms/step | bf16+LoRA tok/s | ms/step | NVFP4 / bf16 |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for size in ("7b", "32b"):
        for b in sorted({r["batch"] for r in rows if r["size"] == size}):
            f4, bf = by.get((size, "nvfp4", b)), by.get((size, "bf16", b))
            cell = lambda r, k, fmt: format(r[k], fmt) if r else "-"
            ratio = f"{f4['tok_s'] / bf['tok_s']:.2f}x" if f4 and bf else "-"
            lines.append(f"| Qwen2.5-{size.upper()} shape | {b} | {cell(f4, 'tok_s', '.0f')} | {cell(f4, 'ms_step', '.2f')} "
                         f"| {cell(bf, 'tok_s', '.0f')} | {cell(bf, 'ms_step', '.2f')} | {ratio} |")
    return "\n".join(lines)


def chat(args):
    """Stream one sampled answer to --prompt through the checkpoint's chat template."""
    dev = resolve_device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    with stop_on_bad_input("rollout.py"):  # a missing model, or one of an architecture this decoder lacks
        folder = read_config(args.model)[0]
    tok = load_tokenizer(folder)
    model = Transformer.from_pretrained(folder, dtype=dtype, device=dev, quantize=args.quant == "nvfp4")
    ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    stops = set(stop_token_ids(tok))  # the same turn ends as eval.py and train.py use
    print(f"# {args.model} ({args.quant}) on {dev}: {len(ids)} prompt tokens, up to {args.max_new_tokens} new, "
          f"temperature {args.temperature}, top_p {args.top_p}", file=sys.stderr)
    out, shown = [], ""

    def show(step, toks):
        nonlocal shown
        t = int(toks[0])
        if t in stops:
            return
        out.append(t)
        text = tok.decode(out, skip_special_tokens=True)
        print(text[len(shown):], end="", flush=True)
        shown = text

    r = generate(model, [ids], max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                 top_k=args.top_k, stop_ids=sorted(stops), seed=args.seed, pad_id=tok.pad_token_id or 0, stream=show)
    s = r.stats
    print(f"\n# {int(r.lengths[0])} tokens ({r.finish[0]}), prefill {1e3 * s['prefill_s']:.0f} ms, "
          f"decode {int(r.lengths[0]) / max(s['decode_s'], 1e-9):.0f} tok/s", file=sys.stderr)


def main(argv=None):
    p = argparse.ArgumentParser(description="Sample from a model with the KV-cached rollout sampler, or benchmark it.")
    p.add_argument("--model", help="HF folder, alias (qwen2.5-7b, tiny) or hub id, for --prompt")
    p.add_argument("--prompt", help="a user message; the answer is streamed through the chat template")
    p.add_argument("--quant", choices=("nvfp4", "bf16"), default="bf16", help="quantize the base to NVFP4 on load")
    p.add_argument("--max-new-tokens", type=int, default=256, help="most tokens to generate")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (0 = greedy)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = all)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--bench", action="store_true", help="print the H200 benchmark table (needs a GPU)")
    p.add_argument("--bench-out", default=None, help="also write the benchmark table (markdown) here")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64], help="benchmark batch sizes")
    p.add_argument("--quants", nargs="+", default=["nvfp4", "bf16"], help="benchmark base formats")
    p.add_argument("--no-big", dest="big", action="store_false", help="skip the 32B NVFP4 batch-1 row")
    p.add_argument("--prompt-len", type=int, default=256, help="benchmark prompt tokens")
    p.add_argument("--new-tokens", type=int, default=512, help="benchmark new tokens (forced, no stop)")
    p.add_argument("--rank", type=int, default=32, help="benchmark LoRA rank")
    p.add_argument("--aqn-sigma", type=float, default=1e-2, help="benchmark AQN noise sigma on the norm weights")
    p.add_argument("--kernels", default="auto", choices=("auto", "triton", "torch"), help="fused ops: Triton or torch")
    p.add_argument("--graphs", default="auto", choices=("auto", "on", "off"), help="CUDA graphs for the decode step and short prefills")
    p.add_argument("--check", action="store_true", help="benchmark: first check the GPU step against eager torch and a full forward")
    p.add_argument("--profile", type=int, nargs="*", default=[], help="benchmark: kernel-time profile at these batches")
    p.add_argument("--variants", action="store_true", help="benchmark: also time eager (no graphs) and torch-op steps")
    p.add_argument("--early-stop", type=mean_length, default=0, metavar="MEAN",
                   help="benchmark: also time rollouts whose rows stop after ~MEAN tokens on average (up to "
                        "--new-tokens), as one batch and moving the live rows into smaller states")
    args = p.parse_args(argv)
    args.graphs = {"auto": "auto", "on": True, "off": False}[args.graphs]
    if args.bench:
        return bench(args)
    if not (args.model and args.prompt):
        p.error("pass --model and --prompt (or --bench)")
    return chat(args)


if __name__ == "__main__":
    main()
