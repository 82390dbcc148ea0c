"""Docstring examples run (doctest) for the objects whose examples are self-contained."""

import doctest

import keras
import numpy as np
import pytest
import tensorflow as tf

import effgrad

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
]


@pytest.mark.parametrize("obj", EXAMPLES, ids=lambda o: o.__qualname__)
def test_docstring_example_runs(obj):
    globs = {
        "effgrad": effgrad,
        "keras": keras,
        "np": np,
        "tf": tf,
        **{n: getattr(effgrad, n) for n in effgrad.__all__},
    }
    tests = doctest.DocTestFinder(recurse=False).find(obj, obj.__qualname__, globs=globs)
    assert tests and tests[0].examples, f"{obj.__qualname__} has no example"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in tests:
        runner.run(test)
    assert runner.failures == 0
