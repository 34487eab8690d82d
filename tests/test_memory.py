"""memory.py: each part's bytes against hand-computed values at the real 7B and 72B shapes and against the
tensors a tiny model really allocates; the plan's choices (the batch lowered as the cap shrinks, the cache
released, the exact setting named when nothing fits, CPU offload only as the one way) and its estimate
against measured peaks."""
import re

import pytest
import torch

import lora
import memory
import model as M
import rollout

BF16 = torch.bfloat16
Q7, Q72 = M.qwen25_config("7b"), M.qwen25_config("72b")
BENCH = dict(prompts=8, group_size=8, prompt_len=256, max_new_tokens=1024, micro_batch=8, lora_rank=32,
             train_norms=False)  # engine.bench_step's step
RECIPE = dict(prompts=16, group_size=8, prompt_len=256, max_new_tokens=2048, micro_batch=8, lora_rank=16)  # train.py's


def tiny():
    return M.Config({**M.qwen25_config("0.5b").raw, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 80,
                     "tie_word_embeddings": False})


def test_the_parts_at_the_7b_and_72b_shapes_by_hand():
    # K and V, every layer, one token: 2 x L x Hkv x D x 2 bytes
    assert memory.kv_bytes_per_token(Q7) == 2 * 28 * 4 * 128 * 2 == 57344
    assert memory.kv_bytes_per_token(Q72) == 2 * 80 * 8 * 128 * 2 == 327680  # 320 KiB
    assert memory.cache_columns(256, 1024) == 1280 and memory.cache_columns(200, 2048) == 2304
    # the prompt rounded up to 64 first, as a graphed prefill pads it: 65 + 40 takes 128 + 40
    assert memory.cache_columns(64, 40) == 128 and memory.cache_columns(65, 40) == 256
    ro = memory.rollout_bytes(Q72, BF16, rows=64, prompts=8, prompt_len=256, max_new_tokens=1024)
    assert ro["kv cache"] == 64 * 1280 * 327680 == 26_843_545_600  # the 21 GB is 64 rows of 1024
    # the linears: q, k, v, o, gate, up, down of every block
    n7 = 28 * (3584 * 3584 + 2 * 3584 * 512 + 3584 * 3584 + 3 * 3584 * 18944)
    n72 = 80 * (8192 * 8192 + 2 * 8192 * 1024 + 8192 * 8192 + 3 * 8192 * 29568)
    assert memory.linear_weights(Q7) == n7 == 6_525_288_448 and memory.linear_weights(Q72) == n72 == 70_212_648_960
    rows72 = 80 * (8192 + 1024 + 1024 + 8192 + 2 * 29568 + 8192)
    bias72 = 80 * (8192 + 2 * 1024) * 2
    w = memory.weight_bytes(Q72)
    assert w["linears"] == n72 // 2 + n72 // 16 + 4 * rows72 + bias72  # 4.5 bits a weight: 39.5 GB
    assert 39.4e9 < w["linears"] < 39.6e9
    assert w["embeddings"] == w["lm_head"] == 152064 * 8192 * 2 and w["norms"] == 161 * 8192 * 4
    assert memory.weight_bytes(Q72, "bf16")["linears"] == 2 * n72 + bias72  # 140 GB: a bf16 72B does not fit
    # LoRA r16 on the seven: r (in + out) each, 16 bytes a parameter with its gradient and AdamW's m and v
    per_block = 16 * ((8192 + 8192) + 2 * (8192 + 1024) + (8192 + 8192) + 3 * (8192 + 29568))
    assert memory.lora_params(Q72, 16) == 80 * per_block == 210_534_400
    t = memory.trained_bytes(Q72, 16)
    assert t["lora"] == 16 * 210_534_400 and t["norms"] == 20 * 2 * 80 * 8192


def test_the_parts_are_what_a_tiny_model_allocates():
    """The counts against the tensors: an NVFP4 model's buffers (each linear alone keeps one global scale,
    where the estimate allows one a row), LoRA's parameters, the trained norms, rollout.py's KV cache."""
    cfg = tiny()
    m = M.Transformer.from_random(cfg, torch.float32, quantize=True)
    got = {n: t.numel() * t.element_size() for n, t in list(m.named_parameters()) + list(m.named_buffers())}
    w = memory.weight_bytes(cfg, "nvfp4", torch.float32)
    codes = sum(v for n, v in got.items() if n.endswith(("weight_packed", "weight_scale", ".bias")))
    scales = sum(v for n, v in got.items() if n.endswith("weight_global_scale"))
    rows = cfg.num_layers * sum(n for n, _ in memory.linear_shapes(cfg).values())
    assert codes == w["linears"] - 4 * rows and scales == 4 * 7 * cfg.num_layers
    assert got["embed_tokens.weight"] == w["embeddings"] and got["lm_head.weight"] == w["lm_head"]
    assert sum(v for n, v in got.items() if n.endswith("norm.weight")) == w["norms"]
    params = lora.apply_lora(m, rank=4, alpha=4)
    norms = lora.train_norms(m)
    assert sum(p.numel() for p in params) == memory.lora_params(cfg, 4)
    assert 16 * sum(p.numel() for p in params) == memory.trained_bytes(cfg, 4)["lora"]
    assert 20 * sum(p.numel() for p in norms) == memory.trained_bytes(cfg, 4)["norms"]
    cache = rollout.KVCache(cfg, 3, 40, BF16, "cpu")
    assert cache.k.numel() * 2 + cache.v.numel() * 2 == 3 * 40 * memory.kv_bytes_per_token(cfg)
    fp8 = rollout.KVCache(cfg, 3, 40, BF16, "cpu", kv="fp8")  # a byte a value, a float32 scale a vector
    assert sum(getattr(fp8, n).nbytes for n in fp8.tensors()) == 3 * 40 * memory.kv_bytes_per_token(cfg, BF16, "fp8")


def test_the_engines_lora_copies():
    """engine/decode.py's copies of the adapters: A and B per group of linears, in the model dtype, the rank
    padded to 16; the estimate holds A twice (its K-ordered copy, which only the GPU's wgmma path makes)."""
    from engine import decode

    cfg = tiny()
    m = M.Transformer.from_random(cfg, BF16, quantize=True)
    lora.apply_lora(m, rank=4, alpha=4)
    dec = decode.Decoder(m, kernels="torch", graphs=False)
    a = sum(g.A.numel() * 2 for layer in dec.layers for g in layer.groups)
    b = sum(g.B.numel() * 2 for layer in dec.layers for g in layer.groups)
    assert memory.engine_lora_bytes(cfg, 4) == 2 * a + b


def test_the_update_by_hand():
    """The copy of train.py's estimates: activation_bytes per token and micro_batch_bytes of prompts shared or
    not; update_bytes with and without checkpointing."""
    need = memory.activation_bytes(Q7, 8 * 1280, BF16)
    assert need == 8 * 1280 * (6 * 3584 + 2 * 512 + 3 * 18944) * 28 * 2
    assert 0.95 < need / (8 * 1280) / 4.28e6 < 1.1  # measured on the H200: 4.28 MB a token (results/bench_h200.md)
    packed = memory.micro_batch_bytes(Q7, BF16, [[1] * 256] * 8, [1024] * 8)
    assert packed == memory.activation_bytes(Q7, 256 + 8 * 1024, BF16, attended=7 * 256)
    p, q = [1, 2, 3], [4, 5]
    assert memory.micro_batch_bytes(Q7, BF16, [p, p, p, q, q], [4, 6, 1, 5, 2]) == memory.activation_bytes(
        Q7, 3 + 4 + 6 + 1 + 2 + 5 + 2, BF16, attended=5 * 9 - 23)
    # the unpadded attention (engine/varlen.py) keeps the later samples' prompt keys and values again, no padding
    unpadded = memory.micro_batch_bytes(Q7, BF16, [p, p, p, q, q], [4, 6, 1, 5, 2], unpadded=True)
    assert unpadded == memory.activation_bytes(Q7, 23, BF16, gathered=3 + 3 + 2) == \
        memory.activation_bytes(Q7, 23, BF16) + 8 * 2 * 512 * 28 * 2
    assert memory.micro_batch_bytes(Q7, BF16, [[1] * 256] * 8, [1024] * 8, unpadded=True) == \
        packed - 7 * 256 * 2 * 3584 * 28 * 2  # at full length no padding either way: the repeated q and output less
    seqs, lengths = [[1] * 256] * 8, [1024] * 8
    off = memory.update_bytes(Q72, BF16, seqs, lengths, False, 1024)
    on = memory.update_bytes(Q72, BF16, seqs, lengths, True, 1024)
    tokens = 256 + 8 * 1024
    assert on["activations kept for backward"] == tokens * 8192 * 2 * 80  # each block's input: 11 GB
    assert off["activations kept for backward"] == memory.micro_batch_bytes(Q72, BF16, seqs, lengths)  # 189 GB
    block = off["activations kept for backward"] // 80
    assert on["logprob chunk, or a block's backward (the larger)"] == max(2 * block, 5 * 1024 * 152064 * 4)
    assert on["dequantized weights"] == 2 * 29568 * 8192 * 2
    assert memory.update_bytes(Q72, BF16, seqs, lengths, True, 1024, quant="bf16")["dequantized weights"] == 0


def test_the_plan_of_a_72b_step_on_80_gb():
    """engine.bench_step's step (8 prompts x 8, 256 + 1024 tokens, LoRA r32): 64 rows of cache do not fit
    beside 52 GB of weights and trained state, 32 do: two rollout calls; the update needs activation
    checkpointing and the cache's memory, so the cache goes before it. 7B fits as asked, cache kept."""
    p = memory.plan(Q72, 80e9, **BENCH)
    assert p.fits and (p.rollout_rows, p.rollout_calls, p.keep_cache, p.checkpointing) == (32, 2, False, True)
    assert (p.micro_batch, p.logp_chunk) == (8, 1024) and p.rollout["kv cache"] == 32 * 1280 * 327680
    assert p.peak <= 80e9 - p.headroom and p.headroom == 2**30 + 0.05 * 80e9
    assert "lowered to fit: rollout_rows 64 -> 32" in p.describe() and "released after each rollout" in p.describe()
    p7 = memory.plan(Q7, 80e9, **BENCH)
    assert (p7.rollout_rows, p7.rollout_calls, p7.keep_cache, p7.checkpointing, p7.micro_batch) == (64, 1, True, False, 8)
    assert "lowered" not in p7.describe() and p7.prompt_len == BENCH["prompt_len"]  # (the rollout's cache width)
    # no cap (the CPU): the asked settings, nothing fitted
    free = memory.plan(Q72, None, **BENCH)
    assert free.fits and (free.rollout_rows, free.keep_cache, free.micro_batch, free.checkpointing) == (64, True, 8, False)


def test_a_smaller_cap_lowers_the_batch_then_names_what_to_lower():
    """train.py's recipe at 72B (16 prompts x 8, completions of up to 2048): as the cap shrinks the rollout
    calls take fewer rows, checkpointing turns on and stays on, the micro-batch falls, the cache is released,
    and every plan's peak (the cache counted in the update's where kept) stays under the cap less headroom;
    below what one group needs, the plan names the setting to lower and the value, which fits, while the
    next value up does not."""
    last = None
    for gb in range(300, 60, -5):
        p = memory.plan(Q72, gb * 1e9, **RECIPE)
        assert p.fits, (gb, p.problems)
        assert p.peak <= gb * 1e9 - p.headroom
        if last:
            assert p.rollout_rows <= last.rollout_rows and p.micro_batch <= last.micro_batch
            assert p.checkpointing >= last.checkpointing  # (the cache may stay where fewer rows leave room)
        last = p
    assert last.rollout_rows < 128 and not last.keep_cache and last.checkpointing
    # left with 6 GB above the fixed part: one sequence's update fits (its logprob chunk lowered), one group's
    # 8 rows x 2304 columns of cache (6.0 GB) with its prefill does not
    fixed = sum(memory.plan(Q72, None, **RECIPE).fixed.values())
    cap = fixed + 2**30 + 6e9
    p = memory.plan(Q72, cap, headroom=2**30, **RECIPE)
    assert not p.fits and len(p.problems) == 1 and "DOES NOT FIT" in p.describe()
    n = int(re.search(r"--max-new-tokens\) to (\d+)", p.problems[0]).group(1))
    assert memory.plan(Q72, cap, headroom=2**30, **{**RECIPE, "max_new_tokens": n}).fits
    assert not memory.plan(Q72, cap, headroom=2**30, **{**RECIPE, "max_new_tokens": n + 1}).fits
    g = int(re.search(r"--group-size\) to (\d+)", p.problems[0]).group(1))
    assert memory.plan(Q72, cap, headroom=2**30, **{**RECIPE, "group_size": g}).fits
    assert not memory.plan(Q72, cap, headroom=2**30, **{**RECIPE, "group_size": g + 1}).fits


def test_when_the_weights_do_not_fit():
    """A bf16 72B needs 145 GB: the plan says an NVFP4 base fits. A LoRA of rank 128 at 72B (27 GB of trained
    state): a rank that fits, and, as the one way to keep rank 128, AdamW's state on the CPU with its cost."""
    p = memory.plan(Q72, 80e9, quant="bf16", **BENCH)
    assert not p.fits and any("--quant nvfp4" in s for s in p.problems) and p.offload is None
    big = memory.plan(Q72, 80e9, **{**BENCH, "lora_rank": 128})
    assert not big.fits and any("--lora-rank) 64 or lower" in s for s in big.problems)
    state = 8 * memory.lora_params(Q72, 128)  # m and v: 13.5 GB, as many bytes copied each step
    assert f"({state / 1e9:.1f} GB)" in big.offload and f"{state / 25e9:.1f} s" in big.offload
    assert memory.plan(Q72, 80e9, **{**BENCH, "lora_rank": 64}).fits
    with pytest.raises(ValueError, match="micro_batch"):
        memory.plan(Q72, 80e9, **{**BENCH, "micro_batch": 0})


def test_the_estimate_against_measured_peaks():
    """The plan's peak against max_memory_allocated of engine.bench_step's steps (8 prompts x 8, 256 + 1024
    tokens forced, LoRA r32; results/memory_plan.md): within the 5% of the cap that the headroom keeps."""
    for size, quant, cap, measured_gib in (("7b", "nvfp4", None, 51.7), ("7b", "bf16", None, 60.4),
                                           ("32b", "nvfp4", 80e9, 52.3)):
        p = memory.plan(M.qwen25_config(size), cap, quant=quant, **BENCH)
        assert abs(p.peak / (measured_gib * 2**30) - 1) < memory.HEADROOM_FRACTION, (size, quant, p.peak / 2**30)


def test_what_the_process_may_use(monkeypatch):
    """gpu_budget: what this process holds and can still allocate (free memory and torch's idle cache, within
    a per-process cap), at most --mem-cap-gb; nothing measured on a CPU. checkpointing_on as train.py's."""
    assert memory.gpu_budget("cpu") is None and memory.gpu_budget("cpu", 80) == 80e9
    used, total = 16e9, 150e9
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: used)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: used + 4e9)  # 4 GB idle in torch's cache
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (100e9, total))

    def fraction(d):  # as torch's: it takes an index, not a bare "cuda"
        assert isinstance(d, int) or getattr(d, "index", None) is not None, d
        return 1.0

    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", fraction)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert memory.gpu_budget("cuda") == used + 104e9 and memory.gpu_budget("cuda", 80) == 80e9
    need = memory.activation_bytes(Q7, 8 * 1280, BF16)
    for free, cap, on in ((100e9, 150e9, False), (1.1 * need + 2**30 - 4e9 - 1e8, 150e9, True),
                          (100e9, used + 1.1 * need + 2**30 + 1e8, False), (100e9, used + 1.1 * need + 2**30 - 1e8, True)):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (free, total))
        monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda d: cap / total)
        assert memory.checkpointing_on("auto", "cuda", need) is on, (free, cap)
        assert memory.checkpointing_on("on", "cuda", need) and not memory.checkpointing_on("off", "cuda", need)
    assert memory.checkpointing_on("auto", "cpu", need) and not memory.checkpointing_on("off", "cpu", need)


def test_the_held_out_evaluation_is_lowered_to_fit_never_raised():
    """The evaluation's rows as asked (eval.py's 64 on a GPU) where their cache fits beside the fixed part and a
    kept rollout cache (7B), lowered in whole problems where it does not (72B: 64 rows of 1280 columns are
    26.8 GB), never above what was asked, and not planned unless asked or without a cap."""
    ev = dict(eval_samples=4, eval_prompt_len=256, eval_max_new_tokens=1024, eval_rows=64)
    assert memory.plan(Q7, 80e9, **BENCH, **ev).eval_rows == 64
    p = memory.plan(Q72, 80e9, **BENCH, **ev)
    fixed = sum(p.fixed.values())
    cache = lambda rows: sum(memory.rollout_bytes(Q72, torch.bfloat16, rows, rows // 4, 256, 1024).values())
    assert p.eval_rows % 4 == 0 and 4 <= p.eval_rows < 64 and "held-out evaluation: " in p.describe()
    assert fixed + cache(p.eval_rows) <= 80e9 - p.headroom < fixed + cache(p.eval_rows + 4)
    assert memory.plan(Q72, 80e9, **BENCH).eval_rows is None and memory.plan(Q72, None, **BENCH, **ev).eval_rows is None
