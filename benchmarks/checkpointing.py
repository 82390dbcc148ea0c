"""Activation checkpointing: memory and time of one forward+backward pass.

Models: a residual MLP and a plain CNN. Methods: no checkpointing, TensorFlow's
``tf.recompute_grad`` around every block, effgrad ``Checkpoint`` around every
block, and effgrad ``checkpoint_sequential(segments="sqrt")``. What is measured
is the allocator peak of computing all weight gradients (each reduced at once,
so the number is the activations kept for backprop) and its wall time.
"""

from __future__ import annotations

from benchmarks import common

MODULE = "benchmarks.checkpointing"
METHODS = ["none", "tf.recompute_grad per block", "effgrad per block", "effgrad sqrt segments"]


def _blocks(config):
    import keras

    keras.utils.set_random_seed(0)
    if config["model"] == "residual_mlp":
        width = config["width"]

        def block(i):
            inputs = keras.Input((width,))
            h = keras.layers.Dense(width, activation="relu")(inputs)
            return keras.Model(inputs, keras.layers.Add()([inputs, keras.layers.Dense(width)(h)]), name=f"block{i}")

        return keras.Input((width,)), [block(i) for i in range(config["depth"])]
    channels, size = config["channels"], config["size"]

    def conv_block(i):
        return keras.Sequential(
            [keras.Input((size, size, channels)), keras.layers.Conv2D(channels, 3, padding="same", activation="relu")],
            name=f"conv{i}",
        )

    return keras.Input((size, size, channels)), [conv_block(i) for i in range(config["depth"])]


def _tf_recompute_layer(block):
    import keras
    import tensorflow as tf

    class TFRecompute(keras.layers.Layer):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def call(self, x):
            return tf.recompute_grad(lambda t: self.inner(t))(x)

    return TFRecompute(block)


def child(config: dict) -> dict:
    import keras
    import tensorflow as tf

    import effgrad

    inputs, blocks = _blocks(config)
    method = config["method"]
    if method.startswith("effgrad") and "segments" in method:  # "effgrad sqrt segments" / "effgrad 8 segments"
        segments = method.split()[1]
        model = effgrad.checkpoint_sequential(
            keras.Sequential([inputs, *blocks]), segments=segments if segments == "sqrt" else int(segments)
        )
    else:
        wrap = {
            "none": lambda b: b,
            "tf.recompute_grad per block": _tf_recompute_layer,
            "effgrad per block": effgrad.Checkpoint,
        }[method]
        model = keras.Sequential([inputs] + [wrap(b) for b in blocks])

    @tf.function
    def forward_backward(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(model(x, training=True)))
        return [tf.reduce_sum(g) for g in tape.gradient(loss, model.trainable_variables)]

    x = tf.random.normal([config["batch"], *inputs.shape[1:]])
    forward_backward(x)
    report = effgrad.memory.measure(forward_backward, x)
    seconds = common.median_time(lambda: forward_backward(x)[0].numpy(), warmup=1, repeats=config["repeats"])
    return {"step_mib": report.extra_mib, "seconds": seconds}


def run(quick: bool = False) -> dict:
    if quick:
        models = [
            {"model": "residual_mlp", "depth": 4, "width": 32, "batch": 32, "repeats": 1},
            {"model": "cnn", "depth": 2, "channels": 8, "size": 8, "batch": 8, "repeats": 1},
        ]
    else:
        models = [
            {"model": "residual_mlp", "depth": 64, "width": 256, "batch": 1024, "repeats": 3},
            {"model": "cnn", "depth": 16, "channels": 32, "size": 32, "batch": 64, "repeats": 3},
        ]
    rows = []
    for config in models:
        configs = [{**config, "method": method} for method in METHODS]
        results = common.run_rounds(MODULE, configs, rounds=1 if quick else 3)
        plain = results[0]
        for method_config, result in zip(configs, results):
            rows.append(
                {
                    **method_config,
                    **result,
                    "memory_ratio": result["step_mib"] / plain["step_mib"],
                    "time_ratio": result["seconds"] / plain["seconds"],
                }
            )
    title = (
        "Activation checkpointing: allocator peak and time of one forward+backward pass (ratios vs no checkpointing)"
    )
    columns = [
        ("model", "model", ""),
        ("depth", "blocks", "d"),
        ("batch", "batch", "d"),
        ("method", "method", ""),
        ("step_mib", "activation MiB", ".1f"),
        ("memory_ratio", "memory ratio", ".2f"),
        ("seconds", "s / pass", ".3f"),
        ("time_ratio", "time ratio", ".2f"),
    ]
    return common.publish("checkpointing", title, rows, columns, configs=models)


if __name__ == "__main__":
    common.child_main(child)
