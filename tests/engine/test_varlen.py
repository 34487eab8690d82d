"""engine/varlen.py: the update's shared-prompt attention without padding, against model.shared_prompt_attention's
padded form. On the CPU a stand-in of the flash kernel (each sequence's own queries over its keys, the causal
mask aligned to the last key) checks the segments and their way through the model, compiled blocks and
checkpointing included; on a GPU the kernel itself, forward and backward, alone and through a bf16 model."""
import pytest
import torch
import torch.nn.functional as F

import lora
import model as M
import train
from engine import varlen
from fp4_ref import gpu_only
from logprobs import micro_batches
from test_train import lora_model, settings, two_groups


def stand_in(q, k, v, cu_q, cu_k, max_q, max_k, **options):
    """varlen_attn as its documentation defines it, one sequence at a time in float64: sequence b's queries
    q[cu_q[b]:cu_q[b+1]] over its keys k[cu_k[b]:cu_k[b+1]], query i seeing the keys up to i plus the keys
    it has more than queries. It asks for the causal options varlen.py passes."""
    assert options == {**varlen._CAUSAL, **varlen._GQA}
    cq, ck = cu_q.tolist(), cu_k.tolist()
    outs = []
    for b in range(len(cq) - 1):
        nq, nk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        assert nq <= nk <= min(max_q, max_k)
        qb, kb, vb = (t[lo:hi].transpose(0, 1).double() for t, lo, hi in ((q, cq[b], cq[b + 1]), (k, ck[b], ck[b + 1]),
                                                                           (v, ck[b], ck[b + 1])))
        mask = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(nk - nq)
        out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, enable_gqa=True)
        outs.append(out.transpose(0, 1).to(q.dtype))
    return torch.cat(outs)


def layout(gen):
    """Six sequences (B, L = 12): two prompts of 3 and 2 samples, the first of them partly shared by a sixth
    that is not its sample (row 5 begins as row 0 does for 3 tokens only), one completion of one token."""
    pa, pb = torch.randint(0, 101, (7,), generator=gen), torch.randint(0, 101, (4,), generator=gen)
    lengths, shared = [12, 9, 8, 8, 10, 11], [0, 7, 7, 0, 4, 0]
    tokens = torch.randint(0, 101, (6, 12), generator=gen)
    for i, p in enumerate([pa, pa, pa, pb, pb, pa[:3]]):
        tokens[i, :len(p)] = p
    tokens[5, 3] = (tokens[0, 3] + 1) % 101
    return tokens, lengths, shared


def test_segments_lay_out_each_sequence():
    """Three sequences of 5, 7 and 3 tokens, the second sharing its first 2 with the first: the packed row holds
    5 + 5 + 3 tokens; the second's keys are the first's two tokens and then its own."""
    index = torch.tensor([[0, 1, 2, 3, 4, 4, 4], [0, 1, 5, 6, 7, 8, 9], [10, 11, 12, 12, 12, 12, 12]])
    kv_index, cu_q, cu_k = varlen.segments(index, [5, 7, 3], [0, 2, 0])
    assert kv_index.tolist() == [0, 1, 2, 3, 4, 0, 1, 5, 6, 7, 8, 9, 10, 11, 12]
    assert cu_q.tolist() == [0, 5, 10, 13] and cu_k.tolist() == [0, 5, 12, 15]
    assert cu_q.dtype == cu_k.dtype == torch.int32


def hidden_and_grads(folder, backend, dtype=torch.float32, device="cpu", seed=4):
    """layout(seed)'s sequences through a fresh LoRA model of `folder` (with a backend: checkpointed, its blocks
    compiled with it): shared_prompt_hidden's states (zeroed past each length) and the LoRA gradients of a
    fixed weighted sum of them, in float32."""
    tokens, lengths, shared = layout(torch.Generator().manual_seed(seed))
    weights = torch.randn(6, 12, 64, generator=torch.Generator().manual_seed(seed + 1)).to(device)
    real = (torch.arange(12)[None] < torch.tensor(lengths)[:, None]).to(device)
    m = M.Transformer.from_pretrained(folder, dtype=dtype, device=device).train()
    torch.manual_seed(0)
    params = lora.apply_lora(m, rank=4, alpha=8)
    for p in params:
        p.data.normal_(0, 0.1)
    m.gradient_checkpointing, m.compile_blocks = backend is not None, backend
    h = m.shared_prompt_hidden(tokens.to(device), lengths, shared) * real[..., None]
    (h.float() * weights).sum().backward()
    return h.detach().float(), [p.grad.float() for p in params]


@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_the_segments_through_the_model_give_the_padded_attention(hf_folder, monkeypatch, backend):
    """shared_prompt_hidden with its attention through varlen.attention (the kernel's stand-in) gives the
    hidden states and LoRA gradients of the padded form, GQA heads (4 query, 2 key) included; plain, and
    with train.py's compiled blocks and checkpointing (the kernel's longest a symbolic size there)."""
    _, folder = hf_folder("qwen2", num_hidden_layers=2)
    results = []
    for unpadded in (False, True):
        calls = []
        monkeypatch.setattr(varlen, "varlen_attn", lambda *a, **kw: calls.append(1) or stand_in(*a, **kw))
        monkeypatch.setattr(varlen, "runs", lambda *a: unpadded)
        results.append(hidden_and_grads(folder, backend))
        assert bool(calls) == unpadded
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-5)
    for g, g0 in zip(results[1][1], results[0][1]):  # float32 sums in another order
        torch.testing.assert_close(g, g0, rtol=1e-4, atol=1e-4 * float(g0.abs().max()))


@gpu_only
def test_the_flash_kernel_gives_the_padded_attention():
    """On a GPU, in bf16, Qwen2.5-7B's heads (28 query, 4 key, 128 wide): eight sequences, two prompts of four
    samples, completions of 1 to 300 tokens; varlen.attention against shared_prompt_attention's padded form
    (SDPA over the whole sequences), forward and the gradients of q, k and v, within bf16's rounding of
    either (both round their output and gradients once to bf16; the softmax sums run in fp32)."""
    gen = torch.Generator().manual_seed(0)
    prompts, completions = [200, 200, 200, 200, 57, 57, 57, 57], [300, 1, 120, 7, 64, 299, 2, 150]
    lengths = [p + c for p, c in zip(prompts, completions)]
    shared = [0, 200, 200, 200, 0, 57, 57, 57]
    L = max(lengths)
    index, packed = M.packed_row(lengths, shared, L)  # as shared_prompt_hidden lays them out
    P = len(packed)
    segments = [t.cuda() for t in varlen.segments(index, lengths, shared)]
    q, k, v = (torch.randn(1, h, P, 128, generator=gen).cuda().bfloat16().requires_grad_() for h in (28, 4, 4))
    grad = torch.randn(1, 28, P, 128, generator=gen).cuda().bfloat16()
    want = M.shared_prompt_attention(q, k, v, index.cuda(), packed.cuda())  # (no segments: the padded form)
    got = varlen.attention(q, k, v, *segments, L)
    assert varlen.runs(q.device, q.dtype, q.shape[-1])
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    for g, g0 in zip(torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad)):
        torch.testing.assert_close(g, g0, rtol=2e-2, atol=2e-2 * float(g0.abs().max()))


@gpu_only
@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_the_flash_kernel_through_the_model_gives_the_padded_attention(hf_folder, monkeypatch, backend):
    """On a GPU, a bf16 model's shared_prompt_hidden with the flash kernel against the same with the padded
    attention (varlen.runs switched off): hidden states and LoRA gradients agree within bf16's rounding
    (each side rounds every layer's outputs to bf16), plain and with train.py's compiled blocks and
    checkpointing. A sequence laid out wrongly would be off by the size of the states themselves."""
    _, folder = hf_folder("qwen2", num_hidden_layers=2)
    results, runs, attention, calls = [], varlen.runs, varlen.attention, []
    monkeypatch.setattr(varlen, "attention", lambda *a: calls.append(1) or attention(*a))
    for flash in (False, True):
        monkeypatch.setattr(varlen, "runs", lambda *a, flash=flash: flash and runs(*a))
        torch._dynamo.reset()  # (else the compiled blocks of the first pass, whose guards see the same code, run)
        results.append(hidden_and_grads(folder, backend, torch.bfloat16, "cuda", seed=6))
        assert bool(calls) == flash  # (the flash kernel ran in the second pass only)
    (h, grads), (h0, grads0) = results[1], results[0]
    torch.testing.assert_close(h, h0, rtol=3e-2, atol=3e-2 * float(h0.abs().max()))
    for g, g0 in zip(grads, grads0):
        torch.testing.assert_close(g, g0, rtol=5e-2, atol=5e-2 * float(g0.abs().max()))


def test_the_update_slices_its_batch_by_the_attention_that_runs(hf_folder, monkeypatch):
    """train.update's micro-batches are micro_batches' for the attention that runs (model.unpadded_attention):
    with the kernel's stand-in on, the unpadded form's slices, which the update's metrics count, here fewer than
    the padded form's; the LoRA gradients are the same either way."""
    m, params = lora_model(hf_folder)
    prompts, lengths, batch = two_groups()
    rows = [prompts[0]] * 4 + [prompts[1]] * 4
    monkeypatch.setattr(varlen, "varlen_attn", stand_in)
    counts, grads = [], []
    for unpadded in (False, True):
        monkeypatch.setattr(varlen, "runs", lambda *a: unpadded)
        out = train.update(settings("--algo", "dapo", "--micro-batch", "2", "--max-new-tokens", "8"), m,
                           torch.optim.SGD(params, lr=0.0), params, batch)
        counts.append(out["micro_batches"])
        assert counts[-1] == len(micro_batches(m.config, m.dtype, rows, lengths, 2, 8, unpadded=unpadded))
        grads.append([p.grad.clone() for p in params])
    assert counts[1] < counts[0], counts
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
