"""ddp.py: data-parallel RL — N processes, one global batch, the same update as one process.

    torchrun --nproc_per_node=N train.py ...          (one machine; train.py alone is one process)

Each of the N ranks holds the whole model (NVFP4 base, LoRA, trained norms). A step's P prompts are
the GLOBAL batch; rank r owns the contiguous block of prompts [r P / N, (r + 1) P / N) (`shard`), samples
their G completions each, grades them and computes its part of the loss. A group never straddles two
ranks, so its mean and std (the group-relative advantage) need no communication.

Why the result is a single process's, term by term. Every loss train.py takes is a SUM over sequences
divided by a count over the whole batch (grpo.py, "Gradient accumulation"):

    token-mean (DAPO)           L = 1/N_tok  sum_b sum_t l_bt      N_tok: masked tokens of the batch
    seq-mean-token-mean (GRPO)  L = 1/N_seq  sum_b mean_t l_bt     N_seq: sequences with a token

Split the batch's sequences into the ranks' sets B_0 .. B_{N-1}. With the GLOBAL counts (each rank's
counts, all-reduced by SUM, `counts`) as divisors,

    L = sum_r L_r,   L_r = 1/N_tok sum_{b in B_r} sum_t l_bt      and so    grad L = sum_r grad L_r

so an all-reduce by SUM of the ranks' gradients (`all_reduce_grads`) gives every rank exactly the
gradient of the global loss: the one a single process computes over the whole batch (up to the order
in which float32 adds the same terms). The norm of that gradient, and so the clip, is the same on every
rank; every rank then steps the same AdamW state with the same gradient, so the parameters stay the
same bits on every rank without ever being sent (`same_everywhere` checks it cheaply, on a checksum).
A mean over the ranks' gradients (what DDP computes) would be right only with per-rank divisors of
equal batches; ours are neither equal (dynamic sampling keeps what it keeps, micro-batches pack by
length) nor per-rank.

Why an explicit all-reduce and not torch's DistributedDataParallel. DDP all-reduces during backward,
bucket by bucket, assuming every rank runs the same backward passes: here ranks run different numbers of
micro-batches (and a rank may own no informative group at all), which DDP handles only with no_sync and
join; it averages where the global-count loss needs a sum; it broadcasts the module's buffers (the
frozen NVFP4 base) at wrap time. The trained parameters are LoRA's A and B and the norms: one flat
all-reduce of their gradients after the local backward passes costs little (about 40M floats at 7B
rank 16) next to the rollout, and the code says what it does.

What else crosses ranks, each for one reason:
- Rewards: every rank ends a round with every group's reward parts and lengths (`gather_rows`: each
  fills its rows of a zero tensor, a SUM all-reduce fills the rest). So DAPO's dynamic sampling counts
  informative groups over the GLOBAL batch and keeps the first `want` in global sampling order, as one
  process would; --adv-std batch takes its std over the global rewards; the logged reward means are the
  batch's.
- Sampling keys: rollout.py's sampler keys row r of a call with seed s as mix32(h(s) + r) (rollout.
  row_keys), a bijective hash h. A rank whose rows start at global row o gets the seed s' with
  h(s') = h(s) + o (`shift_seed`, which inverts h), so its rows draw exactly the noise that rows
  o, o + 1, ... of the single-process call draw: the keys depend on the global prompt index, never on the
  rank or the number of ranks. With the same logits, 1 and N ranks sample the same completions; the
  logits of a prompt in a different batch differ only in float rounding (other padding, other GEMM
  shapes), which changes a sampled token only where two candidates tie to ~1e-7.
- Metrics: the update's per-rank sums are added (maxima maxed) across ranks (`reduce_metrics`).
- Evaluation: eval.evaluate samples batch b of its items with seed + b. Rank r runs batches r, r + N,
  ... with those very seeds and the results are gathered (`map_batches`), so the held-out accuracy is
  the single-process one on the same items; with fewer batches than ranks the others wait.
Only rank 0 writes (metrics, samples, plots, checkpoints, adapter, summary). A checkpoint holds no
rank-dependent state (the data position and the rollout keys are global), so a run resumes on any
number of ranks and continues as it would have; on several machines the run folder must be on a
filesystem they share (every rank reads --resume's checkpoint).

Launch: one machine `torchrun --nproc_per_node=N train.py ...`; several (each runs the same line):
`torchrun --nnodes=M --nproc_per_node=N --node_rank=i --master_addr=HOST0 --master_port=29500 train.py ...`
or with rendezvous `--rdzv_backend=c10d --rdzv_endpoint=HOST0:29500 --rdzv_id=JOB`. NCCL on GPUs (rank
r uses the GPU LOCAL_RANK of its machine), gloo on the CPU. Without torchrun's environment nothing here
initialises: a plain `python train.py` is one process and no process group.
"""
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

M32 = 0xFFFFFFFF


@dataclass(frozen=True)
class World:
    rank: int = 0  # this process, 0 .. size - 1 (rank 0 writes the outputs)
    size: int = 1  # processes in the job
    local_rank: int = 0  # this process on its machine: its GPU

    @property
    def main(self):
        return self.rank == 0


def init(device):
    """(World, device) from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK). With WORLD_SIZE unset
    or 1: World() and `device` as given, no process group. Otherwise a process group on NCCL (a CUDA
    device: this rank's GPU is cuda:LOCAL_RANK) or gloo (the CPU)."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return World(), device
    world = World(int(os.environ["RANK"]), size, int(os.environ.get("LOCAL_RANK", "0")))
    if device.type == "cuda":
        if world.local_rank >= torch.cuda.device_count():
            raise SystemExit(f"train.py: rank {world.rank} wants GPU {world.local_rank}, but this machine has "
                             f"{torch.cuda.device_count()}: pass --nproc_per_node <= the GPU count")
        device = torch.device("cuda", world.local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        # (a long timeout: ranks wait at a collective while one evaluates or samples a long round)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(hours=1))
    return world, device


def shutdown(world):
    """End the process group, every rank at once: a rank that tore down its gloo connections and exited
    while another still used them was seen to abort at exit ("terminate called without an active
    exception", SIGABRT) in one CI run of tests/test_ddp.py; the barrier keeps the ranks together."""
    if world.size > 1 and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def shard(n, world):
    """[start, end) of the n global prompts that this rank owns: contiguous blocks, sizes differing by <= 1."""
    return world.rank * n // world.size, (world.rank + 1) * n // world.size


# ---------------------------------------------------------------------------------------------
# Sampling keys that do not depend on the rank
# ---------------------------------------------------------------------------------------------

def _mix32(x):  # rollout.mix32 on a Python int (lowbias32)
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def _unmix32(x):
    """The inverse of _mix32: each xor-shift and each odd multiplier undone, in reverse order."""
    x ^= x >> 16
    x = (x * pow(0x846CA68B, -1, 2**32)) & M32
    x ^= (x >> 15) ^ (x >> 30)
    x = (x * pow(0x7FEB352D, -1, 2**32)) & M32
    return x ^ (x >> 16)


def _seed_hash(seed):  # h(seed) of rollout.row_keys: row r's key is mix32(h(seed) + r)
    return _mix32(_mix32((seed & M32) ^ 0x9E3779B9) ^ ((seed >> 32) & M32))


def shift_seed(seed, offset):
    """A seed s' whose rows 0, 1, ... get the keys that rows offset, offset + 1, ... get under `seed`
    (rollout.row_keys(s', r) == rollout.row_keys(seed, offset + r)); tests/test_ddp.py checks it
    against rollout.py. offset 0 returns seed itself."""
    if offset == 0:
        return seed
    target = (_seed_hash(seed) + offset) & M32
    return _unmix32(_unmix32(target)) ^ 0x9E3779B9  # (a seed < 2^32: its high word adds nothing)


# ---------------------------------------------------------------------------------------------
# Collectives (each a no-op in one process)
# ---------------------------------------------------------------------------------------------

def all_reduce(t, world, op="sum"):
    """In place, SUM or MAX over the ranks; returns t."""
    if world.size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t


def gather_rows(t, world, device):
    """t holds this rank's rows and zeros elsewhere; → every rank's rows everywhere (a SUM of zeros adds
    nothing, so the values are exact). NCCL reduces only GPU tensors: it travels on `device`."""
    if world.size == 1:
        return t
    return all_reduce(t.to(device), world).to(t.device)


def counts(num_seqs, num_tokens, world, device):
    """The global batch's (sequences, tokens) for the loss's divisors."""
    if world.size == 1:
        return num_seqs, num_tokens
    c = all_reduce(torch.tensor([num_seqs, num_tokens], dtype=torch.float64, device=device), world)
    return int(c[0]), int(c[1])


def all_reduce_grads(params, world):
    """SUM every trainable parameter's gradient over the ranks, as one flat buffer (one collective). A
    rank that ran no backward (no group of its own) sends zeros."""
    if world.size == 1:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1).float() for p in params])  # (total trainable,)
    all_reduce(flat, world)
    for p, g in zip(params, flat.split([p.numel() for p in params])):
        p.grad.copy_(g.view_as(p.grad))


def reduce_metrics(sums, world):
    """The update's metric sums from every rank: added, except `*_max` keys (the largest). A rank without
    a micro-batch has none: the others' keys are kept."""
    if world.size == 1:
        return sums
    everyone = [None] * world.size
    dist.all_gather_object(everyone, sums)
    out = {}
    for part in everyone:  # (rank order: every rank adds the same floats in the same order)
        for k, v in part.items():
            out[k] = (max(out[k], v) if k.endswith("_max") else out[k] + v) if k in out else v
    return out


def broadcast(obj, world):
    """Rank 0's `obj` on every rank (a run id, an output folder)."""
    if world.size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def union(d, world):
    """The union of every rank's dict (keys disjoint: each rank's own items), on every rank."""
    if world.size == 1:
        return d
    everyone = [None] * world.size
    dist.all_gather_object(everyone, d)
    return {k: v for part in everyone for k, v in part.items()}


def map_batches(n_items, per_batch, fn, world):
    """fn(b, start, end) for the batches b of [0, n_items) in slices of per_batch, batch b on rank
    b mod N; → every batch's result, in batch order, on every rank."""
    batches = list(range((n_items + per_batch - 1) // per_batch))
    mine = {b: fn(b, b * per_batch, min(n_items, (b + 1) * per_batch)) for b in batches[world.rank::world.size]}
    if world.size == 1:
        return [mine[b] for b in batches]
    everyone = [None] * world.size
    dist.all_gather_object(everyone, mine)
    merged = {b: r for part in everyone for b, r in part.items()}
    return [merged[b] for b in batches]


def same_everywhere(params, world):
    """Assert that every rank holds the same trainable parameters (a float64 checksum of each, compared
    on every rank): true by construction, checked because a silent drift would go unnoticed."""
    if world.size == 1:
        return
    with torch.no_grad():
        s = torch.stack([p.double().sum() + p.double().abs().sum() * 1e-3 for p in params]).sum()[None]  # (1,)
    low, high = s.clone(), s.clone()
    all_reduce(high, world, "max")
    all_reduce(low.neg_(), world, "max")
    if float(high) != -float(low):
        raise RuntimeError(f"rank {world.rank}: the trainable parameters differ between ranks (checksums "
                           f"{-float(low)!r} .. {float(high)!r}); a rank stepped with other gradients")
