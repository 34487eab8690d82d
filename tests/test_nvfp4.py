"""NVFP4 format: bit-level cases by hand, error statistics, edge cases, and agreement with
compressed-tensors (its quantizer, its decompressor, and transformers loading our checkpoint)."""
import json
import os

import pytest
import torch
from safetensors import safe_open

import nvfp4


def row_with(values, amax=6.0):
    """One 16-wide row whose amax is `amax`, so global_scale * amax/6 = 448 exactly and the
    block scale is 448: the row's values land on E2M1's scale unchanged (times amax/6)."""
    row = torch.zeros(1, 16)
    row[0, : len(values)] = torch.tensor(values)
    row[0, 15] = amax
    return row


def test_scales_by_hand():
    w = row_with([1.0, -3.0])
    q = nvfp4.quantize(w)
    assert q.global_scale.item() == pytest.approx(448 * 6 / 6.0)
    assert q.scale.float().item() == 448.0
    assert q.packed.dtype == torch.uint8 and q.packed.shape == (1, 8)
    assert q.scale.dtype == torch.float8_e4m3fn and q.scale.shape == (1, 1)
    # 1.0 is code 2, -3.0 is code 8|5 = 13: byte 0 holds element 0 low, element 1 high.
    assert q.packed[0, 0].item() == 2 | (13 << 4)
    assert q.packed[0, 7].item() == 0 | (7 << 4)  # element 14 = 0, element 15 = 6.0 → code 7


def test_round_to_nearest_even_at_midpoints():
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    expect = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]  # ties go to the even code (0, 2, 2, 4, 4, 6, 6)
    codes = nvfp4.unpack(nvfp4.quantize(row_with(mids)).packed)[0, :7]
    assert codes.tolist() == [0, 2, 2, 4, 4, 6, 6]
    assert nvfp4.dequantize(nvfp4.quantize(row_with(mids)))[0, :7].tolist() == expect
    # Just past each midpoint rounds up; just below rounds down.
    up = nvfp4.dequantize(nvfp4.quantize(row_with([m * 1.01 for m in mids])))[0, :7].tolist()
    down = nvfp4.dequantize(nvfp4.quantize(row_with([m * 0.99 for m in mids])))[0, :7].tolist()
    assert up == [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert down == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0]


def test_every_grid_value_round_trips_and_negative_zero():
    grid = [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0, -0.1]
    q = nvfp4.quantize(row_with(grid))
    d = nvfp4.dequantize(q)[0]
    assert d[:13].tolist() == grid[:13]
    assert nvfp4.unpack(q.packed)[0, 13].item() == 8  # -0.1 → negative zero, as compressed-tensors
    assert d[13].item() == 0.0


def test_two_level_scale_by_hand():
    # Row 0 has amax 6, row 1 amax 0.6: global = 448; row 1's block scale = 448*0.6/6 = 44.8,
    # which E4M3 rounds to 44 (steps of 4 between 32 and 64), so 0.6 decodes to 6*44/448.
    w = torch.zeros(2, 16)
    w[0, 0], w[1, 0] = 6.0, 0.6
    q = nvfp4.quantize(w)
    assert q.global_scale.item() == pytest.approx(448.0)
    assert q.scale.float()[:, 0].tolist() == [448.0, 44.0]
    assert nvfp4.dequantize(q)[1, 0].item() == pytest.approx(6 * 44 / 448)


def test_zero_tensor_and_zero_block():
    q = nvfp4.quantize(torch.zeros(3, 32))
    assert q.global_scale.item() == 1.0
    assert (q.scale.float() == nvfp4.FP8_EPS).all()
    assert (nvfp4.dequantize(q) == 0).all()
    w = torch.randn(2, 32)
    w[:, 16:] = 0
    d = nvfp4.dequantize(nvfp4.quantize(w))
    assert (d[:, 16:] == 0).all() and torch.isfinite(d).all()


def test_values_past_the_grid_saturate():
    # A tiny block next to a big one: the tiny block's scale underflows E4M3 and is replaced by eps.
    w = torch.zeros(1, 32)
    w[0, 0] = 1e6
    w[0, 16] = 1e-3
    d = nvfp4.dequantize(nvfp4.quantize(w))
    assert d[0, 0].item() == pytest.approx(1e6, rel=1e-6) and d[0, 16].item() == 0.0


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4.quantize(torch.randn(4, 40), name="layers.0.mlp.up_proj.weight")
    bad = torch.randn(4, 32)
    bad[1, 3] = float("nan")
    with pytest.raises(ValueError, match="layers.1.self_attn.q_proj.weight: 1 NaN/Inf"):
        nvfp4.quantize(bad, name="layers.1.self_attn.q_proj.weight")
    bad[1, 3] = float("inf")
    with pytest.raises(ValueError, match="NaN/Inf"):
        nvfp4.quantize(bad)
    with pytest.raises(ValueError, match="2-D"):
        nvfp4.quantize(torch.randn(16))


def test_pack_unpack_inverse():
    codes = torch.randint(0, 16, (5, 48), dtype=torch.uint8)
    assert torch.equal(nvfp4.unpack(nvfp4.pack(codes)), codes)
    assert nvfp4.pack(codes)[0, 0].item() == codes[0, 0].item() | (codes[0, 1].item() << 4)


def test_gaussian_relative_mse():
    torch.manual_seed(1)
    w = torch.randn(512, 1024)
    err = ((w - nvfp4.dequantize(nvfp4.quantize(w))) ** 2).sum() / (w**2).sum()
    # Measured 0.0089 here: E2M1's grid with a per-16 scale; the issue's expectation is ≈ 0.009.
    assert 0.007 < err.item() < 0.011


def ct_quantize(w):
    """compressed-tensors' own NVFP4 quantizer (the NVFP4A16 preset), as llm-compressor runs it."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import NVFP4A16
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    args = NVFP4A16["weights"]
    gs = generate_gparam(w.float().min(), w.float().max())
    blocks = w.float().reshape(w.shape[0], -1, 16)
    scale, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), args, global_scale=gs)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    return NVFP4PackedCompressor.compress({"weight": w, "weight_scale": scale, "weight_global_scale": gs}, scheme), scheme


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_same_codes_and_scales_as_compressed_tensors(dtype):
    pytest.importorskip("compressed_tensors")
    torch.manual_seed(2)
    w = (torch.randn(384, 528) * 0.03).to(dtype)
    w[7, :16] = 0  # a zero block
    theirs, _ = ct_quantize(w)
    ours = nvfp4.quantize(w)
    assert torch.equal(theirs["weight_global_scale"], ours.global_scale)
    assert torch.equal(theirs["weight_scale"].float(), ours.scale.float())
    same = (nvfp4.unpack(theirs["weight_packed"]) == nvfp4.unpack(ours.packed)).float().mean().item()
    assert same >= 0.9999, same


def test_compressed_tensors_decompresses_to_our_dequantize():
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor

    torch.manual_seed(3)
    w = torch.randn(96, 160) * 0.05
    _, scheme = ct_quantize(w)
    q = nvfp4.quantize(w)
    out = NVFP4PackedCompressor.decompress(
        {"weight_packed": q.packed, "weight_scale": q.scale, "weight_global_scale": q.global_scale}, scheme)
    assert torch.equal(out["weight"], nvfp4.dequantize(q, out["weight"].dtype))


def test_checkpoint_layout_and_round_trip(hf_folder, tmp_path):
    hf, src = hf_folder("qwen2", max_shard_size="40KB")  # sharded source
    dst = str(tmp_path / "q")
    nvfp4.save_quantized(src, dst, progress=False)
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    assert nvfp4.is_nvfp4_config(config)
    assert config["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] == 16
    keys = {}
    for name in os.listdir(dst):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(dst, name), "pt") as f:
                keys.update({k: f.get_tensor(k) for k in f.keys()})
    assert "model.layers.0.mlp.down_proj.weight_packed" in keys
    assert "model.layers.0.mlp.down_proj.weight" not in keys
    assert keys["lm_head.weight"].dtype == hf.lm_head.weight.dtype  # lm_head stays high precision
    assert "model.norm.weight" in keys and "model.layers.1.self_attn.q_proj.bias" in keys
    w = hf.model.layers[1].mlp.up_proj.weight.detach()
    gate = hf.model.layers[1].mlp.gate_proj.weight.detach()
    q = nvfp4.quantize(w, global_scale=nvfp4.shared_global_scale([gate, w]))  # gate/up share one scale
    p = "model.layers.1.mlp.up_proj."
    assert torch.equal(keys[p + "weight_packed"], q.packed)
    assert torch.equal(keys[p + "weight_scale"].float(), q.scale.float())
    assert torch.equal(keys[p + "weight_global_scale"], q.global_scale)


def test_transformers_loads_our_checkpoint(hf_folder, tmp_path):
    """transformers + compressed-tensors (vLLM's loader path) read the folder nvfp4.py writes, and
    decompress every linear to exactly our dequantized weight."""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    import model as M

    _, src = hf_folder("qwen2")
    dst = str(tmp_path / "q")
    nvfp4.save_quantized(src, dst, progress=False)
    theirs = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.bfloat16)
    ours = M.Transformer.from_pretrained(dst, dtype=torch.bfloat16)
    x = torch.randint(0, 101, (2, 12))
    with torch.no_grad():
        a, b = theirs(x).logits.float(), ours(x).float()
    assert (a - b).abs().max() <= 0.05 * b.abs().max()  # bf16 arithmetic on the same weights


def test_cli(hf_folder, tmp_path, monkeypatch, capsys):
    _, src = hf_folder("llama")
    dst = str(tmp_path / "cli")
    monkeypatch.setattr("sys.argv", ["nvfp4.py", "--model", src, "--out", dst])
    nvfp4.main()
    assert "wrote" in capsys.readouterr().out
    assert os.path.exists(os.path.join(dst, "model.safetensors"))
    with pytest.raises(ValueError, match="already quantized"):
        nvfp4.save_quantized(dst, str(tmp_path / "again"), progress=False)
    monkeypatch.setattr("sys.argv", ["nvfp4.py", "--model", str(tmp_path / "none"), "--out", dst])
    with pytest.raises(SystemExit, match="nvfp4.py: no model folder at"):  # one line, no traceback
        nvfp4.main()
