"""Train the bundled tiny policy from scratch: a small Qwen2 model that half-solves arith.py's problems.

Why a tiny policy. `python train.py` must show RL working in minutes on a laptop CPU, so the default
policy is a ~0.9 M-parameter Qwen2-architecture model trained here, by supervised fine-tuning (SFT), on
the synthetic arithmetic task. It is an ordinary Hugging Face checkpoint (config.json +
model.safetensors + tokenizer), loaded by the same `model.Transformer.from_pretrained` as Qwen2.5.

    python tiny.py --out assets/tiny --seed 0 --force    # its time and device: assets/tiny/README.md

Architecture (constraints from the rest of the project):
- Every linear is a multiple of 16 in and out (NVFP4 scales one FP8 number per 16 weights):
  hidden 128, 4 query heads and 2 key/value heads of dim 32 (GQA: q 128->128, k/v 128->64),
  o 128->128, SwiGLU MLP 128->384->128, 4 layers. q/k/v carry biases as in Qwen2. Embedding and
  lm_head are untied (as in Qwen2.5-7B) and stay high precision under NVFP4. 3.5 MB in float32.
- Tokenizer: a byte-level BPE (the `tokenizers` library) of 448 tokens trained on the task's own text,
  in Qwen2's exact pipeline (NFC, its split regex, which puts every digit in a token of its own, then
  bytes), so arithmetic is done digit by digit and any text still encodes. Specials: `<|endoftext|>`
  (pad), `<|im_start|>`, `<|im_end|>` (eos). The chat template is ChatML as in Qwen2.5 but without
  Qwen's default system prompt (it would double the prompt of a model that cannot use it):
  `<|im_start|>user\n{message}<|im_end|>\n<|im_start|>assistant\n`.

Training. Prompts are built by tasks.py's own prompt builder for arith (its gsm8k task: question plus
the "####" instruction, in the chat template), so the policy sees at training time exactly what eval.py
and train.py show it; tests/test_tiny.py fails if that prompt changes. The loss is next-token
cross-entropy on the answer tokens only (solution + `<|im_end|>`), AdamW with warmup and cosine decay,
batches drawn from a seeded generator: the same seed and thread count give the same weights.

Partial competence, on purpose. RL needs room: the policy should be right often but not reliably when
it samples at temperature 1 (held-out pass@1 between 15% and 60%, pass@8 well above it), so that
group-relative advantages are nonzero and sharpening pays. Plain SFT stopped early does not give that:
its temperature-1 accuracy tracks its greedy accuracy (the errors are real gaps in arithmetic), and in
a sweep 60 LoRA policy-gradient steps did not move it. Label smoothing (0.05) does: the model keeps ~5%
of its probability off the right token at every position, so at temperature 1 it often slips somewhere
in a ~30-token solution while its most likely continuation is right: greedy accuracy high, pass@1 at
T=1 low, pass@8 well above it (the bundled checkpoint's numbers: assets/tiny/README.md) -- sampling noise
around a mostly-right mode, which RL removes in a few dozen steps (train.py's default run: the README's
results). What RL gains on this policy is therefore mostly sharpening, not new arithmetic.

The checkpoint is built in a temporary folder beside --out and renamed into place when it is complete
(hub.new_folder): a crash or Ctrl-C midway leaves the folder as it was, the bundled policy included.

The held-out numbers at the end are measured through the project's own stack (eval.evaluate: model.py,
NVFP4 via fp4_gemm, rollout.generate, tasks.grade), unquantized and NVFP4; `--report-only` re-measures an
existing checkpoint. Progress during training samples the transformers model being trained through the
same rollout.generate (on its weights, `as_policy`).
"""

import argparse
import json
import math
import os
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import arith
import hub

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2's pre-tokenizer split (its tokenizer.json): words with one leading non-letter, single digits,
# punctuation runs, newlines, spaces.
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
               r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/tiny", help="checkpoint folder to write: new, empty or an earlier "
                   "tiny.py output (the bundled assets/tiny is rewritten only when named, with --force)")
    p.add_argument("--force", action="store_true", help="write into a non-empty --out that tiny.py did not write")
    p.add_argument("--seed", type=int, default=0, help="seed for data, initialisation and batch order")
    p.add_argument("--steps", type=int, default=1000, help="SFT optimizer steps (sets how competent the policy ends up)")
    p.add_argument("--batch-size", type=int, default=64, help="sequences per step")
    p.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate")
    p.add_argument("--warmup", type=int, default=30, help="linear warmup steps")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay (matrices only)")
    p.add_argument("--label-smoothing", type=float, default=0.05,
                   help="cross-entropy label smoothing: the probability kept off the right token (sampling noise)")
    p.add_argument("--train-size", type=int, default=20000, help="arith train problems to draw from")
    p.add_argument("--vocab-size", type=int, default=448, help="BPE vocabulary size incl. specials (a multiple of 16)")
    p.add_argument("--hidden", type=int, default=128, help="hidden size (multiple of 16)")
    p.add_argument("--intermediate", type=int, default=384, help="MLP size (multiple of 16)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.add_argument("--heads", type=int, default=4, help="query heads")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (GQA)")
    p.add_argument("--eval-every", type=int, default=250, help="held-out eval interval in steps (0: end only), on 200 problems")
    p.add_argument("--eval-size", type=int, default=500, help="held-out problems for the final eval")
    p.add_argument("--eval-samples", type=int, default=8, help="samples per problem at temperature 1")
    p.add_argument("--save-every", type=int, default=0, help="also save OUT/step-N every N steps (0: never), to choose --steps")
    p.add_argument("--report-only", action="store_true",
                   help="do not train: re-measure the checkpoint in --out and rewrite its README.md / training.json")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (0: torch's default). The result depends on it in the last bits; one "
                        "thread makes the checkpoint the same on any machine's core count, and a model this small "
                        "gains little from more")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    args = p.parse_args(argv)
    problems = check_args(args)
    if problems:
        p.error("; ".join(problems))
    return args


def check_args(args):
    """What is wrong with the values (the architecture's constraints among them), as messages; checked
    when the command line is read, before any folder is written."""
    problems = [f"--{k.replace('_', '-')} {getattr(args, k)}: must be >= {low}"
                for k, low in (("steps", 1), ("batch_size", 1), ("warmup", 1), ("train_size", 1), ("layers", 1),
                               ("heads", 1), ("kv_heads", 1), ("eval_size", 1), ("eval_samples", 1),
                               ("eval_every", 0), ("save_every", 0), ("threads", 0))
                if getattr(args, k) < low]
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


def build_tokenizer(texts, vocab_size):
    """A byte-level BPE trained on `texts`, in Qwen2's own tokenizer pipeline (NFC, its split regex with
    one digit a token, byte-level), wrapped as an HF fast tokenizer. Using Qwen2's exact pipeline
    matters: transformers 5 loads any qwen2 checkpoint's tokenizer as Qwen2Tokenizer, which rebuilds
    the pipeline from the vocab and merges, so a different pre-tokenizer would be silently replaced."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHAT_TEMPLATE)


def save_tokenizer(tokenizer, out):
    """tokenizer.json from the library, tokenizer_config.json written by hand so that the chat template
    sits inside it (transformers' save_pretrained would move it to a separate .jinja file)."""
    tokenizer.backend_tokenizer.save(str(out / "tokenizer.json"))
    added = {str(tokenizer.convert_tokens_to_ids(t)): {"content": t, "special": True, "lstrip": False,
                                                      "rstrip": False, "normalized": False, "single_word": False}
             for t in SPECIAL}
    config = {"tokenizer_class": "Qwen2Tokenizer", "added_tokens_decoder": added,
              "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "unk_token": None, "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
              "model_max_length": 512, "clean_up_tokenization_spaces": False, "split_special_tokens": False,
              "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def arith_task():
    """The task object that eval.py and train.py use for arith problems (prompt, grading)."""
    import data
    import tasks

    return tasks.get_task(data.DATASETS["arith"][0])


def prompt_text(tokenizer, question):
    """The arith prompt exactly as eval.py / train.py build it."""
    return arith_task().build_prompt(tokenizer, question)


def build_model(args, tokenizer):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        use_sliding_window=False, hidden_act="silu", initializer_range=0.02,
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return Qwen2ForCausalLM(config)


def encode_pairs(tokenizer, items):
    """[(prompt_ids, answer_ids)] with the answer closed by eos, as the policy must produce it."""
    eos = tokenizer.eos_token_id
    prompts = tokenizer([prompt_text(tokenizer, it["question"]) for it in items], add_special_tokens=False)
    answers = tokenizer([it["answer"] for it in items], add_special_tokens=False)
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


@torch.no_grad()
def sample(model, prompts, n, max_new_tokens, temperature, eos_id, pad_id, generator):
    """Each prompt n times through rollout.generate on the transformers model's weights (temperature 0:
    greedy), the seed drawn from `generator`. Returns the completions' token lists, eos excluded."""
    import rollout

    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    r = rollout.generate(as_policy(model), prompts, n=n, max_new_tokens=max_new_tokens, temperature=temperature,
                         stop_ids=(eos_id,), seed=seed, pad_id=pad_id)
    return [[t for t in r.tokens[i, : int(r.lengths[i])].tolist() if t != eos_id] for i in range(r.tokens.shape[0])]


def accuracy(model, tokenizer, items, samples, generator):
    """Held-out greedy accuracy, temperature-1 pass@1 (mean over samples) and pass@samples."""
    prompts = [arith_task().prompt_ids(tokenizer, it["question"]) for it in items]
    gold = [arith.parse_solution(it["answer"])[1] for it in items]
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    model.eval()

    def right(completions, k):
        finals = [arith.parse_solution(tokenizer.decode(c))[1] for c in completions]
        return torch.tensor([f == gold[i // k] for i, f in enumerate(finals)]).view(len(items), k)

    def run(n, temperature):  # in chunks of ~1024 rows, which bounds the KV cache's memory
        per = max(1, 1024 // n)
        return [c for i in range(0, len(prompts), per)
                for c in sample(model, prompts[i:i + per], n, 64, temperature, eos, pad, generator)]

    greedy = right(run(1, 0.0), 1).float().mean().item()
    hits = right(run(samples, 1.0), samples)
    model.train()
    return {"greedy": greedy, "pass@1_t1": hits.float().mean().item(),
            f"pass@{samples}_t1": hits.any(1).float().mean().item()}


def save(model, tokenizer, out):
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
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
    if args.report_only:  # re-measure an existing checkpoint, keeping how it was trained
        if not (out / "training.json").is_file():
            raise SystemExit(f"tiny.py: --report-only re-measures a checkpoint that tiny.py trained, and {out} has "
                             f"no training.json; train one there first (without --report-only)")
        meta = json.loads((out / "training.json").read_text())
        meta = report(out, meta, arith.load("test", args.eval_size, seed=meta["args"]["seed"]), args)
        print(f"rewrote {out / 'training.json'} and {out / 'README.md'}")
        return meta
    try:  # a folder of someone else's files is never written into unasked (hub.check_out)
        state = hub.check_out(str(out), "tiny.py", force=args.force)
        # Built beside --out and renamed into place when complete: a failure leaves --out as it was.
        with hub.new_folder(str(out), "tiny.py", force=args.force) as tmp:
            meta = train_checkpoint(args, Path(tmp), forced=state == "forced")
    except hub.OutputError as e:
        raise SystemExit(f"tiny.py: {e}") from None
    print(f"wrote {out} (model.safetensors {os.path.getsize(out / 'model.safetensors') / 2**20:.2f} MiB)")
    return meta


def train_checkpoint(args, out, forced=False):
    """Train the policy and write it, its training.json and README.md into the folder `out`. forced: --out
    was a folder that only --force let tiny.py replace, so the recorded command keeps --force."""
    t0 = time.time()

    train = arith.load("train", args.train_size, seed=args.seed)
    held = arith.load("test", args.eval_size, seed=args.seed)
    # BPE merges are learned from the text the policy will read and write: the user message as the task
    # phrases it (question + instruction), the role names and the solutions.
    corpus = [f"user\n{m['content']}\nassistant\n" for it in train for m in arith_task().messages(it["question"])]
    tokenizer = build_tokenizer(corpus + [it["answer"] for it in train], args.vocab_size)
    model = build_model(args, tokenizer).to(args.device)
    pairs = encode_pairs(tokenizer, train)
    n_params = sum(p.numel() for p in model.parameters())
    mean_len = sum(len(p) + len(a) for p, a in pairs) / len(pairs)
    print(f"tiny: {n_params / 1e6:.2f} M params, vocab {len(tokenizer)}, {len(pairs)} train problems, "
          f"{mean_len:.0f} tokens a sequence, {args.batch_size * mean_len:.0f} tokens a step, "
          f"{args.steps} steps on {args.device} with {torch.get_num_threads()} threads")

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    lr_at = lambda s: args.lr * min(1.0, (s + 1) / args.warmup) * (  # noqa: E731
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps))))
    gen = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(len(pairs), generator=gen).tolist()
    cursor, history, losses = 0, [], []
    model.train()
    for step in range(args.steps):
        if cursor + args.batch_size > len(order):
            order, cursor = torch.randperm(len(pairs), generator=gen).tolist(), 0
        idx = order[cursor:cursor + args.batch_size]
        cursor += args.batch_size
        tokens, labels = make_batch(pairs, idx, tokenizer.pad_token_id, args.device)
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
            acc = accuracy(model, tokenizer, held[:200], args.eval_samples, torch.Generator().manual_seed(1))
            history.append({"step": step + 1, **acc})
            print(f"  eval step {step + 1}: " + "  ".join(f"{k} {v:.3f}" for k, v in acc.items()), flush=True)
        if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
            save(model, tokenizer, out / f"step-{step + 1}")
    train_time = time.time() - t0
    save(model, tokenizer, out)
    defaults = vars(parse_args([]))
    flags = "".join(f" --{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                    if k not in ("out", "seed", "device", "report_only", "force") and v != defaults[k])
    meta = {"command": f"python tiny.py --out {args.out} --seed {args.seed}{flags}{' --force' if forced else ''}",
            "args": vars(args),
            "params": n_params, "train_seconds": round(train_time, 1), "device": args.device,
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "prompt_example": prompt_text(tokenizer, held[0]["question"]), "losses": losses, "history": history}
    print(f"trained in {train_time:.0f}s")
    return report(out, meta, held, args)


def measure(out, held, samples, device):
    """Held-out accuracy of the saved checkpoint through the project's own stack (model.py, NVFP4 via
    fp4_gemm, rollout.generate, tasks.grade), unquantized and NVFP4: greedy, and pass@1 / pass@K at
    temperature 1 from K samples."""
    import adapters
    import eval as evaluation

    final = {}
    for quant in ("bf16", "nvfp4"):
        m, tok = adapters.load_policy(str(out), None, quant, device)
        kw = dict(max_new_tokens=64, batch_size=512, seed=1)
        greedy = evaluation.evaluate(m, tok, held, "gsm8k", samples=1, temperature=0.0, top_p=1.0, **kw)
        t1 = evaluation.evaluate(m, tok, held, "gsm8k", samples=samples, temperature=1.0, top_p=1.0, **kw)
        final[quant] = {"greedy": greedy["accuracy"], "pass@1_t1": t1["accuracy"],
                        f"pass@{samples}_t1": t1["pass@k"][samples], "seconds": round(t1["seconds"], 1)}
        print(f"final {quant}: " + "  ".join(f"{k} {v:.3f}" for k, v in final[quant].items()), flush=True)
    return final


def report(out, meta, held, args):
    """Measure the checkpoint, then write training.json and README.md next to it."""
    from transformers import AutoConfig

    print(f"final eval on {len(held)} held-out problems, {args.eval_samples} samples each at temperature 1")
    meta["final"] = measure(out, held, args.eval_samples, args.device)
    (out / "training.json").write_text(json.dumps(meta, indent=2) + "\n")
    (out / "README.md").write_text(readme(argparse.Namespace(**meta["args"]), meta, AutoConfig.from_pretrained(out),
                                          len(held), args.eval_samples))
    return meta


def readme(args, meta, config, n_held, k):
    """args: how the checkpoint was trained (its history has args.eval_samples samples a problem); k: the
    samples a problem of the final measurement (--report-only may use another number)."""
    f, q = meta["final"]["bf16"], meta["final"]["nvfp4"]
    full = "float32" if args.device == "cpu" else "bf16"
    kh = args.eval_samples
    rows = "\n".join(f"| {h['step']} | {h['greedy']:.3f} | {h['pass@1_t1']:.3f} | {h[f'pass@{kh}_t1']:.3f} |"
                      for h in meta["history"])
    return f"""# tiny: the bundled policy

A {meta['params'] / 1e6:.2f} M-parameter Qwen2-architecture model trained from scratch by `tiny.py` on the
synthetic arithmetic word problems of `arith.py` (2-4 steps of + - * on small numbers, answers in
GSM8K's format ending in `#### N`). It is the default `--model tiny` of train.py and eval.py, and an
ordinary Hugging Face checkpoint: `transformers.AutoModelForCausalLM` / `AutoTokenizer` load this folder.

Made with this command, on {meta['device']} ({meta['threads']} thread{'s' if meta['threads'] != 1 else ''}, torch {meta['torch']}),
in {meta['train_seconds']:.0f} s of training (the same seed and thread count give the same weights on
the same machine):

    {meta['command']}

## Model
- Qwen2: hidden {config.hidden_size}, {config.num_hidden_layers} layers, {config.num_attention_heads} query heads and
  {config.num_key_value_heads} key/value heads of dim {config.hidden_size // config.num_attention_heads} (GQA), q/k/v biases,
  SwiGLU MLP {config.intermediate_size}, RoPE theta {(getattr(config, "rope_parameters", None) or {"rope_theta": config.rope_theta})["rope_theta"]:g}, untied lm_head, float32 weights.
  Every decoder linear's in and out features are multiples of 16, so all of them quantize to NVFP4.
- Tokenizer: byte-level BPE of {config.vocab_size} tokens trained on the task's text in Qwen2's tokenizer
  pipeline (one digit a token); ChatML template without a system prompt; eos `<|im_end|>`, pad
  `<|endoftext|>`.

## Training
Supervised: {args.steps} AdamW steps of {args.batch_size} (prompt, solution) pairs, lr {args.lr:g} with
{args.warmup} warmup steps and cosine decay to 10%, loss on the solution tokens and `<|im_end|>` only,
label smoothing {args.label_smoothing:g}. The prompt is the one eval.py and train.py use for arith
(tasks.py's gsm8k instruction in the chat template):

    {meta['prompt_example']!r}

Label smoothing leaves probability on wrong tokens, so at temperature 1 the policy often samples a
slip somewhere in its ~30-token solution while its most likely continuation is usually right: greedy
accuracy is high, temperature-1 accuracy is low, pass@{k} well above pass@1. That gap is the room that
RL (train.py) has to close in a few dozen steps. Most of what RL gains on this policy is therefore
sharpening (less sampling noise), not new arithmetic.

## Held-out accuracy (arith test split, first {n_held} problems; {k} samples each at temperature 1, top-p 1)
| weights | greedy | pass@1 (T=1) | pass@{k} (T=1) |
| --- | --- | --- | --- |
| unquantized ({full}) | {f['greedy']:.3f} | {f['pass@1_t1']:.3f} | {f[f'pass@{k}_t1']:.3f} |
| NVFP4 decoder linears | {q['greedy']:.3f} | {q['pass@1_t1']:.3f} | {q[f'pass@{k}_t1']:.3f} |

During training (first 200 held-out problems):

| step | greedy | pass@1 (T=1) | pass@{kh} (T=1) |
| --- | --- | --- | --- |
{rows}

The final table is measured through the project's own stack, as `python eval.py --model tiny --data arith
--temperature 1.0 --top-p 1.0 --samples {k} --quant nvfp4|bf16` (and `--temperature 0` for greedy) would:
model.py, fp4_gemm's NVFP4 linears, rollout.generate and tasks.grade. The training-time rows come from
rollout.generate on the weights being trained and tiny.py's exact `#### N` check.
"""


if __name__ == "__main__":
    main(parse_args())
