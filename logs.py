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

from recipes import RECIPES

PLOTS = [("reward", "reward"), ("accuracy", "rollout accuracy"), ("heldout_accuracy", "held-out accuracy"),
         ("entropy", "entropy"), ("response_length", "response length"), ("sigma", "AQN sigma")]


def append_jsonl(path, rows):
    with open(path, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)



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


def header(args, model, n_norms, n_train, n_items, world, device, out):
    """The start-up lines: the recipe and what changed from it, the model and its weights, the step's shape
    and the tokens it samples, the ranks, the folder."""
    weight_gb = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers())) / 1e9
    kernels = f"; fp4 matmuls: {'Triton kernels' if device.type == 'cuda' else 'torch dequantize + matmul'}" \
        if args.quant == "nvfp4" else ""
    changed = [k for k, v in RECIPES[args.recipe].items()
               if v.value is not None and getattr(args, k, v.value) != v.value]  # (None: derived from another)
    print(f"recipe {args.recipe} ({args.algo}){'; changed: ' + ', '.join(changed) if changed else ''}")
    print(f"model {args.model} ({model.config}) base={args.quant} on {device} ({weight_gb:.3f} GB of weights{kernels}), "
          f"LoRA r={args.lora_rank}{f' + {n_norms} norms' if n_norms else ''}: {n_train / 1e6:.2f}M trainable parameters")
    aqn_text = (f"AQN on: {args.aqn_stages} stages, sigma {args.sigma_start:g} -> {args.sigma_end:g}"
                if args.aqn else "AQN off")
    print(f"{args.steps} steps x {args.prompts} prompts x G={args.group_size} = {args.prompts * args.group_size} "
          f"completions a step, <= {args.max_new_tokens} new tokens each (<= {args.prompts * args.group_size * args.max_new_tokens:,} "
          f"sampled tokens a round); lr {args.lr:g} ({args.warmup_steps} warm-up steps); reward {args.reward}, prompt "
          f"{args.prompt or 'as the reward was trained'}; {aqn_text}; data {args.data} ({n_items[0]} train, {n_items[1]} held-out)")
    if world.size > 1:
        print(f"data-parallel: {world.size} ranks ({'NCCL' if device.type == 'cuda' else 'gloo'}), each sampling and "
              f"training about {args.prompts / world.size:g} of the {args.prompts} prompts a round (ddp.py)")
    print(f"outputs in {out}")


def step_metrics(step, sigma, stage, rounds, filtered, groups, lr):
    """A step's sampling metrics: AQN's sigma and stage (None when off), dynamic sampling's rounds and filtered
    groups, the kept groups' mean reward, its parts, the rollout accuracy and the completions' lengths."""
    m = {"step": step, "sigma": sigma, "aqn_stage": stage, "rounds": rounds, "filtered_groups": filtered,
         "groups": len(groups), "lr": lr}
    if groups:
        mean = lambda f: torch.stack([getattr(g, f) for g in groups]).mean().item()
        correct = torch.stack([g.correct for g in groups])
        lengths = torch.cat([g.lengths for g in groups])
        m.update(reward=mean("reward"), reward_correct=mean("correct"), reward_format=mean("format"),
                 reward_overlong=mean("overlong"), accuracy=(correct > 0).float().mean().item(),
                 response_length=lengths.mean().item(), response_length_max=lengths.max().item())
    return m


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
