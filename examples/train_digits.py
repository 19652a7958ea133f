"""Data-parallel training with torchpmap: a digit classifier on scikit-learn's digits.

Every step, the global batch is split into one shard per instance; each instance
computes the loss and gradients of its shard, the gradients are averaged over the
instances with ``pmean``, and a plain ``torch.optim`` optimizer applies them.

    python examples/train_digits.py               # one instance per local device
    python examples/train_digits.py --devices 8   # 8 instances, even on a single CPU
    python examples/train_digits.py --quick       # a short run, for CI

The data set (1797 8x8 images) ships with scikit-learn: nothing is downloaded.
"""
from __future__ import annotations

import argparse
import sys
import time

import matplotlib

matplotlib.use("Agg")  # write files only, no window
import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from tqdm import tqdm

import torchpmap as tp
from torchpmap.training import data_parallel_step, prefetch_to_device


def load_data(seed: int):
    """Train and held-out splits as tensors; pixel values scaled from 0..16 to 0..1."""
    images, labels = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        images / 16.0, labels, test_size=0.2, stratify=labels, random_state=seed
    )

    def as_x(a):
        return torch.tensor(a, dtype=torch.float32)

    return as_x(x_train), torch.tensor(y_train), as_x(x_test), torch.tensor(y_test)


def batches(x, y, batch_size: int, generator: torch.Generator):
    """One epoch of shuffled global batches; the last incomplete batch is dropped."""
    order = torch.randperm(len(x), generator=generator)
    for start in range(0, len(x) - batch_size + 1, batch_size):
        rows = order[start : start + batch_size]
        yield x[rows], y[rows]


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Dropout(0.1),
        nn.Linear(256, 256), nn.ReLU(), nn.Dropout(0.1),
        nn.Linear(256, 10),
    )


@torch.no_grad()
def accuracy(model: nn.Module, x, y) -> float:
    model.eval()  # dropout off
    return (model(x).argmax(dim=1) == y).float().mean().item()


def plot(losses: list[float], accuracies: list[float], instances: int, devices: int, path: str) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(losses, linewidth=0.8)
    left.set(xlabel="step", ylabel="training loss (cross-entropy)", yscale="log", title="Loss")
    epochs = range(1, len(accuracies) + 1)
    right.plot(epochs, [100 * a for a in accuracies], marker="o")
    right.set(xlabel="epoch", ylabel="held-out accuracy (%)", title="Accuracy")
    right.grid(alpha=0.3)
    over = "1 instance" if instances == 1 else f"{instances} instances"
    fig.suptitle(f"Digits: an MLP trained with data-parallel pmap over {over} ({devices} device(s))")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=tp.local_device_count(),
                        help="pmap instances (may exceed the device count; default: %(default)s)")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=128, help="global batch, split over the instances")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate of Adam (cosine decay)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default="digits_training.png", help="where to write the loss/accuracy plot")
    parser.add_argument("--quick", action="store_true", help="a short run for CI (15 epochs)")
    parser.add_argument("--jit", action="store_true", help="compile the step: pmap(..., jit=True), one device")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads per torch op; the model is so small that 1 is fastest")
    args = parser.parse_args()
    if args.quick:
        args.epochs = 15
    n = args.devices
    if n < 1 or args.batch_size % n:
        parser.error(f"--batch-size {args.batch_size} must split evenly over --devices {n}")

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)  # also seeds each instance's own dropout masks
    x_train, y_train, x_test, y_test = load_data(args.seed)
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    steps_per_epoch = len(x_train) // args.batch_size
    # The optimizer and its schedule are plain torch.optim: the data-parallel step only
    # fills in p.grad (averaged over the instances) before optimizer.step().
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * steps_per_epoch)
    step = data_parallel_step(model, F.cross_entropy, optimizer, axis_name="batch", jit=args.jit)

    print(f"{n} instances on {tp.local_device_count()} device(s) {tp.local_devices()}; "
          f"{args.batch_size // n} examples per instance and step")
    shuffle = torch.Generator().manual_seed(args.seed)
    losses, accuracies = [], []
    start = time.perf_counter()
    total = args.epochs * steps_per_epoch * args.batch_size
    interactive = sys.stderr.isatty()  # a log file gets one plain line per epoch, not a progress bar
    with tqdm(total=total, unit="samples", unit_scale=True, dynamic_ncols=True, disable=not interactive) as bar:
        for epoch in range(1, args.epochs + 1):
            model.train()
            # Shards each batch into (n, batch_size / n, ...) ahead of time, in a thread.
            for batch in prefetch_to_device(batches(x_train, y_train, args.batch_size, shuffle), n=n):
                loss = step(batch).item()
                schedule.step()
                losses.append(loss)
                bar.update(args.batch_size)
                bar.set_postfix(epoch=epoch, loss=f"{loss:.4f}")
            accuracies.append(accuracy(model, x_test, y_test))
            bar.set_postfix(epoch=epoch, loss=f"{loss:.4f}", acc=f"{accuracies[-1]:.3f}")
            if not interactive:
                print(
                    f"epoch {epoch}/{args.epochs}: loss {loss:.4f}, held-out accuracy {accuracies[-1]:.4f}", flush=True
                )
    seconds = time.perf_counter() - start

    print(f"trained {args.epochs} epochs in {seconds:.1f} s ({total / seconds:,.0f} samples/s)")
    print(f"held-out accuracy: {accuracies[-1]:.4f} ({round(accuracies[-1] * len(y_test))}/{len(y_test)})")
    plot(losses, accuracies, n, tp.local_device_count(), args.plot)
    print(f"plot written to {args.plot}")


if __name__ == "__main__":
    main()
