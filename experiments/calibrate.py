"""experiments/calibrate.py: how far do quantization, AQN and temperature move this policy? Measured first.

    python experiments/calibrate.py --model assets/countdown --out results/aqn_replication      # calibration.csv, .json
    python experiments/calibrate.py entropy --model M --adapter RUN/adapter --quant nvfp4 --out RUN/tf_entropy.json

Why calibrate. The earlier AQN experiment (results/aqn_experiment) ran the official sigmas on a policy
whose RMSNorm weights are ~1, where sigma 1e-2 moved the sampler by a KL of 3e-5 nats a token: the noise
never acted. A fair test sets the noise by what it does to the policy, not by its nominal size. So,
on N fixed held-out prompts (512), each completed once by the bf16 policy at temperature 1:

    KL_t(p || q) = sum_v p_t(v) (log p_t(v) - log q_t(v)),    H_t(q) = -sum_v q_t(v) log q_t(v)

at every completion position t (the next-token distributions, teacher-forced on the same tokens),
averaged over all completion tokens ("per token"), for
    nvfp4             q = the NVFP4 base, p = the bf16 base: the quantization's own noise
    aqn-nvfp4 sigma   q = NVFP4 with AQN noise on its norms, p = NVFP4 without: what AQN adds in arms 3-4
    aqn-bf16 sigma    the same on the bf16 base (the figure comparable across models)
    temperature tau   q = softmax(bf16 logits / tau), p = at tau 1
AQN's KL is a mean over DRAWS noise draws (each a fresh Z ~ N(0, sigma^2) on every decoder norm,
aqn.noise). From these:
    sigma*  where KL_aqn-nvfp4(sigma) = KL_nvfp4: interpolated on log KL against log sigma between the
            two measured sigmas around the crossing (beyond the grid: extrapolated with KL ~ sigma^2,
            flagged), then measured there.
    tau*    where H(bf16 at tau) = H(NVFP4 at 1): by bisection on the cached logits (H grows with tau).
    tau_hot the positive control's temperature: max(TAU_HOT_MIN, 1 + 2 (tau* - 1)).
and the relative weight error of NVFP4, ||W - deq(q(W))||_F / ||W||_F over the decoder linears (by
projection and all together; beside it the same on a random matrix of a 7B projection's shape, where
the earlier 7B-shape figures were measured), and the norms' weights (AQN's noise is additive: its size
is relative to |w|).

Teacher-forced entropy of a trained run (`entropy`): the mean token entropy of a policy (base + adapter,
its quantization, no noise, temperature 1) on the reference solutions of the first N held-out problems:
how sharp the policy has become, on text that is the same for every arm.
"""
import argparse
import csv
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

SIGMAS = (1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 1e-1)
TAUS = (0.8, 0.9, 1.0, 1.1, 1.2, 1.3, 1.5)
DRAWS = 4  # AQN noise draws averaged per sigma
TAU_HOT_MIN = 1.25
SEVEN_B_SHAPE = (3584, 3584)  # Qwen2.5-7B's q_proj: the reference for the relative weight error


# ---------------------------------------------------------------------------------------------
# Teacher-forced token statistics
# ---------------------------------------------------------------------------------------------

def pack(prompts, completions, pad_id):
    """Right-padded tokens (B, T) of prompt + completion, and the mask (B, T) of the positions whose
    next token is a completion token (the distributions that chose the completion)."""
    seqs = [p + c for p, c in zip(prompts, completions)]
    T = max(map(len, seqs))
    tokens = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.bool)
    for b, (p, c) in enumerate(zip(prompts, completions)):
        tokens[b, :len(p) + len(c)] = torch.tensor(p + c)
        mask[b, len(p) - 1:len(p) + len(c) - 1] = True
    return tokens, mask


@torch.no_grad()
def logits_at(model, tokens, mask, batch=64):
    """The model's float32 logits at the masked positions, (N, V), in batches of sequences."""
    out = []
    for i in range(0, len(tokens), batch):
        t, m = tokens[i:i + batch].to(model.device), mask[i:i + batch].to(model.device)
        out.append(model(t).float()[m].cpu())  # (n, V)
    return torch.cat(out)


def kl_entropy(p_logits, q_logits, tau_p=1.0, tau_q=1.0):
    """(mean KL(p || q), mean H(q)) over positions, from logits (N, V) at temperatures tau."""
    lp = torch.log_softmax(p_logits / tau_p, -1)
    lq = torch.log_softmax(q_logits / tau_q, -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)  # (N,)
    h = -(lq.exp() * lq).sum(-1)  # (N,)
    return float(kl.mean()), float(h.mean())


def entropy(logits, tau=1.0):
    lq = torch.log_softmax(logits / tau, -1)
    return float(-(lq.exp() * lq).sum(-1).mean())


# ---------------------------------------------------------------------------------------------
# The calibration
# ---------------------------------------------------------------------------------------------

def sample_completions(model, tokenizer, prompts, max_new_tokens, seed):
    """One completion of each prompt by `model` at temperature 1 (rollout.generate), stop token kept."""
    import rollout
    from hub import stop_token_ids

    stops = stop_token_ids(tokenizer)
    r = rollout.generate(model, prompts, n=1, max_new_tokens=max_new_tokens, temperature=1.0,
                         stop_ids=stops, seed=seed, pad_id=tokenizer.pad_token_id)
    return [r.tokens[i, :int(r.lengths[i])].tolist() for i in range(len(prompts))]


def weight_error(model):
    """{projection: relative Frobenius error of NVFP4}, and "all": over every decoder linear together."""
    import nvfp4

    num, den = {}, {}
    for name, m in model.named_modules():
        kind = name.split(".")[-1]
        if isinstance(m, torch.nn.Linear) and kind in nvfp4.LINEAR_NAMES and ".layers." in f".{name}":
            w = m.weight.detach().float()
            err = w - nvfp4.dequantize(nvfp4.quantize(w, name=name), torch.float32).to(w.device)
            for k in (kind, "all"):
                num[k] = num.get(k, 0.0) + float(err.pow(2).sum())
                den[k] = den.get(k, 0.0) + float(w.pow(2).sum())
    return {k: math.sqrt(num[k] / den[k]) for k in num}


def random_weight_error(shape=SEVEN_B_SHAPE, seed=0):
    """NVFP4's relative Frobenius error on a random N(0, 0.02^2) matrix of a 7B projection's shape: the
    figure the earlier 7B-shape measurements correspond to."""
    import nvfp4

    w = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.02
    return float((w - nvfp4.dequantize(nvfp4.quantize(w), torch.float32)).norm() / w.norm())


def norm_weights(model):
    """Mean and smallest |w| of the decoder RMSNorm weights AQN perturbs."""
    import aqn

    w = torch.cat([t.detach().float().abs().flatten().cpu() for t in aqn.find_norms(model).values()])
    return {"mean_abs": float(w.mean()), "min_abs": float(w.min())}


def aqn_logits(model, tokens, mask, sigma, draws, seed):
    """The logits under `draws` independent AQN noise draws, [(N, V)] (the norms restored after each)."""
    import aqn

    out = []
    for d in range(draws):
        gen = torch.Generator(model.device.type).manual_seed(seed + d)
        with aqn.noise(model, sigma, gen):
            out.append(logits_at(model, tokens, mask))
    return out


def cross(xs, ys, level):
    """x where y(x) = level, interpolating log y against log x between the grid points around the crossing
    (ys increasing in xs); beyond the grid, extrapolated from the nearest point with y ~ x^2.
    Returns (x, inside the grid)."""
    pts = [(math.log(x), math.log(max(y, 1e-30))) for x, y in zip(xs, ys)]
    t = math.log(level)
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if y0 <= t <= y1 and y1 > y0:
            return math.exp(x0 + (t - y0) * (x1 - x0) / (y1 - y0)), True
    x0, y0 = pts[0] if t < pts[0][1] else pts[-1]
    return math.exp(x0 + (t - y0) / 2), False


def solve_tau(logits, target, lo=0.3, hi=3.0, iters=50):
    """tau with entropy(logits / tau) = target, by bisection (entropy grows with tau); clamped to [lo, hi]."""
    if entropy(logits, lo) >= target:
        return lo
    if entropy(logits, hi) <= target:
        return hi
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if entropy(logits, mid) < target else (lo, mid)
    return (lo + hi) / 2


def problems(name, n):
    """The first n held-out problems of a generated set (data.GENERATED: arith, countdown, countdown-hard) and
    how each is asked: the tiny.SYNTHETIC task of the module that makes it (countdown-hard is Countdown's)."""
    import data
    import tiny

    return tiny.SYNTHETIC[data.GENERATED[name][0]], data.generated_rows(name, "test", n)


def calibrate(model_dir, data, n, max_new_tokens, device, sigmas=SIGMAS, taus=TAUS, draws=DRAWS, seed=0):
    """The measurements of the module docstring → (rows for calibration.csv, summary dict)."""
    import adapters

    syn, items = problems(data, n)
    ref, tok = adapters.load_policy(model_dir, None, "bf16", device)
    q4, _ = adapters.load_policy(model_dir, None, "nvfp4", device)
    prompts = [syn.task.prompt_ids(tok, it["question"]) for it in items]
    completions = sample_completions(ref, tok, prompts, max_new_tokens, seed)
    tokens, mask = pack(prompts, completions, tok.pad_token_id)
    n_tokens = int(mask.sum())
    base = logits_at(ref, tokens, mask)  # (N, V)
    quant = logits_at(q4, tokens, mask)
    h_bf16 = entropy(base)
    kl_q, h_q = kl_entropy(base, quant)
    rows = [dict(source="bf16", parameter="", kl=0.0, entropy=h_bf16, draws=1),
            dict(source="nvfp4", parameter="", kl=kl_q, entropy=h_q, draws=1)]
    curves = {}
    for name, model, clean in (("aqn-nvfp4", q4, quant), ("aqn-bf16", ref, base)):
        kls = []
        for s in sigmas:
            noisy = aqn_logits(model, tokens, mask, s, draws, seed=1000 + int(s * 1e6))
            stats = [kl_entropy(clean, x) for x in noisy]
            kl, h = (sum(v) / len(v) for v in zip(*stats))
            kls.append(kl)
            rows.append(dict(source=name, parameter=s, kl=kl, entropy=h, draws=draws))
        curves[name] = kls
    for tau in taus:
        kl, h = kl_entropy(base, base, 1.0, tau)
        rows.append(dict(source="temperature", parameter=tau, kl=kl, entropy=h, draws=1))
    sigma_star, inside = cross(sigmas, curves["aqn-nvfp4"], kl_q)
    check = [kl_entropy(quant, x) for x in aqn_logits(q4, tokens, mask, sigma_star, draws, seed=7)]
    kl_star, h_star = (sum(v) / len(v) for v in zip(*check))
    rows.append(dict(source="aqn-nvfp4 at sigma*", parameter=sigma_star, kl=kl_star, entropy=h_star, draws=draws))
    tau_star = solve_tau(base, h_q)
    tau_hot = max(TAU_HOT_MIN, 1 + 2 * (tau_star - 1))
    for r in rows:
        r["entropy_change"] = r["entropy"] - h_bf16
        r["tokens"] = n_tokens
    summary = {"model": model_dir, "data": data, "prompts": n, "completion_tokens": n_tokens, "device": str(device),
               "max_new_tokens": max_new_tokens, "entropy_bf16": h_bf16, "entropy_nvfp4": h_q, "kl_nvfp4": kl_q,
               "sigma_star": sigma_star, "sigma_star_in_grid": inside, "kl_at_sigma_star": kl_star,
               "tau_star": tau_star, "tau_hot": tau_hot, "weight_error": weight_error(ref),
               "weight_error_random_7b_shape": random_weight_error(), "norm_weights": norm_weights(ref),
               "kl_aqn_bf16_at_1e-2": _at(sigmas, curves["aqn-bf16"], 1e-2)}
    return rows, summary


def _at(xs, ys, x):
    return next((y for a, y in zip(xs, ys) if a == x), None)


def write(out, rows, summary):
    os.makedirs(out, exist_ok=True)
    fields = ["source", "parameter", "kl", "entropy", "entropy_change", "tokens", "draws"]
    tmp = os.path.join(out, "calibration.csv.tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows({k: r[k] for k in fields} for r in rows)
    os.replace(tmp, os.path.join(out, "calibration.csv"))
    import hub

    hub.write_json(os.path.join(out, "calibration.json"), summary)


def teacher_forced_entropy(model_dir, adapter, quant, data, n, device):
    """Mean token entropy (temperature 1, no noise) of base + adapter on the reference solutions of the
    first n held-out problems."""
    import adapters

    syn, items = problems(data, n)
    model, tok = adapters.load_policy(model_dir, adapter, quant, device)
    prompts = [syn.task.prompt_ids(tok, it["question"]) for it in items]
    answers = [tok(syn.target(it), add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for it in items]
    tokens, mask = pack(prompts, answers, tok.pad_token_id)
    return {"tf_entropy": entropy(logits_at(model, tokens, mask)), "tokens": int(mask.sum()), "problems": n,
            "quant": quant, "adapter": adapter}


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    sub = argv.pop(0) if argv and argv[0] == "entropy" else "calibrate"
    from data import GENERATED

    p = argparse.ArgumentParser(description="Calibrate NVFP4 / AQN / temperature on a policy, or measure a "
                                "trained run's teacher-forced entropy (`entropy`).")
    p.add_argument("--model", default="assets/countdown", help="the policy (HF folder or alias)")
    p.add_argument("--data", default="countdown", choices=sorted(GENERATED), help="the generated set (a synthetic "
                   "task, or countdown-hard: countdown.load_hard)")
    p.add_argument("--prompts", type=int, default=512 if sub == "calibrate" else 128, help="held-out problems")
    p.add_argument("--max-new-tokens", type=int, default=80, help="completion budget of the sampled completions")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--draws", type=int, default=DRAWS, help="AQN noise draws per sigma")
    p.add_argument("--sigmas", default=",".join(f"{s:g}" for s in SIGMAS), help="AQN sigmas, comma-separated")
    p.add_argument("--taus", default=",".join(f"{t:g}" for t in TAUS), help="temperatures, comma-separated")
    p.add_argument("--out", default="results/aqn_replication", help="calibrate: the folder for calibration.csv and "
                   ".json; entropy: the JSON file to write")
    p.add_argument("--adapter", default=None, help="entropy: the run's adapter folder")
    p.add_argument("--quant", default="bf16", choices=("bf16", "nvfp4"), help="entropy: the base's format")
    args = p.parse_args(argv)
    if args.prompts < 1 or args.draws < 1 or args.max_new_tokens < 1:
        p.error("--prompts, --draws and --max-new-tokens must be >= 1")
    import hub

    device = hub.resolve_device(args.device, "calibrate.py")
    with hub.stop_on_bad_input("calibrate.py"):
        hub.resolve_model_dir(args.model)
        if sub == "entropy":
            res = teacher_forced_entropy(args.model, args.adapter, args.quant, args.data, args.prompts, device)
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            hub.write_json(args.out, res)
            print(f"teacher-forced entropy {res['tf_entropy']:.4f} nats a token over {res['tokens']} tokens: {args.out}")
            return res
        sigmas = tuple(float(s) for s in args.sigmas.split(","))
        taus = tuple(float(t) for t in args.taus.split(","))
        rows, summary = calibrate(args.model, args.data, args.prompts, args.max_new_tokens, device, sigmas, taus,
                                  args.draws)
        write(args.out, rows, summary)
    print(f"KL(bf16 || NVFP4) {summary['kl_nvfp4']:.3e} nats a token, entropy bf16 {summary['entropy_bf16']:.4f} -> "
          f"NVFP4 {summary['entropy_nvfp4']:.4f}; weight error {summary['weight_error']['all']:.4f}")
    print(f"sigma* {summary['sigma_star']:.3e}{'' if summary['sigma_star_in_grid'] else ' (extrapolated)'} "
          f"(KL there {summary['kl_at_sigma_star']:.3e}), tau* {summary['tau_star']:.4f}, tau_hot "
          f"{summary['tau_hot']:.4f}; wrote {args.out}/calibration.csv, calibration.json")
    return summary


if __name__ == "__main__":
    main()
