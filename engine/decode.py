"""The decode engine: rollout.generate on a CUDA GPU, pushed toward the memory-bandwidth floor.

Speeds up: rollout.py's sampler (`rollout.sample`), which it computes exactly: the same cache layout
(left-padded prompts, every row at the same column), the same prefill of each distinct prompt once,
the same counter-based Gumbel sampler (rollout.sample_reference, here inside a Triton kernel), the same
stops and finished rows. Tested against it: tests/engine/test_decode.py (greedy tokens equal, logprobs
within 1e-4 in fp32, the same seeded samples). Measurements: results/rollout_h200.md.

Decoding one token for B sequences reads every weight once and does ~2 FLOPs per weight per sequence,
so up to B ~ 100 a step is memory-bound: its floor is bytes / bandwidth, and everything else (kernel
launches, Python, reading the cache's padding) is overhead to remove. What this file adds to the plain
loop:

- One decode step is one CUDA graph (Decoder.capture). Everything in it reads fixed addresses: the
  token buffer, the counters (current column and step), the cache, the sampler's outputs. The host
  replays it max_new_tokens − 1 times and looks at the device only every few steps.
- Per layer, linears that read the same input are one GEMM (q|k|v, gate|up: _Group, their weights
  stacked once, the model's linears keeping views of the rows), their LoRA A's side by side, and the
  small ops between the GEMMs fused into Triton kernels (engine/decode_kernels.py): residual add +
  RMSNorm, LoRA B + rotary embedding + K/V write, LoRA B + SiLU·up, LoRA B of o and down in place.
- Attention reads only the columns present (split-K over chunks that follow the current column, then a
  combine); a finished row reads none of its own columns; a group's shared prompt is read once, from its
  first row, for all its samples (SHARED_HEADS query heads a program), whether or not they have finished.
- The sampler runs in the graph (split over the vocabulary, then a merge), with the row bookkeeping.
- Programmatic dependent launch (engine/pdl.py) overlaps each kernel's launch with the one before;
  the ops before a warp-specialized wgmma GEMM store x in its K order (engine/korder.py); LoRA A
  products ride in the mma GEMM's launch (engine/side.py) or run beside the GEMM on a second stream
  (Decoder.gemm).
- As rows finish, the live ones move into a state of half the rows or fewer, with its own graph
  (Decoder.shrink), captured with the full state's; a row keeps its row key and so its draws.
- A short prefill replays a CUDA graph per (prompts, padded length) shape (PREFILL_GRAPH_TOKENS).

An option, off by default (generate's kv_cache="fp8", train.py --fp8-kv): the cache in E4M3 with a float32
scale a (row, kv head, column), rollout.KVCache's form: about half the cache's bytes, so more rows a call
(its speed: results/fp8_kv.md). The K/V write quantizes (_rope_write_kernel), and the attention multiplies
each column's scale in where it factors out: a key's into the column's scores, a value's into its softmax
weight (_attn_part).

LoRA stays unmerged: its A's and B's are copied at the start of every call, in the model's dtype with
alpha/r folded into B, into buffers the graph reads. AQN (aqn.py) perturbs the RMSNorm weights in place;
the step reads them where they live. Every fused op keeps its torch form next to its kernel launch
(kernels="torch"), which the tests run against the kernels under Triton's interpreter. `release(model)`
(rollout.py) drops the caches and graphs.
"""
import gc
import math
import time
import weakref
from collections import OrderedDict
from contextlib import contextmanager
from functools import cached_property

import torch
import torch.nn as nn
import torch.nn.functional as F
import triton

import fp4_gemm
import lora
import memory
import rollout
from engine.decode_kernels import (_add_rmsnorm_kernel, _attn_combine_kernel, _attn_partial_kernel, _lora_b_kernel,
                                   _rope_write_kernel, _sample_final_kernel, _sample_partial_kernel, _silu_mul_kernel)
from engine.korder import fp4_linear_k_ordered, wgmma_k_order, x_k_order
from engine.pdl import pdl_opts
from engine.side import fp4_linear_side, side_linear, side_rides_along
from model import apply_rope

# query heads (rows of a group x heads of a kv head) one program takes over a shared prompt (64 spills
# registers; results/rollout_h200.md)
SHARED_HEADS = 32
# A prefill of at most this many prompt tokens (prompts x padded length) is bound by the host, or its time
# swings with the host's (eagerly, a short prefill takes several times its GPU work: results/rollout_h200.md),
# so on the GPU it runs as a CUDA graph, one per (prompts, length) shape; its length is rounded up to a
# multiple of PREFILL_BUCKET so that prompts of nearby lengths share a graph. Larger prefills keep the GPU
# busy eagerly. 0: always eager.
PREFILL_GRAPH_TOKENS = 2048
PREFILL_BUCKET = memory.PROMPT_BUCKET
# The sampler splits each row's vocabulary into chunks of whole blocks of 1024 logits, about this many programs
# an SM over all rows (a program walks its chunk block by block, so fewer, longer chunks are a longer chain;
# 8 against 2: 0.4-0.6% off a step at 32-64 rows, the same at 1-8: results/engine_floor_h100.md)
SAMPLE_PER_SM = 8
# An eager prefill runs this many prompt tokens at a time at most (whole prompts), so that its activations
# (a gate|up output of 16384 tokens is 1.2 GB for a 7B model) stay a small part of the memory
PREFILL_CHUNK_TOKENS = 16384


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
    return t[:, wgmma_k_order(t.shape[1], k_step, t.device)] if k_step else t


def _pow2(x):
    return 1 << max(0, math.ceil(math.log2(max(1, x))))


def _attn_per_sm(stages, D, itemsize):
    """Programs of _attn_partial_kernel an SM holds at `stages` pipeline stages: Triton keeps stages - 1
    blocks of 64 columns of K and of V in shared memory, plus ~6 KB of its own (read off the compiled
    kernel: results/rollout_h200.md), and the GPU reserves 1 KB for every block; 8 KB a program covers
    both with some margin. itemsize: the bytes a cached value takes (2, or 1 for the FP8 cache). An SM has
    228 KB: at D = 128 in bf16, 5, 3 or 2 programs; in E4M3, 9, 5 or 4. Registers are not counted: they
    allow 5 programs without a shared prompt but 2 with one (the larger tile over it), and capping them so
    that 4 fit made no step faster (results/engine_floor_h100.md)."""
    return 228 * 1024 // ((stages - 1) * 2 * 64 * D * itemsize + 8 * 1024)


def _attn_grid(pairs, S, sms, D, itemsize):
    """(split, num_stages) of _attn_partial_kernel for `pairs` (row, kv head) programs of a split each
    over at most S columns. The split: about 2 programs an SM, at most one per 64 columns. Then the
    deepest pipeline (4, 3 or 2 stages) under which the whole grid fits on the GPU at once: a deeper
    one keeps more loads in flight, but a grid that does not fit runs a second wave, which costs more.
    Where a split of 2 or more still fits at 4 stages it is cut to what fits. (Each choice against the
    others it beat: results/rollout_h200.md.)"""
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
            self.k_step, self.k_order = k_step, wgmma_k_order(self.A.shape[1], k_step, self.A.device)
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
            for name in dec.cache_tensors:  # (L, N, Hkv, S, D) and (L, N, Hkv, S); each layer's is contiguous
                setattr(self, name, getattr(parent, name)[:, :N])
            for name in self.ROW_TENSORS:
                setattr(self, name, getattr(parent, name)[:N])
            self.counters, self.stops, self.cos, self.sin = parent.counters, parent.stops, parent.cos, parent.sin
        else:
            # zeros, not empty: the torch attention multiplies masked garbage by 0, and 0 * NaN is NaN
            stored = torch.float8_e4m3fn if dec.kv_fp8 else dt
            self.k = torch.zeros(L, N, Hkv, S, D, dtype=stored, device=dev)  # (L, N, Hkv, S, D)
            self.v = torch.zeros(L, N, Hkv, S, D, dtype=stored, device=dev)
            if dec.kv_fp8:  # one scale a (row, kv head, column): rollout.KVCache
                self.ks = torch.zeros(L, N, Hkv, S, dtype=torch.float32, device=dev)
                self.vs = torch.zeros(L, N, Hkv, S, dtype=torch.float32, device=dev)
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
        self.attn_split, self.attn_stages = _attn_grid(N * Hkv, S, dec.sms, D, self.k.element_size())
        # the prompt that the n rows of a group share: columns [pad, shared) of each row (shared = 0: none),
        # read for several rows at once, its slices into slots attn_split ... 2·attn_split - 1
        # (_attn_partial_kernel)
        self.n = 1
        self.shared = torch.zeros(1, **i64)
        rows = N * cfg.num_heads
        self.attn_m = torch.zeros(rows, 2 * self.attn_split, dtype=torch.float32, device=dev)
        self.attn_l = torch.zeros_like(self.attn_m)
        self.attn_acc = torch.zeros(rows, 2 * self.attn_split, D, dtype=torch.float32, device=dev)
        # sampler split over the vocabulary: about SAMPLE_PER_SM programs an SM
        self.v_block = 1024
        self.v_chunk = self.v_block * math.ceil(V / max(1, math.ceil(SAMPLE_PER_SM * dec.sms / N)) / self.v_block)
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

    def __init__(self, dec, st, row0, n, pad, Lp):
        self.dec, self.st, self.row0, self.n, self.pad, self.Lp = dec, st, row0, n, pad, Lp
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
        k, v = self.dec.cached(self.st, layer, self.rows(P)[1], Lp)  # (P, Hkv, Lp, D)
        # (enable_gqa: SDPA reads the kv heads as they are, faster than with K/V expanded to every query head
        # first: results/rollout_h200.md; SDPA's output keeps q's (P, Lp, Hq, D) layout, so the reshape is a
        # view)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, enable_gqa=True)  # (P, Hq, Lp, D)
        return out.transpose(1, 2).reshape(P * Lp, Hq * D)


# ---------------------------------------------------------------------------------------------
# The decoder: the fused step (torch reference | Triton), graph capture, the generation loop
# ---------------------------------------------------------------------------------------------

class Decoder:
    """The sampler for one model. Built once per model (generate() keeps it on the model; release()
    drops it): regroups the linears, then per (rows, columns) shape keeps a _State and its graphs."""

    def __init__(self, model, kernels="auto", graphs="auto", max_states=2, kv="model"):
        if kernels not in ("auto", "triton", "torch") or graphs not in ("auto", True, False):
            raise ValueError(f"kernels must be auto|triton|torch and graphs auto|True|False, got {kernels!r}, {graphs!r}")
        rollout.check_kv_cache(kv)
        # The model keeps its decoder (generate); a strong reference back would make a cycle, and only the
        # garbage collector would free the two (the caches and graphs with them), whenever it runs.
        self._model, self.cfg = weakref.ref(model), model.config
        self.opts = (kernels, graphs, kv)
        self.kv_fp8 = kv == "fp8"  # the cache in E4M3 with a scale a (row, kv head, column): rollout.KVCache
        self.cache_tensors = rollout.KV_TENSORS[kv]
        self.device, self.dtype = model.device, model.dtype
        self.triton = kernels == "triton" or (kernels == "auto" and self.device.type == "cuda")
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
        self.pdl = pdl_opts(self.device) if self.triton else {}  # (programmatic dependent launch)
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
        stores x for it, (k_step, rows) (x_k_order: for the warp-specialized wgmma kernel, at the rows
        engine/plan.py's plan_forward gives it, in the K order of its k-steps, as the first N rows of a
        buffer of `rows`), or NATURAL (x as it is)."""
        if not (self.triton and self.device.type == "cuda"):
            return (NATURAL,) * len(layer.groups)
        return tuple(x_k_order(N, g.gemm.q, self.dtype, self.device)
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
        for name, t in zip(self.cache_tensors, self.stored(k[:, :, None], v.reshape(M, Hkv, 1, D))):
            rollout.as_bytes(getattr(st, name)[layer]).index_copy_(2, col, rollout.as_bytes(t))
        return q

    def stored(self, k, v):
        """k, v (..., D) as the cache stores them: (k, v), or with the FP8 cache (k8, v8, k's scales, v's)."""
        if not self.kv_fp8:
            return k, v
        (k8, ks), (v8, vs) = rollout.kv_e4m3(k), rollout.kv_e4m3(v)
        return k8, v8, ks, vs

    def cached(self, st, layer, rows, S):
        """The cache's keys and values of `layer` at `rows`, columns [0, S), in the model dtype."""
        if not self.kv_fp8:
            return st.k[layer, rows, :, :S], st.v[layer, rows, :, :S]
        return tuple(rollout.kv_dequant(getattr(st, c)[layer, rows, :, :S], getattr(st, sc)[layer, rows, :, :S],
                                        self.dtype) for c, sc in (("k", "ks"), ("v", "vs")))

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
        copies = lambda t: t.repeat_interleave(n, 0) if n > 1 else t  # (before the FP8 cache's quantizer: torch's
        # repeat does not take E4M3 everywhere)
        for name, t in zip(self.cache_tensors, self.stored(copies(k), copies(heads(v, Hkv)))):
            getattr(cache.st, name)[layer, both, :, :T] = t
        return q

    def _rope_write(self, qkv, a, grp, st, layer, q, pad, prompt=None):
        """Launch _rope_write_kernel: a decode step's (pad of each row), or with prompt = (tokens a prompt,
        cache rows a prompt, first row) a prefill's (pad of each prompt)."""
        cfg = self.cfg
        Hq, Hkv, D, R, M = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, grp.R, qkv.shape[0]
        _rope_write_kernel[(triton.cdiv(M, 16), Hq + 2 * Hkv)](
            qkv, a if R else qkv, grp.B if R else qkv, st.cos, st.sin, pad, st.counters, q, st.k[layer], st.v[layer],
            *self.scales(st, layer), M, st.S, Hq, Hkv, a.shape[1] if R else 0, *(prompt or (1, 1, 0)), D=D,
            R=max(R, 16), BM=16, HAS_LORA=R > 0, PREC=self.prec, PROMPT=prompt is not None, FP8=self.kv_fp8,
            num_warps=4, **self.pdl)

    def scales(self, st, layer):
        """The kernels' ks, vs arguments: the FP8 cache's scales of `layer`, or (unread) its k and v."""
        return (st.ks[layer], st.vs[layer]) if self.kv_fp8 else (st.k[layer], st.v[layer])

    def attention(self, q, st, layer, terms, order=NATURAL):
        """q (M, Hq, D) against this layer's cache columns [pad_b, col] → (M, Hq·D)."""
        M, Hq, D = q.shape
        Hkv = self.cfg.num_kv_heads
        if self.triton:
            G = Hq // Hkv
            rows = min(st.n, max(1, SHARED_HEADS // G))  # rows of a group a program takes over their prompt
            _attn_partial_kernel[(st.attn_split, M * Hkv)](
                q, st.k[layer], st.v[layer], *self.scales(st, layer), st.pad, st.done, st.counters, st.shared,
                st.attn_m, st.attn_l, st.attn_acc, 1.0 / math.sqrt(D), st.S, Hkv, st.attn_m.shape[1], G=G,
                G_PAD=max(16, _pow2(G)), D=D, BLOCK_N=64, N_GROUP=st.n, ROWS=rows, Q_PAD=max(16, _pow2(rows * G)),
                PREC=self.prec, FP8=self.kv_fp8, num_warps=4, num_stages=st.attn_stages, **self.pdl)
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
        out = F.scaled_dot_product_attention(q[:, :, None], *self.cached(st, layer, slice(None), S),
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
        NVFP4 group whose GEMM can carry it (the mma kernel: side_rides_along)
        computes a in the GEMM's own launch (fp4_linear_side).
        Otherwise, on the GPU, cuBLAS computes a on a second stream while the GEMM runs, and the stream
        rejoins before a is read.
        order[0] = k_step > 0: x comes in the K order of the group's warp-specialized wgmma kernel
        (x_orders), as the op before stored it, so fp4_gemm skips its own launch that orders x, and a
        reads A's columns in the same order."""
        k_step = order[0]
        base, A = grp.gemm, grp.A if grp.R else None
        if k_step:
            base = lambda x: fp4_linear_k_ordered(x, grp.gemm.q, grp.gemm.bias)
            A = grp.k_ordered_A(k_step) if grp.R else None
        if not grp.R:
            return base(x), None
        if not self.triton:
            return base(x), F.linear(x, A)
        if not k_step and isinstance(grp.gemm, fp4_gemm.QuantLinear) and (
                self.side_stream is None or side_rides_along(x, grp.gemm.q)):
            return fp4_linear_side(x, grp.gemm.q, grp.gemm.bias, A)
        if self.side_stream is None:  # (CPU tensors: Triton's interpreter)
            return base(x), side_linear(x, A)
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
            thr = rollout.truncation_threshold(logits.float() * inv_t, sp.top_p, sp.top_k) if trunc else None
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
        tok, lp = rollout.sample_reference(logits, st.rowkey, st.counters[1], sp.temperature, sp.top_p, sp.top_k)
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

    def capture(self, st, sp, key):
        """Record one step as a CUDA graph (after two eager warm-up steps that compile the kernels), before
        a call's prefill. The warm-up steps run on rows marked finished (no attention reads) and write their
        K/V and outputs at cache column 0 and output step 0, where the prefill writes after them. The
        counters and the row state they change are put back."""
        t0 = time.perf_counter()
        changed = (st.tok, st.done, st.stopped, st.lengths, st.counters)
        kept = [t.clone() for t in changed]
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
        cache = _PrefillCache(self, st, row0, n, pad, tokens.shape[1])
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
        adapters and fewer passes over the activations (the times of both ways: results/rollout_h200.md,
        results/bench_h200.md); `cache` attends over the prompts and keeps their K/V."""
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
    def run(self, prompts, n, max_new_tokens, sp, seed, stream=None, check_every=16, compact=True, prompt_len=0):
        P, dev = len(prompts), self.device
        N = P * n
        Lp = max(len(p) for p in prompts)
        bucket = PREFILL_BUCKET * math.ceil(Lp / PREFILL_BUCKET)
        graphed_prefill = self.graphs and P * bucket <= PREFILL_GRAPH_TOKENS
        if graphed_prefill:  # nearby prompt lengths share one prefill graph
            Lp = bucket
        # The cache's columns: rounded so that later calls reuse the state and its graphs, and as wide as
        # prompt_len asks (the longest prompt of the calls to come), so that calls whose longest prompts differ
        # share one state, not one each (a cache and a set of graphs captured in whichever call first brings
        # the width)
        S = memory.cache_columns(max(Lp, prompt_len), max_new_tokens)
        st = self.state(N, S)
        nstop = max(16, _pow2(len(sp.stop_ids)))
        if st.stops.numel() != nstop:
            st.stops = torch.full((nstop,), -1, dtype=torch.int64, device=dev)
            st.graphs.clear()
            st.subs.clear()  # (they read the stop list they were made with)
        st.n = n  # rows that share their prompt (the attention launches depend on it)
        st.shared.fill_(Lp if st.n > 1 else 0)
        key = (sp.temperature, sp.top_p, sp.top_k, sp.pad_id, st.n)
        for L in self.layers:
            for grp in L.groups:
                grp.refresh()
        stats = dict(kernels="triton" if self.triton else "torch", graphs=False, capture_s=0.0, rows=N,
                     prefill_rows=P, prompt_len=Lp, cache_columns=S)
        graph = None
        compacts = bool(sp.stop_ids) and compact and stream is None  # whether rows move into smaller states
        if self.graphs:
            if key not in st.graphs:
                stats["capture_s"] = self.capture(st, sp, key)
            if compacts and max_new_tokens - 1 - check_every >= check_every:  # (a shrink can come: the loop's test)
                # and the smaller states that shrink may move the rows into (1, 2, 4, ... N / 2 rows): a graph
                # first needed mid-rollout would compile the GEMM kernels of its row count while the rollout
                # waits, in whichever call first passes through that count, not only the first call
                for i in range((N // 2).bit_length()):
                    sub = self.substate(st, 1 << i)
                    if (*key[:-1], sub.n) not in sub.graphs:
                        stats["capture_s"] += self.capture(sub, sp, (*key[:-1], sub.n))
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
        st.rowkey.copy_(rollout.row_keys(seed, torch.arange(N)).to(dev))
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
        segments, seg_steps, seg_t = [], 1, t1  # [(rows, steps, seconds)] at each batch size, captures left out
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
                if compacts and max_new_tokens - 1 - t >= check_every:
                    now = time.perf_counter()  # (the device has caught up: done was read)
                    smaller = self.shrink(root, st, order, done, Lp + t)
                    if smaller is not st:
                        segments.append((st.N, steps - seg_steps, now - seg_t))
                        seg_steps, seg_t = steps, now
                        st = smaller
                        graph = st.graphs.get((*key[:-1], st.n)) if self.graphs else None
                        shrinks.append((t, st.N))
        sync()
        t2 = time.perf_counter()
        segments.append((st.N, steps - seg_steps, t2 - seg_t))
        back = torch.argsort(order).to(dev) if shrinks else slice(None)  # the call's row r is root's row back[r]
        lengths = root.lengths[back].clone()
        T = max(1, int(lengths.max()))
        stopped = root.stopped[back].tolist()
        stats.update(prefill_s=t1 - t0, decode_s=t2 - t1, steps=steps, shrinks=shrinks, segments=segments)
        return rollout.Rollout(tokens=root.out_tok[back, :T].clone(), logprobs=root.out_lp[back, :T].clone(), lengths=lengths,
                       finish=["stop" if s else "length" for s in stopped],
                       prompt_index=torch.arange(P, device=dev).repeat_interleave(n), stats=stats)

    def shrink(self, root, st, order, done, column):
        """Finished rows stop costing GEMM rows: if st's live rows (done: st's flags, on the host) fit in at
        most half of its rows, rounded up to a power of two, move them to the front of root's rows (their
        K/V up to `column`, the next step's) and return the smaller state of root over them (substate; run
        captured its graph); otherwise st. A row keeps its row key, so it samples the same noise in any
        state. order (root's rows: which row of the call each holds) moves along."""
        live = (~done).nonzero()[:, 0]
        N2 = _pow2(live.numel())
        if N2 > st.N // 2:
            return st
        keep = torch.cat([live, done.nonzero()[:, 0]])  # st's rows, the live ones first, then the finished
        on_dev = keep.to(self.device)
        for name in _State.ROW_TENSORS:  # the finished rows' outputs are kept, behind the live rows
            t = getattr(st, name)
            t.copy_(t[on_dev])
        rows = on_dev[: live.numel()]
        for name in self.cache_tensors:
            cache = rollout.as_bytes(getattr(root, name))
            for layer in range(cache.shape[0]):  # (a layer at a time: the gather's copy stays small)
                cache[layer, : rows.numel(), :, :column] = cache[layer, rows, :, :column]
        order[: st.N] = order[: st.N][keep]
        return self.substate(root, N2)

    def substate(self, root, N2):
        """root's smaller state of N2 rows, made the first time (a _State with root as parent, kept in
        root.subs)."""
        if N2 not in root.subs:
            root.subs[N2] = _State(self, N2, root.S, parent=root)
        return root.subs[N2]


def _fingerprint(model):
    """Addresses of every base tensor the decoder depends on: if any moved (weights reloaded, the
    model moved, a norm weight replaced instead of updated in place), the decoder is rebuilt."""
    return tuple((n, t.data_ptr()) for n, t in list(model.named_parameters()) + list(model.named_buffers())
                 if ".lora_" not in n)


def decoder_of(model):
    """The Decoder the engine keeps on `model` between calls (rollout.ENGINE_STATE), or None."""
    return getattr(model, rollout.ENGINE_STATE, None)


def _decoder(model, kernels, graphs, kv="model"):
    dec = decoder_of(model)
    if dec is None or dec.opts != (kernels, graphs, kv) or dec.fingerprint != _fingerprint(model) \
            or dec.device != model.device or dec.dtype != model.dtype:
        rollout.release(model)
        dec = Decoder(model, kernels, graphs, kv=kv)
        setattr(model, rollout.ENGINE_STATE, dec)
    return dec


def generate(model, prompts, *, n=1, max_new_tokens=256, temperature=1.0, top_p=1.0, top_k=0, stop_ids=(),
             seed=None, pad_id=0, kernels="auto", graphs="auto", stream=None, compact=True, kv_cache="model",
             prompt_len=0):
    """rollout.generate through this engine whatever the device (rollout.generate comes here on a CUDA GPU
    with Triton, or with kernels="triton"): the same arguments and Rollout. kernels: "triton" (default on
    CUDA) or "torch" (the fused ops as torch ops, default elsewhere); graphs: CUDA graphs for the decode
    step and short prefills (PREFILL_GRAPH_TOKENS; default on CUDA, True only there). stream(step,
    tokens (N,)) forces a sync per step. compact: as rows finish, the live ones move into a state of half
    the rows or fewer (Decoder.shrink; not with stream). kv_cache: what the cache stores (rollout.KVCache);
    the engine is rebuilt when it changes. prompt_len: the cache's width is set as for a prompt this long at
    least (Decoder.run)."""
    prompts, sp, seed = rollout.sampling_setup(prompts, n, max_new_tokens, temperature, top_p, top_k, stop_ids, seed,
                                               pad_id)
    was_training = model.training
    model.eval()
    try:
        dec = _decoder(model, kernels, graphs, kv_cache)
        return dec.run(prompts, n, max_new_tokens, sp, seed, stream, compact=compact, prompt_len=prompt_len)
    finally:
        model.train(was_training)
