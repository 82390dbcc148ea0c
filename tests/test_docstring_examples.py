"""Docstring examples run (doctest) for the objects whose examples are self-contained."""

import doctest
import inspect

import keras
import numpy as np
import pytest
import tensorflow as tf

import effgrad
from effgrad import _proof
from effgrad.remat import activations
from effgrad.train import accumulate, compact, shard
from effgrad.train.compact import codec

EXAMPLES = [
    effgrad.build_train_step,
    effgrad.attach,
    effgrad.checkpoint_model,
    effgrad.plan,
    effgrad.MemoryMonitor,
    effgrad.StaticLossScale,
    effgrad.DynamicLossScale,
    effgrad.saliency_summary,
    effgrad.fused_sparse_cross_entropy,
    effgrad.compact_state,
    effgrad.attention,
    effgrad.efficient_attention,
    compact,  # the module's example
    activations,
    codec,
    _proof,
    accumulate.Accumulators,
    shard,
]


def _name(obj):
    return getattr(obj, "__qualname__", obj.__name__)


@pytest.mark.parametrize("obj", EXAMPLES, ids=_name)
def test_docstring_example_runs(obj):
    globs = {
        **vars(inspect.getmodule(obj)),
        "effgrad": effgrad,
        "keras": keras,
        "np": np,
        "tf": tf,
        **{n: getattr(effgrad, n) for n in effgrad.__all__},
    }
    tests = doctest.DocTestFinder(recurse=False).find(obj, _name(obj), globs=globs)
    assert tests and tests[0].examples, f"{_name(obj)} has no example"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in tests:
        runner.run(test)
    assert runner.failures == 0
