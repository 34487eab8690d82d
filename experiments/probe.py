"""experiments/probe.py: run train.py unchanged, with read-only taps that log what its metrics do not.

    python experiments/probe.py PROBE.jsonl -- --out RUN_DIR --algo dapo ...   (any train.py flags)

train.py logs the reward of the groups it trains on. After DAPO's dynamic sampling those are only the
groups with mixed rewards, so that reward sits near 0.5 by construction and says nothing about whether
the policy got better; and the entropy it logs is the trainer's (the update pass's forward, without the
rollout's AQN noise, on the kept groups only). The exploration question needs the sampler's side: how
often *every* sampled completion was right, and how spread the distribution it sampled from was. Three
taps give that without touching train.py:

- tasks.reward: the correctness of every completion train.py grades, all DAPO rounds included;
- rollout.generate: the sampler's logprobs of the tokens it drew. Under temperature T and top-p 1 those
  are log softmax(logits / T) of the sampled token x_t, so the token mean of -logp is an unbiased
  estimate of the sampler's mean token entropy E_t[H(p_t)] (same token weighting as the trainer's
  entropy), noise and quantization included: whatever the rollout model was, this is what it sampled;
- logs.line, called once a step with that step's metrics: the moment to write the step's record and
  start the next. Rollouts inside train.heldout (eval.heldout, the held-out evaluation) are not counted.

Each line of PROBE.jsonl: {"step", "completions", "sampled_accuracy" (fraction right over every sampled
completion), "sampler_entropy" (mean -logp a token), "tokens", "rollouts"}. If train.py stops calling
these through their modules the taps see nothing, and this script fails instead of writing zeros.
With --resume among the flags, PROBE.jsonl is kept and cut back to the steps the checkpoint holds
(runs.restore, tapped too), so a resumed run's file reads as one run's.
"""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import logs  # noqa: E402
import rollout  # noqa: E402
import runs  # noqa: E402
import tasks  # noqa: E402
import train  # noqa: E402


def start_records(path, train_argv):
    """A tap's records file: emptied for a new run; kept for a resumed one (--resume among train.py's flags),
    whose runs.restore tap cuts it back to the steps the checkpoint holds."""
    if "--resume" not in train_argv or not os.path.exists(path):
        open(path, "w").close()


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 1 or argv[0].startswith("-"):
        sys.exit("usage: python experiments/probe.py PROBE.jsonl -- [train.py flags]")
    path, train_argv = argv[0], argv[1:]
    if train_argv[:1] == ["--"]:
        train_argv = train_argv[1:]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    start_records(path, train_argv)

    state = {"in_eval": False, "correct": [], "nll": 0.0, "tokens": 0, "rollouts": 0, "steps": 0}
    real_generate, real_reward, real_evaluate, real_format, real_restore = rollout.generate, tasks.reward, \
        train.heldout, logs.line, runs.restore

    def generate(*args, **kwargs):
        ro = real_generate(*args, **kwargs)
        if not state["in_eval"]:
            lp = ro.logprobs.detach().float().cpu()  # (N, T)
            mask = torch.arange(lp.shape[1])[None] < ro.lengths.cpu()[:, None]  # (N, T)
            state["nll"] -= float((lp * mask).sum())
            state["tokens"] += int(mask.sum())
            state["rollouts"] += 1
        return ro

    def reward(*args, **kwargs):
        total, parts = real_reward(*args, **kwargs)
        if not state["in_eval"]:
            state["correct"].append(float(parts["correct"] > 0))
        return total, parts

    def evaluate(*args, **kwargs):
        state["in_eval"] = True
        try:
            return real_evaluate(*args, **kwargs)
        finally:
            state["in_eval"] = False

    def format_line(m):
        c = state["correct"]
        rec = {"step": m["step"], "completions": len(c), "sampled_accuracy": sum(c) / len(c) if c else None,
               "sampler_entropy": state["nll"] / state["tokens"] if state["tokens"] else None,
               "tokens": state["tokens"], "rollouts": state["rollouts"]}
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        state.update(correct=[], nll=0.0, tokens=0, rollouts=0, steps=state["steps"] + 1)
        return real_format(m)

    def restore(*args, **kwargs):  # a resumed run: keep the lines of the steps its checkpoint holds
        resumed = real_restore(*args, **kwargs)  # (step, ...)
        runs.truncate_jsonl(path, resumed[0])
        return resumed

    rollout.generate, tasks.reward, train.heldout, logs.line, runs.restore = generate, reward, evaluate, \
        format_line, restore
    summary = train.main(train_argv)
    with open(path) as f:
        recs = [json.loads(line) for line in f]
    if not recs or not any(r["completions"] and r["tokens"] for r in recs):
        sys.exit(f"probe.py: the taps recorded nothing in {path}: train.py no longer calls rollout.generate, "
                 f"tasks.reward or logs.line through their modules; update experiments/probe.py to match")
    return summary


if __name__ == "__main__":
    main()
