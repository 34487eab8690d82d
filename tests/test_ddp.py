"""Data-parallel RL (ddp.py) on the CPU with gloo: two processes over one global batch give the update
of one process over it (losses, all-reduced gradients, stepped parameters); a `torchrun --nproc_per_node 2
train.py` run samples the same completions and reaches the same metrics and adapter as a one-process
run; a 2-process run resumed from its checkpoint equals the uninterrupted one, and resumes on 1 process.

Where two runs are not bit-equal it is float32 rounding, and the tolerances say how much: a prompt
prefilled in another batch (other padding, other GEMM shapes) and gradients summed in another order
differ in the last bits; AdamW's first step divides each gradient by its own magnitude, so a parameter
moves by about lr whatever its gradient's size, and the last bits of a gradient near zero can move it by
up to a whole step (step_slack says how much, from the gradients' bound).

How far apart two float32 sums of the same n terms may be (Higham, Accuracy and Stability of Numerical
Algorithms, ch. 4): each order lands within gamma_n ~ n u of the exact sum (u = 2**-24, float32's unit
roundoff), relative to the sum of the terms' magnitudes, so two orders differ by at most 2 n u of it. An
element of a gradient sums one term per token position of the batch (LoRA's dW = sum over positions of
dY x^T), so n is the batch's position count. The test takes the bound normwise, the usual form when the
terms' magnitudes are unknown: 2 n u times the tensor's largest element. An element whose terms cancel
to near zero is then held to its tensor's scale, not to its own size, which a relative tolerance would
do and which the summation order legitimately breaks. A missing all-reduce or a wrong divisor moves a
gradient by a factor, far outside it."""
import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import adapters
import ddp
import grpo
import lora
import model as M
import recipes
import rollout
import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# what each process measures of its own share: its times and memory peak, and the micro-batches its share took
PER_PROCESS = {"time_rollout", "time_update", "time_step", "rollout_tokens_per_s", "peak_memory_gb", "micro_batches"}
# (the kernel picks that tests/test_train.py pins for bit-equal runs)
PINNED = {"MKL_CBWR": "COMPATIBLE", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def test_shifted_seeds_give_the_keys_of_the_global_rows():
    """ddp.shift_seed against rollout.row_keys: a rank's rows 0.. get the keys of global rows offset..,
    for small and 64-bit seeds; offset 0 keeps the seed."""
    gen = torch.Generator().manual_seed(0)
    for seed in (0, 1, 7919 * 3 + 31, 2**32 - 1, 2**32 + 5, 2**62 + 12345):
        for offset in (0, 1, 4, 37, 2**31 + 3):
            n = int(torch.randint(1, 40, (1,), generator=gen))
            got = rollout.row_keys(ddp.shift_seed(seed, offset), torch.arange(n))
            assert torch.equal(got, rollout.row_keys(seed, offset + torch.arange(n))), (seed, offset)
    assert ddp.shift_seed(12345, 0) == 12345
    world = lambda r, n: ddp.World(r, n)
    for n, size in ((16, 2), (16, 3), (3, 2), (1, 2)):  # contiguous blocks that cover the prompts once
        blocks = [ddp.shard(n, world(r, size)) for r in range(size)]
        assert blocks[0][0] == 0 and blocks[-1][1] == n and all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))


def test_one_process_starts_no_process_group(monkeypatch):
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    world, device = ddp.init(torch.device("cpu"))
    assert world == ddp.World() and world.main and device == torch.device("cpu") and not dist.is_initialized()


# ---------------------------------------------------------------------------------------------
# The update: 2 processes over a global batch against 1 process over it
# ---------------------------------------------------------------------------------------------

# (algo, adv-std, groups): DAPO's token-mean; GRPO's sequence mean with its KL to the reference and the
# batch-wide std; a batch of one group, which leaves rank 0 without any.
CASES = [("dapo", "group", 3), ("grpo", "batch", 3), ("dapo", "group", 1)]
LR, EPS = 1e-2, 1e-8  # AdamW's learning rate here and its default eps


def fixed_update(folder, world, algo, adv_std, num_groups):
    """train.update on a fixed batch of num_groups groups of 4 (one truncated row), this rank owning its
    ddp.shard of them; LoRA and trained norms, AdamW. → (metrics, gradients, parameters after the step,
    the global batch's token positions: the length of the sums behind each gradient element)."""
    m = M.Transformer.from_pretrained(folder, dtype=torch.float32)
    torch.manual_seed(0)
    params = lora.apply_lora(m, rank=4, alpha=8)
    for p in params:  # (B away from zero, so that every parameter has a gradient)
        p.data.normal_(0, 0.1, generator=torch.Generator().manual_seed(p.numel()))
    params = params + lora.train_norms(m)
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=0.1, betas=(0.9, 0.99), eps=EPS)
    gen = torch.Generator().manual_seed(1)
    G = 4
    prompts = [torch.randint(0, 101, (n,), generator=gen).tolist() for n in (5, 9, 7)[:num_groups]]
    lengths = torch.tensor([1, 3, 2, 8, 4, 1, 2, 5, 6, 8, 3, 2][: G * num_groups])  # 8 = max_new_tokens
    finish = ["stop"] * len(lengths)
    finish[3] = "length"
    positions = sum(len(prompts[i // G]) for i in range(len(lengths))) + int(lengths.sum())  # (of the global batch)
    ro = type("Rollout", (), dict(tokens=torch.randint(0, 101, (len(lengths), 8), generator=gen), lengths=lengths,
                                  logprobs=-torch.rand(len(lengths), 8, generator=gen), finish=finish))
    lo, hi = ddp.shard(num_groups, world)
    rewards = torch.tensor([[1.0, 0, 0, 1], [0, 1, 1, 1], [0.5, 0, 0, 0]])[:num_groups]
    zero = torch.zeros_like(rewards)
    parts = torch.stack([rewards, zero, zero, lengths.view(num_groups, G).float()])  # (4, groups, G)
    mine = type("Rollout", (), dict(tokens=ro.tokens[lo * G:hi * G], logprobs=ro.logprobs[lo * G:hi * G],
                                    lengths=lengths[lo * G:hi * G], finish=finish[lo * G:hi * G]))
    groups = train.groups_of(list(range(num_groups)), parts, mine, lo)  # (this rank's rows in its own groups)
    advantages = grpo.group_advantages(rewards, std=adv_std)
    batch = train.training_batch(groups, advantages, prompts.__getitem__, True, "cpu")
    cfg = train.update_config(recipes.parse(["--algo", algo, "--max-new-tokens", "8", "--micro-batch", "4",
                                             "--grad-clip", "0.05"]))
    out = train.update(cfg, m, optimizer, params, batch, world)
    return out, [p.grad.clone() for p in params], [p.detach().clone() for p in params], positions


def step_slack(p, g, delta):
    """How far apart two processes' parameters p may land after fixed_update's one AdamW step, elementwise,
    when their gradients g differ by at most delta. AdamW's first step moves a parameter by lr times
    g / (|g| + eps) (its moments are g and g squared, bias-corrected), after a weight decay that both share.
    That function rises with g, so the two steps lie within its rise over [g - delta, g + delta]: next to
    nothing where |g| is far above delta, up to the whole step where g is within delta of zero (its sign is
    then the sums' rounding). On top, each process rounds its new parameter and its step once or twice: a few
    units of float32's last place."""
    direction = lambda x: x / (x.abs() + EPS)
    return LR * (direction(g + delta) - direction(g - delta)) + 4 * torch.finfo(torch.float32).eps * (p.abs() + LR)


def _update_worker(rank, port, folder, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    world, _ = ddp.init(torch.device("cpu"))
    results = [fixed_update(folder, world, *case) for case in CASES]
    # The drift check: the same parameters pass; one float's last bit on one rank fails on every rank.
    same = [torch.linspace(-1, 1, 7)]
    ddp.same_everywhere(same, world)
    same[0][3] = torch.nextafter(same[0][3], torch.tensor(2.0)) if rank == 1 else same[0][3]
    try:
        ddp.same_everywhere(same, world)
        results.append("drift unnoticed")
    except RuntimeError as e:
        results.append(str(e))
    ddp.shutdown(world)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_update_as_one_over_the_global_batch(hf_folder, tmp_path):
    _, folder = hf_folder("qwen2", num_hidden_layers=2)
    mp.spawn(_update_worker, args=(free_port(), folder, str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = [fixed_update(folder, ddp.World(), *case) for case in CASES]
    finally:
        torch.set_num_threads(threads)
    for r in ranks:
        assert "the trainable parameters differ between ranks" in r.pop()
    for case, one, r0, r1 in zip(CASES, single, *ranks):
        (m1, g1, p1, n), (m0, g0, q0, _), (_, g_1, q1, _) = one, r0, r1
        bound = 2 * n * 2.0**-24  # two float32 orders of n-term sums (the docstring)
        assert m1["grad_norm"] > 0.05, case  # (the clip acts: it must see the all-reduced norm to match)
        for k in ("loss", "pg_loss", "kl_loss", "entropy", "clip_frac_high", "grad_norm", "mismatch_ratio_max"):
            assert m0[k] == pytest.approx(m1[k], rel=bound, abs=1e-9), (case, k)
        for g, h, h_1, a, b, c in zip(g1, g0, g_1, p1, q0, q1):
            delta = bound * float(g.abs().max())
            assert torch.equal(h, h_1)  # every rank holds the same summed gradient ...
            torch.testing.assert_close(h, g, rtol=0, atol=delta)  # ... the one process's, within delta
            assert torch.equal(b, c)  # and steps to the same parameters: the one process's, within what delta allows
            slack = step_slack(a, g, delta)
            assert ((b - a).abs() <= slack).all(), (case, float(((b - a).abs() / slack).max()))
        assert any(g.abs().max() > 0 for g in g1)


# ---------------------------------------------------------------------------------------------
# train.py under torchrun: 1 and 2 processes, and resume
# ---------------------------------------------------------------------------------------------

ARGS = ["--steps", "3", "--prompts", "3", "--group-size", "4", "--max-new-tokens", "40", "--eval-limit", "12",
        "--eval-every", "2", "--save-every", "1", "--seed", "5", "--log-samples", "2"]


def torchrun(argv, nproc=2):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "train.py", *argv]
    env = {**os.environ, **PINNED, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return r


def metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if k not in PER_PROCESS} for line in f]


def adapter(out):
    return adapters.read_adapter(os.path.join(out, "adapter"))[1]


# Exact: what sampling and grading decide. Close: what the update computes in float32.
EXACT = {"step", "sigma", "aqn_stage", "rounds", "filtered_groups", "groups", "lr", "reward", "reward_correct",
         "reward_format", "reward_overlong", "accuracy", "response_length", "response_length_max", "heldout_accuracy",
         "heldout_accuracy_strict", "checkpointing", "skipped"}


def assert_same_run(a, b, rel):
    ra, rb = metrics(a), metrics(b)
    assert len(ra) == len(rb) == 3
    for x, y in zip(ra, rb):
        assert set(x) == set(y)
        for k in x:
            if k in EXACT or rel == 0:
                assert x[k] == y[k], (x["step"], k, x[k], y[k])
            elif k != "mismatch_kl":  # (a mean of ~1e-12 differences of two float32 logprobs: rounding only)
                # (losses, grad norms, entropies: measured within 7e-6 of each other)
                assert x[k] == pytest.approx(y[k], rel=rel / 10, abs=1e-7), (x["step"], k, x[k], y[k])
    with open(os.path.join(a, "samples.jsonl")) as f, open(os.path.join(b, "samples.jsonl")) as g:
        assert f.read() == g.read()  # the same completions, sampled by other ranks
    sa, sb = (json.load(open(os.path.join(d, "summary.json"))) for d in (a, b))
    assert (sa["baseline_accuracy"], sa["final_accuracy"]) == (sb["baseline_accuracy"], sb["final_accuracy"])
    wa, wb = adapter(a), adapter(b)
    lr = json.load(open(os.path.join(a, "args.json")))["lr"]
    assert wa.keys() == wb.keys()
    for k in wa:
        for x, y in zip(wa[k], wb[k]):
            if rel == 0:
                assert torch.equal(x, y), k
                continue
            # AdamW moves a parameter by about lr a step whatever its gradient's size (m / sqrt(v)): where a
            # gradient is near zero (cancelling sums, LoRA A's first steps after B leaves zero) the rounding of
            # the sums decides that step. So the tightest true statement is on the whole tensor: a mean
            # difference of `rel` of its mean size (measured: 6e-5 at most), and no element off by more than
            # one step's lr (measured: a third).
            d = (x - y).abs()
            assert d.mean() <= rel * y.abs().mean() and d.max() <= lr, (k, float(d.mean()), float(d.max()))


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """An uninterrupted 2-process run (checkpoints after steps 1, 2, 3)."""
    out = str(tmp_path_factory.mktemp("ddp") / "two")
    torchrun(ARGS + ["--out", out])
    return out


def test_torchrun_two_processes_equal_one(two, tmp_path):
    one = str(tmp_path / "one")
    train.main(ARGS + ["--out", one])
    assert not dist.is_initialized()  # (one process: no process group)
    # Same samples, rewards and held-out accuracy; the update's float32 sums in another order.
    assert_same_run(two, one, rel=3e-4)
    assert sum(r["filtered_groups"] for r in metrics(one)) > 0  # dynamic sampling had groups to filter


def killed_after_step_2(two, tmp_path):
    """A copy of the run as a kill during its last step would leave it: the step-2 checkpoint newest."""
    out = str(tmp_path / "resumed")
    shutil.copytree(two, out)
    os.remove(os.path.join(out, "summary.json"))
    shutil.rmtree(os.path.join(out, "checkpoint"))
    return out


def test_a_resumed_two_process_run_equals_the_uninterrupted_one(two, tmp_path):
    out = killed_after_step_2(two, tmp_path)
    torchrun(["--resume", out])
    assert_same_run(two, out, rel=0)  # bit for bit
    # The same checkpoint resumed by one process: the same run, to float32 rounding.
    one = killed_after_step_2(two, tmp_path / "on-one")
    train.main(["--resume", one])
    assert_same_run(two, one, rel=3e-4)
