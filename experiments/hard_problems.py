"""experiments/hard_problems.py: the Countdown problems the replication's policy cannot solve yet.

    python experiments/hard_problems.py --out assets/countdown_hard          # a GPU: minutes; a CPU core: ~45
    python train.py ... --data countdown-hard --eval-data countdown-hard     # then train and evaluate on them

Why. On Countdown's problems at large the replication's policy learns at its own rate, not at the rate it
finds solutions: at pass@1 0.1-0.2 most groups of 8 samples already hold a right answer
(results/aqn_replication_3). Exploration can matter only where a group of samples usually holds no right
answer, so the replication also trains and evaluates on the problems that the policy solved in none of
SAMPLES samples before RL (results/aqn_replication_4).

What it does. For each split, the first CANDIDATES[split] problems of countdown.load(split) (seed 0) are
each sampled SAMPLES times by the policy (its bf16 weights, no adapter, temperature 1, top-p 1,
MAX_NEW_TOKENS tokens, sampling seed 0, eval.evaluate) and graded (countdown.grade, strict). A problem is
kept when no sample is right, in its order. Written into --out: train.jsonl and test.jsonl (the kept
records, as countdown.load returns them; countdown.load_hard and `--data countdown-hard` read them) and
selection.json (the command, the card, the versions, and for each split the candidates, how many were
kept, and the policy's pass@1 over all the candidates). The test split's problems are disjoint from the
train split's by countdown.split_of, so no kept held-out problem is trained on.
"""
import argparse
import json
import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

CANDIDATES = {"train": 8000, "test": 2500}  # about 40% are kept (pass@16 before RL ~0.6): ~3,000 and ~1,000
SAMPLES = 16
MAX_NEW_TOKENS = 80  # the replication's completion budget


def unsolved(model, tokenizer, items, samples, max_new_tokens, batch_size, seed=0):
    """Sample each item `samples` times and grade them (eval.evaluate at temperature 1, top-p 1). Returns
    (the items with no right sample, in order; the pass@1 over all the samples)."""
    import eval as evaluation

    res = evaluation.evaluate(model, tokenizer, items, kind="countdown", samples=samples, temperature=1.0, top_p=1.0,
                              max_new_tokens=max_new_tokens, batch_size=batch_size, seed=seed, progress=True)
    right = [0] * len(items)
    for r in res["records"]:
        right[r["index"]] += r["correct"]
    return [it for it, c in zip(items, right) if c == 0], sum(right) / (len(items) * samples)


def device_name(device):
    """The GPU's name, or the CPU's model (Linux's /proc/cpuinfo; platform.processor() elsewhere, where it is
    not empty), for selection.json's record of what made the selection."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "cpu"


def main(argv=None):
    p = argparse.ArgumentParser(description="Pick the Countdown problems the policy solves in none of its samples.")
    p.add_argument("--model", default="assets/countdown", help="the policy (HF folder or alias)")
    p.add_argument("--out", default="assets/countdown_hard", help="the folder for train.jsonl, test.jsonl and "
                   "selection.json")
    p.add_argument("--train", type=int, default=CANDIDATES["train"], help="candidate problems from the train split")
    p.add_argument("--test", type=int, default=CANDIDATES["test"], help="candidate problems from the test split")
    p.add_argument("--samples", type=int, default=SAMPLES, help="samples a problem; kept when none is right")
    p.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS, help="completion budget")
    p.add_argument("--batch-size", type=int, default=None, help="completions a rollout call (default: eval.py's)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    args = p.parse_args(argv)
    if min(args.train, args.test, args.samples, args.max_new_tokens) < 1:
        p.error("--train, --test, --samples and --max-new-tokens must be >= 1")
    import adapters
    import countdown
    import hub

    device = hub.resolve_device(args.device, "hard_problems.py")
    summary = {"command": "python experiments/hard_problems.py " + " ".join(sys.argv[1:] if argv is None else argv),
               "model": args.model, "samples": args.samples, "max_new_tokens": args.max_new_tokens,
               "temperature": 1.0, "quant": "bf16", "sampling_seed": 0,
               "device": device_name(device),
               "torch": torch.__version__, "splits": {}}
    with hub.stop_on_bad_input("hard_problems.py"):
        hub.resolve_model_dir(args.model)
        model, tokenizer = adapters.load_policy(args.model, None, "bf16", device)
        os.makedirs(args.out, exist_ok=True)
        for split, n in (("train", args.train), ("test", args.test)):
            t0 = time.time()
            kept, pass1 = unsolved(model, tokenizer, countdown.load(split, n, seed=0), args.samples,
                                   args.max_new_tokens, args.batch_size)
            path = os.path.join(args.out, f"{split}.jsonl")
            with hub.writing(path):  # (one JSON object a line, atomically)
                hub.write_text(path, "".join(json.dumps(r) + "\n" for r in kept))
            summary["splits"][split] = {"candidates": n, "kept": len(kept), "kept_fraction": len(kept) / n,
                                        "pass1_candidates": pass1, "seconds": time.time() - t0}
            print(f"{split}: kept {len(kept)} of {n} problems ({len(kept) / n:.0%}; pass@1 over all {pass1:.3f})")
        hub.write_json(os.path.join(args.out, "selection.json"), summary)
    print(f"wrote {args.out}/train.jsonl, test.jsonl, selection.json")
    return summary


if __name__ == "__main__":
    main()
