"""logprobs.py: the trainer's log-probabilities of the sampled completions, and the micro-batches they
are computed in.

The update needs, for every completion token y_t of every sample, log pi(y_t | prompt, y_<t) under the
policy being trained, at the rollout's temperature (softmax(logits / T)), with gradients into LoRA and
the trained norms. Three things make that affordable at 7B and more:

1. Each prompt runs once for its samples. A step holds G samples of each prompt; their rows share the
   prompt's tokens, so the prompt's hidden states are computed once and every sample attends to them
   (model.Transformer.shared_prompt_hidden), with no padding in the GEMMs.
2. Only completion positions reach lm_head, `chunk` tokens at a time, each chunk recomputed in backward
   (torch.utils.checkpoint): the (tokens, vocab) float32 logits of a whole micro-batch, 0.6 GB per 1,000
   tokens of Qwen2.5's 152k vocabulary, never exist at once.
3. Micro-batches are measured, not counted: a slice holds --micro-batch sequences where completions run to
   the limit, and more where they stop early, as long as its activations (memory.micro_batch_bytes) stay
   within what the full-length slice would need. The losses of the slices add up to the batch's (the
   loss functions take the whole batch's counts as divisors), so the slicing changes no number.
"""
import torch

from memory import micro_batch_bytes
from model import to_device


def shared_prompts(prompts):
    """For each row, how many leading tokens it shares with the row before: its prompt's length where the
    prompts are the same (the samples of one prompt), else 0."""
    return [len(p) if i and p == prompts[i - 1] else 0 for i, p in enumerate(prompts)]


def _chunk_logp(h, weight, targets, temperature):
    logits = (h @ weight.t()).float() / temperature  # (C, V)
    logp_all = logits.log_softmax(-1)
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)  # (C,)
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # (C,)
    return logp, entropy


def completion_logprobs(model, prompts, completions, lengths, temperature, chunk):
    """Logprobs (and entropies) of each completion token under softmax(logits / temperature).

    prompts: list of token lists; completions (B, Tc) right-padded; lengths (B,). Returns logp and
    entropy (B, Tc), zero past each length; logp carries gradients, entropy does not."""
    B, Tc = completions.shape
    device = model.device
    seqs = [p + completions[i, : lengths[i]].tolist() for i, p in enumerate(prompts)]
    T = max(len(s) for s in seqs)
    tokens = torch.zeros(B, T, dtype=torch.long)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = torch.tensor(s)  # right padding, which the model never runs
    tokens = to_device(tokens, device)  # (queued behind the GPU's work, not waiting for it: model.to_device)
    h = model.shared_prompt_hidden(tokens, list(map(len, seqs)), shared_prompts(prompts))  # (B, T, H)
    rows = torch.cat([torch.full((int(n),), i) for i, n in enumerate(lengths)])  # (N,)
    cols = torch.cat([torch.arange(int(n)) for n in lengths])  # (N,) completion index j
    pos = torch.tensor([len(prompts[i]) - 1 for i in rows.tolist()]) + cols  # hidden state that predicts token j
    # (one copy)
    rows, cols, pos, targets = to_device(torch.stack([rows, cols, pos, completions[rows, cols].long()]), device)
    hs = h[rows, pos]  # (N, H)
    weight = model.lm_head.weight
    parts = [torch.utils.checkpoint.checkpoint(_chunk_logp, hs[s:s + chunk], weight, targets[s:s + chunk],
                                               temperature, use_reentrant=False)
             for s in range(0, hs.shape[0], chunk)]
    logp = torch.zeros(B, Tc, device=device)
    entropy = torch.zeros(B, Tc, device=device)
    logp = logp.index_put((rows, cols), torch.cat([p[0] for p in parts]))
    entropy[rows, cols] = torch.cat([p[1] for p in parts]).detach()
    return logp, entropy


def micro_batches(cfg, dtype, prompts, lengths, size, max_new_tokens, unpadded=False):
    """The update's micro-batches: consecutive slices of the batch. `size` sequences a slice where every
    completion runs to max_new_tokens (--micro-batch means what it says there); where they stop early, as
    real ones do, a slice takes the next sequence while its activations (micro_batch_bytes) stay within
    the largest that a slice of `size` sequences of these prompts needs at that limit, so more sequences
    share each forward and backward in no more memory. That pays where a micro-batch is short work for the
    GPU, whose time then goes to the gaps between kernels (measured: results/bench_h200.md). unpadded:
    the attention runs without padding (engine/varlen.py), so early stops leave no padding to count."""
    need = lambda sl, lengths: micro_batch_bytes(cfg, dtype, prompts[sl], lengths[sl], unpadded)
    at_limit = [max_new_tokens] * len(prompts)
    budget = max(need(slice(s, s + size), at_limit) for s in range(0, len(prompts), size))
    slices, start = [], 0
    while start < len(prompts):
        end = start + 1
        while end < len(prompts) and need(slice(start, end + 1), lengths) <= budget:
            end += 1
        slices.append(slice(start, end))
        start = end
    return slices
