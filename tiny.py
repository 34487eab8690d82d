"""Train a small policy from scratch on a synthetic task: the bundled tiny policy, and the Countdown policy.

Why small policies of our own. `python train.py` must show RL working in minutes on a laptop CPU, and
the AQN replication (results/aqn_replication) needs a policy whose exploration RL can change, on a task
where exploring pays, trained in minutes on one GPU. Both are small Qwen2-architecture models trained
here, by supervised fine-tuning (SFT) from random weights, on a task generated in code. Each is an
ordinary Hugging Face checkpoint (config.json, safetensors, tokenizer), loaded by the same
`model.Transformer.from_pretrained` as Qwen2.5. A preset (PRESETS) holds each one's values:

    python tiny.py --out assets/tiny --seed 0 --force                          # arith.py: assets/tiny/README.md
    python tiny.py --task countdown --out assets/countdown --seed 0 --device cuda   # countdown.py: assets/countdown/README.md

Every flag overrides its preset's value; the command recorded with a checkpoint names the flags that
differ from the preset, so it rebuilds that checkpoint.

Architecture (constraints from the rest of the project):
- Every linear is a multiple of 16 in and out (NVFP4 scales one FP8 number per 16 weights). tiny:
  hidden 128, 4 query heads and 2 key/value heads of dim 32 (GQA: q 128->128, k/v 128->64), o
  128->128, SwiGLU MLP 128->384->128, 4 layers, 0.9 M parameters. countdown: hidden 384, 6 query and
  2 key/value heads of dim 64, MLP 1024, 8 layers, about 13 M parameters. q/k/v carry biases as in
  Qwen2; embedding and lm_head are untied (as in Qwen2.5-7B) and stay high precision under NVFP4.
- Tokenizer (bpe.py): a byte-level BPE trained on the task's own text in Qwen2's exact pipeline (one
  digit a token, so arithmetic is done digit by digit), up to --vocab-size tokens; ChatML as in Qwen2.5
  without its default system prompt; eos `<|im_end|>`, pad `<|endoftext|>`.

Training. Prompts are built by tasks.py's Task for the task (the question plus the task's instruction
in the chat template), so the policy sees at training time exactly what eval.py and train.py show it;
tests/test_tiny.py fails if that prompt changes. The loss is next-token cross-entropy on the answer
tokens only (the taught solution + `<|im_end|>`), AdamW with warmup and cosine decay over --steps,
batches drawn from a seeded generator: the same seed, device and thread count give the same weights.
On a GPU the forward runs under bf16 autocast, with float32 master weights.

Partial competence, on purpose: RL needs room. Two ways to leave it, one per preset.
- arith (label smoothing 0.05). Plain SFT stopped early leaves real gaps in arithmetic, which 60 LoRA
  policy-gradient steps did not move in a sweep; label smoothing keeps ~5% of the probability off the
  right token at every position, so at temperature 1 the policy often slips somewhere in a ~30-token
  solution while its most likely continuation is right: greedy accuracy high, pass@1 at T=1 low, pass@8
  well above it. RL removes that noise in a few dozen steps (the README's results): what it gains on
  this policy is sharpening, not new arithmetic, and its entropy is mostly the smoothing's floor.
- countdown (no label smoothing, a stopping rule). The policy's entropy is its own uncertainty about
  which numbers to combine. Every --eval-every steps it samples the first --probe-size held-out
  problems --probe-samples times at temperature 1, and training stops at the first probe whose pass@1
  reaches --stop-at (10%): competent (it writes valid solutions) but far from solved, with most
  problems left for RL to find. The step it stopped at is recorded; a run that never reaches the
  threshold trains all --steps and says so.

Saving. Weights are written in --dtype (float32 for tiny, bf16 for countdown), split into safetensors
shards of at most --shard-mib MiB with an index (countdown: 15, so no file reaches 16 MiB). The
checkpoint is built in a temporary folder beside --out and renamed into place when complete
(hub.new_folder): a crash, Ctrl-C or a full disk midway leaves the folder as it was; a failed write
stops with one line naming the file (hub.writing).

Measurement. At the end the held-out numbers are measured on the saved checkpoint through the project's
own stack (adapters.load_policy: model.py, NVFP4 via fp4_gemm; rollout.generate), unquantized and NVFP4:
greedy accuracy, and pass@1 / pass@K from K samples at temperature 1 (eval.pass_at_k), graded by the
task's judge (arith: the number of the `#### N` line, as arith.parse_solution reads it; countdown.grade).
The probes during training sample the transformers model being trained through the same
rollout.generate (on its weights, `as_policy`).
Every folder carries training.json (the settings, the losses, the probes, the final numbers) and a README
written from it (model_card.py); `--report-only` re-measures an existing checkpoint and rewrites only the
measured table of its README.
"""

import argparse
import copy
import json
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

import arith
import countdown
import data
import hub
import tasks
from bpe import SPECIAL, build_tokenizer, save_tokenizer
from model_card import readme, replace_table


# ---------------------------------------------------------------------------------------------
# The tasks and their presets
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Synthetic:
    """A generated task a policy learns from scratch: its problems, what the policy is taught to write,
    how it is judged, and how a problem is asked (the tasks.py kind and instruction)."""
    name: str
    title: str  # the README's heading
    about: str  # the README's first sentence: what the policy solves
    load: object  # (split, n, seed) -> records {"question", "answer", ...}
    target: object  # record -> the solution text the policy is taught
    grade: object  # (completion, record) -> bool
    valid: object  # (completion, record) -> bool: a well-formed answer (right or not)
    kind: str  # the tasks.py kind that grades and asks it
    instruction: str  # what the prompt asks after the question

    @property
    def task(self):
        """How a problem is asked: the question and the instruction in one user message (tasks.Task)."""
        return tasks.Task(self.kind, self.instruction)


def _arith_grade(text, item):
    """The completion's `#### N` equals the gold's (arith.parse_solution): the answer where it is asked."""
    return arith.parse_solution(text)[1] == arith.parse_solution(item["answer"])[1]


def _arith_valid(text, item):
    return arith.parse_solution(text)[1] is not None


def _countdown_valid(text, item):
    return countdown.verdict(text, item["answer"]) in ("right", "value", "claim")


SYNTHETIC = {
    "arith": Synthetic("arith", "tiny: the bundled policy",
                       "the synthetic arithmetic word problems of `arith.py` (2-4 steps of + - * on small "
                       "numbers, answers in GSM8K's format ending in `#### N`). It is the default `--model tiny` "
                       "of train.py and eval.py", arith.load, lambda it: it["answer"], _arith_grade, _arith_valid,
                       data.DATASETS["arith"][0], tasks.get_task(data.DATASETS["arith"][0]).instruction),
    "countdown": Synthetic("countdown", "countdown: the AQN replication's policy",
                           "the Countdown problems of `countdown.py` (four numbers, reach the target with + - * /, "
                           "each number once; three steps, then the expression after `####`). It is the policy "
                           "of results/aqn_replication", countdown.load, lambda it: it["solution"],
                           lambda text, it: countdown.grade(text, it["answer"]), _countdown_valid,
                           countdown.KIND, countdown.INSTRUCTION),
}

# Each task's values for every flag left out. tiny: the bundled policy's, tuned on the CPU (its README
# has the numbers). countdown: sized for a few minutes on one GPU (~13 M parameters, batch 256 of
# ~110-token sequences); the stopping rule, not --steps, ends its training (see the module docstring).
PRESETS = {
    "arith": dict(out="runs/tiny", steps=1000, batch_size=64, lr=1e-3, warmup=30, label_smoothing=0.05,
                  train_size=20000, vocab_size=448, hidden=128, intermediate=384, layers=4, heads=4, kv_heads=2,
                  eval_every=250, probe_size=200, probe_samples=8, stop_at=None, eval_size=500, eval_samples=8,
                  max_new_tokens=64, dtype="float32", shard_mib=0),
    "countdown": dict(out="runs/countdown", steps=8000, batch_size=256, lr=1e-3, warmup=200, label_smoothing=0.0,
                      train_size=200000, vocab_size=512, hidden=384, intermediate=1024, layers=8, heads=6, kv_heads=2,
                      eval_every=250, probe_size=256, probe_samples=16, stop_at=0.10, eval_size=512, eval_samples=32,
                      max_new_tokens=80, dtype="bfloat16", shard_mib=15),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BPE_PROBLEMS = 20000  # the problems whose text trains the tokenizer (all of the bundled tiny policy's)


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = lambda flag, text, **kw: p.add_argument(flag, default=None, help=text + " (default: the task's preset)", **kw)  # noqa: E731
    p.add_argument("--task", default="arith", choices=sorted(SYNTHETIC), help="the task, and the preset of every flag "
                   "left out (PRESETS): arith, the bundled tiny policy; countdown, the AQN replication's")
    add("--out", "checkpoint folder to write: new, empty or an earlier tiny.py output (the bundled assets/tiny is "
        "rewritten only when named, with --force)")
    p.add_argument("--force", action="store_true", help="write into a non-empty --out that tiny.py did not write "
                   "(with --report-only: rewrite the README and training.json of such a folder)")
    p.add_argument("--seed", type=int, default=0, help="seed for data, initialisation and batch order")
    add("--steps", "SFT optimizer steps at most (the cosine schedule's length)", type=int)
    add("--batch-size", "sequences per step", type=int)
    add("--lr", "peak AdamW learning rate", type=float)
    add("--warmup", "linear warmup steps", type=int)
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay (matrices only)")
    add("--label-smoothing", "cross-entropy label smoothing: the probability kept off the right token", type=float)
    add("--train-size", "train problems to draw from", type=int)
    add("--vocab-size", "BPE vocabulary size incl. specials, at most (the text may support fewer)", type=int)
    add("--hidden", "hidden size (multiple of 16)", type=int)
    add("--intermediate", "MLP size (multiple of 16)", type=int)
    add("--layers", "decoder layers", type=int)
    add("--heads", "query heads", type=int)
    add("--kv-heads", "key/value heads (GQA)", type=int)
    add("--eval-every", "held-out probe interval in steps (0: none)", type=int)
    add("--probe-size", "held-out problems a probe samples", type=int)
    add("--probe-samples", "samples a problem at temperature 1 in a probe", type=int)
    add("--stop-at", "stop at the first probe whose pass@1 (temperature 1) reaches this; 'none': train all --steps",
        type=_fraction_or_none)
    add("--eval-size", "held-out problems for the final measurement", type=int)
    add("--eval-samples", "samples a problem at temperature 1 in the final measurement", type=int)
    add("--max-new-tokens", "completion budget when sampling", type=int)
    add("--dtype", "dtype of the saved weights", choices=sorted(DTYPES))
    add("--shard-mib", "largest safetensors shard in MiB (0: one file)", type=float)
    p.add_argument("--save-every", type=int, default=0, help="also save OUT/step-N every N steps (0: never), to choose --steps")
    p.add_argument("--report-only", action="store_true",
                   help="do not train: re-measure the checkpoint in --out and rewrite its training.json and the "
                        "measured table of its README.md")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (0: torch's default). The result depends on it in the last bits; one "
                        "thread makes the checkpoint the same on any machine's core count, and a model this small "
                        "gains little from more")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    return p


def _fraction_or_none(text):
    """A float, or "none" (kept as the word until the preset is applied: None there means not given)."""
    return "none" if str(text).lower() == "none" else float(text)


def parse_args(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    for k, v in PRESETS[args.task].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.stop_at == "none":
        args.stop_at = None
    problems = check_args(args)
    if problems:
        p.error("; ".join(problems))
    return args


def check_args(args):
    """What is wrong with the values (the architecture's constraints among them), as messages; checked
    when the command line is read, before any folder is written."""
    problems = [f"--{k.replace('_', '-')} {getattr(args, k)}: must be >= {low}"
                for k, low in (("steps", 1), ("batch_size", 1), ("warmup", 1), ("train_size", 1), ("layers", 1),
                               ("heads", 1), ("kv_heads", 1), ("eval_size", 1), ("eval_samples", 1), ("probe_size", 1),
                               ("probe_samples", 1), ("max_new_tokens", 1), ("eval_every", 0), ("save_every", 0),
                               ("threads", 0), ("shard_mib", 0))
                if getattr(args, k) < low]
    if args.stop_at is not None and not 0 < args.stop_at <= 1:
        problems.append(f"--stop-at {args.stop_at}: must be a pass@1 in (0, 1], or none")
    if args.stop_at is not None and not args.eval_every:
        problems.append("--stop-at needs probes: pass --eval-every N > 0 (or --stop-at none)")
    if problems:
        return problems
    if args.vocab_size < 256 + len(SPECIAL):
        problems.append(f"--vocab-size {args.vocab_size}: must hold the 256 bytes and {len(SPECIAL)} special tokens "
                        f"(>= {256 + len(SPECIAL)})")
    if args.hidden % args.heads:
        problems.append(f"--heads {args.heads} must divide --hidden {args.hidden} (head dim = hidden / heads)")
    elif args.heads % args.kv_heads:
        problems.append(f"--kv-heads {args.kv_heads} must divide --heads {args.heads} (GQA shares each key/value "
                        f"head among heads / kv-heads query heads)")
    else:  # (NVFP4 scales one FP8 number per 16 weights: every linear's in and out features)
        for name, v in (("--hidden", args.hidden), ("--intermediate", args.intermediate),
                        ("head dim x --kv-heads (the k/v projections' width)", args.hidden // args.heads * args.kv_heads)):
            if v % 16:
                problems.append(f"{name} = {v} must be a multiple of 16 for NVFP4")
    return problems


# ---------------------------------------------------------------------------------------------
# Prompts, model, batches (the tokenizer: bpe.py)
# ---------------------------------------------------------------------------------------------

def arith_task():
    """The task object that eval.py and train.py use for arith problems (prompt, grading)."""
    return SYNTHETIC["arith"].task


def prompt_text(tokenizer, question, task="arith"):
    """A problem's prompt exactly as eval.py / train.py build it for `task`."""
    return SYNTHETIC[task].task.build_prompt(tokenizer, question)


def build_model(args, tokenizer):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        use_sliding_window=False, hidden_act="silu", initializer_range=0.02,
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return Qwen2ForCausalLM(config)


def encode_pairs(tokenizer, items, task="arith"):
    """[(prompt_ids, answer_ids)] with the answer closed by eos, as the policy must produce it."""
    syn = SYNTHETIC[task]
    eos = tokenizer.eos_token_id
    prompts = tokenizer([prompt_text(tokenizer, it["question"], task) for it in items], add_special_tokens=False)
    answers = tokenizer([syn.target(it) for it in items], add_special_tokens=False)
    return [(p, a + [eos]) for p, a in zip(prompts["input_ids"], answers["input_ids"])]


def make_batch(pairs, idx, pad_id, device):
    """Right-padded tokens (B, T) and labels (B, T) that are -100 except on answer tokens."""
    seqs = [pairs[i][0] + pairs[i][1] for i in idx]
    T = max(map(len, seqs))
    tokens = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    labels = torch.full((len(seqs), T), -100, dtype=torch.long)
    for b, i in enumerate(idx):
        p, a = pairs[i]
        tokens[b, :len(p) + len(a)] = torch.tensor(p + a)
        labels[b, len(p):len(p) + len(a)] = torch.tensor(a)
    return tokens.to(device), labels.to(device)


def as_policy(hf_model):
    """Our model.Transformer holding a transformers Qwen2 model's weights (the same tensors, no copy), so
    that held-out sampling during training goes through rollout.generate, the project's one sampler."""
    import model as M

    ours = M.Transformer(M.Config(hf_model.config.to_dict()), dtype=hf_model.dtype).to(hf_model.device)
    state = {k.removeprefix("model."): v for k, v in hf_model.state_dict().items()}
    ours.load_state_dict(state, strict=True, assign=True)  # (our names are HF's without "model.")
    return ours.eval()


# ---------------------------------------------------------------------------------------------
# Held-out accuracy
# ---------------------------------------------------------------------------------------------

@torch.no_grad()
def sample(policy, prompts, n, max_new_tokens, temperature, eos_id, pad_id, generator):
    """Each prompt n times through rollout.generate on `policy` (our model.Transformer; temperature 0:
    greedy), the seed drawn from `generator`. Returns the completions' token lists, eos excluded."""
    import rollout

    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    r = rollout.generate(policy, prompts, n=n, max_new_tokens=max_new_tokens, temperature=temperature,
                         stop_ids=(eos_id,), seed=seed, pad_id=pad_id)
    return [[t for t in r.tokens[i, : int(r.lengths[i])].tolist() if t != eos_id] for i in range(r.tokens.shape[0])]


def accuracy(policy, tokenizer, items, samples, generator, task="arith", max_new_tokens=64):
    """Held-out greedy accuracy, and at temperature 1 from `samples` samples a problem: pass@1 (the mean
    over samples), pass@samples (a problem solved by any) and the fraction of well-formed answers."""
    from eval import pass_at_k

    syn = SYNTHETIC[task]
    prompts = [syn.task.prompt_ids(tokenizer, it["question"]) for it in items]
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id

    def run(n, temperature):  # in chunks of ~1024 rows, which bounds the KV cache's memory
        per = max(1, 1024 // n)
        out = [c for i in range(0, len(prompts), per)
               for c in sample(policy, prompts[i:i + per], n, max_new_tokens, temperature, eos, pad, generator)]
        return [tokenizer.decode(c) for c in out]

    greedy = run(1, 0.0)
    texts = run(samples, 1.0)
    right = [sum(syn.grade(texts[i * samples + j], it) for j in range(samples)) for i, it in enumerate(items)]
    valid = sum(syn.valid(t, items[i // samples]) for i, t in enumerate(texts)) / len(texts)
    return {"greedy": sum(syn.grade(t, it) for t, it in zip(greedy, items)) / len(items),
            "pass@1_t1": sum(right) / (len(items) * samples),
            f"pass@{samples}_t1": sum(pass_at_k(samples, c, samples) for c in right) / len(items),
            "valid_t1": valid}


def measure(out, held, samples, device, task="arith", max_new_tokens=64):
    """Held-out accuracy of the saved checkpoint through the project's own stack (adapters.load_policy:
    model.py, NVFP4 via fp4_gemm; rollout.generate), unquantized and NVFP4: greedy, and pass@1 / pass@K
    at temperature 1 from K samples, graded by the task's judge."""
    import adapters

    final = {}
    for quant in ("bf16", "nvfp4"):
        t0 = time.time()
        m, tok = adapters.load_policy(str(out), None, quant, device)
        acc = accuracy(m, tok, held, samples, torch.Generator().manual_seed(1), task, max_new_tokens)
        final[quant] = {**acc, "seconds": round(time.time() - t0, 1)}
        print(f"final {quant}: " + "  ".join(f"{k} {v:.3f}" for k, v in final[quant].items()), flush=True)
    return final


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------

def save(model, tokenizer, out, dtype="float32", shard_mib=0, kept=None):
    """The checkpoint in `dtype`, in shards of at most shard_mib MiB (0: one file) with an index. A write
    that fails (a full disk) is one hub.OutputError line naming the folder and `kept`."""
    with hub.writing(str(out), kept=kept):
        out.mkdir(parents=True, exist_ok=True)
        weights = model if DTYPES[dtype] == model.dtype else copy.deepcopy(model).to(DTYPES[dtype])
        kw = {"max_shard_size": int(shard_mib * 2**20)} if shard_mib else {}
        weights.save_pretrained(out, safe_serialization=True, **kw)
        save_tokenizer(tokenizer, out)
    (out / "generation_config.json").unlink(missing_ok=True)  # sampling settings belong to eval/train


def main(args):
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _main(args)
    finally:
        torch.set_num_threads(threads)  # main() is also called from tests: leave the process as it was


def _main(args):
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    try:
        if args.report_only:  # re-measure an existing checkpoint, keeping how it was trained
            return report_only(args, out)
        # A folder of someone else's files is never written into unasked (hub.check_out).
        state = hub.check_out(str(out), "tiny.py", force=args.force)
        # Built beside --out and renamed into place when complete: a failure leaves --out as it was.
        with hub.new_folder(str(out), "tiny.py", force=args.force) as tmp:
            meta = train_checkpoint(args, Path(tmp), forced=state == "forced")
    except hub.OutputError as e:
        raise SystemExit(f"tiny.py: {e}") from None
    size = sum(f.stat().st_size for f in out.glob("model*.safetensors"))
    print(f"wrote {out} (weights {size / 2**20:.2f} MiB)")
    return meta


def report_only(args, out):
    if not (out / "training.json").is_file():
        raise SystemExit(f"tiny.py: --report-only re-measures a checkpoint that tiny.py trained, and {out} has "
                         f"no training.json; train one there first (without --report-only)")
    try:  # (the rules of a folder tiny.py would replace: another command's, or the project's own, need --force)
        hub.check_out(str(out), "tiny.py", force=args.force)
    except hub.OutputError as e:
        raise SystemExit(f"tiny.py: --report-only rewrites training.json and README.md in {out}, which it may not "
                         f"now: {e}") from None
    meta = json.loads((out / "training.json").read_text())
    task = meta["args"].get("task", "arith")
    held = SYNTHETIC[task].load("test", args.eval_size, seed=meta["args"]["seed"])
    meta = report(out, meta, held, args, kept="training.json and README.md are as they were")
    print(f"rewrote {out / 'training.json'} and the measured table of {out / 'README.md'}")
    return meta


def train_checkpoint(args, out, forced=False):
    """Train the policy and write it, its training.json and README.md into the folder `out`. forced: --out
    was a folder that only --force let tiny.py replace, so the recorded command keeps --force."""
    t0 = time.time()
    syn = SYNTHETIC[args.task]
    train = syn.load("train", args.train_size, seed=args.seed)
    held = syn.load("test", args.eval_size, seed=args.seed)
    probe = held[:args.probe_size]
    # BPE merges are learned from the text the policy will read and write: the user message as the task
    # phrases it (question + instruction), the role names and the solutions, of the first BPE_PROBLEMS
    # problems (a generated task's vocabulary is small: more text finds no other merges, only takes longer).
    head = train[:BPE_PROBLEMS]
    corpus = [f"user\n{m['content']}\nassistant\n" for it in head for m in syn.task.messages(it["question"])]
    tokenizer = build_tokenizer(corpus + [syn.target(it) for it in head], args.vocab_size)
    model = build_model(args, tokenizer).to(args.device)
    pairs = encode_pairs(tokenizer, train, args.task)
    n_params = sum(p.numel() for p in model.parameters())
    mean_len = sum(len(p) + len(a) for p, a in pairs) / len(pairs)
    print(f"{args.task}: {n_params / 1e6:.2f} M params, vocab {len(tokenizer)}, {len(pairs)} train problems, "
          f"{mean_len:.0f} tokens a sequence, {args.batch_size * mean_len:.0f} tokens a step, at most "
          f"{args.steps} steps on {args.device} with {torch.get_num_threads()} threads"
          + (f", stopping at probe pass@1 >= {args.stop_at:g}" if args.stop_at is not None else ""))

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    lr_at = lambda s: args.lr * min(1.0, (s + 1) / args.warmup) * (  # noqa: E731
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps))))
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=torch.device(args.device).type == "cuda")
    gen = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(len(pairs), generator=gen).tolist()
    cursor, history, losses, stopped_at = 0, [], [], None
    model.train()
    for step in range(args.steps):
        if cursor + args.batch_size > len(order):
            order, cursor = torch.randperm(len(pairs), generator=gen).tolist(), 0
        idx = order[cursor:cursor + args.batch_size]
        cursor += args.batch_size
        tokens, labels = make_batch(pairs, idx, tokenizer.pad_token_id, args.device)
        with autocast:
            logits = model(input_ids=tokens).logits[:, :-1]  # (B, T-1, V)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels[:, 1:].reshape(-1),
                               ignore_index=-100, label_smoothing=args.label_smoothing)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 20 == 0 or step == args.steps - 1:
            losses.append(round(loss.item(), 4))
            print(f"step {step:4d}  loss {loss.item():.4f}  lr {lr_at(step):.2e}  {time.time() - t0:.0f}s",
                  flush=True)
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            model.eval()
            acc = accuracy(as_policy(model), tokenizer, probe, args.probe_samples, torch.Generator().manual_seed(1),
                           args.task, args.max_new_tokens)
            model.train()
            history.append({"step": step + 1, **acc})
            print(f"  probe step {step + 1}: " + "  ".join(f"{k} {v:.3f}" for k, v in acc.items()), flush=True)
            if args.stop_at is not None and acc["pass@1_t1"] >= args.stop_at:
                stopped_at = step + 1
                print(f"  stopping: probe pass@1 {acc['pass@1_t1']:.3f} >= --stop-at {args.stop_at:g}", flush=True)
                break
        if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
            save(model, tokenizer, out / f"step-{step + 1}", args.dtype, args.shard_mib,
                 kept=f"{args.out} is left as it was")
    train_time = time.time() - t0
    save(model, tokenizer, out, args.dtype, args.shard_mib, kept=f"{args.out} is left as it was")
    meta = {"command": command(args, forced), "args": vars(args), "params": n_params,
            "steps_trained": stopped_at or args.steps, "stopped_at": stopped_at,
            "train_seconds": round(train_time, 1), "device": args.device,
            "gpu": torch.cuda.get_device_name(args.device) if torch.device(args.device).type == "cuda" else None,
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "prompt_example": prompt_text(tokenizer, held[0]["question"], args.task), "losses": losses,
            "history": history}
    print(f"trained {meta['steps_trained']} steps in {train_time:.0f}s")
    return report(out, meta, held, args, kept=f"{args.out} is left as it was")


def command(args, forced):
    """The command that rebuilds this checkpoint: the flags that differ from the task's preset."""
    defaults = vars(parse_args(["--task", args.task]))
    flags = "".join(f" --{k.replace('_', '-')} {'none' if v is None else v}" for k, v in vars(args).items()
                    if k not in ("out", "seed", "device", "report_only", "force", "task") and v != defaults[k])
    task = f" --task {args.task}" if args.task != "arith" else ""
    return f"python tiny.py{task} --out {args.out} --seed {args.seed}{flags}{' --force' if forced else ''}"


def write_text(path, text, kept):
    """Write a file atomically (a reader sees the old file or the new); a failed write is one line."""
    with hub.writing(str(path), kept=kept):
        tmp = path.with_name(path.name + ".tmp")
        try:
            tmp.write_text(text)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)


def report(out, meta, held, args, kept):
    """Measure the checkpoint, then write training.json and README.md next to it. A README that is
    already there (--report-only) keeps everything but its measured table."""
    from transformers import AutoConfig

    print(f"final eval on {len(held)} held-out problems, {args.eval_samples} samples each at temperature 1")
    task = meta["args"].get("task", "arith")
    max_new = meta["args"].get("max_new_tokens", 64)
    meta["final"] = measure(out, held, args.eval_samples, args.device, task, max_new)
    meta["final_device"] = args.device
    trained = argparse.Namespace(**{**PRESETS[task], "task": task, **meta["args"]})  # (older files lack newer flags)
    text = readme(SYNTHETIC[task], trained, meta, AutoConfig.from_pretrained(out), len(held), args.eval_samples)
    readme_path = out / "README.md"
    if args.report_only and readme_path.is_file():
        text = replace_table(readme_path.read_text(), text)
    write_text(out / "training.json", json.dumps(meta, indent=2) + "\n", kept)
    write_text(readme_path, text, kept)
    return meta


if __name__ == "__main__":
    main(parse_args())
