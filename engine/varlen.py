"""The update's attention without padding: model.shared_prompt_attention through torch's variable-length
flash attention.

Speeds up: model.shared_prompt_attention, the attention of train.update's packed micro-batches
(Transformer.shared_prompt_hidden), which gathers each sequence whole, pads it to the micro-batch's longest
and asks every position's query again in every sequence, a square causal mask being what SDPA's fastest
kernels take. At RL lengths that is 3-5x the work of the sequences themselves (results/engine_floor_h100.md).
Here only the packed row's tokens ask, each once, over the keys of its own sequence gathered without
padding: a sequence's queries are its own tokens (the last of its keys; a shared prompt's queries ask in
the prompt's first sequence only), and flash attention aligns the causal mask of fewer queries than keys
to the last key, the lower-right mask they need. The result is already in the packed row's order.
Tested against: shared_prompt_attention's padded form (tests/engine/test_varlen.py: the segments on the
CPU through a stand-in of the kernel; on a GPU the kernel and its backward, alone and through a bf16
model). Measured on an H100 (the update's attention time halved, its peak memory lower):
results/engine_floor_h100.md.
"""
import inspect
import itertools

import torch

try:  # torch 2.10 on
    from torch.nn.attention.varlen import varlen_attn
except ImportError:
    varlen_attn = None

# The causal mask by the name this torch gives it: 2.10 and 2.11 take is_causal; 2.12 on, window_size (left,
# right) = (-1, 0). 2.12 on want enable_gqa for fewer key heads than query heads; before, the flash kernel
# takes them as they are.
_PARAMS = inspect.signature(varlen_attn).parameters if varlen_attn is not None else {}
_CAUSAL = dict(window_size=(-1, 0)) if "window_size" in _PARAMS else dict(is_causal=True)
_GQA = dict(enable_gqa=True) if "enable_gqa" in _PARAMS else {}


def runs(device, dtype, head_dim):
    """Whether the flash kernel takes queries of this device, dtype and head size: CUDA, 16-bit, heads of at
    most 256, and a torch that has varlen_attn. (The update's slicing asks too: memory.micro_batch_bytes
    counts the attention's memory in the form that runs.)"""
    return (varlen_attn is not None and torch.device(device).type == "cuda"
            and dtype in (torch.float16, torch.bfloat16) and head_dim <= 256)


def segments(index, lengths, prefix):
    """The kernel's view of a packed row (host tensors; shared_prompt_hidden's index (B, L): where token j of
    sequence b lies in the row; lengths and prefix: each sequence's tokens and how many it shares with the
    one before). Returns kv_index (sum of lengths,): each sequence's tokens in turn, as positions in the row;
    cu_q (B + 1,) int32: where each sequence's own tokens (its length less its shared prefix) begin and end
    in the row, which holds them in that order; cu_k (B + 1,) int32: where each sequence begins and ends in
    kv_index."""
    kv_index = torch.cat([index[b, :n] for b, n in enumerate(lengths)])
    offsets = lambda sizes: torch.tensor([0, *itertools.accumulate(sizes)], dtype=torch.int32)
    return kv_index, offsets([n - s for n, s in zip(lengths, prefix)]), offsets(lengths)


def attention(q, k, v, kv_index, cu_q, cu_k, longest):
    """shared_prompt_attention's result (1, Hq, P, D) for q (1, Hq, P, D), k and v (1, Hkv, P, D) over the
    packed row's P tokens, the sequences laid out by `segments`; longest: no sequence is longer (the flash
    kernel's grid; under torch.compile a size of a tensor, so that it stays symbolic)."""
    queries = q[0].transpose(0, 1).contiguous()  # (P, Hq, D): already so in memory (the projection's layout)
    keys, values = (t[0].transpose(0, 1)[kv_index] for t in (k, v))  # (sum of lengths, Hkv, D), gathered
    out = varlen_attn(queries, keys, values, cu_q, cu_k, longest, longest, **_CAUSAL, **_GQA)  # (P, Hq, D)
    return out.transpose(0, 1)[None]
