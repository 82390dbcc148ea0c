"""`effgrad.checkpoint_model` on architectures nobody here wrote.

Models: ``keras.applications.ResNet50`` (``weights=None``) and a GPT-2-shaped
``keras_hub.models.GPT2Backbone`` built from constructor arguments. Methods:
no checkpointing; ``checkpoint_model`` with 2, 4, "sqrt" segments and one
segment per block (every cut); the same architecture built inside
``keras.RematScope(mode="full")``, Keras's own answer. What is measured is the
allocator peak of one training-mode forward+backward pass above the weights
and the batch (every gradient reduced at once, so the number is the
activations kept for backprop) and its wall time, each configuration in a
fresh process.
"""

from __future__ import annotations

from benchmarks import common

MODULE = "benchmarks.checkpoint_model"
METHODS = ["none", "2 segments", "4 segments", "sqrt segments", "per block", "keras.RematScope(full)"]


def _build(config):
    import keras

    keras.utils.set_random_seed(0)
    if config["model"] == "ResNet50":
        size = config["size"]
        model = keras.applications.ResNet50(weights=None, input_shape=(size, size, 3), classes=10)
        x = keras.random.normal((config["batch"], size, size, 3))
        return model, x
    import keras_hub

    model = keras_hub.models.GPT2Backbone(
        vocabulary_size=1000,
        num_layers=config["layers"],
        num_heads=config["heads"],
        hidden_dim=config["hidden"],
        intermediate_dim=4 * config["hidden"],
        max_sequence_length=config["sequence"],
    )
    shape = (config["batch"], config["sequence"])
    x = {"token_ids": keras.random.randint(shape, 1, 1000), "padding_mask": keras.ops.ones(shape, "int32")}
    return model, x


def _error(err: Exception) -> dict:
    import re

    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in str(err).splitlines()]
    # Keras wraps the cause: "Exception encountered when calling X.call().", blank, the reason.
    after = [i + 1 for i, line in enumerate(lines) if "Exception encountered" in line]
    rest = [line for line in lines[after[-1] if after else 0 :] if line]
    return {"error": f"{type(err).__name__}: {(rest or [''])[0][:150]}", "seconds": float("inf")}


def child(config: dict) -> dict:
    import keras
    import tensorflow as tf

    import effgrad

    method = config["method"]
    if method.startswith("keras.RematScope"):
        try:
            with keras.RematScope(mode="full"):
                model, x = _build(config)
        except Exception as err:  # reported in the table: where Keras's own tool fails
            return _error(err)
        segments = None
    else:
        model, x = _build(config)
        segments = None
        if method != "none":
            cuts = len(effgrad.model_graph.layer_graph(model).cuts)
            count = {"per block": cuts + 1, "sqrt segments": "sqrt"}.get(method) or int(method.split()[0])
            model = effgrad.checkpoint_model(model, segments=count)
            segments = sum(isinstance(layer, effgrad.Checkpoint) for layer in model.layers)

    @tf.function(autograph=False)
    def forward_backward(x):
        with tf.GradientTape() as tape:
            loss = sum(tf.reduce_sum(tf.square(t)) for t in tf.nest.flatten(model(x, training=True)))
        return [tf.reduce_sum(g) for g in tape.gradient(loss, model.trainable_variables)]

    try:
        forward_backward(x)
    except Exception as err:  # reported in the table: where Keras's own tool fails
        return _error(err)
    report = effgrad.memory.measure(forward_backward, x)
    seconds = common.median_time(lambda: forward_backward(x)[0].numpy(), warmup=1, repeats=config["repeats"])
    return {"step_mib": report.extra_mib, "seconds": seconds, "segments": segments}


def run(quick: bool = False) -> dict:
    methods = METHODS
    if quick:  # seconds, not minutes: one tiny model, three methods
        models = [
            {"model": "GPT2Backbone", "layers": 1, "heads": 2, "hidden": 16, "sequence": 16, "batch": 2, "repeats": 1}
        ]
        methods = ["none", "sqrt segments", "keras.RematScope(full)"]
    else:
        models = [
            {"model": "ResNet50", "size": 64, "batch": 32, "repeats": 3},
            {
                "model": "GPT2Backbone",
                "layers": 8,
                "heads": 4,
                "hidden": 256,
                "sequence": 256,
                "batch": 8,
                "repeats": 3,
            },
        ]
    rows = []
    for config in models:
        configs = [{**config, "method": method} for method in methods]
        results = common.run_rounds(MODULE, configs, rounds=1 if quick else 2)
        plain = results[0]
        for method_config, result in zip(configs, results):
            row = {**method_config, **result}
            if "error" in result:
                del row["seconds"]  # inf only ranked the failed runs last
            else:
                row["memory_ratio"] = result["step_mib"] / plain["step_mib"]
                row["time_ratio"] = result["seconds"] / plain["seconds"]
            rows.append(row)
    title = (
        "checkpoint_model on keras.applications / keras_hub: activation memory and time of one "
        "training forward+backward pass (ratios vs no checkpointing)"
    )
    columns = [
        ("model", "model", ""),
        ("batch", "batch", "d"),
        ("method", "method", ""),
        ("segments", "segments", ""),
        ("step_mib", "activation MiB", ".1f"),
        ("memory_ratio", "memory ratio", ".2f"),
        ("seconds", "s / pass", ".3f"),
        ("time_ratio", "time ratio", ".2f"),
        ("error", "error", ""),
    ]
    return common.publish("checkpoint_model", title, rows, columns, configs=models)


if __name__ == "__main__":
    common.child_main(child)
