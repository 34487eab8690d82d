"""A few RL steps of the paper's GPU recipe on a random-weight Qwen2.5 shape, under each ratio mode.

    python experiments/recipe_steps.py --size 7b          # on a GPU: 3 steps each of trainer, sampler, tis
    python experiments/recipe_steps.py --size toy         # the same on a toy shape (a smoke test; any device, the CPU too)

What it checks that the tiny CPU run cannot: the recipe's settings (recipes.py's gsm8k for `--model qwen2.5-7b
--algo dapo`: NVFP4 base, LoRA r16 alpha16, trained RMSNorms, AdamW beta2 0.99, weight decay 0.1 on LoRA,
grad clip 0.2) at the real shape, with AQN on (sigma 1e-2) during the rollout, for each `--ratio` mode:
the step time split into rollout and update, the peak memory, and the sampler-trainer mismatch the step
logs (mean k3 KL, the largest ratio, the fraction of TIS weights capped). Random weights cannot be graded,
so a random 0/1 reward per completion stands in for the strict reward. It also checks that the trained
norm tensors keep their addresses through the optimizer steps (the decode engine's CUDA graphs read them
at fixed addresses).
"""
import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the project's modules, not this folder's scripts

import torch  # noqa: E402

import aqn  # noqa: E402
import grpo  # noqa: E402
import lora  # noqa: E402
import recipes  # noqa: E402
import rollout  # noqa: E402
import train  # noqa: E402
from model import Config, Transformer, qwen25_config  # noqa: E402

TOY = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
       "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "tie_word_embeddings": False,
       "rope_theta": 1e6, "rms_norm_eps": 1e-6}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="7b", help="a Qwen2.5 size (0.5b ... 32b) or toy")
    p.add_argument("--steps", type=int, default=3, help="steps per ratio mode")
    p.add_argument("--prompts", type=int, default=16, help="prompts per step (toy: 2)")
    p.add_argument("--group-size", type=int, default=8, help="samples per prompt (toy: 4)")
    p.add_argument("--prompt-len", type=int, default=256, help="prompt tokens (toy: 8)")
    p.add_argument("--max-new-tokens", type=int, default=1024, help="completion budget (toy: 16)")
    args = p.parse_args(argv)
    toy = args.size == "toy"
    if toy:
        args.prompts, args.group_size, args.prompt_len, args.max_new_tokens = 2, 4, 8, 16
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = Config(TOY) if toy else qwen25_config(args.size)
    model = Transformer.from_random(cfg, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32, device=dev,
                                    quantize=True)
    params = lora.apply_lora(model, rank=16, alpha=16)
    norms = lora.train_norms(model)
    with torch.no_grad():
        for prm in params:  # nonzero B too, so that the adapter really changes the logits
            prm.normal_(0, 1e-3)
    model.compile_blocks = train.compile_backend(dev, False)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (args.prompt_len,), generator=gen).tolist() for _ in range(args.prompts)]
    # A random model picks nearly uniform tokens: vocab / L stop ids end a row after ~L tokens on average,
    # L a quarter of the budget (7B: ~256 of 1024), so that few completions are truncated (and masked).
    mean_len = max(1, args.max_new_tokens // 4)
    stops = torch.randperm(cfg.vocab_size, generator=gen)[: max(1, cfg.vocab_size // mean_len)].tolist()
    addresses = [t.data_ptr() for t in norms]
    P, G = args.prompts, args.group_size
    for mode in grpo.RATIO_MODES:
        recipe = recipes.parse(["--model", "qwen2.5-7b", "--algo", "dapo", "--ratio", mode,
                                "--max-new-tokens", str(args.max_new_tokens)])
        optimizer = torch.optim.AdamW([{"params": params}, {"params": norms, "weight_decay": 0.0}], lr=recipe.lr,
                                      weight_decay=recipe.weight_decay, betas=(0.9, recipe.adam_beta2))
        for step in range(args.steps):
            if dev.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.time()
            with torch.no_grad(), aqn.noise(model, 1e-2, torch.Generator(dev).manual_seed(step)):
                ro = rollout.generate(model.eval(), prompts, n=G, max_new_tokens=args.max_new_tokens, temperature=1.0,
                                      stop_ids=stops, seed=step)
            t1 = time.time()
            rewards = torch.randint(0, 2, (P, G), generator=gen).float()  # (P, G): stands in for the strict reward
            parts = torch.stack([rewards, torch.zeros_like(rewards), torch.zeros_like(rewards),
                                 ro.lengths.view(P, G).float().cpu()])  # (4, P, G): the reward's parts
            groups = train.groups_of(list(range(P)), parts, ro)
            batch = train.training_batch(groups, grpo.group_advantages(rewards), prompts.__getitem__,
                                         recipe.mask_truncated, dev)
            m = train.update(train.update_config(recipe), model, optimizer, params + norms, batch)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t2 = time.time()
            peak = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else float("nan")
            truncated = sum(f == "length" for f in ro.finish)
            print(f"{args.size} {mode:7s} step {step}: rollout {t1 - t0:5.1f} s, update {t2 - t1:5.1f} s, "
                  f"mean length {float(ro.lengths.float().mean()):.0f}, truncated {truncated}/{P * G}, peak {peak:.1f} GiB"
                  f" | mismatch kl {m.get('mismatch_kl', float('nan')):.2e}, max ratio "
                  f"{m.get('mismatch_ratio_max', float('nan')):.3f}, tis capped {m.get('tis_clip_frac', float('nan')):.4f}"
                  f", clip {m.get('clip_frac_low', 0):.4f}/{m.get('clip_frac_high', 0):.4f}, grad norm "
                  f"{m.get('grad_norm', float('nan')):.3g}", flush=True)
    if [t.data_ptr() for t in norms] != addresses:
        raise SystemExit("a trained norm tensor moved: the decode engine's graphs would read stale weights")
    print(f"trained norm tensors kept their addresses through {args.steps * len(grpo.RATIO_MODES)} optimizer steps")


if __name__ == "__main__":
    main()
