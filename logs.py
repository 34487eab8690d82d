"""logs.py: what a training run shows while it goes and leaves behind: a line a step, metrics.jsonl,
samples.jsonl, curves.png, and optionally TensorBoard or Weights & Biases.

A step's metrics (one JSON object, train.py builds it) carry, per the design card: the reward and its
parts (correct, format, overlong), the rollout accuracy, the policy's entropy, the response lengths, the
clip fractions, the KL to the reference, the sampler-trainer mismatch (grpo.py), DAPO's filtered
groups and rounds, AQN's sigma and stage, the lr, the times and the peak memory. metrics.jsonl is the
record; curves.png is refreshed every --plot-every steps; samples.jsonl holds the first completion of a
few groups a step, for reading what the policy writes.
"""
import json
import math
import os

import torch

PLOTS = [("reward", "reward"), ("accuracy", "rollout accuracy"), ("heldout_accuracy", "held-out accuracy"),
         ("entropy", "entropy"), ("response_length", "response length"), ("sigma", "AQN sigma")]


def append_jsonl(path, rows):
    with open(path, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def line(m):
    """The console line of a step's metrics `m` (a dash where a metric is absent)."""
    f = lambda k, fmt: (fmt % m[k]) if m.get(k) is not None else "-"
    return (f"step {m['step']:4d} | reward {f('reward', '%.3f')} acc {f('accuracy', '%.3f')} "
            f"(correct {f('reward_correct', '%.2f')} fmt {f('reward_format', '%.2f')} over {f('reward_overlong', '%.2f')}) "
            f"| ent {f('entropy', '%.3f')} len {f('response_length', '%.1f')} | clip {f('clip_frac_low', '%.3f')}/"
            f"{f('clip_frac_high', '%.3f')} kl {f('kl_ref', '%.4f')} | sampler-trainer kl {f('mismatch_kl', '%.1e')} "
            f"max {f('mismatch_ratio_max', '%.2f')} | filtered {m['filtered_groups']} | sigma {m['sigma']:.1e} "
            f"| t {m['time_rollout']:.1f}+{m['time_update']:.1f}s {m['rollout_tokens_per_s']:.0f} tok/s "
            f"| mem {m['peak_memory_gb']:.2f}GB" + (f" | held-out {m['heldout_accuracy']:.3f}" if "heldout_accuracy" in m else ""))


def plot(rows, path, baseline=None):
    """curves.png: the reward, accuracies, entropy, length and sigma against the step; the held-out accuracy
    (measured after a step) at step + 1, from the baseline at 0. Written beside and renamed into place."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(12, 6))
    for ax, (key, title) in zip(axes.flat, PLOTS):
        pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if key == "heldout_accuracy":
            pts = [(0, baseline)] * (baseline is not None) + [(s + 1, v) for s, v in pts]
        if pts:
            ax.plot(*zip(*pts), marker="o" if key == "heldout_accuracy" else None, markersize=3)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path + ".tmp.png", dpi=90)
    plt.close(fig)
    os.replace(path + ".tmp.png", path)


def peak_memory_gb(device):
    """The step's peak: torch's allocations on a GPU, the process's resident memory on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


class Tracker:
    """--log: the metrics of every step also to TensorBoard (OUT/tensorboard) or Weights & Biases (offline
    unless WANDB_MODE says otherwise), for watching a run live; metrics.jsonl and curves.png stay the record.
    Both packages are optional: recipes.check refuses --log when the one asked for is missing."""

    def __init__(self, kind, out, run_id=None, config=None):
        self.kind, self.writer = kind, None
        if kind == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(os.path.join(out, "tensorboard"))
        elif kind == "wandb":
            import wandb

            os.environ.setdefault("WANDB_MODE", "offline")  # (no network needed; `wandb sync` uploads later)
            self.writer = wandb.init(project="qerl", dir=out, name=os.path.basename(os.path.normpath(out)),
                                     id=run_id, resume="allow", config=config)

    def log(self, m, step):
        numbers = {k: float(v) for k, v in m.items() if k != "step" and isinstance(v, (int, float)) and math.isfinite(v)}
        if self.kind == "tensorboard":
            for k, v in numbers.items():
                self.writer.add_scalar(k, v, step)
            self.writer.flush()
        elif self.kind == "wandb":
            self.writer.log(numbers, step=step)

    def close(self):
        if self.writer is not None:
            (self.writer.close if self.kind == "tensorboard" else self.writer.finish)()
