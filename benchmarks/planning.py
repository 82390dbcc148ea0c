"""effgrad.plan on architectures it was not designed for: does the budget hold, how long does planning take.

A matrix of architectures from different families, split BEFORE the planner's design was frozen into a
calibration half (looked at while designing) and a validation half (run once the design was frozen):

    calibration   plain CNN, ResNet50, DenseNet121, LSTM classifier, keras_hub GPT-2 LM (tied head, V=50,257),
                  VGG16 fine-tuned (weights dominate)
    validation    MobileNetV2, GRU classifier, keras_hub BERT encoder classifier, causal LM with an untied head
                  (V=32,000), a two-input model (image and table)

Each at three budgets: roomy (1.3x the default step's peak), tight (half way from the smallest peak
any configuration reaches to the default step's) and impossible (0.9x that smallest peak). Every
measurement is a fresh process:

* ``probe``: the default step's first call (trace and call: the unit of planning time) and its peak,
  counted as the planner counts (resident state from shapes plus what a call adds), and by hand the
  smallest peaks of the search space: one row per micro-batch, with and without checkpointing;
* ``plan``: ``effgrad.plan`` at the budget: its time (in default first calls), its choice, or its refusal;
* ``again``: the chosen configuration built by hand and measured as the planner measures: within the budget?
* ``fit``: ``attach(micro_batches="auto", memory_budget=...)`` and ``model.fit``: the allocator's peak over
  two epochs after planning against the plan's own measurement;
* ``fastest`` (tight budgets): by hand, the micro-batched and the checkpointed families (one trace each)
  at k = 1, 2, 4, ...: the fastest configuration whose peak fits, against the plan's choice.
"""

from __future__ import annotations

import gc
import json
import time

from benchmarks import common

MODULE = "benchmarks.planning"

CALIBRATION = ["plain_cnn", "resnet50", "densenet121", "lstm", "gpt2_lm", "vgg16_finetune"]
VALIDATION = ["mobilenetv2", "gru", "bert_encoder", "untied_lm", "two_inputs"]


def _setup(kind: str):
    """``(model, x, y, loss, optimizer)`` of one architecture (nothing downloaded)."""
    import keras
    import numpy as np

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    images = lambda n, s: rng.uniform(0, 1, (n, s, s, 3)).astype("float32")  # noqa: E731
    app = dict(weights=None, classes=10, classifier_activation=None)  # logits, as the loss takes them
    adam, sgd = keras.optimizers.Adam(1e-4), keras.optimizers.SGD(0.01, momentum=0.9)
    if kind == "quick":
        layers = [keras.Input((16,))] + [keras.layers.Dense(32, activation="relu") for _ in range(3)]
        model = keras.Sequential([*layers, keras.layers.Dense(4)])
        return model, rng.normal(size=(256, 16)).astype("float32"), rng.integers(0, 4, 256), loss, adam
    if kind == "plain_cnn":
        layers = [keras.Input((32, 32, 3))]
        for width in (32, 32, 64, 64, 128, 128):
            layers.append(keras.layers.Conv2D(width, 3, padding="same", activation="relu"))
        layers += [keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)]
        return keras.Sequential(layers), images(64, 32), rng.integers(0, 10, 64), loss, sgd
    if kind == "resnet50":
        model = keras.applications.ResNet50(input_shape=(64, 64, 3), **app)
        return model, images(32, 64), rng.integers(0, 10, 32), loss, adam
    if kind == "densenet121":
        model = keras.applications.DenseNet121(input_shape=(64, 64, 3), **app)
        return model, images(32, 64), rng.integers(0, 10, 32), loss, sgd
    if kind in ("lstm", "gru"):
        rnn = keras.layers.LSTM if kind == "lstm" else keras.layers.GRU
        model = keras.Sequential([keras.Input((200,), dtype="int32"), keras.layers.Embedding(20000, 128),
                                  rnn(256, return_sequences=True), rnn(256), keras.layers.Dense(2)])  # fmt: skip
        x = rng.integers(1, 20000, (128, 200)).astype("int32")
        return model, x, rng.integers(0, 2, 128), loss, adam if kind == "lstm" else sgd
    if kind == "gpt2_lm":
        import keras_hub

        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=50257, num_layers=2, num_heads=4, hidden_dim=256, intermediate_dim=1024,
            max_sequence_length=256,
        )  # fmt: skip
        model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
        tokens = rng.integers(1, 50257, (8, 256)).astype("int32")
        x = {"token_ids": tokens, "padding_mask": np.ones((8, 256), "int32")}
        return model, x, np.roll(tokens, -1, 1), loss, keras.optimizers.AdamW(1e-4)
    if kind == "vgg16_finetune":  # 128 MiB of weights, activations a tenth of the gradients
        model = keras.applications.VGG16(input_shape=(32, 32, 3), **app)
        return model, images(16, 32), rng.integers(0, 10, 16), loss, adam
    if kind == "mobilenetv2":
        model = keras.applications.MobileNetV2(input_shape=(64, 64, 3), **app)
        return model, images(64, 64), rng.integers(0, 10, 64), loss, adam
    if kind == "bert_encoder":
        import keras_hub

        backbone = keras_hub.models.BertBackbone(
            vocabulary_size=30522, num_layers=4, num_heads=4, hidden_dim=256, intermediate_dim=1024,
            max_sequence_length=128,
        )  # fmt: skip
        inputs = {k: keras.Input((128,), dtype="int32", name=k) for k in ("token_ids", "segment_ids", "padding_mask")}
        model = keras.Model(inputs, keras.layers.Dense(3)(backbone(inputs)["pooled_output"]))
        tokens = rng.integers(1, 30522, (32, 128)).astype("int32")
        x = {"token_ids": tokens, "segment_ids": np.zeros_like(tokens), "padding_mask": np.ones_like(tokens)}
        return model, x, rng.integers(0, 3, 32), loss, adam
    if kind == "untied_lm":
        import keras_hub

        tokens = keras.Input((256,), dtype="int32")
        h = keras_hub.layers.TokenAndPositionEmbedding(32000, 256, 256)(tokens)
        for _ in range(2):
            h = keras_hub.layers.TransformerDecoder(1024, 4)(h)
        model = keras.Model(tokens, keras.layers.Dense(32000)(h))  # its own head: no tied embedding
        x = rng.integers(1, 32000, (8, 256)).astype("int32")
        return model, x, np.roll(x, -1, 1), loss, keras.optimizers.AdamW(1e-4)
    if kind == "two_inputs":
        image, table = keras.Input((32, 32, 3), name="image"), keras.Input((64,), name="table")
        h = image
        for width in (32, 64, 64):
            h = keras.layers.Conv2D(width, 3, padding="same", activation="relu")(h)
        h = keras.layers.GlobalAveragePooling2D()(h)
        t = keras.layers.Dense(256, activation="relu")(table)
        model = keras.Model([image, table], keras.layers.Dense(5)(keras.layers.Concatenate()([h, t])))
        return (
            model,
            [images(128, 32), rng.normal(size=(128, 64)).astype("float32")],
            rng.integers(0, 5, 128),
            loss,
            sgd,
        )
    raise ValueError(kind)


def _rows(x) -> int:
    import tensorflow as tf

    return int(tf.nest.flatten(x)[0].shape[0])


def _peak(model, loss, optimizer, x, y, micro_batches, segments=None, calls=2, step=None):
    """``(peak as the planner counts it, seconds, step)`` of one configuration (a step made if not given)."""
    import effgrad
    from effgrad.train.planning import harness

    if step is None:
        trained = model if segments is None else effgrad.checkpoint_model(model, segments)
        options = {"micro_batches": max(micro_batches, 2)} if micro_batches > 1 or segments else {}
        step = effgrad.build_train_step(trained, loss, optimizer, **options)
    step.micro_batches = micro_batches
    float(step(x, y)["loss"])
    resident = harness.nbytes([*model.variables, *optimizer.variables]) + sum(
        a.nbytes for a in __import__("tensorflow").nest.flatten((x, y))
    )
    resident += 0 if step.accumulators is None else step.accumulators.nbytes
    extras, times = [], []
    for _ in range(calls):
        start = time.perf_counter()
        extras.append(effgrad.memory.measure(lambda: step(x, y)["loss"]).extra_bytes)
        times.append(time.perf_counter() - start)
    return resident + max(extras), min(times), step


def child(config: dict) -> dict:
    import tensorflow as tf

    import effgrad
    from effgrad.train.planning import harness

    model, x, y, loss, optimizer = _setup(config["model"])
    role, rows = config["role"], _rows(x)
    if role == "probe":
        start = time.perf_counter()
        step = effgrad.build_train_step(model, loss, optimizer)
        float(step(x, y)["loss"])
        first_s = time.perf_counter() - start
        plain, plain_s, _ = _peak(model, loss, optimizer, x, y, 1, step=step)
        smallest = {"micro": _peak(model, loss, optimizer, x, y, rows)[0]}
        segments = harness.segment_choices(model)
        if segments:
            smallest["checkpointed"] = _peak(model, loss, optimizer, x, y, rows, segments[0])[0]
        return {"first_s": first_s, "plain": plain, "plain_s": plain_s, "smallest": smallest,
                "segments": segments[0] if segments else None, "seconds": plain_s}  # fmt: skip
    budget = config["budget"]
    if role == "plan":
        start = time.perf_counter()
        try:
            plan = effgrad.plan(model, loss, optimizer, x, y, memory_budget=budget, verbose=False)
        except ValueError as err:
            return {"plan_s": time.perf_counter() - start, "refused": str(err)[:300], "seconds": 0.0}
        return {
            "plan_s": time.perf_counter() - start,
            "chosen": {"micro_batches": plan.micro_batches, "segments": plan.segments},
            "peak": plan.peak_bytes,
            "step_s": plan.seconds_per_step,
            "measured": sum(bool(c.peaks) for c in plan.table),
            "seconds": 0.0,
        }
    if role == "again":
        chosen = config["chosen"]
        peak, seconds, _ = _peak(model, loss, optimizer, x, y, chosen["micro_batches"], chosen["segments"], calls=3)
        return {"peak": peak, "step_s": seconds, "seconds": seconds}
    if role == "fit":
        gc.collect()
        model.compile(optimizer=optimizer, loss=loss, weighted_metrics=[])
        effgrad.attach(model, micro_batches="auto", memory_budget=budget, verbose=False)
        try:
            model.fit(x, y, batch_size=rows, epochs=1, verbose=0)  # plans at its first batch, then trains
        except ValueError as err:  # refused in this process
            return {"fit_peak": None, "refused": str(err)[:300], "seconds": 0.0}
        base = effgrad.memory.current_bytes()
        tf.config.experimental.reset_memory_stats("CPU:0")
        model.fit(x, y, batch_size=rows, epochs=2, verbose=0)  # training with the plan, everything resident
        extra = tf.config.experimental.get_memory_info("CPU:0")["peak"] - base
        plan = model.effgrad_plan
        resident = harness.nbytes([*model.variables, *optimizer.variables]) + sum(
            a.nbytes for a in tf.nest.flatten((x, y))
        )
        resident += 0 if plan.accumulators is None else plan.accumulators.nbytes
        return {"fit_peak": resident + extra, "plan_peak": plan.peak_bytes, "seconds": 0.0}
    if role == "fastest":  # by hand: each family on one trace, k = 1, 2, 4, ... until one fits
        fits, segments = [], config["segments"]
        for family in [None] + ([segments] if segments else []):
            step, k = None, 1 if family else 2
            if family is None:  # the default step first
                peak, seconds, _ = _peak(model, loss, optimizer, x, y, 1)
                if peak <= budget:
                    fits.append((seconds, 1, None, peak))
            while k <= rows:
                peak, seconds, step = _peak(model, loss, optimizer, x, y, k, family, step=step)
                if peak <= budget:
                    fits.append((seconds, k, family, peak))
                    break
                k *= 2
        best = min(fits, key=lambda fit: fit[0], default=None)  # by time (a tie would compare None with an int)
        if best is None:
            return {"fastest_s": None, "seconds": 0.0}
        return {"fastest_s": best[0], "fastest": _label(best[1], best[2]), "fastest_peak": best[3],
                "seconds": 0.0}  # fmt: skip
    raise ValueError(role)


def _label(micro_batches: int, segments: int | None) -> str:
    return f"k={micro_batches}, seg={segments or '-'}"


def _mib(nbytes):
    return None if nbytes is None else nbytes / 2**20


def run(
    quick: bool = False,
    halves: tuple[str, ...] = ("calibration", "validation"),
    budgets: tuple[str, ...] = ("roomy", "tight", "impossible"),
    models: tuple[str, ...] | None = None,
) -> dict:
    """Runs ``halves`` (their ``models``: all when None) at ``budgets`` (``python -c "from benchmarks import
    planning; planning.run(halves=('validation',))"`` runs one); the published table keeps the rows not run."""
    chosen_budgets = budgets
    matrix = {"calibration": CALIBRATION, "validation": VALIDATION}
    halves = {"quick": ["quick"]} if quick else {half: matrix[half] for half in halves}
    halves = {half: [m for m in names if models is None or m in models] for half, names in halves.items()}
    running = {(half, m) for half, names in halves.items() for m in names}
    published = common.RESULTS / "planning.json"
    rows = [] if quick or not published.exists() else [
        row for row in json.loads(published.read_text())["rows"]
        if row.get("half") in matrix and (row["half"], row["model"]) not in running
    ]  # fmt: skip
    for half, names in halves.items():
        for model in names:
            probe = common.run_isolated(MODULE, {"model": model, "role": "probe"}, timeout=3600)
            # The smallest peak of the search space: the plain step's is the smallest where its updates run
            # inside backward and micro-batches add accumulators.
            smallest = min(probe["plain"], *probe["smallest"].values())
            budgets = {
                "roomy": int(1.3 * probe["plain"]),
                "tight": int(smallest + 0.5 * (probe["plain"] - smallest)),
                "impossible": int(0.9 * smallest),
            }
            if quick:  # a plan (tight: the search, not its first measurement) and a refusal
                del budgets["roomy"]
            budgets = {name: size for name, size in budgets.items() if name in chosen_budgets}
            for name, budget in budgets.items():
                row = {"half": half, "model": model, "budget": name, "budget_mib": _mib(budget)}
                row.update(first_s=probe["first_s"], plain_mib=_mib(probe["plain"]), smallest_mib=_mib(smallest))
                plan = common.run_isolated(MODULE, {"model": model, "role": "plan", "budget": budget}, timeout=3600)
                row["plan_s"] = plan["plan_s"]
                row["plan_x_first"] = plan["plan_s"] / probe["first_s"]
                if "refused" in plan:
                    row["chosen"] = "refused"
                    # Right when the smallest measured by hand does not fit either; the planner also keeps a reserve
                    # below the budget (docs/planning.md), so a refusal of a peak just under it can be wrong here.
                    row["refusal_right"] = smallest > budget
                    row["smallest_vs_budget"] = smallest / budget
                else:
                    chosen = plan["chosen"]
                    row["chosen"] = _label(chosen["micro_batches"], chosen["segments"])
                    row["plan_mib"] = _mib(plan["peak"])
                    again = common.run_isolated(
                        MODULE, {"model": model, "role": "again", "budget": budget, "chosen": chosen}, timeout=3600
                    )
                    row["again_mib"] = _mib(again["peak"])
                    row["fits_fresh"] = again["peak"] <= budget
                    fit = common.run_isolated(MODULE, {"model": model, "role": "fit", "budget": budget}, timeout=3600)
                    if fit["fit_peak"] is not None:
                        row["fit_vs_plan"] = fit["fit_peak"] / plan["peak"]
                    else:
                        row["fit_refused"] = fit["refused"]
                    row["fit_within_budget"] = fit["fit_peak"] is not None and fit["fit_peak"] <= budget
                    if name == "tight" and not quick:
                        fastest = common.run_isolated(
                            MODULE,
                            {"model": model, "role": "fastest", "budget": budget, "segments": probe["segments"]},
                            timeout=3600,
                        )
                        if fastest["fastest_s"]:
                            row["vs_fastest"] = again["step_s"] / fastest["fastest_s"]
                            row["fastest"], row["fastest_mib"] = fastest["fastest"], _mib(fastest["fastest_peak"])
                rows.append(row)
                print(row, flush=True)
    columns = [
        ("half", "half", ""),
        ("model", "model", ""),
        ("budget", "budget", ""),
        ("budget_mib", "MiB", ".1f"),
        ("chosen", "chosen", ""),
        ("plan_s", "plan s", ".1f"),
        ("plan_x_first", "plan / first call", ".1f"),
        ("plan_mib", "plan MiB", ".1f"),
        ("again_mib", "again MiB (fresh)", ".1f"),
        ("fits_fresh", "fits fresh", ""),
        ("fit_vs_plan", "fit / plan peak", ".2f"),
        ("fit_within_budget", "fit within budget", ""),
        ("vs_fastest", "time / fastest", ".2f"),
        ("fastest", "fastest by hand", ""),
        ("fastest_mib", "its MiB", ".1f"),
        ("refusal_right", "refusal right", ""),
        ("smallest_vs_budget", "smallest by hand / budget", ".2f"),
    ]
    rows.sort(key=lambda row: row["half"] == "validation")  # calibration first, whichever ran last
    return common.publish(
        "planning", "Planning on a matrix of architectures (calibration and validation halves)", rows, columns
    )


if __name__ == "__main__":
    common.child_main(child)
