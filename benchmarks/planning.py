"""effgrad.plan: how good its predictions are, and what planning costs.

For a wide MLP (8x256, batch 2048) and a residual conv net (32x32x3, batch
256), Adam, in a fresh process each:

* the plain step's peak and the smallest peak (floor) are found;
* for budgets at 90%, 70% and 50% of the way from the floor to the plain
  peak: ``effgrad.plan`` (its time, choice and measured peak), and the
  search users do by hand: double ``micro_batches`` from 1, running real
  steps, until a step fits (its time and choice);
* every candidate of the tables is measured, so each prediction has an
  error: ``predicted / measured - 1``.
"""

from __future__ import annotations

import time

from benchmarks import common

MODULE = "benchmarks.planning"


def _models(kind: str):
    import keras
    import numpy as np

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    if kind == "mlp_8x256_b2048":
        model = keras.Sequential(
            [keras.Input((32,))]
            + [keras.layers.Dense(256, activation="relu") for _ in range(8)]
            + [keras.layers.Dense(4)]
        )
        x = rng.normal(size=(2048, 32)).astype("float32")
    else:
        inputs = keras.Input((32, 32, 3))
        h = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(inputs)
        for _ in range(4):
            r = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(h)
            r = keras.layers.BatchNormalization()(r)
            h = keras.layers.Add()([h, r])
        model = keras.Model(inputs, keras.layers.Dense(4)(keras.layers.GlobalAveragePooling2D()(h)))
        x = rng.normal(size=(256, 32, 32, 3)).astype("float32")
    return model, x, rng.integers(0, 4, len(x))


def child(config: dict) -> dict:
    import keras

    import effgrad
    from effgrad.train import planner

    model, x, y = _models(config["model"])
    if config["quick"]:  # it runs end to end; the numbers come from the full run
        x, y = x[:64], y[:64]
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    optimizer = keras.optimizers.Adam(1e-3)
    roomy = effgrad.plan(model, loss, optimizer, x, y, budget=2**34)
    plain = roomy.peak_bytes
    probe = planner._Planner(model, loss, optimizer, x, y, None, None, 2**34, 0.1, {}, False)
    floor = min(
        probe.measure(len(x), None).measured_bytes, min(c.measured_bytes for c in roomy.table if c.measured_bytes)
    )
    rows, errors = [], []
    for fraction in (0.7,) if config["quick"] else (0.9, 0.7, 0.5):
        budget = int(floor + fraction * (plain - floor))
        start = time.perf_counter()
        try:
            plan = effgrad.plan(model, loss, optimizer, x, y, budget=budget)
        except ValueError:
            plan = None
        plan_seconds = time.perf_counter() - start
        # The search by hand: k = 1, 2, 4, ... real steps until one fits.
        search = planner._Planner(model, loss, optimizer, x, y, None, None, budget, 0.0, {}, False)
        start, k = time.perf_counter(), 1
        while not config["quick"] and k <= len(x) and not search.measure(k, None).fits:
            k *= 2
        search_seconds = time.perf_counter() - start
        if plan is not None:
            # Every candidate's prediction against a measurement (quick: the chosen one's code path).
            chosen = [c for c in plan.table if (c.micro_batches, c.segments) == (plan.micro_batches, plan.segments)]
            table = chosen if config["quick"] else plan.table
            for c in table:
                if c.predicted_bytes is not None:
                    measured = probe.measure(c.micro_batches, c.segments).measured_bytes
                    errors.append(c.predicted_bytes / measured - 1)
        rows.append(
            {
                "model": config["model"],
                "budget_mib": budget / 2**20,
                "plain_mib": plain / 2**20,
                "floor_mib": floor / 2**20,
                "chosen": "-" if plan is None else f"k={plan.micro_batches}, seg={plan.segments or '-'}",
                "peak_mib": None if plan is None else plan.peak_bytes / 2**20,
                "step_s": None if plan is None else plan.seconds_per_step,
                "plan_s": plan_seconds,
                "doubling_search_s": search_seconds,
                "doubling_found": f"k={k}" if k <= len(x) else "none",
                "plain_step_s": roomy.seconds_per_step,
            }
        )
    abs_errors = [abs(e) for e in errors]
    for row in rows:
        row["prediction_error_mean_pct"] = 100 * sum(abs_errors) / max(len(abs_errors), 1)
        row["prediction_error_max_pct"] = 100 * max(abs_errors, default=0.0)
    return {"rows": rows, "seconds": sum(r["plan_s"] for r in rows)}


def run(quick: bool = False) -> dict:
    models = ["mlp_8x256_b2048"] if quick else ["mlp_8x256_b2048", "resnet_conv_32x32_b256"]
    rows = []
    for model in models:
        rows += common.run_isolated(MODULE, {"model": model, "quick": quick}, timeout=3600)["rows"]
    title = (
        "effgrad.plan vs a doubling search of micro_batches that runs real steps (Adam): budgets 90/70/50% of "
        "the way from the smallest to the plain peak; prediction error over every candidate of the tables"
    )
    columns = [
        ("model", "model", ""),
        ("budget_mib", "budget MiB", ",.1f"),
        ("plain_mib", "plain peak MiB", ",.1f"),
        ("floor_mib", "smallest MiB", ",.1f"),
        ("chosen", "plan chose", ""),
        ("peak_mib", "measured MiB", ",.1f"),
        ("step_s", "s/step", ".3f"),
        ("plain_step_s", "plain s/step", ".3f"),
        ("plan_s", "plan s", ".1f"),
        ("doubling_found", "doubling found", ""),
        ("doubling_search_s", "doubling s", ".1f"),
        ("prediction_error_mean_pct", "pred. err mean %", ".1f"),
        ("prediction_error_max_pct", "pred. err max %", ".1f"),
    ]
    return common.publish("planning", title, rows, columns, models=models)


if __name__ == "__main__":
    common.child_main(child)
