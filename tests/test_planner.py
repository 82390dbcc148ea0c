"""effgrad.plan on real models: the plan fits, is still the exact update, and planning changes nothing.

The search's decisions are tested against synthetic curves in test_planning_search.py; here, what only
TensorFlow can show.
"""

import functools

import keras
import numpy as np
import pytest

import effgrad
from effgrad.train.planning import harness

_LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _wide_mlp(seed=0):
    """Activations dominate (batch 1024 x 8 layers x 256 units against 0.4M weights): the planning regime."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input((32,))] + [keras.layers.Dense(256, activation="relu") for _ in range(8)] + [keras.layers.Dense(4)]
    )


def _conv(seed=0):
    """Each kind of state planning must restore (BatchNormalization statistics, a Dropout's seed) in one
    residual block, cut into 2 segments for the checkpointed family: each block more lengthens every trace
    a plan makes (planning three blocks took twice as long)."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((16, 16, 3))
    h = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(inputs)
    r = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(h)
    h = keras.layers.Add()([h, keras.layers.BatchNormalization()(r)])
    h = keras.layers.GlobalAveragePooling2D()(h)
    return keras.Model(inputs, keras.layers.Dense(4)(keras.layers.Dropout(0.2)(h)))


def _data(rng, shape, n):
    return rng.normal(size=(n, *shape)).astype("float32"), rng.integers(0, 4, n)


def _plain_peak(model, x, y, optimizer):
    """The plain step's peak as the planner counts it (resident state from shapes, what a call adds)."""
    step = effgrad.build_train_step(model, _LOSS, optimizer)
    step(x, y)
    report = effgrad.memory.measure(lambda: step(x, y)["loss"])
    return harness.nbytes([*model.variables, *optimizer.variables]) + x.nbytes + y.nbytes + report.extra_bytes


@functools.cache
def _wide_mlp_budget() -> int:
    """70% of the plain SGD step's peak of the wide MLP on a batch of 1024: it does not fit, micro-batches do.

    A peak depends on the shapes, not on the values, nor on SGD's learning rate: measured once per process
    (a trace and three calls) for the tests that plan this model."""
    x, y = _data(np.random.default_rng(0), (32,), 1024)
    return int(0.7 * _plain_peak(_wide_mlp(), x, y, keras.optimizers.SGD(0.1)))


def test_the_plan_fits_its_budget_and_measures_the_same_again(rng):
    x, y = _data(rng, (32,), 1024)
    budget = _wide_mlp_budget()
    model = _wide_mlp()
    plan = effgrad.plan(model, _LOSS, keras.optimizers.SGD(0.1), x, y, memory_budget=budget, verbose=False)
    assert plan.micro_batches > 1 and plan.peak_bytes <= budget
    assert "<- chosen" in str(plan)
    # The chosen configuration built by hand, measured again as the planner measures: within the budget.
    again = effgrad.build_train_step(plan.model, _LOSS, keras.optimizers.SGD(0.1), micro_batches=plan.micro_batches)
    again(x, y)
    extra = max(effgrad.memory.measure(lambda: again(x, y)["loss"]).extra_bytes for _ in range(2))
    resident = harness.nbytes(model.variables) + again.accumulators.nbytes + x.nbytes + y.nbytes
    assert resident + extra <= budget


def test_planned_step_is_a_train_step_and_still_the_full_batch_update(rng):
    x, y = _data(rng, (32,), 1024)
    planned_model, plain_model = _wide_mlp(), _wide_mlp()
    budget = _wide_mlp_budget()
    step = effgrad.build_train_step(
        planned_model, _LOSS, keras.optimizers.SGD(0.1), micro_batches="auto", memory_budget=budget,
        loss_scale="dynamic", verbose=False,
    )  # fmt: skip
    assert isinstance(step, effgrad.TrainStep) and step.micro_batches == "auto" and step.plan is None
    step(x, y)
    step(x, y)
    assert step.plan.peak_bytes <= budget and step.micro_batches == step.plan.micro_batches > 1
    assert step.accumulators is step.plan.accumulators  # those the plan measured with, as allocated
    plain = effgrad.build_train_step(plain_model, _LOSS, keras.optimizers.SGD(0.1), loss_scale="dynamic")
    plain(x, y)
    plain(x, y)
    for a, b in zip(planned_model.get_weights(), plain_model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # The step's own loss scale, stepped by planning's calls, was restored: two steps' worth.
    for a, b in zip(step.loss_scale.variables, plain.loss_scale.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_planning_changes_no_variable_slot_iteration_statistic_or_seed(rng, capsys):
    model = _conv()
    x, y = _data(rng, (16, 16, 3), 64)
    optimizer = keras.optimizers.Adam(1e-3)
    effgrad.build_train_step(model, _LOSS, optimizer)(x, y)  # slots and iterations exist and are non-zero
    # Every other optimizer variable (the iteration count among them) zero again, as an optimizer built and
    # never stepped has them: planning keeps no host copy of a zero state, and must restore both kinds.
    for v in optimizer.variables[::2]:
        v.assign(np.zeros(v.shape, v.dtype))
    before = [v.numpy().copy() for v in [*model.variables, *optimizer.variables]]
    state = [b.any() for b in before[len(model.variables) :]]
    assert not all(state) and any(state)
    assert any("seed" in v.path for v in model.variables)  # the Dropout's RNG state is among them
    # Tight: above the 0.3 MiB that weights, Adam's state and the batch take (so the planner measures), and
    # one convolution's output (1 MiB) at most: the plain step and micro-batches are measured. Whether the
    # checkpointed family is too depends on measured times and on the kernels (with oneDNN's, micro-batches
    # alone were chosen in a full run), so it is not required here.
    capsys.readouterr()
    try:  # the plain step measured, then micro-batches and checkpointing
        effgrad.plan(model, _LOSS, optimizer, x, y, memory_budget="1MiB", verbose=True)
    except ValueError:
        pass  # nothing fit: planning still ran steps, and still changes nothing
    said = capsys.readouterr().err  # measured: the plain step, micro-batched (and perhaps checkpointed)
    assert "segments=- (the plain step):" in said and "segments=-:" in said, said
    for a, b in zip(before, [v.numpy() for v in [*model.variables, *optimizer.variables]]):
        np.testing.assert_array_equal(a, b)


def test_planning_under_a_mirrored_strategy_restores_every_replica(rng, strategy):
    with strategy.scope():
        model = _conv()
        optimizer = keras.optimizers.Adam(1e-3)
        optimizer.build(model.trainable_variables)
    x, y = _data(rng, (16, 16, 3), 64)
    # Replicas' values differ in training: Keras updates mirrored BatchNormalization statistics on each
    # replica from its own half of the batch. Here every replica's copy of every variable, slot and the
    # iteration count is set apart from the other's (assigned: a traced step costs 4 s).
    state = [v.value for v in [*model.variables, *optimizer.variables]]
    for v in state:
        for i, r in enumerate(v.values):
            r.assign(r.numpy() + np.asarray((i + 1) * (1 if r.dtype.is_integer else 1e-3), r.dtype.as_numpy_dtype))
    before = [[r.numpy().copy() for r in v.values] for v in state]
    assert any(not np.array_equal(*values) for values in before)
    plan = effgrad.plan(model, _LOSS, optimizer, x, y, memory_budget="1GiB", strategy=strategy, verbose=False)
    assert plan.table[0].peaks  # steps ran, on both replicas
    for values, v in zip(before, state):
        for a, r in zip(values, v.values):
            np.testing.assert_array_equal(a, r.numpy())


def test_a_budget_below_what_never_shrinks_is_refused_from_shapes_before_any_trace(rng, monkeypatch):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((1024,)), keras.layers.Dense(1024), keras.layers.Dense(4)])
    x, y = _data(rng, (1024,), 8)
    monkeypatch.setattr(effgrad.TrainStep, "__call__", lambda *a, **k: pytest.fail("traced a step"))
    with pytest.raises(ValueError, match=r"at least [\d.]+ MiB \(weights .*optimizer state.*compact_state") as err:
        effgrad.plan(model, _LOSS, keras.optimizers.Adam(), x, y, memory_budget="8MiB", verbose=False)
    assert "\n" not in str(err.value)


def test_nothing_fits_names_the_smallest_peak(rng):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(4)])
    x, y = _data(rng, (32,), 32)
    optimizer = keras.optimizers.Adam()
    optimizer.build(model.trainable_variables)
    # 48.8 KiB: above the 40.1 KiB the shapes alone need, so the planner measures; about 20 KiB below the
    # smallest peak it ever measured (60-86 KiB across runs), so noise in the allocator cannot make it fit.
    with pytest.raises(ValueError, match=r"smallest peak achievable is [\d.,]+ (KiB|MiB) \(micro_batches="):
        effgrad.plan(model, _LOSS, optimizer, x, y, memory_budget=50_000, verbose=False)


def test_attach_plans_at_the_first_fit_and_trains_like_stock_fit(rng, capfd):
    x, y = _data(rng, (32,), 2048)
    planned, stock = _wide_mlp(), _wide_mlp()
    planned.compile(optimizer=keras.optimizers.SGD(0.05), loss=_LOSS)
    stock.compile(optimizer=keras.optimizers.SGD(0.05), loss=_LOSS, run_eagerly=True)  # a reference: untraced
    budget = _wide_mlp_budget()  # the batches fit sees are 1024 rows
    effgrad.attach(planned, micro_batches="auto", memory_budget=budget)
    assert planned.effgrad_plan is None
    capfd.readouterr()
    history = planned.fit(x, y, batch_size=1024, epochs=2, shuffle=False, verbose=0)
    plan = planned.effgrad_plan
    assert plan.micro_batches > 1 and planned.effgrad_step.accumulators is plan.accumulators
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("effgrad plan: ")]
    assert "batch 1024" in lines[0] and lines[-1].startswith("effgrad plan: chose"), lines
    stock_history = stock.fit(x, y, batch_size=1024, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(history.history["loss"], stock_history.history["loss"], rtol=1e-5)
    for a, b in zip(planned.get_weights(), stock.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def _small_mlp():
    """For what any model shows (a 1 GiB budget fits them all): 2 layers are a shorter trace than the wide MLP's 9."""
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((32,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(4)])


def test_budget_keywords_and_planned_step_options(rng):
    model = _small_mlp()
    x, y = _data(rng, (32,), 64)
    with pytest.warns(DeprecationWarning, match="memory_budget"):
        plan = effgrad.plan(model, _LOSS, keras.optimizers.SGD(), x, y, budget="1GiB", verbose=False)
    assert plan.micro_batches == 1
    with pytest.raises(ValueError, match="memory_budget"):
        effgrad.build_train_step(model, _LOSS, keras.optimizers.SGD(), micro_batches="auto")
    with pytest.raises(ValueError, match="micro_batches='auto'"):
        effgrad.build_train_step(model, _LOSS, keras.optimizers.SGD(), micro_batches=2, memory_budget="1GiB")
    with pytest.raises(ValueError, match="memory_budget"):
        effgrad.build_train_step(model, _LOSS, keras.optimizers.SGD(), micro_batches="auto", memory_budget="lots")


def test_plan_command_prints_the_table_for_a_saved_model(tmp_path, capfd):
    from effgrad import cli  # in this process: a TensorFlow import per command would dominate the test

    model = _small_mlp()
    model.compile(optimizer="adam", loss=_LOSS)
    model.save(tmp_path / "m.keras")
    command = ["plan", str(tmp_path / "m.keras"), "--batch-shape", "512,32"]
    assert cli.main([*command, "--budget", "1GiB"]) == 0
    out, err = capfd.readouterr()
    assert "effgrad memory plan: batch 512" in out and "<- chosen" in out, err[-2000:]
    assert cli.main([*command, "--budget", "lots"]) == 2
    assert "budget must be" in capfd.readouterr().err
