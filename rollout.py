"""Rollout: sample n completions of each prompt with a KV cache, and the logprob of every token drawn.

RL for LLMs spends most of its time here: the policy writes G answers to each prompt, the rewards
grade them, and the update needs the log-probability of every sampled token. This file is the
sampler in plain eager torch, on CPU or GPU, written to be read; it is also the specification that the
fast engine (engine/decode.py) is tested against.

    generate(model, prompts, n=G, max_new_tokens, temperature, top_p, top_k, stop_ids, seed) -> Rollout

The KV cache. Attention at step t needs the keys and values of every earlier token. Recomputing them
costs a forward over the whole sequence each step (O(T²) work for T tokens); storing them costs
memory, once: for L layers, B rows, Hkv kv heads of dim D and S columns,

    k, v         (L, B, Hkv, S, D)      allocated once for the whole call (S = prompt + new tokens)
    valid        (B, S) bool            False at a row's left padding, which no query may see
    length       int                    columns filled so far, the same for every row

Every row writes the same column at every step, so prompts of different lengths are LEFT-padded to
the longest, Lp: row i's l_i tokens sit in columns Lp − l_i … Lp − 1 at positions 0 … l_i − 1 (the
rotary embedding sees positions, not columns, so padding changes nothing but the mask).

Prefill, then decode. The model's forward takes the cache (model.py: `hidden(tokens, positions,
cache)`; the cache's `attend(layer, q, k, v)` writes this call's k, v at column `length` and returns
attention over columns [0, length + T), `advance(T)` moves on):

    prefill      the P distinct prompts (P, Lp) in one forward: their K/V fill columns [0, Lp),
                 the logits at the last column give each prompt's first token
    decode t     one token per row (N, 1) at column Lp + t − 1, position l_i + t − 1; it attends to
                 its row's valid columns; the logits give token t

Below these are `prefill`, `decode_one_token` and `decode_n_tokens` (the loop: sample, keep, stop,
shrink, step), joined by `sample`. What a call cost (Rollout.stats) is measured by `Watch`, an observer
the loop tells when the prefill ends, when the batch shrinks and when it stops.

Shared prompts. A group's n samples continue the same prompt (row r = i·n + j is sample j of prompt
i), so the prompt is run once, on P rows, and its cache rows are then repeated n times (KVCache.
repeat_rows) before decoding N = P·n rows. Same result as prefilling N rows, n times less prefill.

Sampling. With z = logits / τ in float32 (τ the temperature), each step draws

    token   = argmax_v { z[v] + g[v] : v in the kept set }          g[v] ~ Gumbel(0, 1)
    logprob = z[token] − logsumexp(z)

Gumbel-max draws exactly from softmax(z) restricted to the kept set and renormalized. With top-k
alone the kept set is the k largest z; with top-p alone, the shortest prefix of the sorted softmax(z)
whose mass reaches p: with one of them set, the same set HF's logits warpers (and vLLM) sample from.
With both set, ours keeps the tokens in both sets, the top-p set measured on the full softmax(z); HF
and vLLM instead measure top-p on the k tokens that top-k kept, renormalized, and so may keep fewer
(that mass reaches p sooner). train.py and eval.py use top-p alone. The logprob is that of the
UNTRUNCATED softmax(logits / τ): the number the trainer recomputes from a full forward (train.py), so
the two agree up to rounding. Temperature 0 is greedy (argmax), with the logprobs of softmax(logits).

The noise g is a counter-based hash of (seed, row, step, vocab index) (`gumbel_noise`: the integer
hash lowbias32, two rounds, 24 bits to a uniform, then −log(−log u)). There is no RNG state: a draw
depends on nothing but those four numbers, not on how many rows the batch has, in what order the
numbers are drawn, or which code draws them. So the same seed gives the same samples on every call,
on CPU and GPU, here and in the engine's fused kernel (which computes the same hash), and when the
engine moves a row to another batch position it keeps the row's key and so its draws. A stateful
generator (torch.multinomial with a torch.Generator, as HF's generate) gives none of that: its draws
depend on the batch's shape and on every draw made before.

Stops and finished rows. A row that samples a stop token is done: the stop token is kept and counted
in its length, and its later columns hold pad_id with logprob 0. Once the rows still sampling fit in
half the batch, the finished ones leave it (their cache rows dropped, KVCache.keep_rows), so the later
steps cost only about the live rows (halving, not dropping each row as it ends, keeps the copies of the
cache and the distinct batch shapes few). A row's draws depend on its key, not on its place in the
batch, so the samples are the same as if every row had stayed.

Departures from the official code. QeRL samples with vLLM, which pages its KV cache and batches
continuously (rows join and leave at any step); here a batch is static, left-padded, and all rows share
the column index, which keeps the cache one tensor and the step one fixed shape. LoRA stays unmerged
(the adapters change every RL step; merging them would mean re-quantizing the NVFP4 base).

The engine. On a CUDA GPU with Triton, `generate` hands the call to engine/decode.py at one marked
point below. It computes the same thing faster: the whole decode step is one CUDA graph replayed per
token; the residual add + RMSNorm, the rotary embedding + cache write, the LoRA B products, SiLU·up,
and a split-K attention over only the columns present are each one fused Triton kernel; q|k|v and
gate|up are one GEMM each; the sampler above runs inside the graph; a group's shared prompt is read
once for all its samples; and the live rows move into a smaller batch as rows finish. Its tests check
it against this file (greedy tokens equal, logprobs within a stated tolerance, the same seeded samples);
results/rollout_h200.md has its measurements.

    python rollout.py --model tiny --prompt "Tom has 3 apples and buys 4 more. How many now?"
    python rollout.py --model qwen2.5-7b --prompt "What is 17 * 23?" --quant nvfp4
    python rollout.py --bench           # the engine's benchmark (engine/bench_rollout.py; needs a GPU)
"""
import argparse
import importlib.util
import sys
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from hub import load_tokenizer, resolve_device, stop_on_bad_input, stop_token_ids
from model import Transformer, read_config


# ---------------------------------------------------------------------------------------------
# The result
# ---------------------------------------------------------------------------------------------

@dataclass
class Rollout:
    """N = len(prompts) * n completions; row i*n + j is sample j of prompt i.

    tokens    (N, T) int64    completions, right-padded with pad_id; a stop token is included
    logprobs  (N, T) float32  log-prob of each sampled token under softmax(logits / temperature),
                              before top-p / top-k truncation (what the trainer recomputes); 0 at padding
    lengths   (N,)   int64    completion lengths (stop token included)
    finish    list of "stop" (a stop token was sampled) or "length" (max_new_tokens reached)
    prompt_index (N,) int64   which prompt each row continues
    stats     timings and what ran: prefill_s, decode_s, steps (sampling steps: one on the prefill's
              logits, then one after each decode forward), kernels, graphs, capture_s, rows,
              prefill_rows, prompt_len, cache_columns, prefill (eager | captured | replayed), and how
              the batch shrank as rows finished, from both samplers:
              shrinks   [(step, rows)]: after sampling token `step` the live rows moved to a batch of
                        `rows` (this file: exactly the live rows; the engine: their number rounded
                        up to a power of two), which ran every later decode forward until the next
              segments  [(rows, forwards, seconds)]: the decode in each of those batch sizes, in
                        order (graph captures left out); the forwards add up to steps − 1
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


def concat(parts):
    """One Rollout of several calls' (rows in order, prompt_index running on; tokens and logprobs padded
    to the widest call's T with 0); stats: the calls' timings summed."""
    T = max(p.tokens.shape[1] for p in parts)
    pad = lambda t: torch.nn.functional.pad(t, (0, T - t.shape[1]))
    starts = [0]
    for p in parts[:-1]:
        starts.append(starts[-1] + int(p.prompt_index.max()) + 1)
    return Rollout(torch.cat([pad(p.tokens) for p in parts]), torch.cat([pad(p.logprobs) for p in parts]),
                   torch.cat([p.lengths for p in parts]), [f for p in parts for f in p.finish],
                   torch.cat([p.prompt_index + s for p, s in zip(parts, starts)]),
                   {k: sum(p.stats.get(k, 0) for p in parts) for k in ("prefill_s", "decode_s", "capture_s")})


# ---------------------------------------------------------------------------------------------
# Sampling: the counter-based Gumbel noise and the sampler's math
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
    The engine's Triton sampler computes the same bits."""
    ka = mix32((rowkey + step) & M32)  # (N,)
    kb = mix32(ka ^ 0x68E31DA4)
    v = torch.arange(V, device=rowkey.device)
    h = mix32(mix32((v[None] + ka[:, None]) & M32) ^ kb[:, None])  # (N, V)
    u = ((h >> 8).float() + 0.5) * 2.0 ** -24  # uniform in (0, 1), 24 random bits
    return -torch.log(-torch.log(u))


def truncation_threshold(z, top_p, top_k):
    """z (N, V) = logits / temperature → (N,) float32: the smallest z a token may have to be sampled
    (−inf: all). top-k keeps the k largest; top-p the shortest prefix of the sorted softmax(z) whose
    mass reaches top_p (a token is kept when the mass strictly before it is < top_p). With both, the
    larger of the two thresholds: the tokens in both sets, top-p measured on the full softmax(z), not
    on the top-k tokens renormalized as HF's warpers do (module docstring). Ties at the threshold are
    all kept."""
    thr = torch.full(z.shape[:1], float("-inf"), device=z.device)
    if top_k and top_k < z.shape[-1]:
        thr = torch.topk(z, top_k, dim=-1).values[:, -1]
    if top_p < 1.0:
        zs = torch.sort(z, dim=-1, descending=True).values  # (N, V)
        p = torch.softmax(zs, dim=-1)
        before = torch.cumsum(p, dim=-1) - p  # mass strictly before each sorted token
        count = (before < top_p).sum(-1).clamp(min=1)  # (N,)
        thr = torch.maximum(thr, zs.gather(1, (count - 1)[:, None])[:, 0])
    return thr.contiguous()  # (N,): the engine's Triton sampler reads it with stride 1


def sample_reference(logits, rowkey, step, temperature=1.0, top_p=1.0, top_k=0):
    """One sampling step on full rows: logits (N, V) → tokens (N,), logprobs (N,)."""
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
# The static KV cache (model.py's cache interface: attend, advance, length)
# ---------------------------------------------------------------------------------------------

# what the cache stores (K/V in the model's dtype, or in E4M3 with their scales: kv_e4m3) → the tensors that
# hold it, a row each along dim 1 (KVCache's, and the engine's states')
KV_TENSORS = {"model": ("k", "v"), "fp8": ("k", "v", "ks", "vs")}
KV_CACHES = tuple(KV_TENSORS)


def check_kv_cache(kv):
    """generate's kv_cache (and KVCache's, the engine's kv) must be one of KV_CACHES."""
    if kv not in KV_CACHES:
        raise ValueError(f"kv_cache must be one of {KV_CACHES}, got {kv!r}")


def kv_e4m3(t):
    """The FP8 cache's quantizer: t (..., D) → (E4M3 (..., D), scale (...,) float32), t ≈ q · scale for each
    D-vector (one token's key or value in one kv head): scale = amax / 448 (E4M3's largest value), q =
    E4M3(t · 448 / amax), rounded to nearest even. One scale a vector keeps a head's outlier tokens from
    crushing the others; E4M3's 3 mantissa bits leave each element a rounding error of up to 2^-4
    relative. (The engine's cache-writing kernel computes the same bits; the FP8 update quantizes its rows
    with it too: engine/fp8.py.)"""
    v = t.float()
    amax = v.abs().amax(-1, keepdim=True).clamp_min(1e-30)  # (an all-zero vector quantizes to zeros)
    m = torch.full_like(amax, 448.0)  # (a tensor: torch computes `448.0 / a` as 448 · (1 / a), two roundings)
    return (v * (m / amax)).to(torch.float8_e4m3fn), (amax / m)[..., 0]


def kv_dequant(q, scale, dtype):
    """kv_e4m3's inverse, in `dtype`: q (..., D) times its scale (...,)."""
    return (q.float() * scale[..., None]).to(dtype)


class KVCache:
    """k, v (L, B, Hkv, S, D) allocated once; `length` columns are filled, the same number in every row
    (prompts are left-padded). `valid` (B, S) is False at padding, which no query may attend to.
    kv="fp8": k, v are stored in E4M3 with one float32 scale a (row, kv head, column) in ks, vs (L, B, Hkv, S)
    (kv_e4m3), about half the cache's bytes; every query attends to the dequantized keys and values, the
    prompt's own included. An option (generate's kv_cache): it changes the sampler's numbers, and so its
    distance from the trainer's, which recomputes K/V in 16 bits."""

    def __init__(self, cfg, batch, max_len, dtype, device, kv="model"):
        check_kv_cache(kv)
        shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.kv, self.fp8, self.dtype = kv, kv == "fp8", dtype
        stored = torch.float8_e4m3fn if self.fp8 else dtype
        self.k = torch.zeros(shape, dtype=stored, device=device)
        self.v = torch.zeros(shape, dtype=stored, device=device)
        if self.fp8:
            self.ks = torch.zeros(shape[:-1], dtype=torch.float32, device=device)
            self.vs = torch.zeros(shape[:-1], dtype=torch.float32, device=device)
        self.valid = torch.ones(batch, max_len, dtype=torch.bool, device=device)
        self.length = 0

    def attend(self, layer, q, k, v):
        """Store this call's k, v (B, Hkv, T, D) at columns [length, length + T) of `layer`, and return
        q (B, Hq, T, D) attended over every valid column up to its own: (B, Hq, T, D)."""
        s, T = self.length, q.shape[2]
        if s + T > self.k.shape[3]:
            raise ValueError(f"KV cache overflow: {s + T} tokens for a cache of {self.k.shape[3]}")
        if self.fp8:
            self.k[layer, :, :, s:s + T], self.ks[layer, :, :, s:s + T] = kv_e4m3(k)
            self.v[layer, :, :, s:s + T], self.vs[layer, :, :, s:s + T] = kv_e4m3(v)
            keys = kv_dequant(self.k[layer, :, :, :s + T], self.ks[layer, :, :, :s + T], self.dtype)
            values = kv_dequant(self.v[layer, :, :, :s + T], self.vs[layer, :, :, :s + T], self.dtype)
        else:
            self.k[layer, :, :, s:s + T] = k
            self.v[layer, :, :, s:s + T] = v
            keys, values = self.k[layer, :, :, :s + T], self.v[layer, :, :, :s + T]  # (B, Hkv, s+T, D)
        qpos = torch.arange(s, s + T, device=q.device)[:, None]  # (T, 1)
        kpos = torch.arange(s + T, device=q.device)[None, :]  # (1, s+T)
        # a padding query sees only itself, so that no row is fully masked (which would give NaN)
        mask = (kpos <= qpos) & (self.valid[:, None, :s + T] | (kpos == qpos))  # (B, T, s+T)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None], enable_gqa=True)

    def advance(self, T):
        self.length += T

    def tensors(self):
        """The names of the tensors that hold the cache, a row each along dim 1."""
        return KV_TENSORS[self.kv]

    def keep_rows(self, rows):
        """Only these rows from now on (a bool mask or indices over the rows): the finished ones leave."""
        for name in self.tensors():
            setattr(self, name, _rows_of(getattr(self, name), lambda t: t[:, rows]))
        self.valid = self.valid[rows]

    def repeat_rows(self, n):
        """Each row n times (row i → rows i·n … i·n + n − 1): a prompt's cache for its n samples."""
        if n > 1:
            for name in self.tensors():
                setattr(self, name, _rows_of(getattr(self, name), lambda t: t.repeat_interleave(n, 1)))
            self.valid = self.valid.repeat_interleave(n, 0)
        return self


def as_bytes(t):
    """An E4M3 tensor viewed as uint8 (torch's gathers, scatters and index_copy_ do not all take E4M3; its
    bytes move the same), any other tensor as it is."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _rows_of(t, pick):
    """pick(t), through as_bytes."""
    return pick(as_bytes(t)).view(t.dtype)


# ---------------------------------------------------------------------------------------------
# The sampler
# ---------------------------------------------------------------------------------------------

def sampling_problems(max_new_tokens, temperature, top_p, top_k):
    """What is wrong with these sampling numbers: [(argument, value, what it must be)], [] when nothing.
    Each check states what a good value meets, so a NaN, which fails every comparison, is refused too,
    not passed on to give garbage samples. (generate's check, and the CLI's before it loads a model.)"""
    checks = (("max_new_tokens", max_new_tokens, max_new_tokens >= 1, "must be >= 1"),
              ("temperature", temperature, 0 <= temperature < float("inf"),
               "must be a finite number >= 0 (0 = greedy)"),
              ("top_p", top_p, 0 < top_p <= 1, "must be in (0, 1] (1 = no nucleus truncation)"),
              ("top_k", top_k, top_k >= 0, "must be >= 0 (0 = all tokens)"))
    return [(name, value, need) for name, value, ok, need in checks if not ok]


def sampling_setup(prompts, n, max_new_tokens, temperature, top_p, top_k, stop_ids, seed, pad_id):
    """Check generate's arguments → (prompts as lists of ints, sampling parameters, seed). The engine
    takes the same."""
    prompts = [[int(t) for t in p] for p in prompts]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs at least one prompt, and every prompt at least one token")
    if n < 1:
        raise ValueError(f"n must be >= 1, got n={n}")
    problems = sampling_problems(max_new_tokens, temperature, top_p, top_k)
    if problems:
        raise ValueError("generate: " + "; ".join(f"{name}={value}: {need}" for name, value, need in problems))
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)))
    sp = SimpleNamespace(temperature=float(temperature), top_p=float(top_p), top_k=int(top_k),
                         stop_ids=tuple(int(s) for s in stop_ids), pad_id=int(pad_id))
    return prompts, sp, int(seed)


def prefill(model, prompts, n, max_new_tokens, pad_id, kv="model"):
    """The P distinct prompts, left-padded to the longest (Lp), in one forward, their cache rows then
    repeated for the n samples of each. → (logits (N, V) of each row's first token, the cache (S = Lp +
    max_new_tokens columns, storing `kv`: KVCache), pos (N,): the position of each row's next token)."""
    dev, P = model.device, len(prompts)
    lens = torch.tensor([len(p) for p in prompts], device=dev)  # (P,)
    Lp = int(lens.max())
    tokens = torch.full((P, Lp), pad_id, dtype=torch.int64)
    for i, p in enumerate(prompts):
        tokens[i, Lp - len(p):] = torch.tensor(p)
    pad = Lp - lens  # (P,) left padding of each prompt
    positions = (torch.arange(Lp, device=dev)[None] - pad[:, None]).clamp(min=0)  # (P, Lp)
    cache = KVCache(model.config, P, Lp + max_new_tokens, model.dtype, dev, kv)
    cache.valid[:, :Lp] = torch.arange(Lp, device=dev)[None] >= pad[:, None]
    h = model.hidden(tokens.to(dev), positions, cache)[:, -1]  # (P, H): the last column of each prompt
    logits = model.lm_head(h).repeat_interleave(n, 0)  # (N, V)
    return logits, cache.repeat_rows(n), lens.repeat_interleave(n)


def decode_one_token(model, tok, pos, cache):
    """Token t of every row of the batch (B,) in, at its position pos (B,): one more column of the cache.
    → the logits (B, V) of token t + 1."""
    return model.lm_head(model.hidden(tok[:, None], pos[:, None], cache)[:, -1])


class Completions:
    """What the loop writes, for the N rows of the call: tokens (N, max_new_tokens) int64 (pad_id after a
    row's end), logprobs (N, max_new_tokens) float32 (0 there), lengths (N,), stopped (N,) bool."""

    def __init__(self, N, max_new_tokens, pad_id, device):
        self.tokens = torch.full((N, max_new_tokens), pad_id, dtype=torch.int64, device=device)
        self.logprobs = torch.zeros(N, max_new_tokens, dtype=torch.float32, device=device)
        self.lengths = torch.zeros(N, dtype=torch.int64, device=device)
        self.stopped = torch.zeros(N, dtype=torch.bool, device=device)

    def add(self, t, batch, done, tok, lp, stops):
        """Token t (B,) and its logprob lp (B,) of the batch, whose rows are the call's rows `batch`, kept for
        the rows still sampling (not `done`). → (B,) bool: the rows that stop at this token (it is kept)."""
        live = batch[~done]
        self.tokens[live, t] = tok[~done]
        self.logprobs[live, t] = lp[~done]
        self.lengths[live] = t + 1
        hit = torch.isin(tok, stops) & ~done
        self.stopped[batch[hit]] = True
        return hit


def decode_n_tokens(model, logits, cache, pos, keys, max_new_tokens, sp, stream=None, watch=None):
    """From the prefill's logits: sample token t of every row and keep it, then one decode step for the
    logits of token t + 1, until every row has stopped or max_new_tokens. Once the rows still sampling fit
    in half the batch, the finished ones leave it (their cache rows too). keys (N,): each row's sampling
    key. → Completions"""
    N, dev = len(keys), logits.device
    out = Completions(N, max_new_tokens, sp.pad_id, dev)
    stops = torch.tensor(sp.stop_ids, dtype=torch.int64, device=dev)
    batch = torch.arange(N, device=dev)  # the row of the call that each row of the batch holds
    done = torch.zeros(N, dtype=torch.bool, device=dev)  # (batch,) rows that have stopped
    for t in range(max_new_tokens):
        tok, lp = sample_reference(logits, keys[batch], t, sp.temperature, sp.top_p, sp.top_k)  # token t of each
        done |= out.add(t, batch, done, tok, lp, stops)
        if stream is not None:
            stream(t, out.tokens[:, t].cpu())
        if t == max_new_tokens - 1 or bool(done.all()):
            break
        if 2 * int((~done).sum()) <= len(batch):  # the live rows fit in half the batch: the finished ones leave
            keep = ~done
            batch, done, tok, pos = batch[keep], done[keep], tok[keep], pos[keep]
            cache.keep_rows(keep)
            if watch is not None:
                watch.moved(t, len(batch))
        logits = decode_one_token(model, tok, pos, cache)  # (batch, V)
        pos = pos + 1
    if watch is not None:
        watch.ended(t + 1)
    return out


@torch.no_grad()
def sample(model, prompts, n, max_new_tokens, sp, seed, stream=None, watch=None, kv="model"):
    """The plain sampler: prefill the distinct prompts once, then decode all N = P·n rows a token a step.
    stream(step, tokens (N,)) sees every step; watch (a Watch, optional) the prefill's end, every move to
    fewer rows and the loop's end; kv what the cache stores (KVCache). → Rollout (its stats are the watch's
    business: generate fills them)."""
    logits, cache, pos = prefill(model, prompts, n, max_new_tokens, sp.pad_id, kv)
    if watch is not None:
        watch.prefilled()
    keys = row_keys(seed, torch.arange(len(pos))).to(model.device)  # (N,)
    out = decode_n_tokens(model, logits, cache, pos, keys, max_new_tokens, sp, stream, watch)
    T = int(out.lengths.max())
    return Rollout(tokens=out.tokens[:, :T].clone(), logprobs=out.logprobs[:, :T].clone(), lengths=out.lengths,
                   finish=["stop" if s else "length" for s in out.stopped.tolist()],
                   prompt_index=torch.arange(len(prompts), device=model.device).repeat_interleave(n))


# ---------------------------------------------------------------------------------------------
# Bookkeeping: what Rollout.stats reports of a call, watched from outside the loop
# ---------------------------------------------------------------------------------------------

class Watch:
    """An observer of the plain sampler that measures what the engine reports of its own calls (Rollout.
    stats; engine/decode.py): the prefill's and the decode's time, the steps, and how the batch shrank.
    sample() tells it when the prefill is done, when the batch moved to fewer rows after sampling token
    t, and when the loop ended; on a GPU each of those waits for the device, so the times are the work's."""

    def __init__(self, device, prompts, n, max_new_tokens):
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        Lp = max(len(p) for p in prompts)
        self.rows = len(prompts) * n
        self.stats = dict(kernels="torch", graphs=False, capture_s=0.0, rows=self.rows, prefill_rows=len(prompts),
                          prompt_len=Lp, cache_columns=Lp + max_new_tokens, prefill="eager", shrinks=[], segments=[])
        self.start = time.perf_counter()

    def _now(self):
        self.sync()
        return time.perf_counter()

    def prefilled(self):
        self.decode_start = self.segment_start = self._now()
        self.stats["prefill_s"] = self.decode_start - self.start
        self.segment_step = 1  # a segment runs (steps − segment_step) forwards: step 0 samples the prefill's logits

    def moved(self, t, rows):
        """After sampling token t the live rows moved to a batch of `rows`: the forwards so far ran the old size."""
        now = self._now()
        self.stats["segments"].append((self.rows, t + 1 - self.segment_step, now - self.segment_start))
        self.stats["shrinks"].append((t, rows))
        self.rows, self.segment_step, self.segment_start = rows, t + 1, now

    def ended(self, steps):
        now = self._now()
        self.stats["segments"].append((self.rows, steps - self.segment_step, now - self.segment_start))
        self.stats.update(decode_s=now - self.decode_start, steps=steps)


def uses_engine(model, kernels):
    """Whether generate hands the call to the engine: kernels="triton" (on a CPU that means Triton's
    interpreter, for tests), or "auto" with the model on a CUDA GPU and Triton installed."""
    if kernels not in ("auto", "triton", "torch"):
        raise ValueError(f"kernels must be auto|triton|torch, got {kernels!r}")
    if kernels == "torch" or (kernels == "auto" and model.device.type != "cuda"):
        return False
    if importlib.util.find_spec("triton") is None:
        if kernels == "triton":
            raise RuntimeError("kernels='triton' but triton is not installed: pip install triton, or use kernels='torch'")
        return False
    return True


def generate(model, prompts, *, n=1, max_new_tokens=256, temperature=1.0, top_p=1.0, top_k=0, stop_ids=(),
             seed=None, pad_id=0, kernels="auto", graphs="auto", stream=None, compact=True, kv_cache="model",
             prompt_len=0):
    """Sample n completions of each prompt (lists of token ids) → Rollout (see its docstring).

    temperature 0 is greedy; top_p / top_k truncate the sampling set (the logprobs stay those of the
    untruncated softmax(logits / temperature)); stop_ids end a row (the stop token is kept); seed
    makes the call reproducible (None: drawn from torch's global RNG). stream(step, tokens (N,)) is
    called after every step. kernels: "auto" (the engine on a CUDA GPU with Triton, this file's
    sampler elsewhere), "triton" (the engine) or "torch" (this file's sampler). graphs and compact are
    the engine's (engine/decode.py: CUDA graphs, the live rows moved to fewer as rows finish; this
    file's sampler always moves them). kv_cache: "model" (K/V in the model's dtype) or "fp8" (E4M3 with a
    scale a token and kv head, KVCache: about half the cache's memory, an option that moves the sampler's
    numbers away from the trainer's). prompt_len: the longest prompt the calls to come may bring (train.py:
    its data's, as the memory plan counts); the engine makes each call's cache that wide whatever its own
    prompts, so that a run's calls share one state and its CUDA graphs."""
    check_kv_cache(kv_cache)
    # ---- the one dispatch point: the fast engine, where a GPU is there ------------------------------
    if uses_engine(model, kernels):
        from engine import decode

        return decode.generate(model, prompts, n=n, max_new_tokens=max_new_tokens, temperature=temperature,
                               top_p=top_p, top_k=top_k, stop_ids=stop_ids, seed=seed, pad_id=pad_id, kernels=kernels,
                               graphs=graphs, stream=stream, compact=compact, kv_cache=kv_cache,
                               prompt_len=prompt_len)
    if graphs not in ("auto", True, False):
        raise ValueError(f"graphs must be auto|True|False, got {graphs!r}")
    if graphs is True:
        raise ValueError(f"graphs=True needs a model on a CUDA GPU and the engine (kernels auto|triton); this one is "
                         f"on {model.device.type} with kernels={kernels!r}: use graphs='auto' or False")
    prompts, sp, seed = sampling_setup(prompts, n, max_new_tokens, temperature, top_p, top_k, stop_ids, seed, pad_id)
    was_training = model.training
    model.eval()
    try:
        watch = Watch(model.device, prompts, n, max_new_tokens)
        r = sample(model, prompts, n, max_new_tokens, sp, seed, stream, watch, kv_cache)
    finally:
        model.train(was_training)
    r.stats = watch.stats
    return r


ENGINE_STATE = "_rollout_decoder"  # the attribute of a model where the engine keeps its decoder between calls


def release(model):
    """Drop what the engine keeps on `model` between calls (KV caches, CUDA graphs, LoRA buffers)."""
    dec = getattr(model, ENGINE_STATE, None)
    if dec is not None:
        delattr(model, ENGINE_STATE)
        if model.device.type == "cuda":
            del dec
            torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# CLI: one streamed answer
# ---------------------------------------------------------------------------------------------

def chat(args):
    """Stream one sampled answer to --prompt through the checkpoint's chat template."""
    dev = resolve_device(args.device, "rollout.py")  # (stops with a message when cuda is asked for and absent)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    with stop_on_bad_input("rollout.py"):  # a missing model, one of an architecture this decoder lacks, too long
        folder, raw, _ = read_config(args.model)
        tok = load_tokenizer(folder)
        ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                      tokenize=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        check_length(len(ids), args.max_new_tokens, raw.get("max_position_embeddings"), args.model)
    model = Transformer.from_pretrained(folder, dtype=dtype, device=dev, quantize=args.quant == "nvfp4")
    stops = set(stop_token_ids(tok))  # the same turn ends as eval.py and train.py use
    dt = str(model.dtype).removeprefix("torch.")
    weights = f"NVFP4 linears, the rest {dt}" if args.quant == "nvfp4" else f"unquantized {dt}"
    print(f"# {args.model} ({weights}) on {dev}: {len(ids)} prompt tokens, up to {args.max_new_tokens} new, "
          f"temperature {args.temperature}, top_p {args.top_p}, sampler "
          f"{'engine' if uses_engine(model, args.kernels) else 'plain'}", file=sys.stderr)
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
                 top_k=args.top_k, stop_ids=sorted(stops), seed=args.seed, pad_id=tok.pad_token_id or 0, stream=show,
                 kernels=args.kernels)
    s = r.stats
    print(f"\n# {int(r.lengths[0])} tokens ({r.finish[0]}), prefill {1e3 * s['prefill_s']:.0f} ms, "
          f"decode {int(r.lengths[0]) / max(s['decode_s'], 1e-9):.0f} tok/s", file=sys.stderr)


def check_length(prompt_tokens, max_new_tokens, positions, model):
    """ValueError unless the prompt and --max-new-tokens fit the model's positions (max_position_embeddings
    of its config.json; None: the config does not say, nothing to check): checked before the model loads,
    instead of a KV cache allocated for ten million tokens."""
    if not isinstance(positions, int) or prompt_tokens + max_new_tokens <= positions:
        return
    where = f"{model} takes {positions} positions (max_position_embeddings in its config.json)"
    if prompt_tokens >= positions:
        raise ValueError(f"--prompt is {prompt_tokens} tokens in the chat template and {where}: shorten the prompt")
    raise ValueError(f"--max-new-tokens {max_new_tokens}: the prompt is {prompt_tokens} tokens in the chat template and "
                     f"{where}; pass --max-new-tokens {positions - prompt_tokens} or less")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--bench" in argv:  # the engine's benchmark, with its own flags (engine/bench_rollout.py)
        from engine import bench_rollout
        return bench_rollout.main(argv)
    p = argparse.ArgumentParser(description="Sample one answer from a model with the KV-cached sampler "
                                            "(--bench: the engine's benchmark, see engine/bench_rollout.py).")
    p.add_argument("--model", help="HF folder, alias (qwen2.5-7b, tiny) or hub id")
    p.add_argument("--prompt", help="a user message; the answer is streamed through the chat template")
    p.add_argument("--quant", choices=("nvfp4", "bf16"), default="bf16", help="nvfp4: quantize the decoder's "
                   "linears to NVFP4 on load; bf16: keep them unquantized (bf16 on a GPU, float32 on the CPU)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="most tokens to generate")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (0 = greedy)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = all)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--kernels", default="auto", choices=("auto", "triton", "torch"),
                   help="auto: the engine on a CUDA GPU, else this file's sampler; torch: this file's sampler")
    p.add_argument("--bench", action="store_true", help="benchmark the engine instead (needs a GPU; flags: "
                                                        "python -m engine.bench_rollout --help)")
    args = p.parse_args(argv)
    if args.model is None or args.prompt is None:
        p.error("pass --model and --prompt (or --bench)")
    if not args.prompt.strip():
        p.error("--prompt is empty: give it a message to answer, e.g. --prompt \"What is 17 * 23?\"")
    # every bad number stops here, before the model loads (generate would refuse it only after loading)
    problems = sampling_problems(args.max_new_tokens, args.temperature, args.top_p, args.top_k)
    if problems:
        p.error("; ".join(f"--{name.replace('_', '-')} {value}: {need}" for name, value, need in problems))
    return chat(args)


if __name__ == "__main__":
    main()
