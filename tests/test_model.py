"""model.py against transformers: logits on tiny random checkpoints, NVFP4 loading, and the error
paths. (Decoding through the model's KV-cache interface is tested with the sampler, tests/test_rollout.py.)"""
import json
import os

import pytest
import torch

import adapters
import fp4_gemm
import lora
import model as M
import nvfp4

CONFIGS = [  # arch, overrides: tied embeddings, GQA (kv < heads), MHA, explicit head_dim, odd sizes
    ("qwen2", dict(tie_word_embeddings=True)),
    ("qwen2", dict(num_attention_heads=8, num_key_value_heads=2, hidden_size=128, intermediate_size=160)),
    ("llama", dict()),
    ("llama", dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True, rope_theta=500000.0)),
    ("qwen2", dict(num_hidden_layers=3, head_dim=32, num_attention_heads=2, num_key_value_heads=1, vocab_size=77)),
]


@pytest.mark.parametrize("arch,overrides", CONFIGS)
def test_logits_match_transformers(hf_folder, arch, overrides):
    hf, folder = hf_folder(arch, **overrides)
    ours = M.Transformer.from_pretrained(folder, dtype=torch.float32)
    tokens = torch.randint(0, hf.config.vocab_size, (3, 19))
    with torch.no_grad():
        assert (hf(tokens).logits - ours(tokens)).abs().max().item() <= 1e-4


def test_sharded_checkpoint(hf_folder):
    hf, folder = hf_folder("qwen2", max_shard_size="30KB")
    assert os.path.exists(os.path.join(folder, "model.safetensors.index.json"))
    ours = M.Transformer.from_pretrained(folder, dtype=torch.float32)
    tokens = torch.randint(0, 101, (2, 8))
    with torch.no_grad():
        assert (hf(tokens).logits - ours(tokens)).abs().max().item() <= 1e-4


def quant_tensors(m):
    """{module name: (packed, scale, global_scale)} of every QuantLinear of a model."""
    return {n: (q.weight_packed, q.weight_scale.view(torch.uint8), q.weight_global_scale)
            for n, q in m.named_modules() if isinstance(q, fp4_gemm.QuantLinear)}


def assert_same_quantized_model(a, b, tokens):
    """Every QuantLinear's codes, block scales (bit for bit) and global scale equal, and so the logits."""
    ta, tb = quant_tensors(a), quant_tensors(b)
    assert ta.keys() == tb.keys() and len(ta) == 7 * a.config.num_layers
    for name in ta:
        for x, y in zip(ta[name], tb[name]):
            assert x.dtype == y.dtype and torch.equal(x, y), name
    with torch.no_grad():
        assert torch.equal(a(tokens), b(tokens))


def test_quantize_on_load_is_the_exported_model(tmp_path):
    """The bundled tiny policy: exported by `nvfp4.py` then loaded, quantized as it loads (through
    adapters.load_policy, as train.py and eval.py do it), and quantized in memory (fp4_gemm.quantize_model)
    are one model, with the fused groups' shared global scales."""
    tiny = M.read_config("tiny")[0]
    nvfp4.save_quantized(tiny, str(tmp_path / "q"), progress=False)
    exported = M.Transformer.from_pretrained(str(tmp_path / "q"), dtype=torch.float32)
    on_load, _ = adapters.load_policy(tiny, quant="nvfp4", device="cpu")
    in_memory = M.Transformer.from_pretrained(tiny, dtype=torch.float32)
    fp4_gemm.quantize_model(in_memory)
    tokens = torch.randint(0, exported.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    assert_same_quantized_model(exported, on_load, tokens)
    assert_same_quantized_model(exported, in_memory, tokens)
    att, mlp = on_load.layers[2].self_attn, on_load.layers[2].mlp
    for group in ((att.q_proj, att.k_proj, att.v_proj), (mlp.gate_proj, mlp.up_proj)):
        assert len({m.weight_global_scale.item() for m in group}) == 1


def test_qwen25_shaped_layers_quantize_on_load_as_exported(hf_folder, tmp_path):
    """Qwen2.5-0.5B's layer shapes (q 896x896, GQA k/v 128x896 with biases, gate/up 4864x896), bf16 as
    published, sharded so that a group's members lie in different files; k_proj drawn 3x wider than q/v
    (and up 1.5x gate), so the shared scale differs from a member's own: export-then-load and
    quantize-on-load agree bit for bit, and differ from quantizing q_proj alone."""
    cfg = M.qwen25_config("0.5b").raw
    hf, src = hf_folder("qwen2", hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
                        num_attention_heads=cfg["num_attention_heads"], num_key_value_heads=cfg["num_key_value_heads"],
                        num_hidden_layers=1, vocab_size=96)
    with torch.no_grad():
        hf.model.layers[0].self_attn.k_proj.weight.mul_(3)
        hf.model.layers[0].mlp.up_proj.weight.mul_(1.5)
    hf.to(torch.bfloat16).save_pretrained(src, max_shard_size="3MB")
    assert len([f for f in os.listdir(src) if f.endswith(".safetensors")]) > 3
    on_load = M.Transformer.from_pretrained(src, dtype=torch.float32, quantize=True)
    nvfp4.save_quantized(src, str(tmp_path / "q"), progress=False)
    exported = M.Transformer.from_pretrained(str(tmp_path / "q"), dtype=torch.float32)
    assert_same_quantized_model(exported, on_load, torch.randint(0, 96, (2, 7)))
    att = on_load.layers[0].self_attn
    w = {n: getattr(hf.model.layers[0].self_attn, n).weight.detach() for n in ("q_proj", "k_proj", "v_proj")}
    assert att.q_proj.weight_global_scale.item() == nvfp4.global_scale_of(w["k_proj"]).item()  # k's amax rules
    own = nvfp4.quantize(w["q_proj"])
    assert own.global_scale.item() > att.q_proj.weight_global_scale.item()
    assert not torch.equal(own.scale.view(torch.uint8), att.q_proj.weight_scale.view(torch.uint8))


def test_nvfp4_model_close_to_dense_model(hf_folder):
    hf, folder = hf_folder("qwen2", hidden_size=128, intermediate_size=256)
    dense = M.Transformer.from_pretrained(folder, dtype=torch.float32)
    on_load = M.Transformer.from_pretrained(folder, dtype=torch.float32, quantize=True)
    assert sum(isinstance(m, fp4_gemm.QuantLinear) for m in on_load.modules()) == 7 * hf.config.num_hidden_layers
    assert isinstance(on_load.lm_head, torch.nn.Linear)
    tokens = torch.randint(0, 101, (2, 16))
    with torch.no_grad():
        a, b = dense(tokens), on_load(tokens)
    # Each weight carries ~9.5% relative RMS error (sqrt of NVFP4's 0.009 MSE), compounding
    # through the layers of a random model: close, but really quantized.
    rel = ((a - b).norm() / a.norm()).item()
    assert 1e-3 < rel < 0.3, rel
    assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.95


def test_quantize_model_groups_are_what_the_filter_picks(hf_folder):
    """A linear quantized without its group's partners (or under a name outside nvfp4.FUSED_GROUPS)
    keeps its own global scale: only the members picked together share one."""
    _, folder = hf_folder("qwen2")
    m = M.Transformer.from_pretrained(folder, dtype=torch.float32)
    att = m.layers[0].self_attn
    w = {n: getattr(att, n).weight.detach().clone() for n in ("q_proj", "k_proj", "v_proj")}
    fp4_gemm.quantize_model(m, filter=lambda name, mod: fp4_gemm.is_decoder_linear(name, mod)
                            and name.endswith(("q_proj", "k_proj")))
    shared = nvfp4.shared_global_scale([w["q_proj"], w["k_proj"]])
    assert torch.equal(att.q_proj.weight_global_scale, shared) and torch.equal(att.k_proj.weight_global_scale, shared)
    assert isinstance(att.v_proj, torch.nn.Linear)


def test_swap_linears_and_random_model():
    with pytest.raises(ValueError, match="unknown Qwen2.5 size '110b'; use one of 0.5b, 1.5b"):
        M.qwen25_config("110b")
    cfg = M.qwen25_config("0.5b")
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_kv_heads, cfg.tie_word_embeddings) == (896, 24, 2, True)
    small = M.Config({**cfg.raw, "num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 64,
                      "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 50})
    m = M.Transformer.from_random(small, dtype=torch.float32, quantize=True)
    assert sum(isinstance(x, fp4_gemm.QuantLinear) for x in m.modules()) == 7
    assert m.lm_head.weight is m.embed_tokens.weight
    out = m(torch.randint(0, 50, (1, 5)))
    assert out.shape == (1, 5, 50) and torch.isfinite(out).all()
    swapped = m.swap_linears(lambda name, mod: torch.nn.Identity(), lambda name, mod: name.endswith("o_proj"))
    assert list(swapped) == ["layers.0.self_attn.o_proj"]


def test_gradient_checkpointing_same_gradients(hf_folder):
    _, folder = hf_folder("qwen2")
    grads = []
    for ckpt in (False, True):
        m = M.Transformer.from_pretrained(folder, dtype=torch.float32).train()
        m.gradient_checkpointing = ckpt
        m(torch.arange(10)[None]).sum().backward()
        grads.append(m.layers[0].mlp.up_proj.weight.grad)
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


@pytest.mark.parametrize("quantize", [False, True])
def test_compiled_blocks_same_loss_and_lora_gradients(hf_folder, quantize):
    """compile_blocks (train.py's torch.compile of the blocks in the update): the same loss and LoRA
    gradients as eager, through checkpointing, LoRA and (quantize) the NVFP4 op. A counting backend
    shows that the layers share their captured graphs (two: the first layer's input needs no gradient,
    the embeddings being frozen; every later layer reuses the second, forward and recompute alike), and
    that evaluation (no grad, or eval mode) stays eager; aot_eager then runs the autograd the way
    inductor gets it. On the GPU where there is one, as train.py compiles only there (with a CPU model
    on a GPU machine, compiling initializes the GPU inside the checkpointed forward, which torch's
    checkpoint refuses)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    _, folder = hf_folder("qwen2", num_hidden_layers=3)
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    tokens = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(1)).to(dev)
    torch._dynamo.reset()  # forget the graphs of Block.forward that earlier tests compiled
    results = []
    for backend in (None, counting, "aot_eager"):
        m = M.Transformer.from_pretrained(folder, dtype=torch.float32, device=dev, quantize=quantize).train()
        torch.manual_seed(0)
        params = lora.apply_lora(m, rank=4, alpha=8)
        for p in params:
            p.data.normal_(0, 0.1)
        m.gradient_checkpointing, m.compile_blocks = True, backend
        loss = m(tokens).float().log_softmax(-1).mean()
        loss.backward()
        results.append((loss.detach(), [p.grad for p in params]))
        if backend is counting:
            assert len(graphs) == 2
            with torch.no_grad():
                m(tokens)
            m.eval()(tokens)
            assert len(graphs) == 2
    for loss, grads in results[1:]:
        torch.testing.assert_close(loss, results[0][0], rtol=1e-5, atol=1e-6)
        for g, g0 in zip(grads, results[0][1]):
            torch.testing.assert_close(g, g0, rtol=1e-4, atol=1e-6)


def counted_compiles(hf_folder):
    """A 3-layer model with adapters, in training, whose blocks compile through a backend that keeps each graph
    dynamo hands it (and runs it as is), the graphs earlier tests compiled forgotten. → (model, graphs)."""
    _, folder = hf_folder("qwen2", num_hidden_layers=3)
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    m = M.Transformer.from_pretrained(folder, dtype=torch.float32).train()
    lora.apply_lora(m, rank=4, alpha=8)
    m.compile_blocks = counting
    torch._dynamo.reset()
    return m, graphs


def test_compiled_blocks_compile_once_for_every_shape(hf_folder):
    """The update's micro-batches differ in token and sequence counts. Every block's input is marked
    dynamic, so the blocks keep the two graphs of the test above through any such shapes (of two
    sequences or more: torch specializes a count of one). Were only the first block's input marked, the
    later blocks would compile a third time when the counts first change, which a user meets as one
    RL step that takes seconds longer (results/step_h100.md)."""
    m, graphs = counted_compiles(hf_folder)
    gen = torch.Generator().manual_seed(3)
    for shape in [(2, 9), (3, 7), (2, 12), (5, 4)]:
        m(torch.randint(0, 101, shape, generator=gen)).float().logsumexp(-1).mean().backward()
    assert len(graphs) == 2


def test_update_slices_compile_once_a_lone_sequence_included(hf_folder):
    """The update's micro-batches (logprobs.micro_batches) hold as many sequences as fit, so a step's last one
    may hold a single sequence, in whatever step its lengths first leave one over. torch.compile specializes a
    count of one, so shared_prompt_hidden runs a lone sequence's attention as two copies of it: the blocks keep
    their two graphs through slices of 4, 2, 1 and 3 sequences, and the lone one's states are its own."""
    from logprobs import completion_logprobs

    m, graphs = counted_compiles(hf_folder)
    gen = torch.Generator().manual_seed(3)
    pa, pb = torch.randint(0, 101, (7,), generator=gen).tolist(), torch.randint(0, 101, (5,), generator=gen).tolist()
    for prompts in ([pa, pa, pa, pb], [pb, pb], [pa], [pb, pa, pa], [pb]):
        lengths = torch.randint(1, 6, (len(prompts),), generator=gen)
        completions = torch.randint(0, 101, (len(prompts), 6), generator=gen)
        logp, _ = completion_logprobs(m, prompts, completions, lengths, 1.0, 1024)
        logp.sum().backward()
    assert len(graphs) == 2
    tokens = torch.randint(0, 101, (1, 9), generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(m.shared_prompt_hidden(tokens, [9], [0]), m.hidden(tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("quantize,backend", [(False, None), (True, None), (False, "aot_eager")])
def test_shared_prompt_hidden_is_hidden_of_each_whole_sequence(hf_folder, quantize, backend):
    """shared_prompt_hidden (a packed row of the distinct tokens: each shared prompt once, no padding)
    gives each sequence's hidden states and the LoRA gradients that hidden() gives over the padded whole
    sequences: forward, and backward through a shared prompt's keys and values (the gradients of every
    sequence that reads them summed into them). Two prompts of 3 and 2 samples, the first of them shared
    in part by a third sequence, sequences of different lengths; plain, on an NVFP4 base, and with
    checkpointing and the compiled blocks (aot_eager) that train.py uses. On the GPU where there is one
    (its attention kernels), as in the test above."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    _, folder = hf_folder("qwen2", num_hidden_layers=3)
    gen = torch.Generator().manual_seed(2)
    pa, pb = torch.randint(0, 101, (7,), generator=gen), torch.randint(0, 101, (4,), generator=gen)
    lengths = [12, 9, 11, 8, 10, 11]
    prefix = [pa, pa, pa, pb, pb, pa[:3]]
    shared = [0, 7, 7, 0, 4, 0]
    tokens = torch.randint(0, 101, (6, 12), generator=gen)
    for i, p in enumerate(prefix):
        tokens[i, :len(p)] = p
    tokens[5, 3] = (tokens[0, 3] + 1) % 101  # row 5 begins as row 0 does, for 3 tokens only: not shared
    tokens, weights = tokens.to(dev), torch.randn(6, 12, 64, generator=gen).to(dev)
    real = (torch.arange(12)[None] < torch.tensor(lengths)[:, None]).to(dev)  # past a length: no meaning
    results = []
    for packed in (False, True):
        m = M.Transformer.from_pretrained(folder, dtype=torch.float32, device=dev, quantize=quantize).train()
        torch.manual_seed(0)
        params = lora.apply_lora(m, rank=4, alpha=8)
        for p in params:
            p.data.normal_(0, 0.1)
        m.gradient_checkpointing, m.compile_blocks = backend is not None, backend
        h = m.shared_prompt_hidden(tokens, lengths, shared) if packed else m.hidden(tokens)
        h = h * real[..., None]
        (h * weights).sum().backward()
        results.append((h.detach(), [p.grad for p in params]))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-5)
    for g, g0 in zip(results[1][1], results[0][1]):  # float32 sums in another order
        torch.testing.assert_close(g, g0, rtol=1e-4, atol=1e-4 * float(g0.abs().max()))
    with pytest.raises(ValueError, match="prefix"):
        m.shared_prompt_hidden(tokens, lengths, [0, 7, 7, 0, 9, 0])  # more than row 3 has
    with pytest.raises(ValueError, match="1 to 12 tokens"):
        m.shared_prompt_hidden(tokens, [13] + lengths[1:], shared)  # longer than tokens is wide


def test_errors(hf_folder, tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="not a hub id"):
        M.Transformer.from_pretrained(str(tmp_path / "nope"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        M.Transformer.from_pretrained(str(empty))
    _, folder = hf_folder("qwen2")
    config = json.load(open(os.path.join(folder, "config.json")))
    json.dump({**config, "model_type": "mixtral"}, open(os.path.join(folder, "config.json"), "w"))
    with pytest.raises(ValueError, match="unsupported architecture model_type='mixtral'"):
        M.Transformer.from_pretrained(folder)
    json.dump({**config, "num_hidden_layers": 3}, open(os.path.join(folder, "config.json"), "w"))
    with pytest.raises(KeyError, match="lacks .* tensors"):
        M.Transformer.from_pretrained(folder)
    json.dump({**config, "num_hidden_layers": 1}, open(os.path.join(folder, "config.json"), "w"))
    with pytest.raises(KeyError, match="does not use"):
        M.Transformer.from_pretrained(folder)
    json.dump({**config, "intermediate_size": 80}, open(os.path.join(folder, "config.json"), "w"))
    with pytest.raises(ValueError, match=r"model.safetensors: .*gate_proj.weight has shape \(96, 64\), expected \(80, 64\)"):
        M.Transformer.from_pretrained(folder)
    os.remove(os.path.join(folder, "model.safetensors"))
    json.dump(config, open(os.path.join(folder, "config.json"), "w"))
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        M.Transformer.from_pretrained(folder)


def rewrite(folder, key, change):
    """Replace tensor `key` of the folder's one model.safetensors by change(tensor)."""
    from safetensors.torch import load_file, save_file

    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    tensors[key] = change(tensors[key])
    save_file(tensors, path, metadata={"format": "pt"})
    return path


def with_nan(t):
    t = t.clone()
    t.view(-1)[3] = float("nan")
    return t


@pytest.mark.parametrize("quantize", [False, True], ids=["dense", "quantize-on-load"])
@pytest.mark.parametrize("key", ["model.layers.1.post_attention_layernorm.weight", "model.layers.0.self_attn.k_proj.weight",
                                 "model.layers.1.self_attn.q_proj.bias"])
def test_a_nan_in_a_checkpoint_is_refused_naming_the_file(hf_folder, key, quantize):
    _, folder = hf_folder("qwen2")
    path = rewrite(folder, key, with_nan)
    with pytest.raises(ValueError, match=f"^{path}: {key} holds 1 non-finite values"):
        M.Transformer.from_pretrained(folder, dtype=torch.float32, quantize=quantize)


@pytest.mark.parametrize("key,change,message", [
    ("model.layers.0.mlp.up_proj.weight_scale", lambda t: t[:, :-1].contiguous(), r"has shape \(96, 3\), expected \(96, 4\)"),
    ("model.layers.0.mlp.up_proj.weight_packed", lambda t: t.view(torch.int8), "has dtype torch.int8, expected torch.uint8"),
    ("model.layers.1.self_attn.v_proj.weight_scale", lambda t: t.view(torch.uint8), "has dtype torch.uint8, expected torch.float8_e4m3fn"),
    ("model.layers.1.self_attn.v_proj.weight_scale", lambda t: torch.where(  # E4M3's NaN byte
        torch.arange(t.numel()).reshape(t.shape) == 5, torch.tensor(0x7F, dtype=torch.uint8), t.view(torch.uint8)
    ).view(torch.float8_e4m3fn), "holds 1 non-finite values"),
    ("model.layers.1.mlp.down_proj.weight_global_scale", lambda t: t * float("inf"), "holds 1 non-finite values"),
    ("model.layers.1.mlp.down_proj.weight_global_scale", lambda t: t.repeat(2), r"has shape \(2,\), expected \(1,\)"),
    ("model.norm.weight", lambda t: t.to(torch.int32), "has dtype torch.int32, expected a floating-point weight"),
])
def test_a_broken_nvfp4_checkpoint_is_refused_naming_the_file(hf_folder, tmp_path, key, change, message):
    _, folder = hf_folder("qwen2")
    dst = str(tmp_path / "q")
    nvfp4.save_quantized(folder, dst, progress=False)
    path = rewrite(dst, key, change)
    with pytest.raises(ValueError, match=f"^{path}: {key} {message}"):
        M.Transformer.from_pretrained(dst, dtype=torch.float32)


def test_config_reads_both_rope_layouts():
    base = {"model_type": "qwen2", "vocab_size": 10, "hidden_size": 32, "intermediate_size": 32,
            "num_hidden_layers": 1, "num_attention_heads": 2}
    assert M.Config({**base, "rope_theta": 1e6}).rope_theta == 1e6  # transformers 4.x
    assert M.Config({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}).rope_theta == 5e5
    with pytest.raises(ValueError, match="only plain RoPE"):
        M.Config({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="sliding"):
        M.Config({**base, "use_sliding_window": True})


def test_rmsnorm_is_the_float32_formula():
    """RMSNorm: x / sqrt(mean(x^2) + eps) * w in float32 with the float32 weight, one rounding to x's
    dtype at the end: bit for bit the spelled-out float32 formula (on CPU), and float64 to rounding."""
    g = torch.Generator().manual_seed(3)
    norm = M.RMSNorm(96, 1e-6)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.01, generator=g)  # as after AQN: finer than bf16 could hold
    for dtype in (torch.bfloat16, torch.float32):
        x = (torch.randn(4, 7, 96, generator=g) * 3).to(dtype)
        h = x.float()
        assert torch.equal(norm(x), (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight).to(dtype))
        h = x.double()
        ref = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.double()
        step = 2**-8 if dtype == torch.bfloat16 else 1e-6
        assert ((norm(x).double() - ref).abs() <= step * ref.abs() + 1e-12).all()
