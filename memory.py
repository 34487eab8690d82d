"""memory.py: (placeholder in this branch, replaced by the memory-planning file) the update's activation estimates."""
import torch


def activation_bytes(cfg, tokens, dtype, attended=0):
    """About what a forward over `tokens` tokens keeps for backward without activation checkpointing. Per
    token and layer: each RMSNorm's input and output, q and the attention output (6 hidden-size vectors),
    k and v, gate, up and their product (3 intermediate-size vectors); LoRA keeps the inputs of its A's,
    which are among these, and the frozen base weights need none. `attended`: tokens that attention alone
    sees on top (model.shared_prompt_attention: a shared prompt again for each further sample, the
    padding), which hold their q, k, v and output there too. The estimate against measured peaks:
    results/bench_h200.md."""
    per_token = 6 * cfg.hidden_size + 2 * cfg.num_kv_heads * cfg.head_dim + 3 * cfg.intermediate_size
    per_attended = 2 * cfg.hidden_size + 2 * cfg.num_kv_heads * cfg.head_dim
    return (tokens * per_token + attended * per_attended) * cfg.num_layers * torch.finfo(dtype).bits // 8


def shared_prompts(prompts):
    """For each row, how many leading tokens it shares with the row before: its prompt's length where the
    prompts are the same (the samples of one prompt), else 0."""
    return [len(p) if i and p == prompts[i - 1] else 0 for i, p in enumerate(prompts)]


def micro_batch_bytes(cfg, dtype, prompts, lengths):
    """activation_bytes of one micro-batch (prompts, completion lengths) as completion_logprobs runs it: a
    packed row of each prompt once for its samples and no padding, attention seeing the padded whole
    sequences on top."""
    seqs = [len(p) + int(n) for p, n in zip(prompts, lengths)]
    packed = sum(seqs) - sum(shared_prompts(prompts))
    return activation_bytes(cfg, packed, dtype, attended=len(seqs) * max(seqs) - packed)


def checkpointing_on(mode, model, need):
    """Whether the update recomputes each block in backward (model.gradient_checkpointing). `auto`: only
    where the largest micro-batch's activations (`need` bytes, activation_bytes) would not otherwise fit,
    with 10% and 1 GiB to spare, in what this process can still allocate on its GPU (free memory and
    torch's idle cache, within any per-process cap). Recomputing adds a forward, about a third of the
    pass's GEMM work (what it cost a 7B step: results/bench_h200.md). On the CPU (the tiny demo, the
    tests) `auto` keeps it on: memory there is not measured. The gradients are the same either way."""
    if mode != "auto" or model.device.type != "cuda":
        return mode != "off"
    dev = model.device
    free, total = torch.cuda.mem_get_info(dev)
    used = torch.cuda.memory_allocated(dev)
    idle = torch.cuda.memory_reserved(dev) - used
    cap = getattr(torch.cuda, "get_per_process_memory_fraction", lambda d: 1.0)(dev) * total - used
    return 1.1 * need + 2**30 > min(free + idle, cap)
