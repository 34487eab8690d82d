"""NVFP4: the 4-bit weight format that QeRL keeps its frozen base model in.

A weight matrix W (N, K) is stored as three tensors, in the convention of compressed-tensors (the
library behind llm-compressor and vLLM's NVFP4 loading), so that checkpoints written here load there:

    packed        uint8          (N, K/2)   two E2M1 codes a byte; element 2i in the LOW nibble
    scale         float8_e4m3fn  (N, K/16)  one scale per block of 16 consecutive elements of a row
    global_scale  float32        (1,)       = 448 * 6 / amax(|W|)

    W[n, k] ≈ e2m1(code[n, k]) * scale[n, k // 16] / global_scale

E2M1 is a 4-bit float: 1 sign bit, 2 exponent bits, 1 mantissa bit. Its eight magnitudes are
{0, 0.5, 1, 1.5, 2, 3, 4, 6}; the code is sign << 3 | index into that list. Cost: 4 bits a value plus
8 bits per 16 values = 4.5 bits a weight, 3.56x fewer bytes than bf16.

Why two levels of scale. E4M3 (max 448) has only 3 mantissa bits and a narrow exponent range, so the
per-block scale amax_block / 6 (which maps the block's largest value onto E2M1's 6) is first
multiplied by the per-tensor global_scale = 448*6/amax. The largest block then uses the top of E4M3's
range (448) and small blocks keep their precision. Quantizing a block:

    s      = fp8( global_scale * amax_block / 6 )         the stored block scale (0 → 0.125, see below)
    code   = round_e2m1( w * global_scale / s )           round to nearest, ties to the even code
    w_hat  = e2m1(code) * s / global_scale

On Gaussian weights this gives a relative MSE ‖W − Ŵ‖² / ‖W‖² of about 0.009 (measured in
tests/test_nvfp4.py); the error is dominated by E2M1's coarse grid, not by the FP8 scales.

Departures and edge cases, each following compressed-tensors so that its quantizer and ours agree
code for code:
- Rounding uses the midpoints of the grid with ties to the even code: 0.25→0, 0.75→1, 1.25→1,
  1.75→2, 2.5→2, 3.5→4, 5→4; values past 6 saturate to 6.
- The sign is the sign bit of the input, so a small negative value rounds to "negative zero"
  (code 8), which decodes to 0.
- An all-zero tensor gets global_scale 1; a block whose scale rounds to 0 in FP8 stores 0.125 (FP8's
  eps in compressed-tensors) instead, so that decoding never divides by zero.
- K must be a multiple of 16 (every linear of the Qwen2.5 family is); otherwise quantize() raises
  rather than padding silently. NaN or Inf in a weight raises with the tensor's name.

Fused groups: one global scale. vLLM runs q/k/v of a layer as one linear (qkv_proj) and gate/up as
one (gate_up_proj), each holding a single global scale; fed separate ones it keeps the largest and warns
that accuracy may degrade. So every member of such a group (FUSED_GROUPS, fused_groups) is quantized
with the group's scale, 448*6 / (the largest amax of its members), the smallest of their own
(shared_global_scale), as llm-compressor writes NVFP4 checkpoints: on a float32 model its NVFP4A16
output equals ours tensor for tensor (tests/test_nvfp4_export.py). (On a bf16 model llm-compressor
computes the scales in bf16, we in float32: a few block scales and codes differ by one step, with the
same error.) The export (save_quantized) and quantizing on load (model.load_weights,
fp4_gemm.quantize_model) share this rule, so a checkpoint exported here and the same bf16 checkpoint
quantized as it loads are one model, code for code and scale for scale (tests/test_model.py). The
price, for a member whose amax is below its group's: its block scales sit lower in E4M3's range, where
the smallest lose precision to its subnormals (tests/test_nvfp4_export.py bounds the error). In
memory the fused QuantLinear (fp4_gemm.QuantLinear.concat) keeps a global scale per row, all equal
within a group.

This file is the pure format: quantize / dequantize / pack, and checkpoint I/O
(`python nvfp4.py --model SRC --out DST`). It imports no kernel; the module that computes with
these tensors, QuantLinear, lives with its kernels in fp4_gemm.py; the CLI takes its model resolver and
its output-folder rules from hub.py.
"""
import argparse
import json
import os
from dataclasses import dataclass

import torch
from safetensors import safe_open
from safetensors.torch import save_file

import hub  # where models come from and outputs go: imports nothing of the project

BLOCK = 16  # elements per FP8 block scale
FP4_MAX = 6.0
FP8_MAX = 448.0
FP8_EPS = 0.125  # the scale compressed-tensors stores for a block whose scale rounds to zero
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# A value v >= threshold (or > threshold for the odd codes) rounds up past that grid midpoint.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)

# The decoder linears QeRL quantizes; embeddings, norms and lm_head stay in high precision.
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The linears vLLM fuses into one (qkv_proj, gate_up_proj): the checkpoint gives each group one global scale.
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


@dataclass
class NVFP4Tensor:
    packed: torch.Tensor  # (N, K/2) uint8
    scale: torch.Tensor  # (N, K/16) float8_e4m3fn
    global_scale: torch.Tensor  # (1,) float32; (N,), one per row, for fused layers (QuantLinear.concat)

    @property
    def shape(self):
        return (self.packed.shape[0], self.packed.shape[1] * 2)

    def to(self, device):
        return NVFP4Tensor(self.packed.to(device), self.scale.to(device), self.global_scale.to(device))


def e2m1_table(device=None, dtype=torch.float32):
    """The 16 values a 4-bit code decodes to: codes 0-7 positive, 8-15 their negatives."""
    pos = torch.tensor(E2M1_VALUES, dtype=dtype, device=device)
    return torch.cat([pos, -pos])


def round_to_e2m1(x):
    """x (float32, already divided by its scale) → uint8 codes, round-to-nearest-even on the grid."""
    mag = x.abs()
    index = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for i, mid in enumerate(_MIDPOINTS):
        # Crossing the midpoint between index i and i+1: a tie goes to the even index.
        up = mag > mid if i % 2 == 0 else mag >= mid
        index += up.to(torch.uint8)
    sign = torch.signbit(x).to(torch.uint8)
    return index | (sign << 3)


def pack(codes):
    """(N, K) codes → (N, K/2) bytes; element 2i in the low nibble, 2i+1 in the high nibble."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack(packed):
    """(N, K/2) bytes → (N, K) codes."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def global_scale_of(w):
    """448*6/amax as float32 of shape (1,); 1.0 for an all-zero tensor (as compressed-tensors)."""
    amax = w.abs().max().float()
    gs = FP8_MAX * FP4_MAX / amax if amax > 0 else torch.tensor(1.0)
    return gs.reshape(1).to(torch.float32)


def shared_global_scale(weights):
    """One global scale for a fused group (q/k/v, or gate/up, of one layer): 448*6 over the group's
    amax. It equals the smallest of the members' own global scales, which is what llm-compressor
    stores for every member, so that the layer vLLM fuses from them has one exact scale."""
    amax = max(w.abs().max().float() for w in weights)
    gs = FP8_MAX * FP4_MAX / amax if amax > 0 else torch.tensor(1.0)
    return gs.reshape(1).to(torch.float32)


def quantize(w, name="weight", global_scale=None):
    """(N, K) float weight → NVFP4Tensor. `name` is only used in error messages. `global_scale`
    (float32, shape (1,)) replaces the tensor's own 448*6/amax, for a fused group sharing one
    (shared_global_scale); it may not exceed the tensor's own, or the largest blocks would clip."""
    if w.dim() != 2:
        raise ValueError(f"{name}: NVFP4 quantizes 2-D weights, got shape {tuple(w.shape)}")
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"{name}: in_features {k} is not a multiple of {BLOCK}, the NVFP4 block size; "
                         f"pad the weight's columns with zeros to a multiple of {BLOCK}, or leave this layer unquantized "
                         f"(fp4_gemm.quantize_model's filter)")
    w = w.float()
    if not torch.isfinite(w).all():
        bad = (~torch.isfinite(w)).sum().item()
        raise ValueError(f"{name}: {bad} NaN/Inf values in the weight; refusing to quantize a broken tensor")
    gs = global_scale_of(w).to(w.device)
    if global_scale is not None:
        shared = torch.as_tensor(global_scale, dtype=torch.float32).reshape(1).to(w.device)
        if not (torch.isfinite(shared).all() and shared.item() > 0):
            raise ValueError(f"{name}: global_scale must be a positive finite number, got {shared.item()}")
        if w.abs().max() > 0 and shared.item() > gs.item():
            raise ValueError(f"{name}: global_scale {shared.item():.6g} exceeds the weight's own "
                             f"{gs.item():.6g} (448*6/amax): its largest blocks would clip; compute it "
                             f"over a group that includes this weight (shared_global_scale)")
        gs = shared
    blocks = w.reshape(n, k // BLOCK, BLOCK)  # (N, K/16, 16)
    amax = blocks.abs().amax(dim=-1)  # (N, K/16)
    scale = (gs * (amax / FP4_MAX)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    scale = torch.where(scale.float() == 0, torch.tensor(FP8_EPS, device=w.device), scale.float())
    scale = scale.to(torch.float8_e4m3fn)  # exact: 0.125 and every stored value are E4M3 numbers
    scaled = blocks / (scale.float() / gs).unsqueeze(-1)  # (N, K/16, 16), now on E2M1's scale
    codes = round_to_e2m1(scaled.clamp(-FP4_MAX, FP4_MAX)).reshape(n, k)
    return NVFP4Tensor(pack(codes), scale, gs)


def byte_table(device=None):
    """(256, 2) float32: the two values each packed byte decodes to (low nibble first)."""
    return e2m1_table(device)[unpack(torch.arange(256, device=device)[:, None])]


def dequantize(q, dtype=torch.float32):
    """NVFP4Tensor → (N, K) tensor of `dtype`, computed in float32: e2m1 * (scale / global_scale).
    global_scale may also hold one value per row, shape (N,), as fused projections do (fp4_gemm)."""
    n, k = q.shape
    values = byte_table(q.packed.device)[q.packed.int()]  # (N, K/2, 2): one lookup decodes both nibbles
    block_scale = q.scale.float() / q.global_scale.float().reshape(-1, 1)  # (N, K/16)
    w = values.reshape(n, k // BLOCK, BLOCK) * block_scale.unsqueeze(-1)
    return w.reshape(n, k).to(dtype)


# ---------------------------------------------------------------------------------------------
# Checkpoint I/O in the compressed-tensors "nvfp4-pack-quantized" layout
# ---------------------------------------------------------------------------------------------

def quantization_config():
    """The config.json entry that tells compressed-tensors / vLLM how the weights are stored
    (weight-only NVFP4, i.e. the NVFP4A16 scheme; lm_head kept in high precision)."""
    weights = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group",
               "group_size": BLOCK, "dynamic": False, "observer": "minmax", "observer_kwargs": {},
               "actorder": None, "block_structure": None, "scale_dtype": None, "zp_dtype": None}
    group = {"targets": ["Linear"], "weights": weights, "input_activations": None,
             "output_activations": None, "format": "nvfp4-pack-quantized"}
    return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
            "quantization_status": "compressed", "config_groups": {"group_0": group},
            "ignore": ["lm_head"], "kv_cache_scheme": None, "global_compression_ratio": None}


def is_nvfp4_config(config):
    """True when an HF config dict describes a checkpoint written in this layout."""
    qc = config.get("quantization_config") or {}
    if qc.get("quant_method") != "compressed-tensors":
        return False
    formats = {qc.get("format")} | {g.get("format") for g in qc.get("config_groups", {}).values()}
    return "nvfp4-pack-quantized" in formats


def fused_group(key, keys=None):
    """The checkpoint keys quantized with one shared global scale together with `key`: q/k/v of its
    layer, or gate/up of its layer (those present in `keys`, when given); (key,) for o_proj, down_proj.
    vLLM runs each group as one fused linear (qkv_proj, gate_up_proj) that holds a single global scale
    (given separate ones it keeps their largest global scale, the smallest amax's, so the other members
    decode too small, and warns), so a checkpoint for vLLM must share it,
    as llm-compressor's NVFP4 schemes write it."""
    parts = key.split(".")  # model.layers.3.self_attn.q_proj.weight
    prefix, name = ".".join(parts[:-2]), parts[-2]
    for group in FUSED_GROUPS:
        if name in group:
            members = tuple(f"{prefix}.{n}.weight" for n in group)
            return tuple(m for m in members if keys is None or m in keys) or (key,)
    return (key,)


def fused_groups(keys):
    """The keys (checkpoint keys, or module names + '.weight') in groups that share one global scale:
    each key in exactly one group, in the order of the groups' first members; a key that belongs to no
    fused group (o_proj, down_proj, any other name) is a group of its own, and so is a member whose
    partners are not among `keys` (fused_group)."""
    keys = list(keys)
    present = set(keys)
    return list(dict.fromkeys(fused_group(key, present) for key in keys))


def _read_tensor(folder, shard, key):
    path = os.path.join(folder, shard)
    with safe_open(path, "pt") as f:
        return hub.check_tensor(f.get_tensor(key), key, path)


def is_quantized_key(key):
    """model.layers.3.mlp.up_proj.weight → True: the weights this format replaces."""
    parts = key.split(".")
    return key.endswith(".weight") and len(parts) >= 3 and parts[-2] in LINEAR_NAMES and ".layers." in key


def weight_map(folder):
    """{tensor key: shard file name} of an HF checkpoint folder (sharded with
    model.safetensors.index.json, or one model.safetensors)."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return json.load(f)["weight_map"]
    path = os.path.join(folder, "model.safetensors")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{folder}: no model.safetensors or model.safetensors.index.json")
    try:
        with safe_open(path, "pt") as f:
            return {k: "model.safetensors" for k in f.keys()}
    except Exception as e:  # truncated or not safetensors: name the file
        raise ValueError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e}); "
                         f"download or copy it again") from None


def save_quantized(src, dst, progress=True, force=False):
    """Quantize the decoder linears of the HF checkpoint folder `src` into `dst`, shard by shard
    (one shard's output in memory at a time, so a 32B model needs no 64 GB of RAM). Everything else
    (embeddings, norms, lm_head, biases) is copied unchanged; tokenizer files come along.
    The folder appears atomically: written under a temporary name, then renamed; the temporary folder
    goes on any failure, and a write that fails (a full disk: safetensors' SafetensorError or an OSError)
    stops with one line naming the file, `dst` left as it was (hub.writing). `dst` may replace only what
    this project wrote: an earlier output of this command, or, with force, another command's
    (hub.check_out, hub.FORCE_HELP)."""
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    if config.get("quantization_config"):
        raise ValueError(f"{src} is already quantized ({config['quantization_config'].get('quant_method')})")
    with hub.new_folder(dst, "nvfp4.py", sources=[src], force=force) as tmp:
        _write_quantized(src, tmp, config, progress, dst)
    return dst


def _write_quantized(src, tmp, config, progress, dst=None):
    """save_quantized's work, into the empty folder tmp (renamed to dst when complete: a failed write names
    the file as it would lie in dst)."""
    dst = dst or tmp
    kept = (f"{dst} is as it was" if os.path.exists(dst) else f"nothing was written to {dst}") + \
        " (the partial output is removed)"
    from tqdm import tqdm

    keys = weight_map(src)
    shards = sorted(set(keys.values()))
    written, group_scales = {}, {}  # fused group (tuple of keys) -> its shared global scale
    bar = tqdm(total=len(keys), desc="quantizing to NVFP4", unit="tensor", disable=not progress)
    for i, shard in enumerate(shards):
        out = {}
        path = os.path.join(src, shard)
        with safe_open(path, "pt") as f:
            for key in f.keys():
                t = hub.check_tensor(f.get_tensor(key), key, path)  # finite: a NaN would be copied or refused unnamed
                if is_quantized_key(key):
                    members = fused_group(key, keys)
                    if members not in group_scales:  # read the group's other members (any shard) once
                        group_scales[members] = shared_global_scale(
                            [t if m == key else _read_tensor(src, keys[m], m) for m in members])
                    q = quantize(t, name=key, global_scale=group_scales[members])
                    base = key[: -len("weight")]
                    out[base + "weight_packed"] = q.packed
                    out[base + "weight_scale"] = q.scale
                    out[base + "weight_global_scale"] = q.global_scale.clone()  # (a group's members share one)
                else:
                    out[key] = t
                bar.update(1)
        name = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        with hub.writing(os.path.join(dst, name), kept):
            save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(tmp, name), metadata={"format": "pt"})
        written.update({k: name for k in out})
    bar.close()
    config["quantization_config"] = quantization_config()
    files = {"config.json": json.dumps(config, indent=2).encode()}
    if len(shards) > 1:
        files["model.safetensors.index.json"] = json.dumps({"metadata": {}, "weight_map": written}, indent=2).encode()
    for name in os.listdir(src):
        if name.startswith("tokenizer") or name in ("vocab.json", "merges.txt", "special_tokens_map.json",
                                                   "generation_config.json", "chat_template.jinja"):
            with open(os.path.join(src, name), "rb") as f:  # (read here, so a write error below is the write's)
                files[name] = f.read()
    for name, data in files.items():
        with hub.writing(os.path.join(dst, name), kept), open(os.path.join(tmp, name), "wb") as f:
            f.write(data)


def main(argv=None):
    parser = argparse.ArgumentParser(description="Quantize an HF Qwen2/Llama checkpoint's decoder linears to NVFP4 "
                                                 "(compressed-tensors nvfp4-pack-quantized layout).")
    parser.add_argument("--model", required=True, help="local HF folder, alias (qwen2.5-7b, tiny) or hub id")
    parser.add_argument("--out", required=True, help="output folder: new, empty, or an earlier output of this "
                        "command (which it replaces; a killed earlier run's temporary folder beside it is removed)")
    parser.add_argument("--force", action="store_true", help=hub.FORCE_HELP)
    args = parser.parse_args(argv)
    with hub.stop_on_bad_input("nvfp4.py"):  # a missing model or an unusable --out, before any work
        src, config = hub.read_config_json(args.model)
        if config.get("quantization_config"):
            raise ValueError(f"{src} is already quantized ({config['quantization_config'].get('quant_method')}); "
                             f"pass the unquantized checkpoint")
        hub.check_out(args.out, "nvfp4.py", sources=[src], force=args.force)
        save_quantized(src, args.out, force=args.force)  # (unreadable shards name themselves)
    mb = sum(os.path.getsize(os.path.join(args.out, f)) for f in os.listdir(args.out)) / 2**20
    print(f"wrote {args.out} ({mb:.1f} MiB)")


if __name__ == "__main__":
    main()
