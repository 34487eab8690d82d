"""engine/bench_rollout.py's CPU parts: the early-stop benchmark times the same rollouts both ways, and the
command line refuses what it cannot run (also through `python rollout.py --bench`)."""
import pytest
import torch

import lora
import model as M
import rollout
from engine import bench_rollout

CFG = dict(hidden_size=64, intermediate_size=96, num_attention_heads=2, num_key_value_heads=1, vocab_size=97)


def test_early_stop_benchmark_times_both_ways(hf_folder):
    """--bench --early-stop: both rollouts of the same prompts and stops (the live rows moved to fewer, and
    not), on the CPU here with the engine's torch ops: the same rows stop, after the same tokens."""
    _, folder = hf_folder("qwen2", seed=14, **CFG)
    model = M.Transformer.from_pretrained(folder, dtype=torch.float32)
    lora.apply_lora(model, rank=4, alpha=8)
    r = bench_rollout._bench_early_stop(model, batch=32, prompt_len=4, new_tokens=40, mean_len=24, seed=0, rounds=2,
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
