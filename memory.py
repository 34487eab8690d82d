"""memory.py: the memory of an RL step, and a plan that fits one into a GPU.

On one GPU, QeRL's NVFP4 weights (4.5 bits each) leave room for the rollout's KV cache and the update's
activations that bf16 weights would take: the paper (arXiv 2510.11696) trains a 32B model with RL on one
H100 80GB, and here a 72B step is planned into the same 80 GB. This file counts, in bytes, what a step holds at its peak, and
sizes the step's free settings to a memory cap. Everything is arithmetic on the model's config; nothing is
allocated. Per part, for L layers of hidden size H, MLP size I, kv heads Hkv of dim D, vocabulary V:

    the whole run (fixed)
      base weights     NVFP4 linears: a 4-bit code a weight, an E4M3 scale per 16 weights, a float32 global
                       scale per output row at most (the engine's fused q|k|v and gate|up keep one a row):
                       0.5625 bytes a weight. Embeddings and an untied lm_head in the model dtype (2 V·H
                       values), float32 RMSNorm weights. Qwen2.5-72B: 70.2 B linear weights, 39.5 GB; its
                       two 152064 x 8192 bf16 tables 5.0 GB.
      trained state    LoRA's A (r, K) and B (N, r) on each targeted linear, and the two RMSNorms of every
                       block where trained, float32: the parameter, its gradient, AdamW's m and v, 16 bytes
                       a parameter (the norms also keep their base values: 20). The parameters are float32
                       already, so they are their own master copy. 72B at r 16: 211 M parameters, 3.4 GB.
      the engine's     the rollout reads each adapter from copies in the model dtype (A, and B scaled),
      LoRA copies      the rank padded to a power of two >= 16, A once more in its GEMM's K order at most
                       (engine/decode.py's _Group)
    the rollout, while it decodes
      KV cache         K and V of every layer for every row and column of the call:
                           bytes a token = 2 · L · Hkv · D · dtype bytes    (7B: 56 KiB; 72B: 320 KiB)
                       for rows x S columns, S = the prompt + the new tokens rounded up to 128 (the
                       engine's cache width): 64 rows of 1280 columns of the 72B are 26.8 GB
      outputs          a token (int64) and its logprob (float32) per row and column; one step's logits
      prefill          one layer's activations over the call's prompt tokens and the largest weight
                       dequantized (freed layer by layer; a captured prefill keeps them in its CUDA
                       graph's pool while the decoder lives)
    the update, one micro-batch at a time
      activations      what backward needs (activation_bytes): per token and layer six H-vectors, k and
                       v, and gate, up and their product: 4.4 MB a token at 7B, 22 MB at 72B. With
                       activation checkpointing each block keeps only its input (H values a token and
                       layer: 1.3 MB a token at 72B) and one block's activations and their gradients exist
                       at a time, recomputed in backward
      hidden states    the micro-batch's final states (B, T, H), those at the completion tokens, and their
                       gradients
      logprob chunk    lm_head's float32 logits over `logp_chunk` tokens (train.completion_logprobs): the
                       logits, their log-softmax, its exp and the entropy's product, and in backward their
                       gradient: LOGP_COPIES float32 (chunk, V) arrays, 3.1 GB at 1024 tokens of 152064.
                       The chunks run between the blocks' forward and their backward, so the larger of
                       this and one block's backward (its activations' gradients, and with checkpointing
                       the activations recomputed) counts
      dequantized      the NVFP4 update runs bf16 GEMMs on weights dequantized when used: the two largest
    headroom           the caching allocator's fragmentation and all this leaves out: 5% of the cap + 1 GiB

The rollout and the update need not share the memory above the fixed part: after a rollout its cache can
be released (rollout.release), at the cost of allocating it and capturing the decode's CUDA graphs again
at the next step's first rollout call.

plan() fits a step into a cap, in this order:
  1. the fixed part, else: which setting would fit it (--quant nvfp4, a lower --lora-rank), and CPU offload
     of AdamW's state where that is the only way to keep the recipe's rank, with what it costs a step;
  2. the update: activation checkpointing off where the asked micro-batch's activations fit, else on;
     where even that does not fit, the micro-batch halves, then the logprob chunk;
  3. the rollout: the most whole groups of G rows whose cache fits what is left, spread evenly over as few
     rollout.generate calls as that allows (8 prompts that fit 6 at a time: 2 calls of 4);
  4. the cache kept through the update where both fit at once, else released after each rollout;
  5. where asked, the held-out evaluation's calls: the rows asked, fewer (whole problems) where their
     cache would not fit beside the fixed part and a kept rollout cache (train.py releases it after).
What does not fit names the setting to lower and the value that would fit. describe() prints the plan.
The estimates against measured peaks: results/memory_plan.md.

train.py's update decides its micro-batches and activation checkpointing with this file's estimates
(activation_bytes, micro_batch_bytes, checkpointing_on).
"""
import math
from dataclasses import dataclass, field

import torch

import nvfp4

GiB = 2**30
HEADROOM_FRACTION = 0.05  # of the cap, plus 1 GiB: the allocator's fragmentation and what is not counted here
LOGP_COPIES = 5  # float32 (chunk, V) arrays alive at once for a chunk's logprobs, forward and backward
CACHE_COLUMNS = 128  # the engine's cache width is the prompt + new tokens rounded up to this (engine/decode.py)
PROMPT_BUCKET = 64  # the prompt rounded up to this first, as the engine pads a graphed prefill's prompts
MIN_LOGP_CHUNK = 128  # the plan lowers the logprob chunk down to this, no further
PCIE_BYTES_S = 25e9  # host <-> GPU copies, for the cost of CPU offload (PCIe 4.0 x16 in practice; Gen5 about 2x)
# the linears that the decode engine runs as one GEMM (engine/decode.py's _Layer), for its LoRA copies
ENGINE_GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))


# ---------------------------------------------------------------------------------------------
# What each part holds
# ---------------------------------------------------------------------------------------------

def linear_shapes(cfg):
    """{name: (out_features, in_features)} of one decoder block's linears."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"q_proj": (q, H), "k_proj": (kv, H), "v_proj": (kv, H), "o_proj": (H, q),
            "gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}


def linear_weights(cfg):
    """Weights of every decoder linear, the ones NVFP4 stores (7B: 6.53 B; 72B: 70.2 B)."""
    return cfg.num_layers * sum(n * k for n, k in linear_shapes(cfg).values())


def weight_bytes(cfg, quant="nvfp4", dtype=torch.bfloat16):
    """Bytes of the base model by part: {"linears", "embeddings", "lm_head", "norms"}."""
    size = dtype.itemsize
    shapes = linear_shapes(cfg)
    n = linear_weights(cfg)
    if quant == "nvfp4":
        rows = cfg.num_layers * sum(out for out, _ in shapes.values())
        linears = n // 2 + n // nvfp4.BLOCK + 4 * rows  # codes, E4M3 block scales, float32 global scales
    elif quant == "bf16":
        linears = n * size
    else:
        raise ValueError(f"quant {quant!r}: nvfp4 or bf16")
    biases = (sum(shapes[k][0] for k in ("q_proj", "k_proj", "v_proj")) if cfg.attention_bias else 0) + \
        (2 * cfg.intermediate_size + cfg.hidden_size if cfg.mlp_bias else 0)
    table = cfg.vocab_size * cfg.hidden_size * size
    return {"linears": linears + cfg.num_layers * biases * size, "embeddings": table,
            "lm_head": 0 if cfg.tie_word_embeddings else table,
            "norms": (2 * cfg.num_layers + 1) * cfg.hidden_size * 4}


def lora_params(cfg, rank, targets=nvfp4.LINEAR_NAMES):
    """LoRA parameters on the targeted linears: r · (in + out) each (72B, r 16, all seven: 211 M)."""
    return cfg.num_layers * sum(rank * (n + k) for name, (n, k) in linear_shapes(cfg).items() if name in targets)


def trained_bytes(cfg, rank, targets=nvfp4.LINEAR_NAMES, train_norms=True, dtype=torch.float32):
    """The trained parameters with their gradients and AdamW's float32 m and v: {"lora", "norms"}. A
    parameter in a dtype below float32 would also need a float32 master copy."""
    per_param = 2 * dtype.itemsize + 8 + (4 if dtype.itemsize < 4 else 0)
    norms = 2 * cfg.num_layers * cfg.hidden_size if train_norms else 0
    return {"lora": lora_params(cfg, rank, targets) * per_param, "norms": norms * (per_param + 4)}  # (+ base copy)


def engine_lora_bytes(cfg, rank, targets=nvfp4.LINEAR_NAMES, dtype=torch.bfloat16):
    """The decode engine's copies of the adapters: per group of linears sharing an input, A (sections · R, K)
    twice (once in its GEMM's K order, at most) and B (N, R), R the rank padded to a power of two >= 16."""
    if not rank:
        return 0
    R = max(16, 1 << math.ceil(math.log2(rank)))
    shapes = linear_shapes(cfg)
    total = 0
    for group in ENGINE_GROUPS:
        if any(name in targets for name in group):
            K = shapes[group[0]][1]
            total += 2 * len(group) * R * K + sum(shapes[name][0] for name in group) * R
    return cfg.num_layers * total * dtype.itemsize


def kv_bytes_per_token(cfg, dtype=torch.bfloat16, kv_cache="model"):
    """K and V of every layer for one token: 2 · L · Hkv · D · dtype bytes (7B 57344, 72B 327680); with the
    FP8 cache (rollout.KVCache) one byte a value and a float32 scale a kv head: 2 · L · Hkv · (D + 4)."""
    if kv_cache == "fp8":
        return 2 * cfg.num_layers * cfg.num_kv_heads * (cfg.head_dim + 4)
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


def cache_columns(prompt_len, max_new_tokens):
    """The engine's cache width for prompts of up to prompt_len tokens and max_new_tokens new ones: the width
    of every rollout.generate call told that prompt_len is the longest prompt to come, whatever its own."""
    prompt = PROMPT_BUCKET * math.ceil(prompt_len / PROMPT_BUCKET)
    return CACHE_COLUMNS * math.ceil((prompt + max_new_tokens) / CACHE_COLUMNS)


def rollout_bytes(cfg, dtype, rows, prompts, prompt_len, max_new_tokens, quant="nvfp4", kv_cache="model"):
    """A rollout.generate call of `prompts` prompts (rows = prompts · G samples) on the GPU engine, while it
    decodes: {"kv cache", "outputs and logits", "prefill"} (the prefill: one layer's activations over the
    prompt tokens, their logits, and for an NVFP4 base the largest weight dequantized, as a prefill of
    hundreds of rows multiplies in bf16). kv_cache: what the cache stores (kv_bytes_per_token)."""
    S = cache_columns(prompt_len, max_new_tokens)
    H, I, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_kv_heads * cfg.head_dim
    one_layer = 3 * I + 4 * H + 2 * kv  # gate|up, their product; x, its norm, q, attention out; k, v (a token)
    largest = max(n * k for n, k in linear_shapes(cfg).values()) if quant == "nvfp4" else 0
    return {"kv cache": rows * S * kv_bytes_per_token(cfg, dtype, kv_cache),
            "outputs and logits": rows * (S * 12 + cfg.vocab_size * (dtype.itemsize + 4)),
            "prefill": (prompts * prompt_len * one_layer + largest) * dtype.itemsize + prompts * cfg.vocab_size * 4}


def activation_bytes(cfg, tokens, dtype, attended=0, gathered=0):
    """About what a forward over `tokens` tokens keeps for backward without activation checkpointing. Per
    token and layer: each RMSNorm's input and output, q and the attention output (6 hidden-size vectors),
    k and v, gate, up and their product (3 intermediate-size vectors); LoRA keeps the inputs of its A's,
    which are among these, and the frozen base weights need none. On top, what attention alone sees
    (model.shared_prompt_attention): `attended` tokens hold their q, k, v and output there too (the padded
    form: a shared prompt again for each further sample, the padding); `gathered` tokens their k and v
    only (the unpadded form, engine/varlen.py: a shared prompt's keys again for each further sample). The
    estimate against measured peaks: results/bench_h200.md."""
    kv = 2 * cfg.num_kv_heads * cfg.head_dim
    per_token = 6 * cfg.hidden_size + kv + 3 * cfg.intermediate_size
    extra = attended * (2 * cfg.hidden_size + kv) + gathered * kv
    return (tokens * per_token + extra) * cfg.num_layers * torch.finfo(dtype).bits // 8


def packed_tokens(prompts, lengths):
    """(sequence lengths, tokens of the packed row) of a micro-batch as train.completion_logprobs runs it:
    each prompt once for its samples (a row whose prompt equals the row before's shares it), no padding."""
    seqs = [len(p) + int(n) for p, n in zip(prompts, lengths)]
    return seqs, sum(seqs) - sum(len(p) for i, p in enumerate(prompts) if i and p == prompts[i - 1])


def micro_batch_bytes(cfg, dtype, prompts, lengths, unpadded=False):
    """activation_bytes of one micro-batch (prompts as token lists, completion lengths): its packed row
    (packed_tokens), and on top what its attention sees: the padded whole sequences, or with `unpadded`
    (where engine/varlen.py runs: varlen.runs) each sequence's keys and values without padding."""
    seqs, packed = packed_tokens(prompts, lengths)
    if unpadded:
        return activation_bytes(cfg, packed, dtype, gathered=sum(seqs) - packed)
    return activation_bytes(cfg, packed, dtype, attended=len(seqs) * max(seqs) - packed)


def update_bytes(cfg, dtype, prompts, lengths, checkpointing, logp_chunk, quant="nvfp4"):
    """One micro-batch's forward and backward in train.update (prompts as token lists, completion lengths),
    by part: the activations kept for backward, the final hidden states, the larger of a logprob chunk and
    one block's backward, the dequantized weights. The attention is counted in its padded form, an upper
    bound of the unpadded one's that a GPU runs (at full length, what the plan sizes, within 1 GB at 7B)."""
    full = micro_batch_bytes(cfg, dtype, prompts, lengths)
    seqs, packed = packed_tokens(prompts, lengths)
    completion, size = sum(int(n) for n in lengths), dtype.itemsize
    block = full // cfg.num_layers
    # kept for backward: each block's input only, or everything; then in backward one block at a time holds
    # the gradients of its activations (and, recomputed, the activations themselves)
    kept = packed * cfg.hidden_size * size * cfg.num_layers if checkpointing else full
    backward = 2 * block if checkpointing else block
    logp = LOGP_COPIES * min(logp_chunk, max(1, completion)) * cfg.vocab_size * 4
    largest = max(n * k for n, k in linear_shapes(cfg).values())
    return {"activations kept for backward": kept,
            "hidden states and their gradients": 2 * (len(seqs) * max(seqs) + completion) * cfg.hidden_size * size,
            # the logprob chunks run after the blocks' forward and before their backward: never both at once
            "logprob chunk, or a block's backward (the larger)": max(logp, backward),
            "dequantized weights": 2 * largest * size if quant == "nvfp4" else 0}


# ---------------------------------------------------------------------------------------------
# What this process may use
# ---------------------------------------------------------------------------------------------

def allocatable_bytes(device):
    """What this process can still allocate on its GPU: free memory and torch's idle cache, within any
    per-process cap (torch.cuda.set_per_process_memory_fraction)."""
    device = torch.device(device)
    if device.index is None:  # "cuda": the current device (get_per_process_memory_fraction wants an index)
        device = torch.device("cuda", torch.cuda.current_device())
    free, total = torch.cuda.mem_get_info(device)
    used = torch.cuda.memory_allocated(device)
    idle = torch.cuda.memory_reserved(device) - used
    cap = getattr(torch.cuda, "get_per_process_memory_fraction", lambda d: 1.0)(device) * total - used
    return min(free + idle, cap)


def gpu_budget(device, cap_gb=None):
    """The bytes a run may plan with on `device`: what this process holds and can still allocate, and at
    most cap_gb · 1e9 (a --mem-cap-gb); None on a CPU, where memory is not measured."""
    device = torch.device(device)
    if device.type != "cuda":
        return None if cap_gb is None else cap_gb * 1e9
    have = torch.cuda.memory_allocated(device) + allocatable_bytes(device)
    return have if cap_gb is None else min(have, cap_gb * 1e9)


def checkpointing_on(mode, device, need):
    """Whether the update recomputes each block in backward (model.gradient_checkpointing), for mode
    "auto", "on" or "off". auto: only where the largest micro-batch's activations (`need` bytes,
    activation_bytes) would not otherwise fit, with 10% and 1 GiB to spare, in what this process can still
    allocate on its GPU (allocatable_bytes). Recomputing adds a forward, about a third of the pass's GEMM
    work (what it cost a 7B step: results/bench_h200.md). On the CPU (the tiny demo, the tests) auto keeps
    it on: memory there is not measured. The gradients are the same either way."""
    device = torch.device(device)
    if mode != "auto" or device.type != "cuda":
        return mode != "off"
    return 1.1 * need + GiB > allocatable_bytes(device)


# ---------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------

@dataclass
class Plan:
    """A step's memory and the settings that fit it (plan()). Byte counts by part; peaks without headroom."""
    cap: float  # bytes the process may use (None: not measured, on the CPU; nothing is fitted)
    headroom: float
    fixed: dict  # part -> bytes, held the whole run
    rollout: dict  # part -> bytes during a rollout call of rollout_rows rows
    update: dict  # part -> bytes during the largest micro-batch
    rollout_rows: int  # rows (whole groups) a rollout.generate call decodes
    rollout_calls: int  # calls a step's prompts take
    keep_cache: bool  # whether the rollout's cache stays allocated through the update (else rollout.release)
    checkpointing: bool
    micro_batch: int
    logp_chunk: int
    asked: dict  # the settings as asked: rollout rows, micro_batch, logp_chunk
    problems: list = field(default_factory=list)  # what does not fit: the setting to lower, to what
    offload: str = None  # CPU offload, only where it is the one way to keep the recipe, with its cost
    title: str = ""
    eval_rows: int = None  # completions a held-out evaluation's rollout.generate call may take (None: not asked)
    prompt_len: int = 0  # the longest prompt of a step (tokens): every rollout call's cache is as wide as for it

    @property
    def fits(self):
        return not self.problems

    @property
    def peak_rollout(self):
        return sum(self.fixed.values()) + sum(self.rollout.values())

    @property
    def peak_update(self):
        return sum(self.fixed.values()) + sum(self.update.values()) + (sum(self.rollout.values()) if self.keep_cache
                                                                       else 0)  # (prefill: the graphs' pool)

    @property
    def peak(self):
        return max(self.peak_rollout, self.peak_update)

    def settings(self):
        """The plan as plain values (for a log line or JSON): its settings, peaks and parts in GB (1e9 bytes),
        what does not fit."""
        gb = lambda parts: {k: v / 1e9 for k, v in parts.items()}
        return dict(rollout_rows=self.rollout_rows, rollout_calls=self.rollout_calls, keep_cache=self.keep_cache,
                    checkpointing=self.checkpointing, micro_batch=self.micro_batch, logp_chunk=self.logp_chunk,
                    peak_rollout_gb=self.peak_rollout / 1e9, peak_update_gb=self.peak_update / 1e9,
                    cap_gb=None if self.cap is None else self.cap / 1e9, headroom_gb=self.headroom / 1e9,
                    fixed_gb=gb(self.fixed), rollout_gb=gb(self.rollout), update_gb=gb(self.update),
                    fits=self.fits, problems=self.problems, offload=self.offload)

    def describe(self):
        """The plan as a table (GB, 1e9 bytes) and its settings, to print at start."""
        gb = lambda b: f"{b / 1e9:8.2f}"
        cap = "no cap (memory not measured)" if self.cap is None else f"{self.cap / 1e9:.2f} GB"
        lines = [f"memory plan{': ' + self.title if self.title else ''} (cap {cap})", "| part | GB |", "| --- | ---: |"]
        lines += [f"| {k} | {gb(v)} |" for k, v in self.fixed.items()]
        lines.append(f"| rollout: {self.rollout_rows} rows a call, {self.rollout_calls} call(s) a step | |")
        lines += [f"|   {k} | {gb(v)} |" for k, v in self.rollout.items()]
        what = "on" if self.checkpointing else "off"
        lines.append(f"| update: micro-batch {self.micro_batch}, activation checkpointing {what}, logprob chunk "
                     f"{self.logp_chunk} | |")
        lines += [f"|   {k} | {gb(v)} |" for k, v in self.update.items()]
        cache = "kept through the update" if self.keep_cache else "released after each rollout (its graphs captured again)"
        lines.append(f"| peak while rolling out / updating (cache {cache}) | {gb(self.peak_rollout).strip()} / "
                     f"{gb(self.peak_update).strip()} |")
        if self.cap is not None:
            lines.append(f"| headroom (fragmentation: {HEADROOM_FRACTION:.0%} of the cap + 1 GiB) | {gb(self.headroom)} |")
            lines.append(f"| left at the peak | {gb(self.cap - self.headroom - self.peak)} |")
        changed = [f"{k} {self.asked[k]} -> {v}" for k, v in (("rollout_rows", self.rollout_rows),
                                                           ("micro_batch", self.micro_batch),
                                                           ("logp_chunk", self.logp_chunk)) if self.asked[k] != v]
        if changed:
            lines.append(("lowered to fit: " if self.fits else "lowered as far as tried: ") + ", ".join(changed))
        if self.eval_rows:
            lines.append(f"held-out evaluation: {self.eval_rows} rows a call, its cache released after")
        lines += [f"DOES NOT FIT: {p}" for p in self.problems]
        if self.offload:
            lines.append("the one way to keep the recipe: " + self.offload)
        return "\n".join(lines)


def _halvings(n, low=1):
    """n, n/2, n/4, ... down to `low` (rounded down)."""
    out = []
    while n >= low:
        out.append(n)
        n //= 2
    return out


def _largest(ok, high):
    """The largest n in [1, high] with ok(n) (ok true up to some n, false after), or 0 if none."""
    lo, hi = 0, high
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def step_shape(prompts, group_size, prompt_len, length):
    """A step's batch as train.update sees it: prompts · G sequences (token lists, each prompt's G samples
    in a row, prompts distinct) and their completion lengths, all `length`."""
    seqs = [[p] * prompt_len for p in range(prompts) for _ in range(group_size)]
    return seqs, [length] * len(seqs)


def largest_update(cfg, dtype, seqs, lengths, micro_batch, checkpointing, logp_chunk, quant):
    """update_bytes of the largest of the micro-batches of `micro_batch` consecutive sequences."""
    parts = [update_bytes(cfg, dtype, seqs[s:s + micro_batch], lengths[s:s + micro_batch], checkpointing, logp_chunk,
                          quant) for s in range(0, len(seqs), micro_batch)]
    return max(parts, key=lambda p: sum(p.values()))


def plan(cfg, cap, *, prompts, group_size, prompt_len, max_new_tokens, micro_batch, lora_rank, logp_chunk=1024,
         quant="nvfp4", dtype=torch.bfloat16, lora_targets=nvfp4.LINEAR_NAMES, train_norms=True,
         checkpointing="auto", headroom=None, title="", eval_samples=None, eval_prompt_len=None,
         eval_max_new_tokens=None, eval_rows=None, kv_cache="model"):
    """Fit one RL step into `cap` bytes (gpu_budget; None: no cap, the settings as asked).

    cfg: the model's config (model.Config); the step: `prompts` prompts of up to `prompt_len` tokens, G =
    `group_size` samples each, up to `max_new_tokens` new tokens; the update in micro-batches of
    `micro_batch` sequences at full length, logprobs in chunks of `logp_chunk` tokens, checkpointing
    "auto" | "on" | "off"; LoRA of rank `lora_rank` on `lora_targets`, the blocks' norms trained or not;
    the rollout's cache storing `kv_cache` (rollout.KVCache; the evaluation's stores the model dtype).
    headroom: bytes kept free (default 5% of the cap + 1 GiB). With eval_samples, eval_prompt_len and
    eval_max_new_tokens, also the rows of a held-out evaluation's calls: `eval_rows` as asked (eval.py's
    batch), lowered in whole problems of eval_samples to fit beside the fixed part and the rollout's
    cache where the plan keeps it. Returns a Plan (the module docstring: the order in which it fits the
    step)."""
    if min(prompts, group_size, prompt_len, max_new_tokens, micro_batch, logp_chunk) < 1 or lora_rank < 0:
        raise ValueError("memory.plan: prompts, group_size, prompt_len, max_new_tokens, micro_batch and logp_chunk "
                         f"must be >= 1 and lora_rank >= 0; got {prompts}, {group_size}, {prompt_len}, "
                         f"{max_new_tokens}, {micro_batch}, {logp_chunk}, {lora_rank}")
    if checkpointing not in ("auto", "on", "off"):
        raise ValueError(f"memory.plan: checkpointing {checkpointing!r}: auto, on or off")
    seqs, lengths = step_shape(prompts, group_size, prompt_len, max_new_tokens)
    head = 0.0 if cap is None else (GiB + HEADROOM_FRACTION * cap if headroom is None else headroom)
    usable = math.inf if cap is None else cap - head

    def fixed_parts(quant, rank):
        w = weight_bytes(cfg, quant, dtype)
        t = trained_bytes(cfg, rank, lora_targets, train_norms)
        parts = {f"{'NVFP4' if quant == 'nvfp4' else 'bf16'} linear weights": w["linears"],
                 "embeddings + lm_head": w["embeddings"] + w["lm_head"], "norms (float32)": w["norms"],
                 f"LoRA r{rank}: parameters, gradients, AdamW m and v (float32)": t["lora"],
                 "the rollout engine's LoRA copies": engine_lora_bytes(cfg, rank, lora_targets, dtype)}
        if train_norms:
            parts["trained norms: the same, and their base values"] = t["norms"]
        return parts

    def least_step(quant=quant, rank=lora_rank):
        """The fixed part and the least a step can run in: one group's rollout, or one sequence's update."""
        one = rollout_bytes(cfg, dtype, group_size, 1, prompt_len, max_new_tokens, quant, kv_cache)
        upd = update_bytes(cfg, dtype, seqs[:1], lengths[:1], True, MIN_LOGP_CHUNK, quant)
        return sum(fixed_parts(quant, rank).values()) + max(sum(one.values()), sum(upd.values()))

    fixed = fixed_parts(quant, lora_rank)
    left = usable - sum(fixed.values())
    problems, offload = [], None
    if left <= 0:
        fixes = []
        if quant == "bf16" and least_step(quant="nvfp4") <= usable:
            fixes.append(f"an NVFP4 base (--quant nvfp4), whose linears take "
                         f"{weight_bytes(cfg, 'nvfp4', dtype)['linears'] / 1e9:.1f} GB instead of "
                         f"{weight_bytes(cfg, 'bf16', dtype)['linears'] / 1e9:.1f}")
        rank = next((r for r in _halvings(lora_rank // 2) if least_step(rank=r) <= usable), 0)
        if rank:
            fixes.append(f"lora_rank (--lora-rank) {rank} or lower")
        problems.append(f"the weights and the trained state alone need {sum(fixed.values()) / 1e9:.1f} GB, "
                        f"{usable / 1e9:.1f} GB usable (the cap less the headroom): "
                        + ("it fits with " + ", or with ".join(fixes) if fixes else
                           "no setting of the step fits it on this GPU"))
        state = 8 * (lora_params(cfg, lora_rank, lora_targets) + (2 * cfg.num_layers * cfg.hidden_size if train_norms
                                                                  else 0))  # AdamW's m and v
        if least_step() - state <= usable:  # each step: the gradients to the CPU, the parameters back (as many bytes)
            offload = (f"AdamW's m and v ({state / 1e9:.1f} GB) in CPU memory and its step on the CPU, which costs "
                       f"copying the gradients there and the parameters back every step, {state / PCIE_BYTES_S:.1f} s "
                       f"at {PCIE_BYTES_S / 1e9:.0f} GB/s, and the CPU's AdamW (not implemented here)")
        left = 0.0

    # the update: checkpointing off where the asked micro-batch fits, else on; then a smaller micro-batch, then a
    # smaller logprob chunk
    ckpt_modes = {"auto": (False, True), "on": (True,), "off": (False,)}[checkpointing]
    tries = [(logp_chunk, micro_batch, ckpt_modes[0])] + \
        [(logp_chunk, m, ckpt_modes[-1]) for m in _halvings(micro_batch)] + \
        [(c, 1, ckpt_modes[-1]) for c in _halvings(logp_chunk // 2, MIN_LOGP_CHUNK)]
    choice = None
    for chunk, m, ckpt in tries:
        upd = largest_update(cfg, dtype, seqs, lengths, m, ckpt, chunk, quant)
        if sum(upd.values()) <= left:
            choice = chunk, m, ckpt, upd
            break
    if choice is None:
        choice = chunk, m, ckpt, upd  # the last and least one tried
        if left > 0:
            n = _largest(lambda t: sum(update_bytes(cfg, dtype, seqs[:1], [t], ckpt, chunk, quant).values()) <= left,
                         max_new_tokens)
            what = f"lower max_new_tokens (--max-new-tokens) to {n}" if n else "no completion length fits"
            problems.append(f"the update of one sequence of {prompt_len} + {max_new_tokens} tokens needs "
                            f"{sum(upd.values()) / 1e9:.1f} GB with activation checkpointing {'on' if ckpt else 'off'}, "
                            f"{left / 1e9:.1f} GB left: {what}")
    chunk, m, ckpt, upd = choice

    # the rollout: the most whole groups whose cache fits, spread evenly over the calls
    call = lambda g: rollout_bytes(cfg, dtype, g * group_size, g, prompt_len, max_new_tokens, quant, kv_cache)
    groups = _largest(lambda g: sum(call(g).values()) <= left, prompts)
    if not groups:
        if left > 0:
            S = cache_columns(prompt_len, max_new_tokens)
            n = _largest(lambda t: sum(rollout_bytes(cfg, dtype, group_size, 1, prompt_len, t, quant,
                                                     kv_cache).values()) <= left, max_new_tokens)
            g = _largest(lambda g: sum(rollout_bytes(cfg, dtype, g, 1, prompt_len, max_new_tokens, quant,
                                                     kv_cache).values()) <= left, group_size)
            fix = ([f"lower max_new_tokens (--max-new-tokens) to {n}"] if n else []) + \
                ([f"group_size (--group-size) to {g}"] if g >= 2 else [])
            problems.append(f"a rollout of one group ({group_size} rows x {S} columns) needs "
                            f"{sum(call(1).values()) / 1e9:.1f} GB, {left / 1e9:.1f} GB left: "
                            f"{' or '.join(fix) or 'no setting of this step fits'}")
        groups = 1
    calls = math.ceil(prompts / groups)
    per_call = math.ceil(prompts / calls)
    ro = call(per_call)
    keep = sum(ro.values()) + sum(upd.values()) <= left  # (a kept decoder keeps its prefill graph's pool too)
    asked_eval, eval_rows = eval_rows, None
    if eval_max_new_tokens and cap is not None:
        room = left - (sum(ro.values()) if keep else 0)
        ev = lambda p: sum(rollout_bytes(cfg, dtype, p * eval_samples, p, eval_prompt_len, eval_max_new_tokens,
                                         quant).values())
        eval_rows = _largest(lambda p: ev(p) <= room, max(1, (asked_eval or 4096) // eval_samples)) * eval_samples
        if not eval_rows and left > 0:
            problems.append(f"a held-out evaluation of one problem ({eval_samples} samples of up to "
                            f"{eval_max_new_tokens} new tokens) needs {ev(1) / 1e9:.1f} GB, {room / 1e9:.1f} GB left: "
                            f"lower --eval-samples or --eval-max-new-tokens")
    return Plan(cap=cap, headroom=head, fixed=fixed, rollout=ro, update=upd, rollout_rows=per_call * group_size,
                rollout_calls=calls, keep_cache=keep, checkpointing=ckpt, micro_batch=m, logp_chunk=chunk,
                asked=dict(rollout_rows=prompts * group_size, micro_batch=micro_batch, logp_chunk=logp_chunk),
                problems=problems, offload=offload, title=title, eval_rows=eval_rows, prompt_len=prompt_len)
