"""The exported checkpoint as vLLM needs it: the linears vLLM fuses into one (q/k/v into qkv_proj,
gate/up into gate_up_proj) share one global scale, computed over the group's amax, exactly as
llm-compressor writes them; the in-memory fused layers (QuantLinear.concat) keep per-row scales.
And how the export writes: a full disk is one line with the output as it was, on a real small filesystem
too; a SIGKILLed export's temporary folder goes with the next run; every file readable by others."""
import glob
import json
import os
import signal
import stat
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

import nvfp4


def read_folder(folder):
    out = {}
    for path in glob.glob(os.path.join(folder, "*.safetensors")):
        with safe_open(path, "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def test_quantize_with_a_given_global_scale():
    torch.manual_seed(0)
    a, b = torch.randn(48, 32) * 0.02, torch.randn(16, 32) * 0.05  # b holds the group's amax
    gs = nvfp4.shared_global_scale([a, b])
    assert torch.equal(gs, nvfp4.global_scale_of(torch.cat([a, b])))
    assert gs.item() == min(nvfp4.global_scale_of(a).item(), nvfp4.global_scale_of(b).item())
    qa = nvfp4.quantize(a, global_scale=gs)
    assert torch.equal(qa.global_scale, gs)
    # By hand: a block scale is fp8(gs * amax_block / 6); a smaller gs than a's own lowers its scales.
    blocks = a.reshape(48, 2, 16).abs().amax(-1)
    assert torch.equal(qa.scale.float(), (gs * blocks / 6).to(torch.float8_e4m3fn).float())
    assert (qa.scale.float() <= nvfp4.quantize(a).scale.float()).all()
    err = ((nvfp4.dequantize(qa) - a) ** 2).sum() / (a**2).sum()
    assert err < 0.02  # still NVFP4's ~0.009 territory: the group's amax is within a few times a's
    # The tensor holding the amax quantizes exactly as on its own.
    qb = nvfp4.quantize(b, global_scale=gs)
    assert torch.equal(qb.packed, nvfp4.quantize(b).packed) and torch.equal(qb.scale.float(), nvfp4.quantize(b).scale.float())
    # An all-zero member of a group takes any scale; a scale larger than the tensor's own would clip.
    assert torch.equal(nvfp4.dequantize(nvfp4.quantize(torch.zeros(16, 32), global_scale=gs)), torch.zeros(16, 32))
    with pytest.raises(ValueError, match="exceeds the weight's own"):
        nvfp4.quantize(b, name="k_proj", global_scale=gs * 2)
    with pytest.raises(ValueError, match="positive finite"):
        nvfp4.quantize(a, global_scale=torch.tensor([0.0]))


def test_fused_group_names():
    k = "model.layers.7.self_attn.k_proj.weight"
    assert nvfp4.fused_group(k) == tuple(f"model.layers.7.self_attn.{n}_proj.weight" for n in "qkv")
    assert nvfp4.fused_group("model.layers.0.mlp.up_proj.weight") == (
        "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight")
    for key in ("model.layers.0.mlp.down_proj.weight", "model.layers.0.self_attn.o_proj.weight"):
        assert nvfp4.fused_group(key) == (key,)
    assert nvfp4.fused_group(k, {k: "x"}) == (k,)  # only members the checkpoint has
    # fused_groups partitions keys into groups, in the order of their first members; a name outside
    # FUSED_GROUPS, or a member without its partners, is a group of its own.
    keys = [f"layers.0.self_attn.{n}_proj.weight" for n in "qkvo"] + ["layers.0.mlp.up_proj.weight", "fc.weight",
                                                                    "layers.0.mlp.gate_proj.weight", "layers.1.mlp.up_proj.weight"]
    assert nvfp4.fused_groups(keys) == [tuple(keys[:3]), (keys[3],), (keys[6], keys[4]), (keys[5],), (keys[7],)]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_checkpoint_groups_share_one_global_scale_and_load(hf_folder, tmp_path, arch):
    import model as M

    hf, src = hf_folder(arch, max_shard_size="20KB")  # group members land in different shards
    shards = {n for n in os.listdir(src) if n.endswith(".safetensors")}
    assert len(shards) > 2
    dst = str(tmp_path / "q")
    nvfp4.save_quantized(src, dst, progress=False)
    t = read_folder(dst)
    for i, layer in enumerate(hf.model.layers):
        for mod, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj")), (layer.mlp, ("gate_proj", "up_proj"))):
            ws = [getattr(mod, n).weight.detach() for n in names]
            amax = max(w.abs().max() for w in ws)
            for n, w in zip(names, ws):
                p = f"model.layers.{i}.{'self_attn' if mod is layer.self_attn else 'mlp'}.{n}."
                assert t[p + "weight_global_scale"].item() == (448 * 6 / amax).item()
                q = nvfp4.quantize(w, global_scale=t[p + "weight_global_scale"])
                assert torch.equal(t[p + "weight_packed"], q.packed)
                assert torch.equal(t[p + "weight_scale"].float(), q.scale.float())
        for p, w in ((f"model.layers.{i}.self_attn.o_proj.", layer.self_attn.o_proj.weight),
                     (f"model.layers.{i}.mlp.down_proj.", layer.mlp.down_proj.weight)):
            assert torch.equal(t[p + "weight_global_scale"], nvfp4.global_scale_of(w.detach()))  # its own
    # model.py loads it: every QuantLinear holds the checkpoint's tensors, and the model computes what
    # the HF model computes with each linear's weight replaced by the checkpoint's dequantized one.
    ours = M.Transformer.from_pretrained(dst, dtype=torch.float32)
    lin = ours.layers[1].self_attn.v_proj
    p = "model.layers.1.self_attn.v_proj."
    assert torch.equal(lin.weight_global_scale.float().reshape(1), t[p + "weight_global_scale"])
    assert torch.equal(lin.weight_packed, t[p + "weight_packed"])
    with torch.no_grad():
        for name, mod in hf.named_modules():
            if name.split(".")[-1] in nvfp4.LINEAR_NAMES:
                p = name + "."
                mod.weight.copy_(nvfp4.dequantize(nvfp4.NVFP4Tensor(
                    t[p + "weight_packed"], t[p + "weight_scale"], t[p + "weight_global_scale"])))
        x = torch.randint(0, 101, (2, 9))
        ref, got = hf(x).logits, ours(x)
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("key", ["model.embed_tokens.weight", "model.layers.1.mlp.up_proj.weight"])
def test_export_refuses_a_nan_naming_the_file(hf_folder, tmp_path, key):
    """A NaN in the source is refused with the file and tensor named, whether the tensor would be copied
    (embeddings) or quantized; the output folder is not left behind."""
    from safetensors.torch import load_file, save_file

    _, src = hf_folder("qwen2")
    path = os.path.join(src, "model.safetensors")
    tensors = load_file(path)
    tensors[key][0, 5] = float("nan")
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"^{path}: {key} holds 1 non-finite values"):
        nvfp4.save_quantized(src, str(tmp_path / "q"), progress=False)
    assert not os.path.exists(tmp_path / "q")


def test_concat_keeps_per_row_scales_of_a_shared_scale_checkpoint(hf_folder, tmp_path):
    """Fusing loaded q/k/v in memory stacks their (here equal) scales row by row: exact either way."""
    from fp4_gemm import QuantLinear

    import model as M

    _, src = hf_folder("qwen2")
    dst = str(tmp_path / "q")
    nvfp4.save_quantized(src, dst, progress=False)
    m = M.Transformer.from_pretrained(dst, dtype=torch.float32)
    att = m.layers[0].self_attn
    parts = [att.q_proj, att.k_proj, att.v_proj]
    fused = QuantLinear.concat(parts)
    x = torch.randn(3, parts[0].in_features)
    with torch.no_grad():
        want = torch.cat([p(x) for p in parts], -1)
        assert torch.allclose(fused(x), want, atol=1e-5, rtol=1e-5)
    assert fused.weight_global_scale.float().unique().numel() == 1  # the group's one scale, on every row


# llm-compressor pins its own transformers and compressed-tensors, older than the project's, so it lives in a
# side folder (`make test` installs requirements-llmcompressor.txt there, .llmcompressor/ by default) and runs
# in a subprocess with that folder first on its path, leaving this interpreter's packages alone.
LLMC_ENV = "QERL_LLMCOMPRESSOR"
LLMC_DEFAULT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".llmcompressor")
LLMC_SCRIPT = """
import sys, torch
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=getattr(torch, sys.argv[3]))
oneshot(model=m, recipe=QuantizationModifier(targets="Linear", scheme="NVFP4A16", ignore=["lm_head"]))
m.save_pretrained(sys.argv[2], save_compressed=True)
"""


def llmcompressor_site():
    """The folder to put first on the subprocess's path: $QERL_LLMCOMPRESSOR (which must then exist),
    else .llmcompressor/ where `make test` installed it, else "" when this Python has llmcompressor itself.
    Skips when none is there."""
    import importlib.util

    site = os.environ.get(LLMC_ENV)
    if site:
        assert os.path.isdir(os.path.join(site, "llmcompressor")), (
            f"{LLMC_ENV}={site} holds no llmcompressor: run `make test`, which installs it there, or unset {LLMC_ENV}")
        return site
    if os.path.isdir(os.path.join(LLMC_DEFAULT, "llmcompressor")):
        return LLMC_DEFAULT
    if importlib.util.find_spec("llmcompressor") is not None:
        return ""
    pytest.skip(f"llm-compressor not installed: `make test` installs it into {LLMC_DEFAULT} "
                f"(requirements-llmcompressor.txt) and runs this test; or set {LLMC_ENV} to such a folder")


def llmcompressor_nvfp4a16(site, src, dst, dtype="float32"):
    """llm-compressor's data-free NVFP4A16 oneshot of the HF folder src, saved compressed into dst."""
    import subprocess
    import sys

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (site, env.get("PYTHONPATH")) if p)
    run = subprocess.run([sys.executable, "-c", LLMC_SCRIPT, src, dst, dtype], env=env, capture_output=True, text=True)
    assert run.returncode == 0, f"llm-compressor failed (python path {site or 'this venv'}):\n{run.stderr[-3000:]}"


def test_same_checkpoint_as_llmcompressor(hf_folder, tmp_path):
    """llm-compressor's NVFP4A16 (weight-only, data-free oneshot) on the same float32 model writes
    exactly our tensors: codes, block scales and the fused groups' shared global scales."""
    site = llmcompressor_site()
    hf, src = hf_folder("qwen2")
    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
    nvfp4.save_quantized(src, ours, progress=False)
    llmcompressor_nvfp4a16(site, src, theirs)
    a, b = read_folder(ours), read_folder(theirs)
    quant = [k for k in a if k.endswith(("weight_packed", "weight_scale", "weight_global_scale"))]
    assert len(quant) == 3 * 7 * len(hf.model.layers)
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        x, y = (a[k].view(torch.uint8), b[k].view(torch.uint8)) if a[k].dtype == torch.float8_e4m3fn else (a[k], b[k])
        assert torch.equal(x, y), k
    gs = lambda n: b[f"model.layers.0.{n}.weight_global_scale"].item()  # noqa: E731
    assert gs("self_attn.q_proj") == gs("self_attn.k_proj") == gs("self_attn.v_proj")
    assert gs("mlp.gate_proj") == gs("mlp.up_proj")
    assert gs("self_attn.q_proj") != gs("self_attn.o_proj")  # (a shared scale is not one for the whole model)


def leftovers(folder):
    return sorted(n for n in os.listdir(folder) if n.startswith("."))


def test_a_full_disk_is_one_line_and_leaves_the_output_as_it_was(hf_folder, tmp_path, monkeypatch):
    """safetensors reports a full disk as its own SafetensorError, not an OSError: the export stops with one
    line naming the file and what is kept, no traceback, and no temporary folder; an earlier output stays
    exactly as it was."""
    from safetensors import SafetensorError

    _, src = hf_folder("qwen2")
    dst = tmp_path / "q"

    def full(*a, **k):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    with monkeypatch.context() as m:
        m.setattr(nvfp4, "save_file", full)
        with pytest.raises(SystemExit) as e:
            nvfp4.main(["--model", src, "--out", str(dst)])
    assert e.value.code == (f"nvfp4.py: cannot write {dst}/model.safetensors: Error while serializing: I/O error: No "
                            f"space left on device (os error 28); nothing was written to {dst} (the partial output "
                            f"is removed)")
    assert os.listdir(tmp_path) == [os.path.basename(src)]
    nvfp4.main(["--model", src, "--out", str(dst)])
    before = {n: (dst / n).read_bytes() for n in os.listdir(dst)}
    monkeypatch.setattr(nvfp4, "save_file", full)
    with pytest.raises(SystemExit, match=f"; {dst} is as it was"):
        nvfp4.main(["--model", src, "--out", str(dst)])
    assert {n: (dst / n).read_bytes() for n in os.listdir(dst)} == before and leftovers(tmp_path) == []


def test_a_full_disk_on_a_real_small_filesystem(small_fs):
    """The bundled tiny model (3.5 MB, 0.9 MB in NVFP4) quantized onto a 256 KiB filesystem: the write that
    does not fit fails in safetensors; one line, and nothing left on the filesystem."""
    code = f"""
import json, os
import nvfp4
out = os.path.join({small_fs.folder!r}, "q")
try:
    nvfp4.main(["--model", "tiny", "--out", out])
    message = None
except SystemExit as e:
    message = str(e.code)
print(json.dumps({{"message": message, "left": os.listdir({small_fs.folder!r})}}))
"""
    p = small_fs("256k", code)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["message"].startswith(f"nvfp4.py: cannot write {small_fs.folder}/q/model.safetensors: "), res
    assert res["message"].endswith(f"; nothing was written to {small_fs.folder}/q (the partial output is removed)")
    assert res["left"] == []


def test_a_killed_exports_temporary_folder_goes_with_the_next_run(hf_folder, tmp_path):
    """SIGKILL midway (no cleanup runs) leaves .q.tmp-* beside --out; the next export into --out removes it,
    proved dead by its lock, and writes --out; every file of it readable as an ordinary file is."""
    _, src = hf_folder("qwen2")
    dst = str(tmp_path / "q")
    code = f"""
import os, signal, nvfp4
nvfp4.save_file = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
nvfp4.main(["--model", {src!r}, "--out", {dst!r}])
"""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    assert [n[:7] for n in leftovers(tmp_path)] == [".q.tmp-"] and not os.path.exists(dst)
    nvfp4.main(["--model", src, "--out", dst])
    assert leftovers(tmp_path) == [] and "model.safetensors" in os.listdir(dst)
    mask = os.umask(0)
    os.umask(mask)
    assert {n: stat.S_IMODE(os.stat(os.path.join(dst, n)).st_mode) for n in os.listdir(dst)} == \
        {n: 0o666 & ~mask for n in os.listdir(dst)}
