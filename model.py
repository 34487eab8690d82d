"""A minimal Qwen2-family decoder (Qwen2, Qwen2.5, Llama) that loads Hugging Face checkpoints.

The architecture, for one token stream x (B, T, H) through L identical blocks:

    h = x + o_proj( attention( rope(q_proj(n1)), rope(k_proj(n1)), v_proj(n1) ) )   n1 = rmsnorm1(x)
    x = h + down_proj( silu(gate_proj(n2)) * up_proj(n2) )                          n2 = rmsnorm2(h)
    logits = lm_head( rmsnorm(x) )

- RMSNorm: x / sqrt(mean(x²) + eps) * w. The weight is kept in float32 whatever the model's dtype:
  AQN (aqn.py) adds noise of sigma ~1e-3 to it, which bf16 (8 bits of mantissa, a step of 2^-7
  near 1.0) would round away.
- Attention: grouped-query (num_key_value_heads ≤ num_attention_heads; each kv head serves a group of
  query heads), causal, rotary position embedding on q and k with base rope_theta. Qwen2 has biases
  on q/k/v (attention_bias), Llama does not.
- MLP: SwiGLU. Embeddings tied to lm_head or not (tie_word_embeddings).

Everything the model is comes from config.json (never from the folder's name). Weights are read
from safetensors (one file, or shards listed in model.safetensors.index.json) through an explicit key
map (our names are HF's without the leading "model."), with a shape check per tensor, into a model
first built on the meta device so no memory is spent on a random init.

Every linear is an ordinary module, and `swap_linears(make, filter)` replaces them: fp4_gemm
swaps in NVFP4 QuantLinears, lora.py wraps them with adapters. A folder whose config.json carries a
compressed-tensors NVFP4 quantization_config (written by `python nvfp4.py`) loads straight into
QuantLinears, as does `from_pretrained(..., quantize=True)` on a bf16 folder, one fused group of weights
at a time (q/k/v, gate/up of a layer: they share one global scale, as the export writes them), so a
32B model is never whole in bf16 and the two routes give the same model bit for bit. Every tensor read
is checked finite and of the shape (and, for NVFP4's tensors, the dtype) the model expects.

The forward takes optional positions (B, T) and a KV cache: any object with `length` (columns
filled), `attend(layer, q, k, v) -> out` and `advance(T)` (rollout.py's KVCache is the one the sampler
uses). Without them it is a plain causal forward over the whole sequence. `shared_prompt_hidden`
runs sequences that share a prompt as one packed row, the prompt once (the RL update's samples).
"""
import functools
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from torch.utils.checkpoint import checkpoint

import fp4_gemm
import hub
import nvfp4
from engine import varlen
# Where models come from lives in hub.py (the bottom of the import graph); these names stay importable
# from here for the callers that know them as model's.
from hub import (ALIASES, load_tokenizer, resolve_device, resolve_model_dir, stop_on_bad_input,  # noqa: F401
                 stop_token_ids)
from hub import read_config_json

SUPPORTED = ("qwen2", "llama")


class Config:
    """The fields of an HF config.json that the architecture needs, checked."""

    def __init__(self, d):
        model_type = d.get("model_type")
        if model_type not in SUPPORTED:
            raise ValueError(f"unsupported architecture model_type={model_type!r} "
                             f"(architectures={d.get('architectures')}); this decoder supports {SUPPORTED}")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act={d.get('hidden_act')!r}; only SwiGLU (silu) is implemented")
        # transformers < 5 writes rope_theta and rope_scaling; 5.x writes them into rope_parameters.
        rope = {**(d.get("rope_scaling") or {}), **(d.get("rope_parameters") or {})}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"unsupported rope scaling {rope}; only plain RoPE is implemented")
        if d.get("use_sliding_window"):
            raise ValueError("use_sliding_window=true is not supported; set it false (Qwen2.5 ships it false)")
        self.model_type = model_type
        self.vocab_size = d["vocab_size"]
        self.hidden_size = d["hidden_size"]
        self.intermediate_size = d["intermediate_size"]
        self.num_layers = d["num_hidden_layers"]
        self.num_heads = d["num_attention_heads"]
        self.num_kv_heads = d.get("num_key_value_heads") or self.num_heads
        self.head_dim = d.get("head_dim") or self.hidden_size // self.num_heads
        self.rms_norm_eps = d.get("rms_norm_eps", 1e-6)
        self.rope_theta = d.get("rope_theta") or rope.get("rope_theta") or 10000.0
        self.tie_word_embeddings = d.get("tie_word_embeddings", False)
        self.attention_bias = d.get("attention_bias", model_type == "qwen2")
        self.mlp_bias = d.get("mlp_bias", False)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads {self.num_kv_heads}")
        self.raw = d

    def __repr__(self):
        return (f"Config({self.model_type}: L={self.num_layers} H={self.hidden_size} I={self.intermediate_size} "
                f"heads={self.num_heads}/{self.num_kv_heads}x{self.head_dim} V={self.vocab_size} tied={self.tie_word_embeddings})")


def qwen25_config(size):
    """The published Qwen2.5-{size}-Instruct config.json (size: '0.5b' … '72b'), for building
    random-weight models of the real shapes in benchmarks, where no checkpoint can be downloaded. Every
    size has rope_theta 1e6, rms_norm_eps 1e-6 and 32768 positions in its Instruct config.json (the 72B
    base model's says 1e-5 and 131072; sources: results/memory_plan.md). Past 32768 tokens Qwen's model
    card adds a YaRN rope_scaling, which Config refuses."""
    shapes = {  # hidden, intermediate, layers, heads, kv heads, vocab, tied
        "0.5b": (896, 4864, 24, 14, 2, 151936, True), "1.5b": (1536, 8960, 28, 12, 2, 151936, True),
        "3b": (2048, 11008, 36, 16, 2, 151936, True), "7b": (3584, 18944, 28, 28, 4, 152064, False),
        "14b": (5120, 13824, 48, 40, 8, 152064, False), "32b": (5120, 27648, 64, 40, 8, 152064, False),
        "72b": (8192, 29568, 80, 64, 8, 152064, False)}
    if size.lower() not in shapes:
        raise ValueError(f"unknown Qwen2.5 size {size!r}; use one of {', '.join(shapes)}")
    h, i, n, a, kv, v, tied = shapes[size.lower()]
    return Config({"model_type": "qwen2", "hidden_size": h, "intermediate_size": i, "num_hidden_layers": n,
                   "num_attention_heads": a, "num_key_value_heads": kv, "vocab_size": v,
                   "tie_word_embeddings": tied, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6})


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))  # float32 always: see the docstring

    def forward(self, x):
        # In float32 with the float32 weight, one rounding at the end. torch's rms_norm: the same numbers
        # (bit-identical on CPU: tests/test_model.py), and recent torch runs it as one fused CUDA kernel
        # forward and backward where the spelled-out form made about eight passes (results/bench_h200.md).
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight, self.eps).to(x.dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(q, k, cos, sin):
    """The rotary embedding of q and k (..., D) at the angles whose cos / sin broadcast against them."""
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rope_cos_sin(positions, inv_freq, dtype):
    """positions (B, T) → cos, sin (B, 1, T, D), computed in float32 like transformers."""
    freqs = positions[..., None].float() * inv_freq  # (B, T, D/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (B, T, D)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


class Attention(nn.Module):
    def __init__(self, cfg, layer_idx, dtype):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h, q_out, kv_out = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(h, q_out, bias=cfg.attention_bias, dtype=dtype)
        self.k_proj = nn.Linear(h, kv_out, bias=cfg.attention_bias, dtype=dtype)
        self.v_proj = nn.Linear(h, kv_out, bias=cfg.attention_bias, dtype=dtype)
        self.o_proj = nn.Linear(q_out, h, bias=False, dtype=dtype)

    def forward(self, x, cos, sin, cache=None, shared=None):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # (B, Hq, T, D)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        q, k = apply_rope(q, k, cos, sin)
        if cache is not None:
            out = cache.attend(self.layer_idx, q, k, v)  # (B, Hq, T, D)
        elif shared is not None:
            out = shared_prompt_attention(q, k, v, *shared)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # (B, Hq, T, D)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


def packed_row(lengths, prefix, L):
    """The packed row of B sequences (Transformer.shared_prompt_hidden), of these lengths, each sharing its
    first prefix[b] tokens with the sequence before, laid out in a (B, L) batch: index (B, L), where token j
    of sequence b lies in the row (a shared token where the sequence before has it; past the length, copies
    of the last token, after every real query), and packed (P,), each row token's flat position b·L + j."""
    index = torch.zeros(len(lengths), L, dtype=torch.long)
    packed, P = [], 0
    for b, (n, s) in enumerate(zip(lengths, prefix)):
        index[b, :s] = index[b - 1, :s]
        index[b, s:n] = torch.arange(P, P + n - s)
        index[b, n:] = index[b, n - 1]
        packed.append(torch.arange(b * L + s, b * L + n))
        P += n - s
    return index, torch.cat(packed)


def shared_prompt_attention(q, k, v, index, packed, *segments):
    """Causal attention over a packed row (Transformer.shared_prompt_hidden): q (1, Hq, P, D), k and v
    (1, Hkv, P, D) hold the P tokens that B sequences have, each shared prompt once; index (B, L) says
    where token j of sequence b lies among them, packed (P,) where each of them lies among the B·L.
    Attention alone sees the whole sequences (gathered by index: a shared prompt's queries, keys and
    values repeated in each, padding as copies that no real query sees), with a square causal mask,
    which SDPA's fastest kernels take. Each token's output is its own sequence's (a prompt's: its first
    sequence's). → (1, Hq, P, D). On a GPU, engine/varlen.py computes the same without the padding and
    the repeated queries, from `segments` (its segments(): the sequences' layout for its kernel)."""
    if segments and varlen.runs(q.device, q.dtype, q.shape[-1]):
        return varlen.attention(q, k, v, *segments, index.shape[1])

    def whole(t):  # (1, H, P, D) → (B, H, L, D)
        return t[0][:, index].transpose(0, 1)

    out = F.scaled_dot_product_attention(whole(q), whole(k), whole(v), is_causal=True, enable_gqa=True)
    return out.transpose(0, 1).flatten(1, 2)[:, packed][None]


def to_device(t, device):
    """A host tensor on `device` without the host waiting for the GPU. From pageable memory a copy first
    waits for everything queued on the stream (CUDA stages it through a buffer of its own): an update that
    copies a micro-batch's index tensors that way leaves the GPU idle while the host builds them. From
    pinned memory the copy is queued like a kernel (torch keeps the pinned buffer until the copy has run),
    and the host builds the next micro-batch while the GPU runs this one. Elsewhere: t.to(device)."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class MLP(nn.Module):
    def __init__(self, cfg, dtype):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=cfg.mlp_bias, dtype=dtype)
        self.up_proj = nn.Linear(h, i, bias=cfg.mlp_bias, dtype=dtype)
        self.down_proj = nn.Linear(i, h, bias=cfg.mlp_bias, dtype=dtype)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg, layer_idx, dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, dtype)

    def forward(self, x, cos, sin, cache=None, shared=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, shared)
        return x + self.mlp(self.post_attention_layernorm(x))


@functools.lru_cache(maxsize=None)
def _compiled_block(backend):
    """Block.forward through torch.compile, for training. The layers share the compiled code (the block
    is an argument, its weights are graph inputs; only the first layer, whose input needs no gradient,
    gets a graph of its own). It fuses the elementwise passes between the GEMMs (rotary, residual adds,
    SiLU * up, LoRA's adds and casts) that eager runs as a kernel each (timings: results/bench_h200.md)."""
    return torch.compile(Block.forward, backend=backend)


class Transformer(nn.Module):
    def __init__(self, cfg, dtype=torch.float32):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(Block(cfg, i, dtype) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)
        self.gradient_checkpointing = False  # recompute each block in backward (train.update decides)
        self.compile_blocks = None  # a torch.compile backend for the blocks in training (train.py: on a GPU)

    def _inv_freq(self, device=None):
        d = self.config.head_dim
        return 1.0 / (self.config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))

    def materialize(self, device):
        """Allocate the meta-device model on `device` (uninitialized), re-tying lm_head, which
        to_empty would untie, and recomputing the rope frequencies, which are not in checkpoints."""
        self.to_empty(device=device)
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.inv_freq = self._inv_freq(device)

    @property
    def dtype(self):
        return self.embed_tokens.weight.dtype

    @property
    def device(self):
        return self.embed_tokens.weight.device

    @property
    def unpadded_attention(self):
        """Whether shared_prompt_hidden's attention runs without padding here (engine/varlen.py: on a GPU, in
        16 bits), which the update's slicing counts (logprobs.micro_batches)."""
        return varlen.runs(self.device, self.dtype, self.config.head_dim)

    def hidden(self, tokens, positions=None, cache=None, shared=None):
        """tokens (B, T) → final-normed hidden states (B, T, H), before lm_head. shared = (index, packed,
        *segments): the one row packs several sequences (shared_prompt_hidden)."""
        B, T = tokens.shape
        if positions is None:
            start = cache.length if cache is not None else 0
            positions = torch.arange(start, start + T, device=tokens.device).expand(B, T)
        x = self.embed_tokens(tokens)  # (B, T, H)
        cos, sin = rope_cos_sin(positions, self.inv_freq, x.dtype)  # (B, 1, T, D)
        training = self.training and torch.is_grad_enabled()
        compiled = _compiled_block(self.compile_blocks) if training and self.compile_blocks else None
        if compiled:  # each micro-batch brings its own token and sequence counts: compile shape-generic at once;
            # else torch compiles for static shapes first, then again as each count first changes (seconds
            # each, once a run: results/bench_h200.md)
            dims = [(cos, 0), (cos, 2), (sin, 0), (sin, 2)]
            for t, d in dims + ([(shared[0], 0), (shared[0], 1)] + [(t, 0) for t in shared[1:]] if shared else []):
                torch._dynamo.maybe_mark_dynamic(t, d)
        for layer in self.layers:
            run = functools.partial(compiled, layer) if compiled else layer
            if compiled:  # every block's input, not the first only: each is a new tensor, whose unmarked
                # sizes would compile the later blocks' graph once more when the counts first change
                torch._dynamo.maybe_mark_dynamic(x, 0)
                torch._dynamo.maybe_mark_dynamic(x, 1)
            if self.gradient_checkpointing and training:
                x = checkpoint(run, x, cos, sin, cache, shared, use_reentrant=False)
            else:
                x = run(x, cos, sin, cache, shared)
        if cache is not None:
            cache.advance(T)
        return self.norm(x)

    def shared_prompt_hidden(self, tokens, lengths, prefix):
        """hidden(tokens) for B right-padded sequences, tokens (B, L) of lengths (B,), in which sequence b
        begins with the first prefix[b] tokens of sequence b - 1 (0: nothing shared), with each shared
        token and all padding run once or not at all. That is an RL update's G samples of a prompt
        (train.completion_logprobs): with 256-token prompts and 1024-token completions it is a sixth
        fewer tokens (the update's time: results/bench_h200.md). The caller vouches that
        the shared tokens are equal. The model sees one packed row of the distinct tokens, each at its
        position in its sequence; only attention tells the sequences apart (shared_prompt_attention).
        Backward sums the gradients of every sequence that reads a shared token into it. Returns
        (B, L, H), final-normed; past a sequence's length the states mean nothing."""
        B, L = tokens.shape
        lengths = [int(n) for n in lengths]
        if (min(lengths) < 1 or max(lengths) > L or prefix[0]
                or any(s > min(n, m) for s, n, m in zip(prefix[1:], lengths[1:], lengths))):
            raise ValueError(f"shared_prompt_hidden: every sequence needs 1 to {L} tokens (the width of tokens), "
                             f"prefix[0] must be 0 and prefix[b] at most the lengths of sequences b and b - 1; "
                             f"got lengths {lengths}, prefix {prefix}")
        index, packed = packed_row(lengths, prefix, L)
        if B == 1:  # attention runs a lone sequence as two copies of it: torch.compile specializes a count of
            # one, so one sequence would compile the blocks anew in whatever later step first brings it
            index = index.repeat(2, 1)
        index, packed, *segments = (to_device(t, tokens.device)
                                    for t in (index, packed, *varlen.segments(index, lengths, prefix)))
        h = self.hidden(tokens.flatten()[packed][None], (packed % L)[None], shared=(index, packed, *segments))[0]
        return h[index[:B]]  # (B, L, H) from (P, H)

    def forward(self, tokens, positions=None, cache=None):
        """tokens (B, T) → logits (B, T, V)."""
        return self.lm_head(self.hidden(tokens, positions, cache))

    def swap_linears(self, make, filter):
        """Replace every submodule for which filter(name, module) holds by make(name, module).
        Names are dotted paths like 'layers.3.mlp.up_proj'. Returns the new modules by name."""
        chosen = [(name, m) for name, m in self.named_modules() if name and filter(name, m)]
        new = {}
        for name, m in chosen:
            parent_name, _, child = name.rpartition(".")
            parent = self.get_submodule(parent_name) if parent_name else self
            new[name] = make(name, m)
            setattr(parent, child, new[name])
        return new

    @classmethod
    def _skeleton(cls, cfg, dtype, quantize):
        """The model on the meta device (no memory yet), its decoder linears empty QuantLinears when
        quantize."""
        with torch.device("meta"):
            model = cls(cfg, dtype)
        if quantize:
            model.swap_linears(lambda name, m: fp4_gemm.QuantLinear(m.in_features, m.out_features, m.bias is not None,
                                                                     dtype=dtype), fp4_gemm.is_decoder_linear)
        return model

    @classmethod
    def from_pretrained(cls, name_or_path, dtype=torch.bfloat16, device="cpu", quantize=False):
        """Load an HF Qwen2/Llama folder, alias or hub id. NVFP4 folders load as NVFP4; with
        quantize=True a bf16/fp32 folder is quantized to NVFP4 as it loads, with the export's shared
        global scales (load_weights): the model `python nvfp4.py` would have written."""
        folder, raw, cfg = read_config(name_or_path)
        model = cls._skeleton(cfg, dtype, quantize or nvfp4.is_nvfp4_config(raw))
        model.materialize(device)
        load_weights(model, folder, quantize_on_load=quantize and not nvfp4.is_nvfp4_config(raw))
        return model.eval()

    @classmethod
    def from_random(cls, cfg, dtype=torch.bfloat16, device="cpu", quantize=False, seed=0, std=0.02):
        """A model of cfg's shape with N(0, std) weights, built layer by layer on `device` (and
        quantized layer by layer with quantize=True): for benchmarks of real shapes without weights."""
        gen = torch.Generator(device=device).manual_seed(seed)
        model = cls._skeleton(cfg, dtype, quantize)
        model.materialize(device)
        for name, m in model.named_modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                m.weight.data.normal_(0, std, generator=gen)
            elif isinstance(m, RMSNorm):
                m.weight.data.fill_(1.0)
            if getattr(m, "bias", None) is not None:
                m.bias.data.normal_(0, std, generator=gen)
        # The quantized linears' weights: drawn and quantized a fused group at a time, with its shared scale.
        quant = {name + ".weight": m for name, m in model.named_modules() if isinstance(m, fp4_gemm.QuantLinear)}
        fp4_gemm.quantize_in_groups(quant, lambda key: torch.randn(
            quant[key].out_features, quant[key].in_features, generator=gen, device=device, dtype=dtype) * std)
        return model.eval()


def hf_key(name):
    """Our parameter name → the HF checkpoint's key (ours are HF's without the 'model.' prefix)."""
    return name if name.startswith("lm_head.") else "model." + name


def load_weights(model, folder, quantize_on_load=False):
    """Fill `model` (already materialized, possibly with QuantLinears) from the folder's safetensors.
    Every tensor read is checked (hub.check_tensor): finite, of the shape config.json gives it, and, for
    NVFP4's codes, block scales and global scales, of their exact dtype (any float is cast to the
    model's dtype); a bad one stops the load with one line naming the file. With quantize_on_load the
    QuantLinears take float weights from the checkpoint and quantize them as they arrive, a fused group
    (q/k/v, gate/up of a layer) at a time with its one shared global scale (fp4_gemm.quantize_in_groups),
    as `python nvfp4.py` exports them: the same codes and scales as loading the exported folder."""
    weight_map = nvfp4.weight_map(folder)
    tied = model.config.tie_word_embeddings
    # The explicit map: every tensor the model holds, by its checkpoint key.
    wanted = {hf_key(n): t for n, t in model.state_dict().items() if not (tied and n == "lm_head.weight")}
    quant_modules = {hf_key(n) + ".weight": m for n, m in model.named_modules()
                     if isinstance(m, fp4_gemm.QuantLinear)} if quantize_on_load else {}
    for key in quant_modules:  # these arrive as float weights and are quantized here
        for suffix in ("weight_packed", "weight_scale", "weight_global_scale"):
            wanted.pop(key[: -len("weight")] + suffix)
    missing = [k for k in list(wanted) + list(quant_modules) if k not in weight_map]
    if missing:
        raise KeyError(f"{folder}: checkpoint lacks {len(missing)} tensors the model needs, e.g. {missing[:5]}")
    ignorable = lambda k: k.endswith("rotary_emb.inv_freq") or (tied and k == "lm_head.weight")
    unexpected = [k for k in weight_map if k not in wanted and k not in quant_modules and not ignorable(k)]
    if unexpected:
        raise KeyError(f"{folder}: checkpoint has {len(unexpected)} tensors this architecture does not use, "
                       f"e.g. {unexpected[:5]}; is config.json's model_type right?")
    shards = {}  # shard file -> its open handle; a fused group's members may lie in different shards

    def read(key, shape, dtype=None):
        path = os.path.join(folder, weight_map[key])
        if path not in shards:
            try:  # a truncated or corrupted shard: name it, rather than safetensors' bare error
                shards[path] = safe_open(path, "pt")
            except Exception as e:
                raise ValueError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e}); "
                                 f"download or copy it again") from None
        try:
            t = shards[path].get_tensor(key)
        except Exception as e:
            raise ValueError(f"{path}: cannot read tensor {key} ({type(e).__name__}: {e}); the file may be "
                             f"truncated: download or copy it again") from None
        if dtype is None and not t.is_floating_point():
            raise ValueError(f"{path}: {key} has dtype {t.dtype}, expected a floating-point weight")
        return hub.check_tensor(t, key, path, shape=shape, dtype=dtype)

    for key in sorted(wanted, key=lambda k: weight_map[k]):  # shard by shard
        dst = wanted[key]
        exact = key.endswith(("weight_packed", "weight_scale", "weight_global_scale"))  # NVFP4's own dtypes
        src = read(key, dst.shape, dst.dtype if exact else None)
        dst.copy_(src if exact else src.to(dst.dtype))
    shape = lambda key: (quant_modules[key].out_features, quant_modules[key].in_features)  # noqa: E731
    fp4_gemm.quantize_in_groups(quant_modules, lambda key: read(key, shape(key)).to(model.device))


def read_config(name_or_path):
    """(folder, config.json as a dict, Config) of a model folder, alias or hub id: Config raises for an
    architecture this decoder does not implement, so a CLI can check its --model before loading anything."""
    folder, raw = read_config_json(name_or_path)
    try:
        return folder, raw, Config(raw)
    except (KeyError, TypeError) as e:
        raise ValueError(f"{os.path.join(folder, 'config.json')}: missing or malformed field {e}") from None
