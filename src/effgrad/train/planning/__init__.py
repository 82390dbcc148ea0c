"""Fitting a train step to a memory budget: ``effgrad.plan`` and ``build_train_step(micro_batches="auto")``.

``search`` (pure Python: the algorithm), ``harness`` (TensorFlow: real steps measured, state
restored), ``plan`` (the entry point, the floor and the plan's table), ``planned_step`` (the step
that plans at its first call).
"""
