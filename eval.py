"""Evaluate a policy (a base model, NVFP4 or not, plus an optional LoRA adapter) on math benchmarks.

    python eval.py --model tiny --data arith                         # seconds on a CPU
    python eval.py --model qwen2.5-7b --adapter runs/x/adapter --quant nvfp4 --data math500 --samples 4

For each problem we sample K completions (rollout.generate, batched and KV-cached), grade each with
tasks.grade (the same judge RL is rewarded by), and report:

- avg@K: the fraction of all N*K completions that are right. It is the unbiased estimate of pass@1 at
  this temperature, with less variance than one sample a problem; `accuracy` and `pass@1` are this
  number.
- pass@k for k = 1, 2, 4, ... <= K (and K): the probability that at least one of k completions is right,
  with the unbiased estimator of Chen et al. 2021 (the Codex paper). A problem with c right out of n
  samples contributes

      pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n - c + 1}^{n} (1 - k / i)

  (the product form avoids huge binomials); it is 1 when n - c < k. Averaged over problems. Plugging in
  "any of the first k samples is right" instead would be unbiased too but waste the other n - k.
- the same avg@K and pass@k with the strict grader (`accuracy_strict`, `pass@k_strict`: a GSM8K answer
  counts only after `####` or inside `<answer>` tags, the form RL with the strict reward trains; the
  lenient `accuracy` also reads a box or the last number), side by side, and `answer_format`, the
  fraction of completions that give an answer in such a spot. For MATH-style sets the two agree: a
  `\\boxed{}` (or `<answer>`) answer is required either way (tasks.py says why).
- per-level and per-subject avg@K when the items carry them (MATH500), the mean completion length and
  the fraction cut off at --max-new-tokens.

The summary, with the settings that produced it (model, adapter, quant, data, split, prompt style,
sampling), goes to OUT/summary.json, every completion with its grade and extracted answer to
OUT/samples.jsonl, and the summary is printed. samples.jsonl grows as each batch is graded, and the
summary is written last: an evaluation that stops early (a crash, Ctrl-C, a full disk) keeps every
completion graded until then, and a folder without summary.json holds an unfinished one. OUT defaults
to runs/eval/<model>[+<adapter>]-<quant>-<data>[-<split>] (default_out), each input that is a path named
with a short hash of where it lies, so two files of the same name never share a folder. --prompt
paper, official and bare ask as the official code does (tasks.py's prompt styles): evaluate a policy
with the prompt style it was trained with.

Everything the CLI is told is checked before the model loads: the numbers, the data (a file with no
problems, an arith --limit beyond what its split holds), and the lengths against the model's positions
(max_position_embeddings in config.json): the longest prompt plus --max-new-tokens must fit, and when the
budget is not given its default is cut to what fits.

Departures from the official QeRL evaluation, each on purpose:
- The LoRA adapter is applied. The official GSM8K eval script builds the vLLM engine from the base
  checkpoint and never passes the trained adapter, so it reports the base model's accuracy;
  tests/test_eval.py checks that an adapter with nonzero B changes our completions.
- Answers are judged by tasks.grade (exact rational comparison for `#### N`, math-verify equivalence
  for `\\boxed{}`), not by comparing the first character of each answer as the official GSM8K script
  does.
- Defaults follow the paper's evaluation (temperature 0.6, top-p 0.95); the tiny policy is meant to
  be read at temperature 1 (train.py's held-out metric), which --temperature 1 --top-p 1 gives.

`evaluate(model, tokenizer, items, kind, ...)` is the library entry point (train.py's held-out eval);
`main(argv)` is the CLI and returns the summary.
"""

import argparse
import hashlib
import json
import math
import os
import time
import unicodedata
from collections import defaultdict

import torch

import tasks
from data import DATASETS, dataset_path, load_dataset

# Completion budgets. The CLI knows the data set, so it gives each its own (when --max-new-tokens is not
# passed): the arith task's solutions fit in 49 tokens of the tiny policy, GSM8K's reasoning in a few
# hundred, and any other set is taken as MATH-style long reasoning and gets 2048 tokens (the official
# GSM8K scripts' completion length; their BigMath runs allow 4096). evaluate() is told no data set, so a
# caller that names no budget gets one fixed middle value; train.py and tiny.py always pass their own.
DEFAULT_MAX_NEW_TOKENS = {"arith": 64, "countdown": 80, "countdown-hard": 80, "gsm8k": 512}  # by --data
OTHER_MAX_NEW_TOKENS = 2048  # eval.py --data of any other name, or a file
EVALUATE_MAX_NEW_TOKENS = 1024  # evaluate()'s default (and what None means there)
# Completions a rollout.generate call samples when batch_size is not given: the tiny model's KV cache is
# small on the CPU; on a GPU a 7B cache grows with every row.
DEFAULT_BATCH = {"cpu": 256, "cuda": 64}


def default_batch(device):
    """DEFAULT_BATCH for a model on `device` (a GPU's value for any accelerator)."""
    return DEFAULT_BATCH.get(torch.device(device).type, DEFAULT_BATCH["cuda"])


def pass_at_k(n, c, k):
    """Unbiased pass@k of one problem with c right out of n samples (Chen et al. 2021)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def ks_for(samples):
    """1, 2, 4, ... up to `samples`, and `samples` itself."""
    ks = [2**i for i in range(int(math.log2(samples)) + 1)]
    return ks if ks[-1] == samples else ks + [samples]


def _breakdown(records, field):
    """avg@K per value of an item field (MATH500's level / subject), from the per-sample records."""
    hits = defaultdict(list)
    for r in records:
        if r.get(field) is not None:
            hits[r[field]].append(r["correct"])
    return {str(k): {"n": len(v), "accuracy": sum(v) / len(v)}
            for k, v in sorted(hits.items(), key=lambda kv: str(kv[0]))}


@torch.no_grad()
def evaluate(model, tokenizer, items, kind=None, *, samples=1, temperature=0.6, top_p=0.95,
             max_new_tokens=EVALUATE_MAX_NEW_TOKENS, batch_size=None, seed=0, progress=False, prompt="ours",
             on_batch=None):
    """Sample `samples` completions of each item and grade them.

    items: data.load_dataset records ({question, answer[, kind, level, subject, id]}); an item's own
    `kind` wins over the `kind` argument (the default for items without one). batch_size: completions
    per rollout.generate call (prompts per call = batch_size // samples, at least 1; default 256 for a
    model on the CPU, 64 on a GPU, where the KV cache grows with it). seed: the
    sampling seed; batch b uses seed + b, so the result does not depend on the global RNG.

    max_new_tokens: the most tokens a completion may take (None: EVALUATE_MAX_NEW_TOKENS, 1024, a
    budget for any set since this function is not told which one it grades; the CLI picks one per data
    set instead, DEFAULT_MAX_NEW_TOKENS). A completion cut off there is graded as it stands and counted
    in `truncated`.

    prompt: a tasks.PROMPT_STYLES name (ours, paper, official, bare), as tasks.get_task.

    on_batch(records): called with each batch's graded records as soon as they are graded (eval.py
    appends them to samples.jsonl, so that a late failure loses nothing).

    Returns {"accuracy", "pass@1", "avg@K", "pass@k": {k: ...}, "accuracy_strict", "pass@k_strict",
    "answer_format", "n", "samples", "mean_length", "truncated", "by_level", "by_subject", "seconds",
    "records"}: accuracy and pass@k with the lenient grader, *_strict with the strict one (tasks.grade),
    answer_format the fraction of completions giving their answer in an explicit spot; records holds one
    dict a completion (item index, sample index, completion text, extracted answer, correct,
    correct_strict, length, finish)."""
    import rollout
    from hub import stop_token_ids

    if not items:
        raise ValueError("evaluate needs at least one item")
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    max_new_tokens = EVALUATE_MAX_NEW_TOKENS if max_new_tokens is None else max_new_tokens
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    kinds = [it.get("kind") or kind for it in items]
    if any(k is None for k in kinds):
        raise ValueError("items without a 'kind' need the kind argument ('gsm8k' or 'math')")
    prompts = [tasks.get_task(k, prompt).prompt_ids(tokenizer, it["question"]) for it, k in zip(items, kinds)]
    longest = max(len(p) for p in prompts)
    problem = too_long(longest, max_new_tokens, positions_of(getattr(model, "config", None)))
    if problem:
        raise ValueError(f"evaluate: {problem}")
    stops = stop_token_ids(tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    batch_size = batch_size or default_batch(model.device)
    per_call = max(1, batch_size // samples)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(items), desc="eval", unit="problem", dynamic_ncols=True)
    t0 = time.time()
    records = []
    for b, start in enumerate(range(0, len(items), per_call)):
        batch = []
        chunk = prompts[start:start + per_call]
        ro = rollout.generate(model, chunk, n=samples, max_new_tokens=max_new_tokens, temperature=temperature,
                              top_p=top_p, stop_ids=stops, seed=seed + b, pad_id=pad_id,
                              prompt_len=longest)  # (every chunk's cache as wide: the engine keeps one state)
        texts = ro.texts(tokenizer, skip_special_tokens=True)
        for row, text in enumerate(texts):
            i = start + int(ro.prompt_index[row])
            it, k = items[i], kinds[i]
            batch.append({"index": i, "sample": row % samples, "id": it.get("id", i), "kind": k,
                          "level": it.get("level"), "subject": it.get("subject"),
                          "question": it["question"], "gold": it["answer"], "completion": text,
                          "extracted": tasks.extract_answer(k, text),
                          "correct": bool(tasks.grade(k, text, it["answer"])),
                          "correct_strict": bool(tasks.grade(k, text, it["answer"], strict=True)),
                          "answer_format": bool(tasks.has_final_answer(k, text)),
                          "length": int(ro.lengths[row]), "finish": ro.finish[row]})
        records += batch
        if on_batch is not None:
            on_batch(batch)
        if bar is not None:
            right = sum(r["correct"] for r in records)
            bar.set_postfix(acc=f"{right / len(records):.3f}")
            bar.update(len(chunk))
    if bar is not None:
        bar.close()

    def scores(field):  # (avg@K, {k: pass@k}) of one grader's verdicts
        right = defaultdict(int)
        for r in records:
            right[r["index"]] += r[field]
        avg = sum(right[i] for i in range(len(items))) / (len(items) * samples)
        return avg, {k: sum(pass_at_k(samples, right[i], k) for i in range(len(items))) / len(items)
                     for k in ks_for(samples)}

    avg, pass_k = scores("correct")
    avg_strict, pass_k_strict = scores("correct_strict")
    return {"accuracy": avg, "pass@1": avg, f"avg@{samples}": avg, "pass@k": pass_k,
            "accuracy_strict": avg_strict, "pass@k_strict": pass_k_strict, "prompt": prompt,
            "answer_format": sum(r["answer_format"] for r in records) / len(records), "n": len(items),
            "samples": samples, "temperature": temperature, "top_p": top_p, "max_new_tokens": max_new_tokens,
            "mean_length": sum(r["length"] for r in records) / len(records),
            "truncated": sum(r["finish"] == "length" for r in records) / len(records),
            "by_level": _breakdown(records, "level"), "by_subject": _breakdown(records, "subject"),
            "seconds": time.time() - t0, "records": records}


def positions_of(config):
    """The most positions (prompt + completion tokens) a model takes: max_position_embeddings of its
    config.json (model.Config keeps it in .raw; a transformers config has it as an attribute), or None
    when the config does not say."""
    raw = getattr(config, "raw", None)
    n = raw.get("max_position_embeddings") if isinstance(raw, dict) else getattr(config, "max_position_embeddings", None)
    return n if isinstance(n, int) and n > 0 else None


def too_long(longest_prompt, max_new_tokens, positions):
    """What is wrong when a prompt of `longest_prompt` tokens plus `max_new_tokens` exceeds the model's
    `positions` (a string saying what fits), or None: refused before a KV cache of that length is made."""
    if positions is None or longest_prompt + max_new_tokens <= positions:
        return None
    room = positions - longest_prompt
    if room < 1:
        return (f"the longest prompt has {longest_prompt} tokens and the model takes {positions} positions "
                f"(max_position_embeddings in its config.json): no room for a completion; evaluate shorter problems")
    return (f"max_new_tokens {max_new_tokens}: the longest prompt has {longest_prompt} tokens and the model takes "
            f"{positions} positions (max_position_embeddings in its config.json), so at most {room} new tokens fit")


def heldout(model, tokenizer, items, *, seed, samples=1, temperature=0.6, top_p=0.95, max_new_tokens=None,
            prompt="ours", world=None, batch_size=None):
    """A training run's held-out accuracy, graded leniently and strictly: evaluate over `items` in batches
    of batch_size completions (None: evaluate's default), batch b sampled with seed + b. Under several ranks
    (a ddp.World) each runs some of the batches with those same seeds, so the counts are the single-process
    ones (ddp.map_batches). → (accuracy, strict accuracy)."""
    model.eval()
    kw = dict(samples=samples, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, prompt=prompt)
    if world is None or world.size == 1:
        res = evaluate(model, tokenizer, items, seed=seed, batch_size=batch_size, **kw)
        return res["accuracy"], res["accuracy_strict"]
    import ddp

    per_batch = max(1, (batch_size or default_batch(model.device)) // samples)  # (evaluate's batches: the same seeds)

    def right(b, start, end):
        recs = evaluate(model, tokenizer, items[start:end], seed=seed + b, batch_size=per_batch * samples, **kw)["records"]
        return sum(r["correct"] for r in recs), sum(r["correct_strict"] for r in recs)

    counts = ddp.map_batches(len(items), per_batch, right, world)
    n = len(items) * samples
    return sum(c[0] for c in counts) / n, sum(c[1] for c in counts) / n


def parse_args(argv=None):
    import hub

    p = argparse.ArgumentParser(description="pass@1 / avg@K / pass@K of a policy on a math benchmark.")
    p.add_argument("--model", default="tiny", help="HF folder, alias (tiny, qwen2.5-7b, ...) or hub id")
    p.add_argument("--adapter", default=None, help="PEFT LoRA folder (adapter_config.json + adapter_model.safetensors)")
    p.add_argument("--quant", default="nvfp4", choices=["nvfp4", "bf16"],
                   help="base weights: NVFP4 decoder linears (as QeRL trains on) or unquantized (bf16 on GPU, fp32 on CPU)")
    p.add_argument("--data", default="arith", help="gsm8k, math500, aime24, amc23, arith, or a .jsonl path")
    p.add_argument("--split", default="test", help="split of a named dataset")
    p.add_argument("--data-dir", default=None, help="dataset cache folder (default $QERL_DATA or ~/.cache/qerl/data)")
    p.add_argument("--limit", type=int, default=None, help="evaluate only the first N problems (arith: at most "
                   f"{arith_max('test')} of its test split, {arith_max('train')} of train)")
    p.add_argument("--samples", type=int, default=1, help="K, completions per problem")
    p.add_argument("--temperature", type=float, default=0.6, help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass")
    p.add_argument("--prompt", default="ours", choices=list(tasks.PROMPT_STYLES), help="how problems are asked "
                   "(tasks.PROMPTS): ours, our instruction; paper, as the code of the paper's time (think tags, then "
                   "####); official, the think/answer system prompt; bare, the question alone. Evaluate a policy "
                   "with the style it was trained with (train.py --prompt)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="completion budget (default: 64 for arith, 512 for gsm8k, 2048 for any other set, "
                   "MATH-style long reasoning; a default is cut to what the model's positions leave after the "
                   "longest prompt, a value given must fit)")
    p.add_argument("--batch-size", type=int, default=None, help="completions per generate call (default: 256 CPU, 64 GPU)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--out", default=None, help="output folder (default runs/eval/<model>[+<adapter>]-<quant>-<data>"
                   "[-<split>], the split left out for a file, a path with a short hash of where it lies); an earlier "
                   "eval.py output there is replaced")
    p.add_argument("--force", action="store_true", help=hub.FORCE_HELP)
    return p.parse_args(argv)


def arith_max(split):
    """The most problems --data arith gives from `split` (arith.MAX_SIZE), or None for a split it lacks."""
    import arith

    return arith.MAX_SIZE.get(split)


def check_args(args):
    """Every bad value stops here, with what to do, before the model loads."""
    problems = []
    for flag, value in (("--limit", args.limit), ("--samples", args.samples), ("--max-new-tokens", args.max_new_tokens),
                        ("--batch-size", args.batch_size)):
        if value is not None and value < 1:
            problems.append(f"{flag} {value}: must be >= 1")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        problems.append(f"--temperature {args.temperature}: must be a number >= 0 (0 = greedy)")
    if not 0 < args.top_p <= 1:  # (False for nan too)
        problems.append(f"--top-p {args.top_p}: must be in (0, 1]")
    if args.data == "arith":
        most = arith_max(args.split)
        if most is None:
            problems.append(f"--split {args.split}: arith has the splits train and test")
        elif args.limit is not None and args.limit > most:
            problems.append(f"--limit {args.limit}: arith's {args.split} split gives at most {most} distinct problems "
                            f"(arith.MAX_SIZE); pass --limit {most} or less")
    if len(problems) == 1:
        raise SystemExit(f"eval.py: {problems[0]}")
    if problems:
        raise SystemExit("eval.py: " + "\n  ".join(["cannot start:"] + problems))


def data_file(args):
    """The file --data reads (a named set's cached copy, or the file named), which --out may not hold;
    None for arith, which is generated."""
    if args.data in DATASETS:
        return None if DATASETS[args.data][1] is None else str(dataset_path(args.data, args.split, args.data_dir))
    return os.path.expanduser(str(args.data))


def default_out(args):
    """runs/eval/<model>[+<adapter>]-<quant>-<data>[-<split>]: every setting that picks what is evaluated
    is in the name, so two evaluations that differ in any of them never overwrite each other's results.
    An input that is a path (a model folder, the adapter, a data file) is named by its folder or file name
    and the first 8 hex digits of the SHA-256 of its resolved path: a/test.jsonl and b/test.jsonl get two
    folders. The adapter appears as its folder and its parent's name (runs/x/adapter -> +x_adapter-<hash>);
    the split only for a named data set (a file is read whole, whatever --split says). Names keep their
    letters in any script; only path separators and control characters become '_'. Sampling settings
    (--samples, --temperature, --prompt, ...) are not in the name but in summary.json: pass --out to keep
    such runs apart. E.g. runs/eval/tiny-nvfp4-gsm8k-test, runs/eval/qwen2.5-7b+x_adapter-1f0c2a9e-bf16-math500-test."""
    import hub

    model = str(args.model)
    if model.lower() in hub.ALIASES or not os.path.exists(model):  # an alias, or a hub id org/name
        name = _readable(model.replace("/", "_"))
    else:
        name = _path_name(model)
    if args.adapter:
        adapter = os.path.abspath(os.path.expanduser(str(args.adapter)))
        parent = os.path.basename(os.path.dirname(adapter))
        name += "+" + _path_name(adapter, f"{parent}_{os.path.basename(adapter)}" if parent else None)
    if args.data in DATASETS:
        data = f"{args.data}-{_readable(args.split)}"
    else:
        data = _path_name(os.path.expanduser(str(args.data)), suffix=".jsonl")
    return os.path.join("runs", "eval", f"{name}-{args.quant}-{data}")


def _readable(s, limit=40):
    """`s` as part of a folder name: letters of any script, digits, spaces and punctuation kept; path
    separators, control characters and unpaired surrogates (undecodable bytes of a file name) made '_';
    leading dots dropped (no hidden folder); cut to `limit` bytes of UTF-8 (a folder name takes 255)."""
    s = "".join("_" if c in "/\\" or unicodedata.category(c) in ("Cc", "Cs") else c for c in s).lstrip(".") or "_"
    return s.encode("utf-8")[:limit].decode("utf-8", "ignore")


def _path_name(path, readable=None, suffix=""):
    """<name>-<hash>: the readable file or folder name of `path` (or `readable`), and the first 8 hex
    digits of the SHA-256 of its resolved path, which tell two inputs of the same name apart."""
    name = readable or os.path.basename(os.path.normpath(path))
    digest = hashlib.sha256(os.fsencode(os.path.realpath(path))).hexdigest()[:8]
    return f"{_readable(name.removesuffix(suffix) if suffix else name)}-{digest}"


class SampleWriter:
    """OUT/samples.jsonl, a JSON line a graded completion, appended as each batch is graded (evaluate's
    on_batch). A write that fails (a full disk, a quota) is cut back to the last whole line and stops with
    one line naming the file and how many completions it keeps (hub.writing)."""

    def __init__(self, path):
        import hub

        self.path, self.kept, self.size = path, 0, 0
        with hub.writing(path, "nothing was evaluated yet"):
            self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)

    def __call__(self, records):
        import hub

        data = "".join(json.dumps(r) + "\n" for r in records).encode("utf-8")
        with hub.writing(self.path, f"it keeps the {self.kept} completions graded before, whole lines"):
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(self.fd, view):]
            except OSError:
                os.ftruncate(self.fd, self.size)  # (no half line for a reader; freeing space cannot fail for lack of it)
                raise
        self.size += len(data)
        self.kept += len(records)

    def close(self):
        os.close(self.fd)


def main(argv=None):
    args = parse_args(argv)
    check_args(args)
    import hub
    import adapters
    from model import read_config

    device = hub.resolve_device(args.device, "eval.py")  # (stops with a message when cuda is asked for and absent)
    data_name = os.path.basename(str(args.data)).removesuffix(".jsonl")
    max_new = args.max_new_tokens or DEFAULT_MAX_NEW_TOKENS.get(data_name, OTHER_MAX_NEW_TOKENS)
    out = args.out or default_out(args)
    # The model, the adapter, the data, the lengths and the output folder first, before any loading: an
    # unwritable --out found after the evaluation would lose its results.
    with hub.stop_on_bad_input("eval.py"):
        model_dir, _, config = read_config(args.model)
        if args.adapter:
            adapters.adapter_fits(config, adapters.read_adapter(args.adapter)[1], args.adapter)
        items = load_dataset(args.data, split=args.split, limit=args.limit, data_dir=args.data_dir)
        if not items:
            raise ValueError(f"--data {args.data} holds no problems; pass a jsonl file with one problem a line "
                             f"({{\"question\": ..., \"answer\": ...}}) or a named set")
        max_new, cut = fit_budget(items, hub.load_tokenizer(model_dir), args, max_new, positions_of(config))
        hub.claim_folder(out, "eval.py", sources=[model_dir, args.adapter, data_file(args)], force=args.force,
                         files=["samples.jsonl", "summary.json"])
        model, tokenizer = adapters.load_policy(model_dir, args.adapter, args.quant, device)
    fewer = f" (all the data holds; --limit {args.limit})" if args.limit and len(items) < args.limit else ""
    print(f"eval: {args.model}{' + ' + args.adapter if args.adapter else ''} ({args.quant}) on {device}, "
          f"{args.data}/{args.split}: {len(items)} problems{fewer} x {args.samples} samples, T={args.temperature} "
          f"top-p={args.top_p}, max {max_new} new tokens{cut}, prompt {args.prompt}")
    samples = os.path.join(out, "samples.jsonl")
    try:
        writer = SampleWriter(samples)
        try:
            res = evaluate(model, tokenizer, items, samples=args.samples, temperature=args.temperature,
                           top_p=args.top_p, max_new_tokens=max_new, batch_size=args.batch_size, seed=args.seed,
                           progress=True, prompt=args.prompt, on_batch=writer)
        finally:
            writer.close()
        res.pop("records")
        summary = {"model": args.model, "adapter": args.adapter, "quant": args.quant, "data": args.data,
                   "split": args.split, "device": str(device), "seed": args.seed, **res}
        path = os.path.join(out, "summary.json")
        with hub.writing(path, f"every completion and its grade are in {samples}"):
            hub.write_json(path, summary)
    except hub.OutputError as e:
        raise SystemExit(f"eval.py: {e}") from None
    K = args.samples
    print(f"avg@{K} (pass@1) = {res['accuracy']:.4f}   " +
          "   ".join(f"pass@{k} = {v:.4f}" for k, v in res["pass@k"].items() if k > 1) +
          f"   mean length {res['mean_length']:.1f}, truncated {res['truncated']:.1%}, {res['seconds']:.1f}s")
    print(f"strict (answer only in its prompted spot): avg@{K} = {res['accuracy_strict']:.4f}   "
          f"answer in the prompted format: {res['answer_format']:.1%}")
    for field in ("by_level", "by_subject"):
        if res[field]:
            print(f"{field.removeprefix('by_')}: " +
                  ", ".join(f"{k} {v['accuracy']:.3f} (n={v['n']})" for k, v in res[field].items()))
    print(f"wrote {out}/summary.json and samples.jsonl")
    return summary


def fit_budget(items, tokenizer, args, max_new, positions):
    """(completion budget, a note for the header): --max-new-tokens when the longest prompt plus it fits the
    model's positions, a ValueError saying what fits otherwise; a default budget cut to what fits."""
    if positions is None:
        return max_new, ""
    longest = max(len(tasks.get_task(it["kind"], args.prompt).prompt_ids(tokenizer, it["question"])) for it in items)
    room = positions - longest
    where = f"{args.model} takes {positions} positions (max_position_embeddings in its config.json)"
    if room < 1:
        raise ValueError(f"--data {args.data}: its longest prompt has {longest} tokens and {where}: no room for a "
                         f"completion; evaluate shorter problems")
    if max_new <= room:
        return max_new, ""
    if args.max_new_tokens is None:
        return room, f" (the default {max_new} cut to fit the model's {positions} positions)"
    raise ValueError(f"--max-new-tokens {max_new}: the longest prompt of --data {args.data} has {longest} tokens and "
                     f"{where}; pass --max-new-tokens {room} or less")


if __name__ == "__main__":
    main()
