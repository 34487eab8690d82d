"""model_card.py: the model card of a policy that tiny.py trains: the README.md of its checkpoint folder.

A card says what the policy solves and how the folder loads, the command that made it (which rebuilds it),
the architecture as the saved config.json has it, the training (its prompt, its schedule, and how it left
the policy partly competent, on purpose), and two tables: the held-out accuracy measured on the saved
checkpoint, unquantized and NVFP4, and the probes taken during training. Every number comes from the
folder's own files (training.json, which tiny.py writes beside it, and config.json).

The measured block is the TABLE_HEADING line and the table under it (`table_block`). `tiny.py
--report-only` re-measures a checkpoint and swaps in that block alone (`replace_table`): every other line
of an existing card, hand edits included, stays as it was.
"""

TABLE_HEADING = "## Held-out accuracy"


def table_block(text):
    """(start, end) of the measured part of a README: its TABLE_HEADING line and the table under it."""
    lines = text.split("\n")
    start = next((i for i, line in enumerate(lines) if line.startswith(TABLE_HEADING)), None)
    if start is None:
        return None
    end = start + 1
    while end < len(lines) and (lines[end].startswith("|") or (end == start + 1 and not lines[end])):
        end += 1
    return start, end


def replace_table(old, new):
    """`old` with its measured block (table_block) taken from `new`; `new` whole when old has none."""
    a, b = table_block(old), table_block(new)
    if a is None or b is None:
        return new
    old_lines, new_lines = old.split("\n"), new.split("\n")
    return "\n".join(old_lines[:a[0]] + new_lines[b[0]:b[1]] + old_lines[a[1]:])


def readme(syn, args, meta, config, n_held, k):
    """The card's text. syn: the task (tiny.SYNTHETIC's entry: its title and what it solves); args: how the
    checkpoint was trained (its probes have args.probe_samples samples a problem); meta: its training.json;
    config: its saved config; n_held, k: the held-out problems and the samples a problem of the final
    measurement (--report-only may use another number than training did)."""
    f, q = meta["final"]["bf16"], meta["final"]["nvfp4"]
    full = "float32" if meta.get("final_device", args.device) == "cpu" else "bf16"
    kh = args.probe_samples
    rows = "\n".join(f"| {h['step']} | {h['greedy']:.3f} | {h['pass@1_t1']:.3f} | {h[f'pass@{kh}_t1']:.3f} | "
                     f"{h.get('valid_t1', float('nan')):.3f} |" for h in meta["history"])
    where = meta["device"] + (f" ({meta['gpu']})" if meta.get("gpu") else "")
    if args.stop_at is not None:
        probes = f"probes every {args.eval_every} steps on the first {args.probe_size} held-out problems, {kh} samples each"
        competence = (f"It stopped at step {meta['stopped_at']}, the first probe whose pass@1 at temperature 1 reached "
                      f"{args.stop_at:g} ({probes}): competent, far from solved, with most problems left for RL to "
                      f"find." if meta.get("stopped_at") else
                      f"No probe reached pass@1 {args.stop_at:g} ({probes}): it trained all {args.steps} steps.")
        if not args.label_smoothing:
            competence += " No label smoothing: the policy's entropy is its own uncertainty about what to write."
    else:
        competence = (f"Label smoothing leaves probability on wrong tokens, so at temperature 1 the policy often "
                      f"samples a slip somewhere in its solution while its most likely continuation is usually right: "
                      f"greedy accuracy is high, temperature-1 accuracy is low, pass@{k} well above pass@1. That gap "
                      f"is the room that RL (train.py) has to close in a few dozen steps. Most of what RL gains on this "
                      f"policy is therefore sharpening (less sampling noise), not new arithmetic.")
    shards = f", in shards of at most {args.shard_mib:g} MiB" if args.shard_mib else ""
    return f"""# {syn.title}

A {meta['params'] / 1e6:.2f} M-parameter Qwen2-architecture model trained from scratch by `tiny.py` on
{syn.about}, and an ordinary Hugging Face checkpoint: `transformers.AutoModelForCausalLM` /
`AutoTokenizer` load this folder.

Made with this command, on {where} ({meta['threads']} CPU thread{'s' if meta['threads'] != 1 else ''}, torch {meta['torch']}),
in {meta['train_seconds']:.0f} s of training (the same seed, device and thread count give the same weights):

    {meta['command']}

## Model
- Qwen2: hidden {config.hidden_size}, {config.num_hidden_layers} layers, {config.num_attention_heads} query heads and
  {config.num_key_value_heads} key/value heads of dim {config.hidden_size // config.num_attention_heads} (GQA), q/k/v biases,
  SwiGLU MLP {config.intermediate_size}, RoPE theta {(getattr(config, "rope_parameters", None) or {"rope_theta": config.rope_theta})["rope_theta"]:g}, untied lm_head, {args.dtype} weights{shards}.
  Every decoder linear's in and out features are multiples of 16, so all of them quantize to NVFP4.
- Tokenizer: byte-level BPE of {config.vocab_size} tokens trained on the task's text in Qwen2's tokenizer
  pipeline (one digit a token); ChatML template without a system prompt; eos `<|im_end|>`, pad
  `<|endoftext|>`.

## Training
Supervised: {meta.get('steps_trained', args.steps)} AdamW steps of {args.batch_size} (prompt, solution) pairs (cosine over {args.steps}),
lr {args.lr:g} with {args.warmup} warmup steps and cosine decay to 10%, loss on the solution tokens and
`<|im_end|>` only, label smoothing {args.label_smoothing:g}. The prompt is the one eval.py and train.py use
for this task (tasks.py's instruction in the chat template):

    {meta['prompt_example']!r}

{competence}

{TABLE_HEADING} ({args.task} test split, first {n_held} problems; {k} samples each at temperature 1, top-p 1)
| weights | greedy | pass@1 (T=1) | pass@{k} (T=1) | well-formed (T=1) |
| --- | --- | --- | --- | --- |
| unquantized ({full}) | {f['greedy']:.3f} | {f['pass@1_t1']:.3f} | {f[f'pass@{k}_t1']:.3f} | {f.get('valid_t1', float('nan')):.3f} |
| NVFP4 decoder linears | {q['greedy']:.3f} | {q['pass@1_t1']:.3f} | {q[f'pass@{k}_t1']:.3f} | {q.get('valid_t1', float('nan')):.3f} |

During training (first {args.probe_size} held-out problems, {kh} samples each):

| step | greedy | pass@1 (T=1) | pass@{kh} (T=1) | well-formed (T=1) |
| --- | --- | --- | --- | --- |
{rows}

The final table is measured on the saved checkpoint through the project's own stack: model.py,
fp4_gemm's NVFP4 linears, rollout.generate, graded by the task's judge (pass@K unbiased from K samples,
eval.pass_at_k); well-formed: the answer is where the prompt asks for it and can be read (countdown:
an expression of the problem's four numbers, right or not). The training-time rows come from
rollout.generate on the weights being trained, with the same judge.
"""
