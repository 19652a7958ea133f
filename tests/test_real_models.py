"""Real models train under data_parallel_step as in plain PyTorch, on one device and on all.

Each model (random init, tiny config, nothing downloaded) takes a few AdamW steps through
``data_parallel_step`` over 4 instances, and the same model takes the same steps in plain
PyTorch on the mean of the 4 shards' losses; parameters and losses must agree. A model
that ``torch.func.vmap`` cannot run falls back to one instance at a time, with a
:class:`~torchpmap.VectorizationFallbackWarning`, and must still agree; the recurrent
networks (their initial state batched, ``torchpmap._engines.recurrent``) and the Hugging
Face models with padding masks (their ``padding_mask.all()`` read once, the same on
every instance) no longer fall back.
"""
from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchpmap as tp
from torchpmap.training import data_parallel_step, shard

N, B = 4, 3  # instances, examples per instance
STEPS = 3


def _devices() -> list:
    return [tp.devices()[:1], tp.devices()]


def _train_both(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    model_inputs: Callable[[Any], Any],
    devices: list,
    tol: float,
) -> bool:
    """Trains ``model`` with data_parallel_step and a copy in plain PyTorch; returns whether
    vmap fell back to one instance at a time."""
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    step = data_parallel_step(model, loss_fn, opt, model_inputs=model_inputs, devices=devices)
    shards = [torch.utils._pytree.tree_map(lambda t: t[i * B:(i + 1) * B], batch) for i in range(N)]
    fell_back = False
    for _ in range(STEPS):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = step(shard(batch, n=N))
        fell_back |= any(issubclass(w.category, tp.VectorizationFallbackWarning) for w in caught)
        ref_opt.zero_grad()
        ref_loss = torch.stack([loss_fn(_call(reference, model_inputs(s)), s) for s in shards]).mean()
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=tol, atol=tol)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")
    return fell_back


def _call(model: nn.Module, inputs: Any) -> Any:
    return model(**inputs) if isinstance(inputs, dict) else model(inputs)


def _mse_of_y(out: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(out, batch["y"])


def _sequence_batch(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "x": torch.randn(N * B, 5, 3, generator=g, dtype=dtype),
        "y": torch.randn(N * B, 5, 8, generator=g, dtype=dtype),
    }


class _Recurrent(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.rnn = getattr(nn, kind)(3, 8, batch_first=True)

    def forward(self, x):
        return self.rnn(x)[0]


@pytest.mark.parametrize("devices", _devices(), ids=["one", "all"])
@pytest.mark.parametrize(
    "kind, dtype",
    [
        ("GRU", torch.float32),
        ("RNN", torch.float32),
        ("LSTM", torch.float32),
        ("LSTM", torch.float64),
        ("GRU", torch.float64),
    ],
)
def test_recurrent_networks(kind, dtype, devices):
    torch.manual_seed(0)
    model = _Recurrent(kind).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    assert not _train_both(model, _sequence_batch(dtype), _mse_of_y, lambda b: b["x"], devices, tol)


@pytest.mark.parametrize("devices", _devices(), ids=["one", "all"])
def test_transformer_encoder(devices):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True)
    model = nn.Sequential(
        nn.Linear(3, 8), nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    ).double()
    fell_back = _train_both(
        model, _sequence_batch(torch.float64), _mse_of_y, lambda b: b["x"], devices, 1e-10
    )
    assert not fell_back  # vectorized


@pytest.mark.parametrize("devices", _devices(), ids=["one", "all"])
def test_cnn_with_batch_norm(devices):
    # batch statistics per shard, as DDP computes them: the plain step runs shard by shard too
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(4, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(8, 3),
    ).double()
    g = torch.Generator().manual_seed(1)
    batch = {
        "x": torch.randn(N * B, 3, 8, 8, generator=g, dtype=torch.float64),
        "y": torch.randint(0, 3, (N * B,), generator=g),
    }
    fell_back = _train_both(model, batch, lambda out, b: F.cross_entropy(out, b["y"]), lambda b: b["x"], devices, 1e-10)
    assert not fell_back  # vectorized


@pytest.mark.parametrize("devices", _devices(), ids=["one", "all"])
def test_embedding_models(devices):
    torch.manual_seed(0)

    class Bag(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.bag = nn.Embedding(20, 8), nn.EmbeddingBag(20, 8, mode="mean")
            self.out = nn.Linear(16, 2)

        def forward(self, tokens):
            return self.out(torch.cat([self.emb(tokens).mean(1), self.bag(tokens)], -1))

    g = torch.Generator().manual_seed(1)
    batch = {"tokens": torch.randint(0, 20, (N * B, 6), generator=g), "y": torch.randint(0, 2, (N * B,), generator=g)}
    _train_both(
        Bag().double(), batch, lambda out, b: F.cross_entropy(out, b["y"]), lambda b: b["tokens"], devices, 1e-10
    )


# --------------------------------------------------------------------------- Hugging Face transformers


def _text_batch(vocab: int, with_labels: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, vocab, (N * B, 7), generator=g)
    lengths = torch.randint(3, 8, (N * B,), generator=g)
    mask = (torch.arange(7) < lengths[:, None]).long()  # padding at the end: the normal case for real text
    batch = {"input_ids": ids * mask, "attention_mask": mask}
    batch["labels"] = (
        torch.randint(0, 2, (N * B,), generator=g) if with_labels == "class" else torch.where(mask.bool(), ids, -100)
    )
    return batch


@pytest.mark.slow
@pytest.mark.parametrize("devices", _devices(), ids=["one", "all"])
def test_bert_with_padding_masks(devices):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=30, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    model = transformers.BertForSequenceClassification(config).double()
    # the tokenizer's dict goes to the model as keyword arguments; the model computes its loss
    assert not _train_both(model, _text_batch(30, "class"), lambda out, b: out.loss, lambda b: b, devices, 1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("devices", _devices(), ids=["one", "all"])
def test_gpt2_with_padding_masks(devices):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=30, n_positions=16, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    model = transformers.GPT2LMHeadModel(config).double()
    assert not _train_both(model, _text_batch(30, "lm"), lambda out, b: out.loss, lambda b: b, devices, 1e-9)


# --------------------------------------------------------------------------- the fallback itself


def test_a_value_dependent_function_falls_back_once_and_matches_a_loop():
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(3))
    f = tp.pmap(lambda v: tp.psum(v * 2 if v.sum() > 0 else v * v.max().item(), "i"), "i")
    with pytest.warns(tp.VectorizationFallbackWarning, match=r"data-dependent control flow.*one at a time"):
        out = torch.as_tensor(f(x))
    expected = torch.stack([v * 2 if v.sum() > 0 else v * v.max().item() for v in x]).sum(0)
    torch.testing.assert_close(out, expected.expand(8, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # remembered: no second attempt, no second warning
        torch.testing.assert_close(torch.as_tensor(f(x)), expected.expand(8, 3))


def test_a_users_own_error_is_not_retried():
    f = tp.pmap(lambda v: v.reshape(5))  # a plain bug: raised as it is, no fallback
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeError, match="is invalid for input of size"):
            f(torch.zeros(4, 3))
