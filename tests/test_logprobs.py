"""logprobs.py: the trainer's completion logprobs against a plain forward of each whole sequence, and the
micro-batches the update computes them in (whole sequences, short ones packed within the memory of the
full-length slices)."""
import pytest
import torch

import lora
import model as M
from logprobs import completion_logprobs, micro_batches
from memory import micro_batch_bytes


def test_micro_batches_hold_whole_sequences_and_pack_short_ones():
    """--micro-batch 8: completions at the length limit go 8 to a micro-batch, whether or not prompts are
    shared; shorter ones share micro-batches of no more memory (micro_batch_bytes within that of the
    8-sequence slices at the limit), each slice taking the next sequence until it would not fit."""
    cfg, bf16 = M.qwen25_config("7b"), torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    groups = [torch.randint(0, 1000, (256,), generator=gen).tolist() for _ in range(8)]
    shared, distinct = [p for p in groups for _ in range(8)], [p + [i] for i in range(8) for p in groups]
    lengths = torch.randint(1, 400, (64,), generator=gen)
    lengths[[5, 40]] = 1024  # the long tail
    for prompts in (shared, distinct):
        full = [1024] * 64
        assert micro_batches(cfg, bf16, prompts, full, 8, 1024) == [slice(s, s + 8) for s in range(0, 64, 8)]
        budget = micro_batch_bytes(cfg, bf16, prompts[:8], full[:8])
        slices = micro_batches(cfg, bf16, prompts, lengths, 8, 1024)
        assert [sl.start for sl in slices] == [0] + [sl.stop for sl in slices[:-1]] and slices[-1].stop == 64
        assert len(slices) < 6
        for sl in slices:
            assert micro_batch_bytes(cfg, bf16, prompts[sl], lengths[sl]) <= budget
            if sl.stop < 64:  # the next sequence would not have fit
                assert micro_batch_bytes(cfg, bf16, prompts[sl.start:sl.stop + 1], lengths[sl.start:sl.stop + 1]) > budget
    assert micro_batches(cfg, bf16, shared[:3], torch.tensor([1024, 1, 1]), 1, 1024) == [slice(0, 1), slice(1, 3)]


def test_micro_batches_count_the_attention_that_runs():
    """Where the update's attention runs unpadded (engine/varlen.py), early stops leave no padding to count:
    a slice of the same batch holds more sequences, each slice within the unpadded form's full-length budget,
    the next sequence past it; at the limit the slices are --micro-batch's either way."""
    cfg, bf16 = M.qwen25_config("7b"), torch.bfloat16
    gen = torch.Generator().manual_seed(2)
    prompts = [p for p in (torch.randint(0, 1000, (256,), generator=gen).tolist() for _ in range(8)) for _ in range(8)]
    # engine.bench_step's early stop: a stop chance of 1/256 a token, at most 1024 tokens
    lengths = (-torch.rand(64, generator=gen).log() * 256).long().clamp(1, 1024)
    assert micro_batches(cfg, bf16, prompts, [1024] * 64, 8, 1024, unpadded=True) == [slice(s, s + 8) for s in range(0, 64, 8)]
    padded = micro_batches(cfg, bf16, prompts, lengths, 8, 1024)
    slices = micro_batches(cfg, bf16, prompts, lengths, 8, 1024, unpadded=True)
    assert slices[0].stop > padded[0].stop  # (29 sequences against 24)
    budget = micro_batch_bytes(cfg, bf16, prompts[:8], [1024] * 8, unpadded=True)
    assert [sl.start for sl in slices] == [0] + [sl.stop for sl in slices[:-1]] and slices[-1].stop == 64
    for sl in slices:
        assert micro_batch_bytes(cfg, bf16, prompts[sl], lengths[sl], unpadded=True) <= budget
        if sl.stop < 64:
            grown = slice(sl.start, sl.stop + 1)
            assert micro_batch_bytes(cfg, bf16, prompts[grown], lengths[grown], unpadded=True) > budget


def test_completion_logprobs_match_a_forward_of_each_whole_sequence(hf_folder):
    """completion_logprobs (each prompt run once for its samples, lm_head in chunks) against a plain forward
    of every prompt + completion: the same logprobs and entropies at temperature 0.7, zeros past each
    length. Two prompts of different lengths, rows of different lengths (one of a single token), and a
    chunk that splits rows."""
    _, folder = hf_folder("qwen2", num_hidden_layers=3)
    m = M.Transformer.from_pretrained(folder, dtype=torch.float32)
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randint(0, 101, (6,), generator=gen).tolist(), torch.randint(0, 101, (9,), generator=gen).tolist()
    prompts = [a] * 3 + [b] * 2
    completions = torch.randint(0, 101, (5, 7), generator=gen)
    lengths = torch.tensor([4, 7, 1, 5, 3])
    with torch.no_grad():
        logp, ent = completion_logprobs(m, prompts, completions, lengths, 0.7, chunk=4)
        for i, p in enumerate(prompts):
            n = int(lengths[i])
            z = m(torch.tensor([p + completions[i, :n].tolist()]))[0, len(p) - 1: len(p) - 1 + n] / 0.7
            want = z.log_softmax(-1)
            torch.testing.assert_close(logp[i, :n], want.gather(1, completions[i, :n, None])[:, 0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(ent[i, :n], -(want.exp() * want).sum(-1), rtol=1e-5, atol=1e-5)
            assert not logp[i, n:].any() and not ent[i, n:].any()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_completion_logprobs_queue_their_work_without_waiting_for_the_gpu(hf_folder):
    """On a GPU, a micro-batch's forward and backward (train.update's) make no call that waits for the GPU:
    torch's sync debug mode raises on any, such as a copy from pageable host memory, which waits for all the
    work queued before it (model.to_device), so that between micro-batches the GPU would sit idle while the
    host builds the next one's tensors. The logprobs are the CPU's."""
    _, folder = hf_folder("qwen2", num_hidden_layers=2)
    gen = torch.Generator().manual_seed(5)
    a, b = torch.randint(0, 101, (6,), generator=gen).tolist(), torch.randint(0, 101, (9,), generator=gen).tolist()
    prompts, lengths = [a] * 3 + [b] * 2, torch.tensor([4, 7, 1, 5, 3])
    completions = torch.randint(0, 101, (5, 7), generator=gen)
    want, _ = completion_logprobs(M.Transformer.from_pretrained(folder, dtype=torch.float32), prompts, completions,
                                  lengths, 0.7, chunk=4)
    m = M.Transformer.from_pretrained(folder, dtype=torch.float32, device="cuda")
    params = lora.apply_lora(m, rank=4, alpha=8)  # (the update's trained parameters; the base frozen)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        logp, _ = completion_logprobs(m, prompts, completions, lengths, 0.7, chunk=4)
        logp.sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(p.grad is not None for p in params)
    torch.testing.assert_close(logp.detach().cpu(), want.detach(), rtol=1e-5, atol=1e-5)
