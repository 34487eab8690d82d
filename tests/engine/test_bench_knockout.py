"""engine/bench_knockout.py on the CPU (the engine's torch ops): taking a kind of kernel out changes the
rollout's numbers and nothing else, and only inside the block; measure times every variant in turns (rows
sharing prompts as asked)."""
import pytest
import torch

import model as M
from engine import bench_knockout, decode
from engine.bench_rollout import _add_lora
from rollout import release

CFG = dict(hidden_size=64, intermediate_size=96, num_attention_heads=2, num_key_value_heads=1, vocab_size=97)
PROMPTS = [[5, 9, 2, 7], [3, 8, 1]]


@pytest.fixture
def tiny(hf_folder):
    _, folder = hf_folder("qwen2", seed=3, **CFG)
    model = M.Transformer.from_pretrained(folder, dtype=torch.float32)
    _add_lora(model, 4)
    return model


def rollout(model):
    release(model)  # (a decoder built under another variant would keep its steps)
    return decode.generate(model, PROMPTS, n=2, max_new_tokens=6, seed=1, kernels="torch", graphs=False)


def test_each_kind_taken_out_changes_the_numbers_only_inside_the_block(tiny):
    methods = {name: getattr(decode.Decoder, name) for name in bench_knockout.METHODS.values()}
    ref = rollout(tiny)
    for kind in bench_knockout.KINDS:
        with bench_knockout.taken_out((kind,)):
            r = rollout(tiny)
        assert r.tokens.shape == ref.tokens.shape and torch.equal(r.lengths, ref.lengths)  # forced: every row 6
        assert not torch.equal(r.logprobs, ref.logprobs), f"taking out {kind} changed nothing"
        assert {name: getattr(decode.Decoder, name) for name in methods} == methods
    again = rollout(tiny)
    assert torch.equal(again.tokens, ref.tokens) and torch.equal(again.logprobs, ref.logprobs)
    with pytest.raises(ValueError, match="unknown kinds"):
        with bench_knockout.taken_out(("norm",)):
            pass


def test_measure_times_every_variant_in_turns(tiny):
    rows = bench_knockout.measure(tiny, [1, 2], rounds=2, new_tokens=4, prompt_len=3, samples=2, report=lambda r: None,
                                  kernels="torch", graphs=False)
    names = list(bench_knockout.variants())
    assert len(names) == 2 + len(bench_knockout.KINDS)
    assert [r["variant"] for r in rows[::2]] == names + names[::-1]  # round 2 in reverse order
    assert [r["batch"] for r in rows] == [1, 2] * (2 * len(names)) and all(r["ms_step"] > 0 for r in rows)
    assert {r["prompts"] for r in rows} == {1}  # the two rows of batch 2 share their prompt
    lines = bench_knockout.table(rows, floors={1: 0.5, 2: 0.6}).splitlines()
    assert len(lines) == 2 + len(names) + 1 and lines[2].startswith("| as is |") and "(+" in lines[3] + lines[4]
    assert decode.decoder_of(tiny) is None  # (released after the last variant: its steps read the zeros)


def test_the_command_line_refuses_samples_that_do_not_divide_a_batch():
    with pytest.raises(SystemExit):  # argparse's error, before anything is built
        bench_knockout.main(["--batches", "8", "12", "--samples", "8"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_without_a_gpu_it_says_so():
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench_knockout.main(["--batches", "1"])
