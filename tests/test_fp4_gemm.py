"""fp4_gemm.py, the idea file: the torch reference, the portable Triton kernel and its dX, the op and its
autograd, QuantLinear, and the dispatch point, each against a float64 reference (tests/fp4_ref.py says
what is asserted and why).

On a CPU-only machine the Triton kernel runs in Triton's interpreter (conftest.py switches it on before
triton is first imported). With a GPU the same tests run through the engine room, plus the checks that
only make sense there (CUDA graphs, torch.compile). Each engine file has its own tests in tests/engine/.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fp4_gemm
from fp4_ref import (DEV, SHAPES, assert_replays_in_a_graph, check_split_k, forward_case, gpu_only, make_q,
                     needs_triton, ref_weight, rel_err, run_case, tol)


@pytest.mark.parametrize("M,K,N", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_torch_path(M, K, N, dtype, poisoned):
    for bias, per_row, lead in [(False, False, ()), (True, True, (2,))]:
        err = run_case(M, K, N, dtype, bias, per_row, lead, seed=M * 1000 + K + N, path="torch")
        assert err <= tol(dtype), (bias, per_row, err)



@needs_triton
@pytest.mark.parametrize("case", range(6))
def test_portable_kernel_forward(case, poisoned):
    """The tiled kernel (pinned) at odd shapes, bf16 and fp32 x, bias, per-row global scales, leading dims."""
    err, limit, what = forward_case("tiled", case)
    assert err <= limit, (what, err)


@needs_triton
@pytest.mark.parametrize("plan", [
    dict(kernel="tiled", BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, GROUP_M=2, SPLIT_K=4),
    dict(kernel="tiled", BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, GROUP_M=1, SPLIT_K=2),
    # a deep split as the GPU plans for 17-64 rows use: 8 asked, 5 left after rounding to whole K blocks
    dict(kernel="tiled", BLOCK_M=32, BLOCK_N=16, BLOCK_K=32, GROUP_M=8, SPLIT_K=8),
])
def test_split_k(plan, poisoned):
    """Split-K: fp32 partials in a workspace (poisoned too) summed by the reduce kernel, with uneven splits
    (K = 272 is no multiple of the split's K range) and tiles that overhang N and M; deterministic."""
    check_split_k(fp4_gemm.tiled_linear, plan, 17, 272, 40)


@needs_triton
@pytest.mark.parametrize("M,K,N", [(17, 48, 40), (3, 272, 264), (1, 16, 8)])
def test_portable_dx_kernel(M, K, N, poisoned):
    """The tiled dX kernel (dY @ W, the reduction over W's rows, per-row global scales folded into dY) at
    odd shapes with tails in N and K."""
    for per_row in (False, True):
        q = make_q(N, K, per_row, seed=M + K + N)
        g = torch.randn(M, N, generator=torch.Generator().manual_seed(N)).to(torch.bfloat16).to(DEV)
        dx = fp4_gemm.tiled_dx(g, q.packed, q.scale.view(torch.uint8), q.global_scale)
        assert dx.shape == (M, K) and torch.isfinite(dx).all()
        assert rel_err(dx, g.double().cpu() @ ref_weight(q.packed, q.scale, q.global_scale)) <= 1e-2, per_row


@pytest.mark.parametrize("path,kernel", [("torch", None)] + ([("triton", "tiled"), ("triton", "dequant")]
                                                          if fp4_gemm.HAS_TRITON else []))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_backward_dx_only(path, kernel, dtype, poisoned):
    """dX = dY @ W (float64 reference); packed weight, scales and global scale get no gradient; a
    trainable bias gets dY summed over the leading dims."""
    if path == "triton" and DEV.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no interpreter")
    M, K, N = 17, 48, 40
    q = make_q(N, K, per_row=(dtype == torch.float32), seed=11)
    layer = fp4_gemm.QuantLinear(K, N, bias=True, dtype=dtype, device=DEV, per_row_scale=q.global_scale.numel() > 1)
    layer.weight_packed.copy_(q.packed)
    layer.weight_scale.copy_(q.scale)
    layer.weight_global_scale.copy_(q.global_scale)
    layer.bias.requires_grad_(True)
    g = torch.Generator().manual_seed(12)
    x = torch.randn(2, M, K, generator=g).to(dtype).to(DEV).requires_grad_(True)
    dy = torch.randn(2, M, N, generator=g).to(dtype).to(DEV)
    with fp4_gemm.backend(path, kernel=kernel):
        layer(x).backward(dy)
    w = ref_weight(q.packed, q.scale, q.global_scale)
    assert x.grad.dtype == dtype and torch.isfinite(x.grad).all()
    assert rel_err(x.grad, dy.double().cpu() @ w) <= tol(dtype)
    assert rel_err(layer.bias.grad, dy.double().cpu().sum((0, 1))) <= tol(dtype)
    assert all(not b.requires_grad for b in layer.buffers())



def test_concat_is_exact_on_the_torch_path():
    """QuantLinear.concat (q/k/v, gate/up fusion) keeps each part's global scale per row, so the
    fused output equals the separate outputs bit for bit."""
    torch.manual_seed(31)
    K = 48
    parts = [torch.nn.Linear(K, n, bias=b, dtype=torch.bfloat16) for n, b in ((24, True), (8, False), (16, True))]
    for lin in parts:
        lin.weight.data *= torch.rand(()) * 10  # different amax → different global scales
    qs = [fp4_gemm.QuantLinear.from_linear(lin) for lin in parts]
    fused = fp4_gemm.QuantLinear.concat(qs)
    assert fused.weight_global_scale.shape == (48,) and fused.out_features == 24 + 8 + 16
    x = torch.randn(3, 5, K, dtype=torch.bfloat16)
    with fp4_gemm.backend("torch"):
        want = torch.cat([q(x) for q in qs], -1)
        got = fused(x)
    assert torch.equal(got, want)
    assert torch.equal(fused.dequantized_weight(), torch.cat([q.dequantized_weight() for q in qs]))


@needs_triton
def test_concat_through_triton(poisoned):
    parts = [fp4_gemm.QuantLinear(272, n, bias=False, device=DEV) for n in (24, 40)]
    for i, p in enumerate(parts):
        q = make_q(p.out_features, 272, seed=40 + i)
        p.weight_packed.copy_(q.packed)
        p.weight_scale.copy_(q.scale)
        p.weight_global_scale.copy_(q.global_scale * (1 + 3 * i))
    fused = fp4_gemm.QuantLinear.concat(parts)
    x = torch.randn(3, 272, dtype=torch.bfloat16, device=DEV)
    with fp4_gemm.backend("triton"):
        got = fused(x)
    w = torch.cat([ref_weight(p.weight_packed, p.weight_scale, p.weight_global_scale) for p in parts])
    assert rel_err(got, x.double().cpu() @ w.t()) <= 1e-2


def test_backend_choice(monkeypatch):
    """auto: torch on CPU tensors, Triton on CUDA ones; forcing either works; bad names are refused."""
    called = []
    monkeypatch.setattr(fp4_gemm, "_triton_linear", lambda *a, **k: called.append("triton") or torch.zeros(1, 8))
    q = make_q(8, 16, seed=50)
    x = torch.randn(1, 16, device=DEV)
    fp4_gemm.fp4_linear(x, q)
    assert called == (["triton"] if DEV.type == "cuda" and fp4_gemm.HAS_TRITON else [])
    with fp4_gemm.backend("torch"):
        fp4_gemm.fp4_linear(x, q)
    assert len(called) == (1 if DEV.type == "cuda" and fp4_gemm.HAS_TRITON else 0)
    if fp4_gemm.HAS_TRITON:
        with fp4_gemm.backend("triton"):
            fp4_gemm.fp4_linear(x, q)
        assert called[-1] == "triton"
    with pytest.raises(ValueError):
        fp4_gemm.set_backend("cutlass")
    assert fp4_gemm._choice["backend"] in fp4_gemm.BACKENDS
    # the environment variable is checked as strictly, at import
    import subprocess
    env = dict(os.environ, QERL_FP4_BACKEND="tritn")
    r = subprocess.run([sys.executable, "-c", "import fp4_gemm"], cwd=Path(fp4_gemm.__file__).parent, env=env, capture_output=True, text=True)
    assert r.returncode != 0 and "QERL_FP4_BACKEND='tritn'" in r.stderr


def test_shape_errors():
    q = make_q(8, 32, seed=60)
    with pytest.raises(ValueError):
        fp4_gemm.fp4_linear(torch.randn(2, 48, device=DEV), q)
    with pytest.raises(ValueError):
        fp4_gemm.QuantLinear(30, 8)



@needs_triton
def test_dispatch_point(monkeypatch):
    """The one dispatch point: CPU tensors with no engine kernel pinned run this file's tiled kernel without
    importing the engine room; a pinned engine kernel goes to engine/plan.py's linear and dx; a missing
    engine/ folder leaves the portable kernel serving every shape."""
    q = make_q(40, 48, seed=90)
    x = torch.randn(3, 48, dtype=torch.bfloat16, device=DEV)
    want = x.double().cpu() @ ref_weight(q.packed, q.scale, q.global_scale).t()
    if DEV.type == "cpu":
        monkeypatch.setattr(fp4_gemm, "_engine", lambda: pytest.fail("the portable path reached the engine"))
        with fp4_gemm.backend("triton"):
            assert rel_err(fp4_gemm.fp4_linear(x, q), want) <= 1e-2
        monkeypatch.undo()
    engine = fp4_gemm._engine()
    assert engine is not None
    calls = []
    monkeypatch.setattr(engine, "linear", lambda *a, **k: calls.append("linear") or fp4_gemm.tiled_linear(*a))
    monkeypatch.setattr(engine, "dx", lambda *a, **k: calls.append("dx") or fp4_gemm.tiled_dx(*a))
    with fp4_gemm.backend("triton", kernel="dequant"):
        xg = x.clone().requires_grad_(True)
        y = fp4_gemm.fp4_linear(xg, q)
        y.float().sum().backward()
    assert calls == ["linear", "dx"] and rel_err(y, want) <= 1e-2
    monkeypatch.setattr(fp4_gemm, "_engine", lambda: None)  # (as without the engine/ folder)
    with fp4_gemm.backend("triton", kernel="mma"):
        assert rel_err(fp4_gemm.fp4_linear(x, q), want) <= 1e-2
    assert calls == ["linear", "dx"]


def test_importing_does_not_choose_the_interpreter():
    """The library leaves TRITON_INTERPRET to its callers (tests, CLIs): importing fp4_gemm, model and lora
    in a fresh process does not set it."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "import os, fp4_gemm, model, lora; print(os.environ.get('TRITON_INTERPRET'))"
    r = subprocess.run([sys.executable, "-c", code], cwd=Path(fp4_gemm.__file__).parent, env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "None", r.stderr



def test_opcheck_and_compile_trace():
    """The custom op's fake (meta) implementation and autograd registration are consistent, and
    torch.compile traces a layer as one opaque op without graph breaks. (opcheck's schema test
    perturbs inputs arithmetically, which float8 tensors do not support on CPU.)"""
    q = make_q(24, 48, seed=70)
    x = torch.randn(5, 48, dtype=torch.float32, device=DEV, requires_grad=True)
    b = torch.randn(24, device=DEV)
    with fp4_gemm.backend("torch"):
        torch.library.opcheck(torch.ops.qerl.fp4_linear.default, (x, q.packed, q.scale, q.global_scale, b),
                              test_utils=("test_autograd_registration", "test_faketensor"))
        f = torch.compile(lambda t: fp4_gemm.fp4_linear(t, q, b).square().sum(), backend="aot_eager", fullgraph=True)
        f(x).backward()
    ref = x.detach().double().cpu() @ ref_weight(q.packed, q.scale, q.global_scale).t() + b.double().cpu()
    assert rel_err(x.grad, (2 * ref) @ ref_weight(q.packed, q.scale, q.global_scale)) < 1e-5



def qwen25_layer_shapes(size):
    """{layer: (K, N, fused)} of a Qwen2.5 decoder block as the model runs it: q/k/v and gate/up fused (one
    global scale per part, as after QuantLinear.concat), o and down alone."""
    import model

    c = model.qwen25_config(size)
    qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    return {"qkv": (c.hidden_size, qkv, True), "o": (c.num_heads * c.head_dim, c.hidden_size, False),
            "gate_up": (c.hidden_size, 2 * c.intermediate_size, True), "down": (c.intermediate_size, c.hidden_size, False)}


@gpu_only
@pytest.mark.parametrize("layer", ["qkv", "o", "gate_up", "down"])
def test_gpu_default_plans_at_the_72b_shapes(layer):
    """Each Qwen2.5-72B layer through the plan the engine picks for it (plan_forward, unpinned) at the rows
    of x an RL step runs it at: 1 and 8 (decode), 64 (a rollout's batch), 256 (prefill, the update's
    micro-batches). The 72B shapes take plans the 7B-32B tests never reach: down's K = 29568 is no multiple
    of 256 (k-steps of 128, split unevenly), q/k/v at 64 rows persistent stream-K. Against the float64
    decode of fp4_ref, within its bf16 tolerance; a wrong split or tail is off by far more."""
    K, N, fused = qwen25_layer_shapes("72b")[layer]
    q = make_q(N, K, per_row=fused, seed=K + N)
    w = ref_weight(q.packed, q.scale, q.global_scale).to(DEV)  # (N, K) float64, decoded apart from fp4_gemm
    g = torch.Generator().manual_seed(N)
    x = torch.randn(256, K, generator=g).to(torch.bfloat16).to(DEV)
    for M in (1, 8, 64, 256):
        y = fp4_gemm.fp4_linear(x[:M], q, None)
        ref = x[:M].double() @ w.t()
        err = ((y.double() - ref).norm() / ref.norm()).item()
        assert torch.isfinite(y).all() and err < tol(torch.bfloat16), (layer, M, K, N, err)


@gpu_only
def test_gpu_cuda_graph_and_compile():
    """A decode-sized call replays inside a CUDA graph and runs under torch.compile with the same result."""
    layer = fp4_gemm.QuantLinear.from_linear(torch.nn.Linear(512, 384, dtype=torch.bfloat16, device=DEV))
    x = torch.randn(4, 512, dtype=torch.bfloat16, device=DEV)
    want = layer(x)  # also compiles the kernel before capture
    got = assert_replays_in_a_graph(layer, x)
    compiled = torch.compile(layer, fullgraph=True)
    assert torch.equal(compiled(x), layer(x))
    assert not torch.equal(want, got)  # the replay really recomputed from the new x

