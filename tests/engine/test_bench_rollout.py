"""engine/bench_rollout.py's CPU parts: the early-stop benchmark times the same rollouts both ways, the
command line refuses what it cannot run (also through `python rollout.py --bench`), the random NVFP4 model
is drawn in NVFP4 at the intended scale, and each row is set against its floor."""
import pytest
import torch

import fp4_gemm
import lora
import model as M
import nvfp4
import rollout
from engine import bench_rollout

CFG = dict(hidden_size=64, intermediate_size=96, num_attention_heads=2, num_key_value_heads=1, vocab_size=97)


def test_early_stop_benchmark_times_both_ways(hf_folder):
    """--bench --early-stop: both rollouts of the same prompts and stops (the live rows moved to fewer, and
    not), on the CPU here with the engine's torch ops: the same rows stop, after the same tokens."""
    _, folder = hf_folder("qwen2", seed=14, **CFG)
    model = M.Transformer.from_pretrained(folder, dtype=torch.float32)
    lora.apply_lora(model, rank=4, alpha=8)
    r = bench_rollout._bench_early_stop(model, batch=32, prompt_len=4, new_tokens=40, mean_len=16, seed=0, rounds=2,
                                        kernels="torch")
    off, on = r[False], r[True]
    assert 0 < off["stopped"] < 64 and 1 < off["mean"] < 40 and off["longest"] == off["steps"] == [40, 40]
    assert (on["stopped"], on["mean"], on["longest"], on["steps"]) == (off["stopped"], off["mean"], [40, 40], [40, 40])
    assert off["shrinks"] == [] and on["shrinks"] and off["tok_s"] > 0 and on["tok_s"] > 0


def test_random_stop_ids_end_rows_after_about_the_mean():
    gen = torch.Generator().manual_seed(0)
    stops = bench_rollout.random_stop_ids(1000, 25, gen)
    assert len(stops) == 40 and len(set(stops)) == 40 and all(0 <= s < 1000 for s in stops)


@pytest.mark.parametrize("main", [bench_rollout.main, rollout.main])
def test_bench_rejects_a_mean_length_below_one_token(main):
    with pytest.raises(SystemExit):  # argparse's error, before anything is built
        main(["--bench", "--early-stop", "0.5"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_bench_without_a_gpu_says_so():
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        rollout.main(["--bench"])


def test_an_nvfp4_linear_drawn_directly_has_the_intended_scale():
    """draw_nvfp4_: a QuantLinear's codes and block scales drawn from a pool of quantized N(0, std) blocks.
    Its dequantized weight is N(0, std) quantized: the std within NVFP4's error (a relative MSE of ~0.009, so
    at most 0.5% in the std) and 5 standard errors of sampling (the pool's 65536 values and the layer's
    16384), the mean within 5 standard errors of 0; its codes as frequent as in nvfp4.quantize of a fresh
    N(0, std) matrix, within 5 standard errors of each frequency; and it computes x @ W^T of that weight."""
    for std in (0.02, 0.5):
        gen = torch.Generator().manual_seed(0)
        pool = bench_rollout.nvfp4_pool(std, 4096, "cpu", gen)
        layer = fp4_gemm.QuantLinear(256, 64, bias=False, dtype=torch.float32)
        bench_rollout.draw_nvfp4_(layer, pool, gen)
        w = layer.dequantized_weight()  # (64, 256)
        n = w.numel()
        se = (1 / (2 * 65536) + 1 / (2 * n)) ** 0.5
        assert abs(w.std().item() / std - 1) < 0.005 + 5 * se, (std, w.std().item())
        assert abs(w.mean().item()) < 5 * std / n ** 0.5
        assert torch.equal(layer.weight_global_scale, pool[2])
        fresh = nvfp4.quantize(torch.randn(64, 256, generator=gen) * std)
        for q in (fresh.packed, layer.weight_packed):
            assert q.shape == (64, 128)
        p = torch.bincount(nvfp4.unpack(fresh.packed).flatten(), minlength=16).double() / n
        f = torch.bincount(nvfp4.unpack(layer.weight_packed).flatten(), minlength=16).double() / n
        assert ((f - p).abs() <= 5 * (2 * p * (1 - p) / n).sqrt() + 1 / n).all(), (p, f)
        x = torch.randn(3, 256, generator=gen)
        assert torch.allclose(layer(x), x @ w.t(), rtol=1e-4, atol=1e-5 * std)


def test_random_model_builds_nvfp4_without_a_bf16_weight(monkeypatch):
    """random_model(..., "nvfp4"): every decoder linear an NVFP4 QuantLinear drawn from one pool (nvfp4.quantize
    runs once, on the pool: no layer is ever made in bf16 to be quantized), embeddings and lm_head N(0, std),
    norms 1; it runs. bf16: Transformer.from_random."""
    cfg = M.Config({**M.qwen25_config("0.5b").raw, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 97, "tie_word_embeddings": False})
    calls = []
    quantize = nvfp4.quantize
    monkeypatch.setattr(nvfp4, "quantize", lambda w, *a, **k: calls.append(tuple(w.shape)) or quantize(w, *a, **k))
    m = bench_rollout.random_model(cfg, "nvfp4", "cpu", pool_blocks=4096)
    assert calls == [(64, 1024)]
    linears = [x for x in m.modules() if isinstance(x, fp4_gemm.QuantLinear)]
    assert len(linears) == 14 and m.dtype == torch.bfloat16
    assert abs(m.lm_head.weight.float().std().item() / 0.02 - 1) < 0.05 and m.lm_head.weight is not m.embed_tokens.weight
    assert all(torch.equal(x.weight, torch.ones_like(x.weight)) for x in m.modules() if isinstance(x, M.RMSNorm))
    assert not torch.equal(linears[0].weight_packed, linears[7].weight_packed)  # (layers differ)
    assert torch.isfinite(m(torch.randint(0, 97, (1, 5))).float()).all()
    b = bench_rollout.random_model(cfg, "bf16", "cpu")
    assert not any(isinstance(x, fp4_gemm.QuantLinear) for x in b.modules())
    with pytest.raises(ValueError, match="nvfp4 or bf16"):
        bench_rollout.random_model(cfg, "fp8", "cpu")


def test_a_rows_floor_and_the_table():
    """floor_ms: weights and KV cache read once at the copy bandwidth. The 7B NVFP4 + LoRA r32 step reads 4.92
    GB of weights and 56 KiB a token of cache; at prompt 256 + 512 new tokens (a mean column of 512) and 3.03
    TB/s: 1.63 / 1.70 / 2.24 ms at batch 1 / 8 / 64 (the floors DESIGN.md quotes). The table shows each row's
    floor and share; JSON keeps every row, a nan as null."""
    floors = [bench_rollout.floor_ms(4.92e9, 57344, b * 512, 3.03) for b in (1, 8, 64)]
    assert [round(f, 2) for f in floors] == [1.63, 1.70, 2.24]
    rows = [dict(size="7b", quant=q, batch=1, tok_s=t, ms_step=ms, floor_ms=1.63, share=1.63 / ms)
            for q, t, ms in (("nvfp4", 364, 2.73), ("bf16", 161, 6.22))]
    rows.append(dict(rows[0], size="72b", batch=1, tok_s=50.0, ms_step=20.0, floor_ms=14.0, share=0.7))
    table = bench_rollout._table(rows).splitlines()
    assert "floor ms | share" in table[0]
    assert "| Qwen2.5-7B shape | 1 | 364 | 2.73 | 1.63 | 60% | 161 | 6.22 | 1.63 | 26% | 2.26x |" in table
    assert "| Qwen2.5-72B shape | 1 | 50 | 20.00 | 14.00 | 70% | - | - | - | - | - |" in table


def test_a_profile_is_set_against_its_reads():
    """step_reads splits a step's reads into the NVFP4 weights (every QuantLinear's codes and scales), the
    16-bit rest of step_bytes (lm_head, LoRA) and the rows' KV cache; against_reads sets each profile group
    against the part it reads (share = floor / time) and sums what reads no weights."""
    cfg = M.Config({**M.qwen25_config("0.5b").raw, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 97, "tie_word_embeddings": False})
    m = bench_rollout.random_model(cfg, "nvfp4", "cpu", pool_blocks=4096)
    bench_rollout._add_lora(m, 4)
    reads = bench_rollout.step_reads(m, batch=3, columns=10)
    (quant, _), (dense, _), (kv, attn) = reads.values()
    per_layer = 64 * (64 + 32 + 32 + 64 + 96 * 3)  # q, k, v, o, gate, up, down weights (head_dim 16)
    assert quant == 2 * (per_layer // 2 + per_layer // 16) + sum(  # 4-bit codes, a byte's scale per 16, fp32 globals
        x.weight_global_scale.numel() * 4 for x in m.modules() if isinstance(x, fp4_gemm.QuantLinear))
    assert quant + dense == bench_rollout.step_bytes(m) and dense > 97 * 64 * 2  # lm_head and LoRA
    assert kv == 3 * 10 * 2 * 2 * 2 * 16 * 2 and attn == ("attention",)
    # every group a part names is one the profile's classifier gives the engine's kernels (and cuBLAS's)
    kernels = ("_mma_kernel", "_wgmma_ws_kernel", "_k_order_kernel", "_small_kernel", "_lora_b_kernel",
               "_attn_partial_kernel", "sm90_xmma_gemm_bf16bf16_bf16f32", "_add_rmsnorm_kernel")
    named = {g for _, gs in reads.values() for g in gs}
    assert named <= {bench_rollout.kernel_group(k) for k in kernels}
    assert bench_rollout.kernel_group("_add_rmsnorm_kernel") == "add_rmsnorm"
    groups = {"fp4 gemm": 2.0, "attention": 0.5, "LoRA B": 0.25, "cuBLAS (lm_head, LoRA, bf16 base)": 0.75,
              "silu_mul": 0.2, "add_rmsnorm": 0.1}
    reads = {"w": (2e9, ("fp4 gemm", "fp4 gemm: x in K order")),
             "d": (0.5e9, ("LoRA B", "cuBLAS (lm_head, LoRA, bf16 base)")), "kv": (0.25e9, ("attention",))}
    lines = bench_rollout.against_reads(groups, reads, copy_tb_s=2.0)
    assert lines[0] == "    w: 2.000 GB, floor 1.000 ms; its kernels 2.000 ms (share 50%)"
    assert lines[1].endswith("floor 0.250 ms; its kernels 1.000 ms (share 25%)")
    assert lines[2].endswith("floor 0.125 ms; its kernels 0.500 ms (share 25%)")
    assert lines[3] == "    the rest (activations only, floor ~0): 0.300 ms (silu_mul 0.200, add_rmsnorm 0.100)"


def test_json_rows_are_written_whole(tmp_path):
    import json

    from engine.bench_gemm import write_json
    path = tmp_path / "rows.json"
    write_json(str(path), dict(rows=[dict(a=1.5, b=float("nan"), c=torch.tensor([1, 2]))], name="x"))
    assert json.loads(path.read_text()) == dict(rows=[dict(a=1.5, b=None, c=[1, 2])], name="x")
    assert [p.name for p in tmp_path.iterdir()] == ["rows.json"]  # (no temporary file left)


def test_timeline_shares_add_up_to_the_stretch():
    """Made-up steps of 20 µs: x put in K order, a cuBLAS product on the second stream started beside it and
    ending inside the GEMM after it (hidden: it costs nothing), an attention kernel launched early, 2 µs before
    the GEMM ends (it costs its 3 µs past the GEMM), a sampler after 2 idle µs, and 2 idle µs after it. Over
    (lo, hi] = steps 3-12, each kind's share a step and the idle time add up to the stretch."""
    ev, t = [], 0.0
    for _ in range(16):
        ev += [dict(name="_k_order_kernel", ts=t, dur=2.0),
               dict(name="sm90_xmma_gemm", ts=t + 0.5, dur=5.5),
               dict(name="_wgmma_kernel", ts=t + 2, dur=8.0, args=dict(grid=[56, 1, 8])),
               dict(name="_attn_partial_kernel", ts=t + 8, dur=5.0),
               dict(name="_sample_final_kernel", ts=t + 15, dur=3.0)]
        t += 20.0
    shares, idle = bench_rollout.timeline_shares(ev, 60.0, 260.0)
    per_step = {k: v / 10 for k, v in shares.items()}
    assert per_step == {bench_rollout.K_ORDER: 2.0, "fp4 gemm _wgmma_kernel grid (56, 1, 8)": 8.0,
                        "attention: split": 3.0, "sampler": 3.0}
    assert idle / 10 == 4.0 and sum(shares.values()) + idle == 200.0
    # a stretch that cuts kernels: only their parts inside it count; the cuBLAS kernel takes what no other
    # covers; a stretch with no kernel is idle
    shares, idle = bench_rollout.timeline_shares(ev, 1.0, 5.0)
    assert shares == {bench_rollout.K_ORDER: 1.0, "fp4 gemm _wgmma_kernel grid (56, 1, 8)": 3.0} and idle == 0.0
    assert bench_rollout.timeline_shares([ev[1]], 1.0, 5.0) == ({bench_rollout.CUBLAS: 4.0}, 0.0)
    assert bench_rollout.timeline_shares(ev, 318.0, 319.5) == ({}, 1.5)


def test_a_diagnostic_that_fails_leaves_a_note_not_an_error(capsys):
    """--timeline and --profile runs go through _diagnose: their text, or the error they raised, is printed and
    kept among the benchmark's notes, and the benchmark goes on."""
    notes = []
    bench_rollout._diagnose(notes, "7b nvfp4", "timeline", lambda: "timeline batch 1: 2660 us a step")

    def broken():
        raise RuntimeError("no CUPTI")

    bench_rollout._diagnose(notes, "7b nvfp4", "profile", broken)
    assert notes == ["7b nvfp4 timeline batch 1: 2660 us a step", "7b nvfp4 profile failed: RuntimeError: no CUPTI"]
    assert capsys.readouterr().out.splitlines() == notes
