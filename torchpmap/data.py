"""Data for a data-parallel pmap: a dataset (or a ``DataLoader``) in, sharded global batches out.

:class:`ShardedLoader` reads a map-style dataset in global batches of a fixed size, splits
each global batch over the processes and then over this process' instances, and hands
out batches shaped ``(n, b, ...)`` (``n`` local instances of ``b`` examples), prefetched
to the device by :func:`torchpmap.training.prefetch_to_device`: exactly what
:func:`torchpmap.training.data_parallel_step` and any ``pmap(..., in_axes=0)`` take.

* **One process**: a plain ``torch.utils.data.DataLoader`` over a seeded shuffle (a
  ``RandomSampler`` whose generator is seeded with ``seed + epoch``).
* **Several processes** (after :func:`torchpmap.distributed.initialize`): every process
  makes the same order (the same seeded ``RandomSampler``), and each reads only its own
  consecutive share of every global batch, process 0's first. Global step ``j`` of an
  epoch covers positions ``j*B .. (j+1)*B - 1`` of that order, and instance ``i`` of the
  step (counted over the processes, process 0's instances first) the same ``b``
  examples, whatever the number of processes: a model with per-instance state (batch
  norm statistics) trains as in one process. (``DistributedSampler`` deals positions
  ``r, r + P, ...`` to rank ``r``, which would give the instances other examples.)
* **Equal steps.** The number of steps per epoch is a function of the dataset's size,
  the global batch size, the number of processes and ``last_batch`` alone, the same in
  every process by construction; building the loader checks (one small
  ``all_gather_object``) that every process passed the same size and settings, so an
  epoch ends at the same step everywhere and no process waits in a collective that the
  others never reach.
* **The last uneven batch** is dropped (``last_batch="drop"``, the default) or padded
  (``last_batch="pad"``): see :class:`ShardedLoader`.
* **Resumable**: :meth:`ShardedLoader.state_dict` holds the epoch and the step within
  it; :func:`torchpmap.checkpoint.save` stores it with the rest of the training state.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from torchpmap._placement import devices as _devices
from torchpmap.training import _instances, prefetch_to_device

__all__ = ["ShardedLoader"]

_LAST_BATCH = ("drop", "pad")
# DataLoader arguments that ShardedLoader decides itself, and what to use instead.
_OWN_ARGUMENTS = {
    "batch_size": "pass global_batch_size= (it is split over processes and instances)",
    "shuffle": "pass shuffle= to ShardedLoader",
    "sampler": "ShardedLoader samples itself (one seeded order, each process its share); pass the dataset",
    "batch_sampler": "ShardedLoader batches itself; pass the dataset and global_batch_size=",
    "drop_last": "pass last_batch='drop' or last_batch='pad'",
    "generator": "pass seed= (the shuffle and the workers' seeds derive from it)",
}
# The loading settings taken over from a DataLoader that is passed in.
_LOADING_SETTINGS = (
    "collate_fn",
    "num_workers",
    "pin_memory",
    "worker_init_fn",
    "timeout",
    "multiprocessing_context",
    "persistent_workers",
    "prefetch_factor",
    "pin_memory_device",
    "in_order",
)


def _positive_int(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"ShardedLoader: {what} must be a positive int, got {value!r}")
    return value


def _split_error(global_batch_size: int, processes: int, n: int) -> str | None:
    """Why ``global_batch_size`` does not split over ``processes`` x ``n`` instances, or None."""
    instances = processes * n
    if global_batch_size % instances == 0:
        return None
    below = global_batch_size - global_batch_size % instances
    above = below + instances
    suggestion = f"{below} or {above}" if below else f"{above}"
    layout = f"{processes} process{'es' if processes > 1 else ''} x {n} local instance{'s' if n > 1 else ''}"
    return (
        f"ShardedLoader: global_batch_size={global_batch_size} does not split evenly over {layout} = "
        f"{instances} instances ({global_batch_size} % {instances} = {global_batch_size % instances}); every "
        f"instance must get the same number of examples. Use a global batch size that is a multiple of "
        f"{instances} ({suggestion}, say), or another number of local instances (n=)."
    )


class ShardedLoader:
    """Sharded global batches from a dataset or a ``DataLoader``, one epoch per ``for`` loop.

    Every step takes ``global_batch_size`` examples of the dataset, ``global_batch_size /
    process_count()`` of them in each process, and yields this process' part sharded
    over its ``n`` instances: every leaf of the collated batch has shape
    ``(n, global_batch_size / (process_count() * n), ...)``, already on the device the
    instances run on (prefetched in a background thread by
    :func:`torchpmap.training.prefetch_to_device`). ``for batch in loader`` runs the
    current epoch from the current step, then moves on to the next epoch (a new
    shuffle); ``len(loader)`` is the number of steps per epoch, the same in every process.

    **The last uneven batch.** When ``len(dataset)`` is no multiple of the global batch:

    * ``last_batch="drop"`` (the default, for training): the examples that do not fill a
      whole global batch are left out of that epoch (``len(dataset) // global_batch_size``
      steps; a different shuffle leaves out others the next epoch).
    * ``last_batch="pad"``: the epoch has ``ceil`` as many steps; the last one is filled
      up to a whole batch with **repeated examples** (the first examples of the epoch's
      order again). Every example is seen, and a few twice: in a training step the
      repeated ones weigh twice in the mean loss. For exact sums (evaluation), pass
      ``mask=True``: each item is then ``(batch, mask)``, where ``mask`` is a bool tensor
      of shape ``(n, b)``, True for a real example and False for a repeat, so that
      ``psum((per_example_metric * mask).sum())`` counts every example exactly once.

    **Across processes** every process must build the loader (its construction is a
    collective: it checks that all processes passed the same dataset size and settings)
    and must iterate the same epochs; each reads only its own share of the data.

    Args:
        data: a map-style dataset (``__len__`` and ``__getitem__``), or a
            ``DataLoader`` over one. From a loader, ShardedLoader takes the dataset, the
            batch size (the global batch size; for a loader whose sampler is a
            ``DistributedSampler``, a DDP script's loader, the per-process batch size
            times its ``num_replicas``), the shuffle and seed of its sampler (unless
            given here) and its loading settings (``collate_fn``, ``num_workers``,
            ``pin_memory``, ``worker_init_fn``, ...); the order of the examples is
            ShardedLoader's own. A loader with another sampler or a ``batch_sampler`` is
            refused: pass its dataset.
        global_batch_size: examples per step over all processes and instances; a
            multiple of ``process_count() * n``. Required for a dataset.
        shuffle: a new random order every epoch (default True for a dataset).
        seed: the seed of the shuffle (default 0); the same in every process.
        last_batch: ``"drop"`` (the default) or ``"pad"``, see above. From a
            ``DataLoader`` that keeps its last partial batch (``drop_last=False``, its
            default), it must be given when the examples do not fill whole global
            batches: ShardedLoader cannot yield a partial one.
        mask: yield ``(batch, mask)`` instead of ``batch`` (see above).
        n: the number of local instances to shard into (default
            ``torchpmap.local_device_count()``); the same in every process.
        prefetch: how many batches to keep ready ahead of the step (at least 1).
        num_workers: ``DataLoader`` worker processes (0: load in a background thread of
            this process). Workers are seeded from ``seed``, the epoch and the rank, so
            random augmentations are reproducible too.
        collate_fn: the ``DataLoader``'s ``collate_fn``.
        **loader_kwargs: other ``DataLoader`` arguments (``pin_memory``,
            ``worker_init_fn``, ...), for a dataset.

    Raises:
        ValueError: for a global batch size that does not split evenly (naming the
            sizes and multiples that do), a dataset too small for one step, or
            processes that passed different sizes or settings (naming each rank's).
        TypeError: for an iterable-style dataset or a loader whose sampling cannot be
            split over processes.

    Example:
        >>> import torch
        >>> from torch.utils.data import TensorDataset
        >>> from torchpmap.data import ShardedLoader
        >>> data = TensorDataset(torch.arange(10.).unsqueeze(1), torch.arange(10))
        >>> loader = ShardedLoader(data, global_batch_size=4, n=2, shuffle=False)
        >>> len(loader)                      # 10 // 4 steps; examples 8 and 9 are dropped
        2
        >>> for x, y in loader:
        ...     print(tuple(x.shape), y.tolist())
        (2, 2, 1) [[0, 1], [2, 3]]
        (2, 2, 1) [[4, 5], [6, 7]]
        >>> loader.epoch, loader.step        # the next ``for`` runs epoch 1
        (1, 0)
        >>> padded = ShardedLoader(data, global_batch_size=4, n=2, shuffle=False, last_batch="pad", mask=True)
        >>> (x, y), real = list(padded)[-1]  # the last step: 2 real examples, 2 repeats
        >>> y.tolist(), real.tolist()
        ([[8, 9], [0, 1]], [[True, True], [False, False]])
    """

    def __init__(
        self,
        data: Any,
        global_batch_size: int | None = None,
        *,
        shuffle: bool | None = None,
        seed: int | None = None,
        last_batch: str | None = None,
        mask: bool = False,
        n: int | None = None,
        prefetch: int = 2,
        num_workers: int = 0,
        collate_fn: Callable[[list], Any] | None = None,
        **loader_kwargs: Any,
    ) -> None:
        for name in _OWN_ARGUMENTS.keys() & loader_kwargs.keys():
            raise TypeError(f"ShardedLoader: {name}= is not a DataLoader argument to pass here: {_OWN_ARGUMENTS[name]}")
        processes, rank = _devices.process_count(), _devices.process_index()
        settings: dict[str, Any] = {}
        if isinstance(data, DataLoader):
            if num_workers or collate_fn is not None or loader_kwargs:
                raise TypeError(
                    "ShardedLoader: with a DataLoader, its own loading settings are used; set num_workers, collate_fn "
                    "and the other DataLoader arguments on the loader (or pass its dataset instead)"
                )
            dataset, global_batch_size, shuffle, seed = self._from_loader(
                data, global_batch_size, shuffle, seed, processes
            )
            if last_batch is None and not data.drop_last and hasattr(dataset, "__len__") and (
                len(dataset) % global_batch_size
            ):
                raise ValueError(
                    f"ShardedLoader: the DataLoader keeps its last partial batch (drop_last=False), but every step of "
                    f"a ShardedLoader has the whole global batch of {global_batch_size}, and its {len(dataset)} "
                    f"examples leave {len(dataset) % global_batch_size} over. Pass last_batch='drop' to leave them "
                    "out of the epoch (as drop_last=True does), or last_batch='pad', mask=True to fill the last step "
                    "with repeats that the mask tells apart (every example counted once, for evaluation)."
                )
            settings = {k: getattr(data, k) for k in _LOADING_SETTINGS if hasattr(data, k)}
            if not settings.get("num_workers"):
                for k in ("prefetch_factor", "persistent_workers", "timeout"):  # worker-only settings
                    settings.pop(k, None)
        else:
            dataset = data
            settings = dict(loader_kwargs, num_workers=num_workers)
            if collate_fn is not None:
                settings["collate_fn"] = collate_fn
            if global_batch_size is None:
                raise TypeError("ShardedLoader: pass global_batch_size= (the examples per step, over all processes)")
        if isinstance(dataset, IterableDataset) or not (
            hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")
        ):
            raise TypeError(
                f"ShardedLoader: needs a map-style dataset (with __len__ and __getitem__), got a "
                f"{type(dataset).__name__}. An iterable-style dataset cannot be split by a sampler, so the processes "
                "could not be given equal shares ending at the same step: split it yourself so that every process "
                "yields the same number of batches, and pass them through torchpmap.training.prefetch_to_device."
            )
        if last_batch is None:
            last_batch = "drop"
        if last_batch not in _LAST_BATCH:
            raise ValueError(f"ShardedLoader: last_batch must be 'drop' or 'pad', got {last_batch!r}")
        if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 1:
            raise ValueError(
                f"ShardedLoader: prefetch must be a positive int (how many batches to keep ready), got {prefetch!r}"
            )
        if seed is None:
            seed = 0
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"ShardedLoader: seed must be an int, got {seed!r}")
        global_batch_size = _positive_int(global_batch_size, "global_batch_size")
        n = _instances(n, "ShardedLoader")
        error = _split_error(global_batch_size, processes, n)
        if error:
            raise ValueError(error)

        self.dataset = dataset
        self.global_batch_size = global_batch_size
        #: Examples per step in this process, and per instance.
        self.process_batch_size = global_batch_size // processes
        self.instance_batch_size = self.process_batch_size // n
        self.n = n
        self.shuffle = True if shuffle is None else bool(shuffle)
        self.seed = seed
        self.last_batch = last_batch
        self.mask = bool(mask)
        self.prefetch = prefetch
        self._settings = settings
        self._processes, self._rank = processes, rank
        self._size = len(dataset)
        # One order per epoch, the same in every process: a seeded RandomSampler (or the
        # dataset's order); each global batch of it is dealt out in consecutive shares,
        # process 0's first, so instance i of global step j holds the same examples in any
        # number of processes (DistributedSampler deals positions r, r + P, ... to rank r,
        # which would give the instances other examples than in one process).
        self._order = torch.Generator()
        self._sampler: Any = (
            RandomSampler(dataset, generator=self._order) if self.shuffle and self._size else SequentialSampler(dataset)
        )
        B = global_batch_size
        self.steps_per_epoch = self._size // B if last_batch == "drop" else -(-self._size // B)
        self._epoch, self._step = 0, 0
        self._agree(processes)
        if self._size == 0:
            raise ValueError(
                f"ShardedLoader: the dataset ({type(dataset).__name__}) is empty: len(dataset) == 0, so there is "
                f"nothing to load (a global batch needs {global_batch_size} examples). Check that it found its data "
                "(a path, a filter, a split that left nothing), or pass a dataset with at least one global batch."
            )
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"ShardedLoader: a dataset of {self._size} examples holds no whole global batch of "
                f"{global_batch_size}, so an epoch would have no step; use a smaller global_batch_size or "
                "last_batch='pad'"
            )

    @staticmethod
    def _from_loader(
        loader: DataLoader, global_batch_size: int | None, shuffle: bool | None, seed: int | None, processes: int
    ) -> tuple[Any, int, bool | None, int | None]:
        sampler = loader.sampler
        if loader.batch_size is None:
            raise TypeError(
                "ShardedLoader: this DataLoader has no batch_size (it uses a batch_sampler, or batch_size=None); "
                "pass its dataset and global_batch_size= instead"
            )
        if isinstance(sampler, DistributedSampler):
            if sampler.num_replicas != processes:
                raise ValueError(
                    f"ShardedLoader: the loader's DistributedSampler splits the data over num_replicas="
                    f"{sampler.num_replicas} processes, but this run has {processes}; pass the dataset instead"
                )
            batch = loader.batch_size * sampler.num_replicas
            shuffle = sampler.shuffle if shuffle is None else shuffle
            seed = sampler.seed if seed is None else seed
        elif isinstance(sampler, (RandomSampler, SequentialSampler)):
            if isinstance(sampler, RandomSampler) and (sampler.replacement or sampler._num_samples is not None):
                raise TypeError(
                    "ShardedLoader: the loader's RandomSampler draws with replacement or a fixed num_samples, which "
                    "cannot be split over processes; pass the dataset (ShardedLoader shuffles without replacement)"
                )
            batch = loader.batch_size
            shuffle = isinstance(sampler, RandomSampler) if shuffle is None else shuffle
        else:
            raise TypeError(
                f"ShardedLoader: the loader samples with a {type(sampler).__name__}, which cannot be split over "
                "processes with equal shares; pass its dataset (and global_batch_size=) instead"
            )
        if global_batch_size is not None and global_batch_size != batch:
            raise ValueError(
                f"ShardedLoader: global_batch_size={global_batch_size} differs from the loader's global batch of "
                f"{batch}; pass one of them"
            )
        return loader.dataset, batch, shuffle, seed

    def _config(self) -> dict[str, Any]:
        return {
            "dataset_size": self._size,
            "global_batch_size": self.global_batch_size,
            "local_instances": self.n,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "last_batch": self.last_batch,
        }

    def _agree(self, processes: int) -> None:
        """Every process passed the same settings (else all of them raise, naming each rank's)."""
        if processes == 1:
            return
        mine = self._config()
        everyone: list[Any] = [None] * processes
        dist.all_gather_object(everyone, mine)
        differ = [k for k in mine if any(c[k] != everyone[0][k] for c in everyone)]
        if differ:
            detail = "; ".join(
                f"{k}: " + ", ".join(f"rank {r}: {c[k]!r}" for r, c in enumerate(everyone)) for k in differ
            )
            raise ValueError(
                f"ShardedLoader: the processes disagree on {', '.join(differ)} ({detail}). Every process must build "
                "the loader over the same data with the same settings: otherwise their epochs would end at "
                "different steps and a collective would wait for a process that has stopped."
            )

    # ----------------------------------------------------------------- position

    @property
    def epoch(self) -> int:
        """The epoch the next ``for`` loop runs (0 first)."""
        return self._epoch

    @property
    def step(self) -> int:
        """How many batches of the current epoch have been handed out."""
        return self._step

    def __len__(self) -> int:
        return self.steps_per_epoch

    def set_epoch(self, epoch: int) -> None:
        """Starts ``epoch`` from its first step at the next ``for`` loop (its shuffle
        depends on ``seed`` and ``epoch`` only)."""
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise ValueError(f"ShardedLoader.set_epoch: epoch must be a non-negative int, got {epoch!r}")
        self._epoch, self._step = epoch, 0

    def state_dict(self) -> dict[str, Any]:
        """The position in the data (epoch, and batches handed out in it) and the settings
        that define the order, for :func:`torchpmap.checkpoint.save`.

        Example:
            >>> import itertools, torch
            >>> from torchpmap.data import ShardedLoader
            >>> loader = ShardedLoader(torch.arange(12.), global_batch_size=4, n=1, seed=3)
            >>> first, second = [b.tolist() for b in itertools.islice(loader, 2)]  # stop after 2 steps
            >>> state = loader.state_dict()
            >>> state["epoch"], state["step"]
            (0, 2)
            >>> again = ShardedLoader(torch.arange(12.), global_batch_size=4, n=1, seed=3)
            >>> again.load_state_dict(state)            # resumes at the third batch of epoch 0
            >>> [b.tolist() for b in again] == [b.tolist() for b in loader]
            True
        """
        order = {k: v for k, v in self._config().items() if k != "local_instances"}
        return {"epoch": self._epoch, "step": self._step, **order}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resumes at the position of :meth:`state_dict`.

        The order-defining settings (dataset size, global batch size, shuffle, seed,
        last_batch) must be those the state was saved with; the number of processes
        and of local instances may differ (with ``last_batch="drop"`` a global step
        holds the same examples whatever the number of processes).
        """
        mine = self._config()
        differ = [
            f"{k}: saved {state[k]!r}, here {mine[k]!r}"
            for k in ("dataset_size", "global_batch_size", "shuffle", "seed", "last_batch")
            if k in state and state[k] != mine[k]
        ]
        if differ:
            raise ValueError(
                "ShardedLoader.load_state_dict: the saved position belongs to another data order ("
                + "; ".join(differ)
                + "); build the loader with the saved settings to resume"
            )
        epoch, step = state["epoch"], state["step"]
        if not (isinstance(epoch, int) and epoch >= 0 and isinstance(step, int) and 0 <= step <= self.steps_per_epoch):
            raise ValueError(
                f"ShardedLoader.load_state_dict: position epoch={epoch!r}, step={step!r} is outside an epoch of "
                f"{self.steps_per_epoch} steps"
            )
        self._epoch, self._step = epoch, step

    # ----------------------------------------------------------------- iteration

    def _indices(self, epoch: int) -> list[int]:
        """This process' dataset indices for ``epoch``: of each global batch of the
        epoch's order (cut to whole batches, or padded by wrapping around to its first
        examples), this process' consecutive share."""
        self._order.manual_seed(self.seed + epoch)
        order = list(self._sampler)
        B, b = self.global_batch_size, self.process_batch_size
        length = self.steps_per_epoch * B
        if len(order) < length:  # pad: the epoch's first examples again
            order = (order * -(-length // len(order)))[:length]
        first = self._rank * b
        return [i for j in range(self.steps_per_epoch) for i in order[j * B + first : j * B + first + b]]

    def _worker_seed(self, epoch: int) -> int:
        return ((self.seed * 1_000_003 + epoch) * 1_009 + self._rank) % 2**63

    def _batches(self, epoch: int, start: int) -> Iterator[Any]:
        """This process' collated batches of ``epoch`` from step ``start`` (runs in the prefetch thread)."""
        b = self.process_batch_size
        indices = self._indices(epoch)[start * b :]
        generator = torch.Generator()
        generator.manual_seed(self._worker_seed(epoch))  # DataLoader draws the workers' base seed from it
        loader = DataLoader(
            self.dataset, batch_size=b, sampler=indices, drop_last=False, generator=generator, **self._settings
        )
        for step, batch in enumerate(loader, start):
            if self.mask:  # a position of the epoch's order past the dataset is a repeat
                positions = step * self.global_batch_size + self._rank * b + torch.arange(b)
                yield batch, positions < self._size
            else:
                yield batch

    def __iter__(self) -> Iterator[Any]:
        epoch, start = self._epoch, self._step
        if start < self.steps_per_epoch:
            batches = prefetch_to_device(self._batches(epoch, start), size=self.prefetch, n=self.n)
            try:
                for batch in batches:
                    self._step += 1
                    yield batch
            finally:
                batches.close()  # stops the prefetch thread after a break
        self._epoch, self._step = epoch + 1, 0

    def __repr__(self) -> str:
        return (
            f"ShardedLoader({len(self.dataset)} examples, global_batch_size={self.global_batch_size}, "
            f"{self._processes} process(es) x n={self.n}, {self.steps_per_epoch} steps per epoch, "
            f"last_batch={self.last_batch!r}, epoch={self._epoch}, step={self._step})"
        )
