"""engine/decode.py (and its kernels, engine/decode_kernels.py) against rollout.py's plain sampler, the
specification: greedy tokens equal, logprobs within 1e-4 in float32 (1e-5 where only the batch's row
count differs), the same seeded samples. On the CPU the engine runs its fused ops as torch ops
(kernels="torch") and, under Triton's interpreter, as the Triton kernels; on a GPU the graphed step,
also in bf16 and with NVFP4 bases, against one full forward."""
import os
from types import SimpleNamespace

import pytest
import torch

import fp4_gemm
import lora
import model as M
import rollout
from engine import decode, pdl
from engine.korder import wgmma_k_order
from rollout_ref import CFG, full_forward_logprobs, load, prompts_of, rows

interpreted = pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="the kernels on the CPU need Triton's interpreter (TRITON_INTERPRET=1)")
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def assert_same_rollout(got, ref, atol=1e-4):
    assert torch.equal(got.tokens, ref.tokens) and got.finish == ref.finish and torch.equal(got.lengths, ref.lengths)
    assert torch.allclose(got.logprobs, ref.logprobs, atol=atol, rtol=0)


# --- the engine against the plain sampler -------------------------------------------------------

@pytest.mark.parametrize("kernels,quantize", [("torch", False), ("torch", True),
                                              pytest.param("triton", False, marks=interpreted)])
@pytest.mark.parametrize("temperature,top_p,top_k", [(0.0, 1.0, 0), (0.8, 0.9, 0), (1.2, 1.0, 20)])
def test_engine_equals_the_plain_sampler(hf_folder, kernels, quantize, temperature, top_p, top_k):
    """Greedy and seeded: the same tokens, stops and lengths as rollout.py's sampler, logprobs within 1e-4
    (fp32: the two differ in summation order only), over prompts of different lengths and groups of 3."""
    _, model = load(hf_folder, quantize=quantize, seed=1)
    prompts = prompts_of([5, 1, 9], 97, seed=1)
    kw = dict(n=3, max_new_tokens=7, temperature=temperature, top_p=top_p, top_k=top_k, stop_ids=(3, 11, 50), seed=5)
    ref = rollout.generate(model, prompts, kernels="torch", **kw)
    got = decode.generate(model, prompts, kernels=kernels, **kw)
    assert ref.stats["kernels"] == "torch" and got.stats["kernels"] == kernels
    assert_same_rollout(got, ref)


@interpreted
@pytest.mark.parametrize("per_sm", [1, 8])
def test_sampler_split_over_the_vocabulary_samples_the_same(hf_folder, monkeypatch, per_sm):
    """A vocabulary of 2,500 (three blocks of 1,024 logits), 2 rows, 4 SMs on the CPU: at 1 program an SM each
    row's vocabulary is two chunks of two blocks, at 8 three chunks of one. Both sample as the plain sampler."""
    monkeypatch.setattr(decode, "SAMPLE_PER_SM", per_sm)
    _, model = load(hf_folder, seed=2, vocab_size=2500)
    prompts = prompts_of([4, 6], 2500, seed=2)
    kw = dict(n=1, max_new_tokens=5, temperature=1.1, top_p=1.0, top_k=0, stop_ids=(7,), seed=3)
    ref = rollout.generate(model, prompts, kernels="torch", **kw)
    got = decode.generate(model, prompts, kernels="triton", **kw)
    st = next(iter(decode.decoder_of(model).states.values()))
    assert (st.v_split, st.v_chunk) == ((2, 2048) if per_sm == 1 else (3, 1024))
    assert_same_rollout(got, ref)


def test_generate_dispatches_to_the_engine_only_where_asked(hf_folder):
    _, model = load(hf_folder, with_lora=False)
    assert not rollout.uses_engine(model, "auto") and not rollout.uses_engine(model, "torch")  # (a CPU model)
    assert rollout.uses_engine(model, "triton")
    r = rollout.generate(model, [[1, 2]], max_new_tokens=2, seed=0)
    assert decode.decoder_of(model) is None and r.stats["kernels"] == "torch"
    decode.generate(model, [[1, 2]], max_new_tokens=2, seed=0)
    assert isinstance(decode.decoder_of(model), decode.Decoder)
    rollout.release(model)
    assert decode.decoder_of(model) is None


@interpreted
def test_logprobs_equal_full_forward(hf_folder):
    import aqn

    _, model = load(hf_folder)
    prompts = prompts_of([5, 1, 9], 97, seed=1)
    T, n = 0.8, 3
    with aqn.noise(model, 0.05, torch.Generator().manual_seed(0)):  # AQN in place on the norms
        r = rollout.generate(model, prompts, n=n, max_new_tokens=7, temperature=T, top_p=0.9,
                             stop_ids=(3, 11, 50), seed=5, kernels="triton")
        for i, comp in rows(r):
            ref = full_forward_logprobs(model, prompts[i // n], comp, T)
            assert (r.logprobs[i, : len(comp)].double() - ref).abs().max() <= 1e-4
    assert r.stats["kernels"] == "triton" and r.stats["prefill_rows"] == len(prompts)


@pytest.mark.parametrize("quantize", [False, True])
def test_fused_projections_share_the_model_weights(hf_folder, quantize):
    """The decoder's stacked q|k|v and gate|up weights are the model's own memory (the linears hold
    views of their rows): no copy, the same forward before and after, and a later in-place change of a
    weight is seen by the next rollout."""
    _, model = load(hf_folder, quantize=quantize)
    seq = torch.tensor([prompts_of([6], 97, seed=3)[0]])
    with torch.no_grad():
        before = model(seq)
    decode.generate(model, prompts_of([4], 97), max_new_tokens=2, seed=0, kernels="torch")
    for layer in model.layers:
        for mods in ((layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
                     (layer.mlp.gate_proj, layer.mlp.up_proj)):
            tensors = [m.base.weight_packed if quantize else m.base.weight for m in mods]
            storage = {t.untyped_storage().data_ptr() for t in tensors}
            assert len(storage) == 1, "the stacked weight is a copy"
            assert tensors[0].data_ptr() == next(iter(storage))  # first rows first
    with torch.no_grad():
        assert torch.equal(model(seq), before)
        greedy = decode.generate(model, [seq[0].tolist()], max_new_tokens=1, temperature=0, kernels="torch")
        q = model.layers[0].self_attn.q_proj.base
        (q.weight_packed if quantize else q.weight).zero_()  # in place, as a loader would write
        changed = decode.generate(model, [seq[0].tolist()], max_new_tokens=1, temperature=0, kernels="torch")
        assert not torch.equal(greedy.logprobs, changed.logprobs)
        want = torch.log_softmax(model(seq)[0, -1].double(), -1)[changed.tokens[0, 0]]
        assert abs(changed.logprobs[0, 0].item() - want.item()) <= 1e-5


@interpreted
def test_padded_batch_equals_each_prompt_alone(hf_folder):
    _, model = load(hf_folder, seed=4)
    prompts = prompts_of([2, 11, 5, 1], 97, seed=3)
    batch = rollout.generate(model, prompts, max_new_tokens=9, temperature=0.0, kernels="triton")
    for i, p in enumerate(prompts):
        alone = rollout.generate(model, [p], max_new_tokens=9, temperature=0.0, kernels="torch")
        assert batch.tokens[i].tolist() == alone.tokens[0].tolist()
        assert torch.allclose(batch.logprobs[i], alone.logprobs[0], atol=1e-5)


@interpreted
def test_attention_chunks_follow_the_current_column(hf_folder):
    """The decode attention splits each row's columns [pad, col] into chunks as the column moves: a
    long prompt next to a short (left-padded) one, chunks of 64 columns, more than the row has (some
    empty); the kernels' rollout is the plain sampler's."""
    _, model = load(hf_folder, seed=8)
    prompts = prompts_of([127, 3], 97, seed=8)
    kw = dict(max_new_tokens=6, temperature=0.0)
    a = rollout.generate(model, prompts, kernels="torch", **kw)
    b = rollout.generate(model, prompts, kernels="triton", **kw)
    st = next(iter(decode.decoder_of(model).states.values()))
    assert st.attn_split > 127 // 64 + 1
    assert torch.equal(a.tokens, b.tokens)
    assert torch.allclose(a.logprobs, b.logprobs, atol=1e-4)


@interpreted
@pytest.mark.filterwarnings("ignore:invalid value encountered in subtract:RuntimeWarning")
def test_kernels_store_their_outputs_in_the_next_gemms_k_order(hf_folder, monkeypatch):
    """Where a GEMM reads x in its K order (on the GPU from a few tens of rows), the op before stores its
    output so: here that order asked of the ops before q|k|v, o and gate|up (add_rmsnorm, the attention's
    combine) on the CPU, in k-steps of 64 columns, and each GEMM given its x back in natural order. The same
    rollout as without the order (logprobs equal here; within 1e-6, as the combine then merges two heads a
    program, not one, which another build may sum in another order); groups of 3 samples share their prompts."""
    _, model = load(hf_folder, seed=8, hidden_size=192, num_attention_heads=6, num_key_value_heads=2)
    prompts = prompts_of([5, 9], 97, seed=8)
    kw = dict(n=3, max_new_tokens=6, temperature=0.0, kernels="triton")
    ref = decode.generate(model, prompts, **kw)
    rollout.release(model)
    k_step = 64  # (q|k|v's, o's and gate|up's K are 192; down's, 96, stays in natural order)
    natural = torch.argsort(wgmma_k_order(192, k_step, "cpu"))
    monkeypatch.setattr(decode.Decoder, "x_orders", lambda self, layer, N: ((k_step, N),) * 3 + (decode.NATURAL,))
    gemm = decode.Decoder.gemm
    monkeypatch.setattr(decode.Decoder, "gemm", lambda self, grp, x, order=decode.NATURAL:
                        gemm(self, grp, x[:, natural] if order[0] else x))
    got = decode.generate(model, prompts, **kw)
    assert next(iter(decode.decoder_of(model).states.values())).x_orders[0][:3] == ((k_step, 6),) * 3
    assert_same_rollout(got, ref, atol=1e-6)


def test_attention_grid_fits_in_one_wave():
    """D = 128 on 132 SMs: a program holds 102, 70 or 38 KB of shared memory at 4, 3 or 2 stages in bf16,
    so 2, 3 or 5 fit an SM (fp32 blocks take twice the room). The split: about 2 programs an SM, at most
    one per 64 columns, cut to what fits at 4 stages where 2 or more chunks a pair still do; then the
    deepest pipeline under which the whole grid fits."""
    assert [decode._attn_per_sm(s, 128, 2) for s in (4, 3, 2)] == [2, 3, 5]
    assert [decode._attn_per_sm(s, 128, 4) for s in (4, 3, 2)] == [1, 1, 3]
    grid = lambda rows, S=768: decode._attn_grid(rows * 4, S, 132, 128, 2)  # 4 kv heads a row
    assert grid(1) == (12, 4) and grid(1, 100) == (2, 4)  # one chunk per 64 columns at most
    assert grid(8) == (8, 4)  # 9 chunks for 2 an SM, cut to the 8 that fit at 4 stages
    assert grid(16) == (4, 4) and grid(32) == (2, 4)
    assert grid(64) == (2, 2)  # a cut to 1 chunk is not made; 512 programs fit only at 2 stages
    assert grid(99) == (1, 3) and grid(100) == (1, 2) and grid(1000) == (1, 2)
    # the FP8 cache's blocks take half the room: 64 rows fit at 4 stages
    assert [decode._attn_per_sm(s, 128, 1) for s in (4, 3, 2)] == [4, 5, 9]
    assert decode._attn_grid(64 * 4, 768, 132, 128, 1) == (2, 4)


# (Under Triton's interpreter the attention's masked columns compute -inf - (-inf) in numpy, which warns; those
# lanes are masked out of the result, so the warning says nothing about the kernel.)
@pytest.mark.parametrize("kernels,n,shrinks", [
    ("torch", 4, [8, 4, 2, 1]),
    pytest.param("triton", 2, [4, 2, 1], marks=[interpreted, pytest.mark.filterwarnings(
        "ignore:invalid value encountered in subtract:RuntimeWarning")])])
def test_finished_rows_leave_the_batch(hf_folder, kernels, n, shrinks):
    """As rows stop, the live ones move into a state of half the rows or fewer (views of the same cache),
    and the later steps run only those rows: the same completions, logprobs, lengths and finish reasons,
    in the call's row order, as the rollout that keeps every row to the end, and as the plain sampler;
    and (torch ops) the same again when the next call reuses the smaller states, whose cache rows the
    first call moved around."""
    _, model = load(hf_folder, seed=12)
    stops = set(range(3, 97, 9))  # ~1/9 a token: the rows end after 1 to ~20 tokens
    prompts = prompts_of([3, 6, 2, 5], 97, seed=13)
    kw = dict(n=n, max_new_tokens=40, temperature=1.3, stop_ids=stops, seed=5)
    plain = rollout.generate(model, prompts, kernels="torch", **kw)
    ref = decode.generate(model, prompts, compact=False, kernels=kernels, **kw)
    assert_same_rollout(ref, plain)
    seen = []
    hook = model.embed_tokens.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[0]))
    runs = [decode.generate(model, prompts, kernels=kernels, **kw) for _ in range(2 if kernels == "torch" else 1)]
    hook.remove()
    assert ref.stats["shrinks"] == [] and len(set(ref.lengths.tolist())) > 4
    assert ref.stats["segments"][0][:2] == (len(prompts) * n, ref.stats["steps"] - 1)
    for got in runs:
        assert [n for _, n in got.stats["shrinks"]] == shrinks
        assert_same_rollout(got, ref, atol=1e-5)
        # the decode's time in segments, one a batch size: their rows, and their steps adding up to the call's
        segments = got.stats["segments"]
        assert [r for r, _, _ in segments] == [len(prompts) * n] + shrinks
        assert sum(k for _, k, _ in segments) == got.stats["steps"] - 1 and all(sec >= 0 for _, _, sec in segments)
    steps = seen[1: runs[0].stats["steps"]]  # the first call's decode steps: seen[0] is its prefill
    moves = runs[0].stats["shrinks"]  # [(step, rows)]
    for (t, n_rows), (t_next, _) in zip(moves, moves[1:] + [(len(steps), None)]):
        assert steps[t:t_next] == [n_rows] * (t_next - t)  # the steps after the shrink at step t ran n_rows rows
        live = (ref.lengths > t + 1).sum().item()  # rows that had not ended by output step t
        assert live <= n_rows < 2 * live


def assert_first_layer_cache_is_the_16_bit_one_quantized(model, prompts, n, kernels, columns):
    """After a prefill (one greedy token: the prefill alone writes the cache), the FP8 engine's first layer
    holds, in its first `columns` columns, bit for bit rollout.kv_e4m3 of what the model-dtype engine stores
    there (that layer's K/V do not depend on the attention)."""
    first = {}
    for kv in ("model", "fp8"):
        decode.generate(model, prompts, n=n, max_new_tokens=1, temperature=0.0, kernels=kernels, kv_cache=kv)
        st = next(iter(decode.decoder_of(model).states.values()))
        first[kv] = [getattr(st, c)[0, :, :, :columns].clone() for c in decode.decoder_of(model).cache_tensors]
    k8, v8, ks, vs = first["fp8"]
    for (q, scale), (q_ref, s_ref) in zip(((k8, ks), (v8, vs)), map(rollout.kv_e4m3, first["model"])):
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(scale, s_ref)


@pytest.mark.parametrize("kernels", ["torch", pytest.param("triton", marks=[interpreted, pytest.mark.filterwarnings(
    "ignore:invalid value encountered in subtract:RuntimeWarning")])])
def test_fp8_cache_equals_the_plain_samplers(hf_folder, kernels, monkeypatch):
    """kv_cache="fp8" (rollout.KVCache): the engine's rollout, its live rows moved to fewer states as they stop,
    against the plain sampler's with the same cache: the same tokens, stops and lengths, logprobs within 5e-3.
    Not 1e-4 as elsewhere: the two compute K and V in different fp32 orders, and a last-bit difference can move
    an element across an E4M3 rounding boundary (a step of up to 2^-3 of it). The cache itself is not what
    differs: after the prefill the engine's first layer holds, bit for bit, rollout.kv_e4m3 of what the
    model-dtype engine stores there (that layer's K/V do not depend on the attention). The FP8 cache moves the
    logprobs by ~2e-2 here, beyond that tolerance (so a cache left in the model dtype fails). The attention's
    grid is sized for the 1-byte values the cache holds."""
    _, model = load(hf_folder, seed=12)
    prompts = prompts_of([3, 6, 2, 5], 97, seed=13)
    kw = dict(n=3, max_new_tokens=30, temperature=1.3, stop_ids=set(range(3, 97, 9)), seed=5)
    plain = rollout.generate(model, prompts, kernels="torch", kv_cache="fp8", **kw)
    sized = []
    monkeypatch.setattr(decode, "_attn_grid", lambda *a, grid=decode._attn_grid: sized.append(a[-1]) or grid(*a))
    got = decode.generate(model, prompts, kernels=kernels, kv_cache="fp8", **kw)
    assert sized and set(sized) == {1}
    assert got.stats["shrinks"] and plain.stats["shrinks"]
    assert_same_rollout(got, plain, atol=5e-3)
    exact = rollout.generate(model, prompts, kernels="torch", **kw)
    assert (exact.logprobs[:, :2] - plain.logprobs[:, :2]).abs().max() > 1e-2
    assert_first_layer_cache_is_the_16_bit_one_quantized(model, prompts, 2, kernels, columns=6)


def test_every_smaller_state_is_captured_with_the_full_one(hf_folder, monkeypatch):
    """With graphs, run captures the step of every state shrink may move rows into (1, 2, 4, ... half the
    rows) with the full state's, before the call's prefill, so that a later call captures nothing whichever
    row counts its stops pass through. On the CPU, with a stand-in capture whose graph replays the eager step
    (what a CUDA graph of the step records): each call's rollout equals the ungraphed engine's."""
    _, model = load(hf_folder, seed=12)
    monkeypatch.setattr(decode, "PREFILL_GRAPH_TOKENS", 0)
    dec = decode.Decoder(model, kernels="torch", graphs=False)
    dec.graphs = True
    captured, prefills = [], []

    class Replay:
        def __init__(self, st, sp):
            self.st, self.sp = st, sp

        def replay(self):
            dec.step(self.st, self.sp)

    def capture(st, sp, key):
        captured.append((st.N, len(prefills)))
        st.graphs[key] = Replay(st, sp)
        return 0.5

    prefill = dec.prefill
    monkeypatch.setattr(dec, "capture", capture)
    monkeypatch.setattr(dec, "prefill", lambda *a, **k: prefills.append(1) or prefill(*a, **k))
    prompts = prompts_of([3, 6, 2, 5], 97, seed=13)
    stops = set(range(3, 97, 9))
    sp, shrinks = SimpleNamespace(temperature=1.3, top_p=1.0, top_k=0, pad_id=0, stop_ids=stops), []
    for seed in (5, 6, 7):
        got = dec.run(prompts, 4, 40, sp, seed)
        ref = decode.generate(model, prompts, n=4, max_new_tokens=40, temperature=1.3, stop_ids=stops, seed=seed,
                              kernels="torch", graphs=False)
        assert_same_rollout(got, ref, atol=1e-5)
        assert got.stats["graphs"] and got.stats["capture_s"] == (2.5 if seed == 5 else 0.0)
        shrinks.append([n for _, n in got.stats["shrinks"]])
    assert captured == [(16, 0), (1, 0), (2, 0), (4, 0), (8, 0)]  # (rows, prefills run before it)
    assert len(set(map(tuple, shrinks))) > 1  # (the calls' rows did pass through different counts)


def test_calls_told_the_longest_prompt_share_one_state(hf_folder):
    """generate's prompt_len (train.py: the memory plan's longest prompt): calls whose own longest prompts
    differ get caches of one width, so they share the engine's state (keyed by rows and width: its cache and
    its graphs) where each width would otherwise make a state of its own, captured in whichever later step
    first brings it; the rollouts are those of calls without it."""
    _, model = load(hf_folder, seed=12)
    short, long = prompts_of([3, 6], 97, seed=13), prompts_of([40, 90], 97, seed=14)
    widths = {}
    for prompt_len in (0, 90):
        for prompts in (short, long):
            got = decode.generate(model, prompts, n=2, max_new_tokens=40, temperature=1.3, seed=5, kernels="torch",
                                  prompt_len=prompt_len)
            ref = decode.generate(model, prompts, n=2, max_new_tokens=40, temperature=1.3, seed=5, kernels="torch")
            assert_same_rollout(got, ref, atol=1e-5)
            widths.setdefault(prompt_len, set()).add(got.stats["cache_columns"])
    assert widths == {0: {128, 256}, 90: {256}}  # (64 + 40 and 128 + 40 columns, rounded up to 128)


def test_samples_share_the_prompt_prefill(hf_folder):
    _, model = load(hf_folder, seed=9)
    seen = []
    hook = model.embed_tokens.register_forward_hook(lambda m, args, out: seen.append(tuple(args[0].shape)))
    prompts = prompts_of([5, 3, 8], 97, seed=8)
    r = decode.generate(model, prompts, n=5, max_new_tokens=4, temperature=1.0, seed=0, kernels="torch")
    hook.remove()
    prefill = [s for s in seen if len(s) == 2]
    assert prefill == [(3, 8)]  # one pass over the 3 distinct prompts (left-padded to 8), not 15 rows
    assert r.tokens.shape[0] == 15 and seen[1:] == [(15,)] * 3  # then one decode step of all rows per token


@pytest.mark.parametrize("kernels", ["torch", pytest.param("triton", marks=interpreted)])
def test_prefill_in_chunks_gives_the_same_rollout(hf_folder, monkeypatch, kernels):
    """A prefill split into chunks of whole prompts (PREFILL_CHUNK_TOKENS) writes each chunk's K/V into the
    rows of its own prompts' samples, from a row past the first chunk's: the same rollout as in one pass."""
    _, model = load(hf_folder, seed=10)
    prompts = prompts_of([6, 2, 9], 97, seed=9)
    kw = dict(n=2, max_new_tokens=5, temperature=1.0, seed=3, kernels=kernels)
    ref = decode.generate(model, prompts, **kw)
    monkeypatch.setattr(decode, "PREFILL_CHUNK_TOKENS", 9)  # one prompt (padded to 9 tokens) a chunk
    seen = []
    hook = model.embed_tokens.register_forward_hook(lambda m, args, out: seen.append(tuple(args[0].shape)))
    got = decode.generate(model, prompts, **kw)
    hook.remove()
    assert [s for s in seen if len(s) == 2] == [(1, 9)] * 3
    assert torch.equal(ref.tokens, got.tokens) and not torch.equal(got.tokens[0], got.tokens[2])
    assert torch.allclose(ref.logprobs, got.logprobs, atol=1e-5)


@interpreted
def test_samples_of_a_prompt_read_its_cached_prompt_together(hf_folder, monkeypatch):
    """The kernels attend over a group's shared prompt from its first row's cache only: the other rows'
    copies of the prompt may hold anything (NaN here) and the rollout does not change by a bit. Four query
    heads a program: each group of 3 rows (2 query heads each) in two programs, of 2 rows and 1."""
    _, model = load(hf_folder, seed=3)
    prompts = prompts_of([4, 7], 97, seed=2)
    kw = dict(n=3, max_new_tokens=5, temperature=1.0, seed=7, kernels="triton")
    monkeypatch.setattr(decode, "SHARED_HEADS", 4)
    ref = rollout.generate(model, prompts, **kw)
    prefill = decode.Decoder.prefill

    def poisoned(self, st, prompts, n, Lp, sp, **k):
        prefill(self, st, prompts, n, Lp, sp, **k)
        copies = torch.arange(st.N) % n != 0
        st.k[:, copies, :, :Lp] = float("nan")
        st.v[:, copies, :, :Lp] = float("nan")

    monkeypatch.setattr(decode.Decoder, "prefill", poisoned)
    got = rollout.generate(model, prompts, **kw)
    assert torch.equal(ref.tokens, got.tokens) and torch.equal(ref.logprobs, got.logprobs)
    assert not torch.equal(ref.tokens[0], ref.tokens[1])  # the rows of a group did sample apart


@interpreted
@pytest.mark.parametrize("n,shared_heads", [(3, 4), (5, 6), (4, 2)])
def test_attention_programs_launched_prompt_readers_first(hf_folder, monkeypatch, n, shared_heads):
    """The attention's programs launch the rows that read their group's shared prompt first
    (decode_kernels._attn_row), and every row is still served once: the plain sampler's rollout, over groups
    of 3 rows two a program over the prompt (rows 0 and 2 first, then 1), of 5 three a program (0 and 3, then
    1, 2, 4: the last set short) and of 4 one a program (every row reads the prompt)."""
    _, model = load(hf_folder, seed=3)
    prompts = prompts_of([4, 7, 2], 97, seed=2)
    kw = dict(n=n, max_new_tokens=5, temperature=1.0, seed=7)
    monkeypatch.setattr(decode, "SHARED_HEADS", shared_heads)  # (2 query heads a row)
    assert_same_rollout(decode.generate(model, prompts, kernels="triton", **kw),
                        rollout.generate(model, prompts, kernels="torch", **kw))


@interpreted
@pytest.mark.parametrize("k_step", [32, 64])
def test_ops_store_their_output_in_the_next_gemms_k_order(hf_folder, k_step):
    """With k_step the kernels before a GEMM (add_rmsnorm, the attention, silu_mul) store their output in
    the K order of engine/korder.py (what the warp-specialized wgmma kernel reads, so that its own ordering
    launch is skipped on the GPU): exactly the natural output gathered by wgmma_k_order, on both paths; the
    Triton path as the first rows of a buffer of 8 (the rows the GEMM's tiles of x read)."""
    _, model = load(hf_folder, seed=5, intermediate_size=128)
    g = torch.Generator().manual_seed(6)
    rnd = lambda *shape: torch.randn(*shape, generator=g)
    for kernels in ("triton", "torch"):
        dec = decode.Decoder(model, kernels=kernels, graphs=False)
        order = lambda t: t[:, wgmma_k_order(t.shape[1], k_step, t.device)]
        x, delta = rnd(5, 64), rnd(5, 64)
        norm = dec.layers[0].ln2
        assert torch.equal(dec.add_rmsnorm(x, delta, norm, (k_step, 8))[1], order(dec.add_rmsnorm(x, delta, norm)[1]))
        grp = dec.layers[0].gu
        grp.refresh()
        gu, a = rnd(5, 256), rnd(5, 2 * grp.R)
        assert torch.equal(dec.silu_mul(gu, a, grp, (k_step, 8)), order(dec.silu_mul(gu, a, grp)))
        st = dec.state(3, 128)
        st.k.normal_(generator=g)
        st.v.normal_(generator=g)
        st.counters.copy_(torch.tensor([9, 1]))
        st.pad.copy_(torch.tensor([0, 2, 5]))
        q = rnd(3, 2, 32)
        terms = None if dec.triton else dec.step_terms(st)
        got, ref = dec.attention(q, st, 1, terms, (k_step, 8)), dec.attention(q, st, 1, terms)
        assert torch.equal(got, order(ref)) and not torch.equal(got, ref)
        if dec.triton:
            assert got.untyped_storage().nbytes() == 8 * 64 * got.element_size()


def test_rejects_bad_arguments(hf_folder):
    _, model = load(hf_folder, with_lora=False)
    with pytest.raises(ValueError):
        decode.generate(model, [[]])
    with pytest.raises(ValueError):
        decode.generate(model, [[1, 2]], top_p=0.0)
    with pytest.raises(ValueError, match="graphs=True needs a model on a CUDA GPU"):  # (load: on the CPU)
        decode.generate(model, [[1, 2]], graphs=True)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        _, odd = load(hf_folder, with_lora=False, hidden_size=48, num_attention_heads=2)  # head_dim 24
        decode.generate(odd, [[1, 2]], kernels="triton")


def test_a_dropped_model_frees_its_decoder_at_once(hf_folder):
    """The decoder the engine keeps on a model (its caches and graphs: GBs on a GPU) goes with the model when
    the last reference to it does, without waiting for the garbage collector: no reference cycle."""
    import gc
    import weakref

    _, model = load(hf_folder, quantize=True)
    decode.generate(model, prompts_of([3, 5], 97), n=2, max_new_tokens=4, stop_ids=(7,), seed=0, kernels="torch")
    gone = weakref.ref(decode.decoder_of(model)), weakref.ref(model)
    collecting = gc.isenabled()
    gc.disable()
    try:
        del model
        assert all(ref() is None for ref in gone)
    finally:
        if collecting:
            gc.enable()


# --- on the GPU -------------------------------------------------------------------------------

@gpu
def test_gpu_graphs_and_kernels_match_the_plain_sampler(hf_folder):
    """fp32 on the GPU: the graphed Triton step against rollout.py's sampler with the same seed, and its
    logprobs against one full forward."""
    hf, folder = hf_folder("qwen2", seed=10, **{**CFG, "hidden_size": 256, "num_attention_heads": 4,
                                                 "num_key_value_heads": 2, "intermediate_size": 512})
    model = M.Transformer.from_pretrained(folder, dtype=torch.float32, device="cuda")
    lora.apply_lora(model, rank=8, alpha=16)
    with torch.no_grad():
        for m in lora.lora_modules(model).values():
            m.lora_B.weight.normal_(0, 0.1)
    prompts = prompts_of([13, 4, 30], 97, seed=9)
    kw = dict(n=3, max_new_tokens=40, temperature=0.9, top_p=0.95, seed=1, stop_ids=(5,))
    ref = rollout.generate(model, prompts, kernels="torch", graphs=False, **kw)
    fast = rollout.generate(model, prompts, **kw)
    assert fast.stats["graphs"] and fast.stats["kernels"] == "triton" and ref.stats["kernels"] == "torch"
    same = (fast.tokens == ref.tokens).all(1).float().mean()
    assert same >= 0.8  # fp32 everywhere, TF32 in the kernels' tl.dot: a rare near-tie may flip one draw
    for i, comp in rows(fast):
        lp = full_forward_logprobs(model, prompts[i // 3], comp, 0.9)
        assert (fast.logprobs[i, : len(comp)].double() - lp).abs().max() <= 1e-3


@gpu
def test_gpu_sampler_over_vocabulary_chunks(hf_folder):
    """The compiled sampler where a row's vocabulary is several chunks (2,500 tokens: three blocks of 1,024, at
    least two chunks on any GPU), graphed, fp32: the same draws as rollout.py's sampler with the same seed (as
    in the test above, a near-tie under TF32 may flip one), and each drawn token's logprob that of one full
    forward, so the chunks' logsumexp and best candidate are merged right."""
    _, folder = hf_folder("qwen2", seed=21, **{**CFG, "vocab_size": 2500})
    model = M.Transformer.from_pretrained(folder, dtype=torch.float32, device="cuda")
    prompts = prompts_of([9, 17], 2500, seed=4)
    kw = dict(n=2, max_new_tokens=24, temperature=1.1, top_p=1.0, seed=6, stop_ids=())
    ref = rollout.generate(model, prompts, kernels="torch", graphs=False, **kw)
    fast = rollout.generate(model, prompts, **kw)
    st = next(iter(decode.decoder_of(model).states.values()))
    assert fast.stats["graphs"] and st.v_split >= 2
    assert (fast.tokens == ref.tokens).all(1).float().mean() >= 0.75
    for i, comp in rows(fast):
        lp = full_forward_logprobs(model, prompts[i // 2], comp, 1.1)
        assert (fast.logprobs[i, : len(comp)].double() - lp).abs().max() <= 1e-3


def gpu_lora_model(hf_folder, seed, quantize=True):
    """A small bf16 model (NVFP4 base unless quantize=False) on the GPU with rank-8 LoRA on every
    projection, B nonzero."""
    _, folder = hf_folder("qwen2", seed=seed, **{**CFG, "hidden_size": 256, "num_attention_heads": 4,
                                                  "num_key_value_heads": 2, "intermediate_size": 512})
    model = M.Transformer.from_pretrained(folder, dtype=torch.bfloat16, device="cuda", quantize=quantize)
    lora.apply_lora(model, rank=8, alpha=16)
    with torch.no_grad():
        for m in lora.lora_modules(model).values():
            m.lora_B.weight.normal_(0, 0.2)
    return model


def error_and_adapter_effect(model, prompts, n, r):
    """Mean |logprob of the rollout r - that of one full forward| over its tokens (temperature 1), and
    the mean |change| of those full-forward logprobs when the adapters are switched off."""
    err, effect = [], []
    for i, comp in rows(r):
        lp = full_forward_logprobs(model, prompts[i // n], comp, 1.0)
        with lora.disable_adapters(model):
            lp0 = full_forward_logprobs(model, prompts[i // n], comp, 1.0)
        err.append((r.logprobs[i, : len(comp)].double() - lp).abs())
        effect.append((lp0 - lp).abs())
    return torch.cat(err).mean().item(), torch.cat(effect).mean().item()


@gpu
@pytest.mark.parametrize("prompts,n,kernel", [(4, 1, "mma"), (4, 2, "mma"), (2, 4, None), (5, 8, None)])
def test_gpu_nvfp4_lora_decode_in_bf16(hf_folder, prompts, n, kernel):
    """The bf16 NVFP4 decode of 4, 8 and 40 rows: logprobs match one full forward with the adapters (to
    bf16 rounding) far better than they match the model without them. kernel="mma": every GEMM through
    the mma kernel, which computes the group's LoRA A product in the same launch
    (engine.side.fp4_linear_side; the plan uses it up to 8 rows off Hopper, at one row on it); None: the
    plan's kernels (on Hopper wgmma, with the LoRA A products on the decoder's second stream; at 40 rows
    the warp-specialized variant, whose x the kernels before it store in its K order)."""
    model = gpu_lora_model(hf_folder, seed=11)
    prompts = prompts_of([13, 4, 30, 7, 19][:prompts], 97, seed=12)
    with fp4_gemm.backend("auto", kernel=kernel):
        r = rollout.generate(model, prompts, n=n, max_new_tokens=24, temperature=1.0, seed=3, kernels="triton",
                             graphs=True)
    if torch.cuda.get_device_capability() == (9, 0):
        (st,) = decode.decoder_of(model).states.values()
        assert [k for k, _ in st.x_orders[0]] == ([256] * 4 if st.N > 32 else [0] * 4)
    err, effect = error_and_adapter_effect(model, prompts, n, r)
    print(f"n={n}: |decode - full forward| {err:.4f}, |without - with adapters| {effect:.4f}")
    assert err < 0.1 * effect


@gpu
@pytest.mark.parametrize("prompts,n", [(4, 1), (5, 8)])
def test_gpu_fp8_cache_graphed_in_bf16(hf_folder, prompts, n):
    """The FP8 cache through the graphed bf16 NVFP4 step (4 and 40 rows): its first layer's cache after the
    prefill is, bit for bit, rollout.kv_e4m3 of what the model-dtype cache holds there; its logprobs are
    within the same distance of the plain sampler's with the FP8 cache as the model-dtype engine's are of
    the plain sampler's (bf16 rounding: a tenth of the adapters' effect), the FP8 cache's own effect on top."""
    model = gpu_lora_model(hf_folder, seed=11)
    prompts = prompts_of([13, 4, 30, 7, 19][:prompts], 97, seed=12)
    kw = dict(n=n, max_new_tokens=24, temperature=1.0, seed=3)
    assert_first_layer_cache_is_the_16_bit_one_quantized(model, prompts, n, "triton", columns=30)
    r = rollout.generate(model, prompts, kernels="triton", graphs=True, kv_cache="fp8", **kw)
    assert r.stats["graphs"]
    err, effect = error_and_adapter_effect(model, prompts, n, r)  # (the full forward: K/V in bf16)
    ref = rollout.generate(model, prompts, kernels="torch", kv_cache="fp8", **kw)
    same = r.tokens == ref.tokens
    lp_err = (r.logprobs - ref.logprobs).abs()[same & r.mask].mean().item()
    print(f"n={n}: |fp8-cache decode - full forward| {err:.4f}, |its torch form| {lp_err:.4f}, "
          f"|without - with adapters| {effect:.4f}")
    assert lp_err < 0.1 * effect and err < 0.3 * effect


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="programmatic dependent launch needs a Hopper or newer GPU")
@pytest.mark.parametrize("prompts,n,quantize", [(1, 1, True), (2, 8, True), (5, 8, True), (2, 8, False)])
def test_gpu_programmatic_launch_gives_the_same_rollout(hf_folder, monkeypatch, prompts, n, quantize):
    """With programmatic dependent launch (engine/pdl.py: each decode kernel may be scheduled before the
    one ahead of it has finished, and waits for it in pdl_wait) the graphed LoRA decode gives the same
    tokens and logprobs, bit for bit, as plain launches: a kernel touching memory before the wait would
    race. NVFP4 base: 1 row runs the mma kernel (the LoRA A products in its launch), 16 rows the wgmma
    kernel on Hopper, 40 rows its warp-specialized variant (x stored in its K order by the kernels before
    it); bf16 base: cuBLAS. From 16 rows the LoRA A products run on the decoder's second stream."""
    model = gpu_lora_model(hf_folder, seed=13, quantize=quantize)
    assert pdl.pdl_opts(model.device)["PDL"]
    kw = dict(n=n, max_new_tokens=32, temperature=1.0, seed=4, kernels="triton", graphs=True)
    ps = prompts_of([21, 9, 14, 3, 30][:prompts], 97, seed=14)
    runs = []
    for on in (True, False):
        monkeypatch.setattr(pdl, "ENABLED", on)
        rollout.release(model)  # a new decoder: its graphs are captured with (or without) PDL
        runs.append(rollout.generate(model, ps, **kw))
    assert torch.equal(runs[0].tokens, runs[1].tokens) and torch.equal(runs[0].logprobs, runs[1].logprobs)


@gpu
@pytest.mark.parametrize("quantize", [True, False])
def test_gpu_short_prefill_replays_its_graph(hf_folder, quantize):
    """A short prefill (decode.PREFILL_GRAPH_TOKENS) runs eagerly and is captured as a CUDA graph the first
    time its (prompts, padded length) shape comes, and replays it after, for prompts of other lengths in the
    same bucket too: the same tokens and logprobs bit for bit as the eager prefill of the same prompts, and
    logprobs that match one full forward."""
    model = gpu_lora_model(hf_folder, seed=15, quantize=quantize)
    kw = dict(n=2, max_new_tokens=16, temperature=1.0, seed=5, kernels="triton", graphs=True)
    first, other = prompts_of([37, 20], 97, seed=16), prompts_of([50, 61], 97, seed=17)  # both padded to 64
    runs = [rollout.generate(model, ps, **kw) for ps in (first, first, other)]
    assert [r.stats["prefill"] for r in runs] == ["captured", "replayed", "replayed"]
    assert runs[0].stats["prompt_len"] == runs[2].stats["prompt_len"] == decode.PREFILL_BUCKET
    for replayed, ps in zip(runs[1:], (first, other)):
        rollout.release(model)  # a new decoder, so that these prompts come first: an eager prefill
        ref = rollout.generate(model, ps, **kw)
        assert ref.stats["prefill"] == "captured"
        assert torch.equal(replayed.tokens, ref.tokens) and torch.equal(replayed.logprobs, ref.logprobs)
    err, effect = error_and_adapter_effect(model, other, 2, runs[2])
    assert err < 0.1 * effect


@gpu
@pytest.mark.parametrize("quantize", [True, False])
def test_gpu_finished_rows_leave_the_graph(hf_folder, monkeypatch, quantize):
    """Graphed, 40 rows (NVFP4: the warp-specialized kernel) that stop at different steps: the live rows
    move into smaller states, each with its graph, captured with the full state's before the prefill (their
    warm-up steps write where the prefill and the later steps write after them). The logprobs match one
    full forward; a second call with the same seed replays those graphs and gives the same rollout bit for
    bit. A third with a longer stop list drops every graph (the prefill runs eagerly here, so none is left)
    and captures them again in the same pool."""
    monkeypatch.setattr(decode, "PREFILL_GRAPH_TOKENS", 0)
    model = gpu_lora_model(hf_folder, seed=16, quantize=quantize)
    prompts = prompts_of([13, 4, 30, 7, 19], 97, seed=18)
    kw = dict(n=8, max_new_tokens=96, temperature=1.0, seed=6, kernels="triton", graphs=True)
    first, again = (rollout.generate(model, prompts, stop_ids=set(range(3, 97, 20)), **kw) for _ in range(2))
    assert first.stats["shrinks"] and again.stats["shrinks"] == first.stats["shrinks"]
    assert again.stats["capture_s"] == 0
    assert torch.equal(first.tokens, again.tokens) and torch.equal(first.logprobs, again.logprobs)
    longer = rollout.generate(model, prompts, stop_ids=range(3, 97, 5), **kw)  # 19 ids: a new list size
    assert longer.stats["capture_s"] > 0 and "stop" in longer.finish
    for r in (first, longer):
        err, effect = error_and_adapter_effect(model, prompts, 8, r)
        print(f"shrinks {r.stats['shrinks']}: |decode - full forward| {err:.4f}, |without - with adapters| {effect:.4f}")
        assert err < 0.1 * effect
