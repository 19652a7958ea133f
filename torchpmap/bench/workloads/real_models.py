"""(i) Real models' data-parallel training steps: what a model that vmap cannot vectorize,
or vectorizes slowly, costs under ``data_parallel_step`` on one device.

One row per model (random init, small configs, nothing downloaded), 4 instances of 8
examples, float32, eager and ``jit=True``, against plain PyTorch taking the same step
(the mean of the 4 shards' losses, one shard at a time, as row (h)):

* ``gru``, ``lstm``: vectorized (``data_parallel_step`` gives them an initial state
  batched like the input: ``torchpmap._engines.recurrent``); a float32 ``nn.LSTM``
  still has vmap's per-instance loop inside ``mkldnn_rnn_layer``, whose backward under
  ``torch.func`` is its differentiable math, step by step. (Before: ``nn.GRU`` ran one
  instance at a time, ``VectorizationFallbackWarning``.)
* ``cnn_bn``: a small CNN with batch norm (statistics per shard, as DDP computes them).
* ``bert_padded``, ``gpt2_padded``: Hugging Face models (if ``transformers`` is
  installed) with padding masks, which check the mask's values (``padding_mask.all()``):
  the same on every instance here (every shard has padding), so read once and
  vectorized (before: one instance at a time); the batch is a dict, passed as keyword
  arguments.

Each column computes the averaged loss and the gradients (``optimizer=None``), so repeated
calls do the same work. Dropout is off so that the columns can be compared.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from torchpmap.bench import frameworks as fw
from torchpmap.bench.core import Case, Cell, Config, Workload
from torchpmap.training import data_parallel_step

N, B = 4, 8  # instances, examples per instance
Batch = dict[str, torch.Tensor]


class _Recurrent(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.rnn = getattr(nn, kind)(16, 32, batch_first=True)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0][:, -1])


class _ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).flatten(1))


def _classification(x: torch.Tensor, classes: int) -> Batch:
    g = torch.Generator().manual_seed(1)
    return {"x": x, "y": torch.randint(0, classes, (N * B,), generator=g)}


def _sequences(steps: int) -> Batch:
    return _classification(torch.randn(N * B, steps, 16, generator=torch.Generator().manual_seed(0)), 4)


def _images(side: int) -> Batch:
    return _classification(torch.randn(N * B, 3, side, side, generator=torch.Generator().manual_seed(0)), 10)


def _text(vocab: int, length: int, labels: str) -> Batch:
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, vocab, (N * B, length), generator=g)
    lengths = torch.randint(length // 2, length + 1, (N * B,), generator=g)
    mask = (torch.arange(length) < lengths[:, None]).long()  # padding at the end
    batch = {"input_ids": ids * mask, "attention_mask": mask}
    batch["labels"] = (
        torch.randint(0, 2, (N * B,), generator=g) if labels == "class" else torch.where(mask.bool(), ids, -100)
    )
    return batch


def _cross_entropy(out: torch.Tensor, batch: Batch) -> torch.Tensor:
    return F.cross_entropy(out, batch["y"])


def _own_loss(out: Any, batch: Batch) -> torch.Tensor:
    return out.loss


class _Model:
    """A row: the model, its batch, its loss, and what of the batch the model takes."""

    def __init__(
        self,
        make: Callable[[], nn.Module],
        batch: Batch,
        loss: Callable[[Any, Batch], torch.Tensor],
        inputs: Callable[[Batch], Any],
    ):
        self.make, self.batch, self.loss, self.inputs = make, batch, loss, inputs


def _hugging_face(cfg: Config) -> dict[str, _Model]:
    try:
        import transformers
    except ImportError:
        return {}
    transformers.logging.set_verbosity_error()
    width, length, layers = (16, 8, 1) if cfg.quick else (64, 32, 2)  # quick: less to compile
    bert = transformers.BertConfig(
        vocab_size=100, hidden_size=width, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=2 * width,
        max_position_embeddings=64, num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    gpt2 = transformers.GPT2Config(
        vocab_size=100,
        n_positions=64,
        n_embd=width,
        n_layer=layers,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return {
        "bert_padded": _Model(
            lambda: transformers.BertForSequenceClassification(bert),
            _text(100, length, "class"),
            _own_loss,
            lambda b: b,
        ),
        "gpt2_padded": _Model(
            lambda: transformers.GPT2LMHeadModel(gpt2), _text(100, length, "lm"), _own_loss, lambda b: b
        ),
    }


def _models(cfg: Config) -> dict[str, _Model]:
    steps, side = (8, 8) if cfg.quick else (32, 16)
    x = lambda b: b["x"]  # noqa: E731
    return {
        "gru": _Model(lambda: _Recurrent("GRU"), _sequences(steps), _cross_entropy, x),
        "lstm": _Model(lambda: _Recurrent("LSTM"), _sequences(steps), _cross_entropy, x),
        "cnn_bn": _Model(_ConvNet, _images(side), _cross_entropy, x),
        **_hugging_face(cfg),
    }


def _on(device: torch.device, batch: Batch) -> Batch:
    return {k: v.to(device) for k, v in batch.items()}


def _call(model: nn.Module, inputs: Any) -> Any:
    return model(**inputs) if isinstance(inputs, dict) else model(inputs)


def _torchpmap(cfg: Config, spec: _Model, jit: bool) -> Callable[[], torch.Tensor]:
    torch.manual_seed(0)
    model = spec.make().to(cfg.device)
    step = data_parallel_step(model, spec.loss, None, model_inputs=spec.inputs, devices=fw.torchpmap_devices(), jit=jit)
    batch = {k: v.reshape(N, B, *v.shape[1:]) for k, v in _on(cfg.device, spec.batch).items()}

    def run() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        with warnings.catch_warnings():  # fallbacks and vmap's slow-path notes: measured, not news
            warnings.simplefilter("ignore")
            return step(batch)

    return run


def _plain(cfg: Config, spec: _Model) -> Callable[[], torch.Tensor]:
    torch.manual_seed(0)
    model = copy.deepcopy(spec.make()).to(cfg.device)
    batch = _on(cfg.device, spec.batch)
    shards = [{k: v[i * B:(i + 1) * B] for k, v in batch.items()} for i in range(N)]

    def run() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        loss = torch.stack([spec.loss(_call(model, spec.inputs(s)), s) for s in shards]).mean()
        loss.backward()
        return loss.detach()

    return run


def build(cfg: Config) -> list[Case]:
    cases = []
    for name, spec in _models(cfg).items():
        columns: dict[str, Cell] = {
            "torchpmap": fw.torch_impl(cfg, _torchpmap(cfg, spec, jit=False)),
            "torchpmap.jit": fw.torch_impl(cfg, _torchpmap(cfg, spec, jit=True)),
            "torch": fw.torch_impl(cfg, _plain(cfg, spec)),
        }
        cases.append(Case("real_models", f"{name}[{N}x{B}]", "step", columns, rtol=1e-4, atol=1e-5))
    return cases


WORKLOAD = Workload(
    "real_models",
    f"data-parallel steps of real models ({N} x {B} examples): GRU, LSTM, a CNN with batch norm, "
    "BERT and GPT-2 with padding masks; eager and jit=True",
    build,
)
