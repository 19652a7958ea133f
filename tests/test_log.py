"""The torchpmap logger reports what the library decides."""
import logging

import torch

import torchpmap as tp


def test_the_engine_and_a_fallback_are_logged(caplog):
    caplog.set_level(logging.DEBUG, logger="torchpmap")
    tp.pmap(lambda v: v * 2, devices=tp.devices()[:1])(torch.ones(4))
    assert "map over axis None: 4 instances on cpu:0, engine: vectorized" in caplog.text
    caplog.clear()
    with_branch = tp.pmap(lambda v: v * 2 if v.sum() > 0 else v, devices=tp.devices()[:1])
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tp.VectorizationFallbackWarning)
        with_branch(torch.arange(-4.0, 4.0).reshape(4, 2))  # the branch differs between instances
    assert any(r.levelno == logging.INFO and "run one at a time from now on" in r.getMessage() for r in caplog.records)


def test_nothing_is_printed_without_configuration(capsys):
    tp.pmap(lambda v: v + 1)(torch.ones(2))
    captured = capsys.readouterr()
    assert captured.out == "" and "torchpmap" not in captured.err
