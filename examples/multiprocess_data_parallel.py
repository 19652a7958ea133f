"""Data-parallel training over several processes with torchpmap and torch.distributed.

Every process runs this same program (multi-controller, like JAX's multi-host pmap).
Each takes its own share of every global batch; ``pmap`` maps the instances of this
process, ``pmean(..., "batch")`` averages the gradients over the instances of *all*
processes, and every process applies the same update with a plain ``torch.optim``
optimizer, so the replicas stay identical without ever being broadcast.

    torchrun --nproc-per-node=2 examples/multiprocess_data_parallel.py        # 2 CPU processes
    torchrun --nproc-per-node=4 examples/multiprocess_data_parallel.py --steps 100
    torchrun --nproc-per-node=2 examples/multiprocess_data_parallel.py --jit  # compiled steps
    python examples/multiprocess_data_parallel.py                            # 1 process works too

Several machines: run the same command on each node (see docs/multiprocess.md)::

    torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d \\
             --rdzv-endpoint=HOST_OF_NODE_0:29500 --rdzv-id=job42 \\
             examples/multiprocess_data_parallel.py

With CUDA each process uses ``cuda:LOCAL_RANK`` and NCCL; on CPU, gloo.
"""
from __future__ import annotations

import argparse
import datetime
import time

import torch
from torch import nn
from torch.func import functional_call, grad_and_value

import torchpmap as tp
import torchpmap.distributed as tpd
from torchpmap.training import shard


def make_data(n: int, features: int, seed: int):
    """A synthetic regression problem, the same in every process (same seed)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    true_w = torch.randn(features, 1, generator=g)
    y = torch.tanh(x @ true_w) + 0.05 * torch.randn(n, 1, generator=g)
    return x, y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=64, help="the global batch, over all processes")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--jit", action="store_true", help="compile each process' step (pmap(jit=True))")
    args = parser.parse_args()

    tpd.initialize(timeout=datetime.timedelta(minutes=2))  # a no-op when run as a single process
    rank, nproc = tp.process_index(), tp.process_count()
    n_local = tp.local_device_count()  # instances in this process (one per local device)
    instances = nproc * n_local
    if args.batch_size % instances:
        raise SystemExit(f"--batch-size {args.batch_size} must be divisible by the {instances} instances")
    per_process = args.batch_size // nproc

    torch.manual_seed(0)  # the same initial parameters in every process
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1)).to(tp.local_devices()[0].torch_device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    def loss_fn(params, x, y):
        return ((functional_call(model, params, (x,)) - y) ** 2).mean()

    def instance_step(params, x, y):  # one instance, on its shard of the global batch
        grads, loss = grad_and_value(loss_fn)(params, x, y)
        return tp.pmean((grads, loss), "batch")  # averaged over every process' instances, in one exchange

    p_step = tp.pmap(instance_step, axis_name="batch", in_axes=(None, 0, 0), out_axes=None, jit=args.jit)

    x_all, y_all = make_data(args.batch_size * args.steps, 16, seed=1)
    device = tp.local_devices()[0].torch_device
    start = time.perf_counter()
    for step in range(args.steps):
        rows = slice(step * args.batch_size, (step + 1) * args.batch_size)
        x, y = x_all[rows], y_all[rows]  # the global batch
        mine = slice(rank * per_process, (rank + 1) * per_process)  # this process' share
        x_local, y_local = shard((x[mine].to(device), y[mine].to(device)), n_local)
        params = {k: p.detach() for k, p in model.named_parameters()}
        grads, loss = p_step(params, x_local, y_local)
        if step == 0:
            # The averaged gradient is the gradient of the mean loss over the whole global
            # batch: what one process computes on all of it.
            whole = torch.func.grad(loss_fn)(params, x.to(device), y.to(device))
            same = all(torch.allclose(grads[k], whole[k], rtol=1e-4, atol=1e-6) for k in whole)
            if rank == 0:
                print(f"{nproc} process(es) x {n_local} instance(s); the averaged gradient matches the "
                      f"single-process step: {same}", flush=True)
        for k, p in model.named_parameters():
            p.grad = grads[k]
        opt.step()
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {loss.item():.4f}", flush=True)

    # Every process took the same steps: the replicas are identical. Check it with a collective.
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    spread = tp.pmap(lambda v: tp.pmax(v, "p") - tp.pmin(v, "p"), axis_name="p")(flat[None]).abs().max()
    if rank == 0:
        print(f"{args.steps} steps in {time.perf_counter() - start:.2f} s; largest difference between the "
              f"processes' parameters: {spread.item():.1e}", flush=True)
    tpd.shutdown()


if __name__ == "__main__":
    main()
