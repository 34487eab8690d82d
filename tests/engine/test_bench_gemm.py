"""engine/bench_gemm.py's output: each row's floor and shares, in the table and in the JSON rows (the timing
itself needs a GPU: tests/engine/test_plan.py checks the table's kernel labels), and the layer shapes of each size."""
from engine import bench_gemm


def row(M, N, K, ms, cublas_ms):
    """A measured row as bench_gemm._measure makes it, our bytes being the packed weight, its scales, x and y."""
    nbytes = N * K // 2 + N * K // 16 + 2 * M * K + 2 * M * N
    return dict(shape="gate_up", M=M, N=N, K=K, direction="fwd", plan=dict(kernel="mma", ROW_TILES=1, num_warps=4,
                SPLIT_K=2), ms=ms, err=1e-3, cublas_ms=cublas_ms, cublas_err=1e-3, tbps=nbytes / ms / 1e9,
                tflops=2 * M * N * K / ms / 1e9, ratio=cublas_ms / ms)


def test_a_rows_floor_and_shares_by_hand():
    """Qwen2.5-7B's gate|up at one row: ours moves 37888 x 3584 x 9/16 bytes of weight (+ x, y), cuBLAS twice
    that per weight in bf16; at 3.0 TB/s each floor is its bytes / 3e12, each share floor / time."""
    r = row(1, 37888, 3584, ms=0.0318, cublas_ms=0.0824)
    ours = 37888 * 3584 * 9 // 16 + 2 * 3584 + 2 * 37888
    theirs = 2 * (37888 * 3584 + 3584 + 37888)
    floor_us, share, cublas_share = bench_gemm.floor_shares(r, 3.0)
    assert abs(floor_us - ours / 3e12 * 1e6) < 1e-9 and abs(share - ours / 3e12 / 31.8e-6) < 1e-12
    assert abs(cublas_share - theirs / 3e12 / 82.4e-6) < 1e-12
    line = bench_gemm._table([r], 3.0, device="a GPU").splitlines()[-1]
    assert f"| {floor_us:.1f} | {share:.0%} | {cublas_share:.0%} |" in line
    (j,) = bench_gemm.json_rows([r], 3.0)
    assert (j["floor_us"], j["share"], j["cublas_share"]) == (floor_us, share, cublas_share)
    assert j["kernel"] == "mma 64 rows split2 w4" and j["ms"] == r["ms"]


def test_bench_shapes_are_the_published_configs():
    """--size: a Qwen2.5 size's linears as the decode fuses them (q|k|v with its bias, o, gate|up, down), from
    model.qwen25_config; the 7B ones are those the plan's table was read off."""
    assert bench_gemm.QWEN7B_SHAPES == {"qkv": (3584, (3584, 512, 512), True), "o": (3584, (3584,), False),
                                        "gate_up": (3584, (18944, 18944), False), "down": (18944, (3584,), False)}
    s32, s72 = bench_gemm.layer_shapes("32b"), bench_gemm.layer_shapes("72b")  # 40 / 64 heads, 8 kv heads of 128
    assert s32["qkv"] == (5120, (5120, 1024, 1024), True) and s32["gate_up"] == (5120, (27648, 27648), False)
    assert s72["o"] == (8192, (8192,), False) and s72["down"] == (29568, (8192,), False)
    problems = list(bench_gemm._problems(s32, [1, 64], with_dx=True))
    assert [(n, M, d) for n, _, M, d in problems][:5] == [("qkv", 1, "fwd"), ("o", 1, "fwd"), ("gate_up", 1, "fwd"),
                                                         ("down", 1, "fwd"), ("qkv", 64, "fwd")]
    assert len(problems) == 12 and all(shape == s32[n] for n, shape, _, _ in problems)
