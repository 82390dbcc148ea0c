"""The loss of a large vocabulary without its logits: peak and time of one step against Keras.

In a fresh process per row (the fastest of three, interleaved), one Adam step of:

* keras_hub ``GPT2CausalLM`` (vocabulary 50,257, 2 layers, hidden 256) at T=256
  batch 8 and T=1024 batch 4, with the padding mask as sample weights;
* a 100,000-class classifier (``Dense`` head on 256 features, batch 512);

by ``keras train_on_batch``, ``effgrad unfused`` (``fused_loss=False``) and
``effgrad fused`` (the default where it applies); for the LMs also ``effgrad
fused + checkpoint_model`` (the task model cut inside its backbone, ``segments=
"sqrt"``: the two tricks composed). ``logits MiB`` is one
float32 copy of the ``[rows, vocabulary]`` logits the fused step never makes.
A second table sweeps the vocabulary of an LM-shaped classifier (2,048 positions
on 64 features): the unfused peak grows with the logits, the fused one with
the kernel (and its gradient and Adam slots) only.
"""

from __future__ import annotations

from benchmarks import common

MODULE = "benchmarks.fused_loss"
TABLES = ["fused_loss", "fused_loss_head"]  # the step; the head and loss alone


def _model(config):
    import keras

    keras.utils.set_random_seed(0)
    if config["model"] == "gpt2":
        import keras_hub

        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=config["vocab"],
            num_layers=2,
            num_heads=4,
            hidden_dim=256,
            intermediate_dim=1024,
            max_sequence_length=config["seq"],
        )
        return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    features = config.get("features", 256)
    inputs = keras.Input((features,))
    h = keras.layers.Dense(features, activation="relu")(inputs)
    return keras.Model(inputs, keras.layers.Dense(config["vocab"])(h))


def head_child(config: dict) -> dict:
    """Peak of the head and loss alone at GPT-2's shapes: loss and gradients of ``(hidden, kernel)``."""
    import keras
    import tensorflow as tf

    import effgrad

    rows, depth, vocab = config["rows"], 256, config.get("vocab", 50257)  # --quick: a smaller vocabulary
    hidden = tf.random.normal([rows, depth])
    kernel = tf.Variable(tf.random.normal([vocab, depth], stddev=0.02))  # tied: [V, d]
    labels = tf.random.uniform([rows], 0, vocab, tf.int32)
    plain = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def head_and_loss():
        with tf.GradientTape() as tape:
            tape.watch(hidden)
            if config["method"] == "effgrad fused":
                loss = tf.reduce_mean(effgrad.fused_sparse_cross_entropy(hidden, kernel, labels, transposed=True))
            else:
                loss = plain(labels, tf.matmul(hidden, kernel, transpose_b=True))
        d_hidden, d_kernel = tape.gradient(loss, [hidden, kernel])
        return loss + tf.reduce_sum(d_hidden) + tf.reduce_sum(d_kernel)  # the gradients are made, then freed

    head_and_loss()
    report = effgrad.memory.measure(head_and_loss)
    return {"transient_mib": report.extra_mib, "gradients_mib": (rows + vocab) * depth * 4 / 2**20}


def child(config: dict) -> dict:
    if config["model"] == "head":
        return head_child(config)
    import keras
    import numpy as np
    import tensorflow as tf

    import effgrad

    rng = np.random.default_rng(0)
    batch, vocab = config["batch"], config["vocab"]
    model = _model(config)
    method = config["method"]
    if method.endswith("checkpoint_model"):
        model = effgrad.checkpoint_model(model)
    if config["model"] == "gpt2":
        seq = config["seq"]
        tokens = rng.integers(1, vocab, (batch, seq)).astype("int32")
        mask = np.ones((batch, seq), "int32")
        mask[:, -seq // 8 :] = 0  # some padding
        x = {"token_ids": tf.constant(tokens), "padding_mask": tf.constant(mask)}
        y, w = tf.constant(np.roll(tokens, -1, axis=1)), tf.constant(mask.astype("float32"))
        rows = batch * seq
    else:
        x = tf.constant(rng.normal(size=(batch, config.get("features", 256))).astype("float32"))
        y, w, rows = tf.constant(rng.integers(0, vocab, batch)), None, batch
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt = keras.optimizers.Adam(1e-4)
    if method == "keras":
        model.compile(optimizer=opt, loss=loss, weighted_metrics=[])
        model.optimizer.build(model.trainable_variables)  # else the first call traces twice

        def one_step():
            return model.train_on_batch(x, y, sample_weight=w)
    else:
        step = effgrad.build_train_step(model, loss, opt, fused_loss=method.startswith("effgrad fused"))

        def one_step():
            return step(x, y, w)["loss"]

    one_step()
    report = effgrad.memory.measure(one_step)
    seconds = common.median_time(one_step, warmup=0, repeats=config["repeats"])
    weights = sum(int(np.prod(v.shape)) for v in model.trainable_variables) * 4 / 2**20
    return {
        "peak_mib": report.peak_mib,
        "seconds": seconds,
        "logits_mib": rows * vocab * 4 / 2**20,
        "weights_mib": weights,
    }


def run(quick: bool = False) -> dict:
    methods = ["keras", "effgrad unfused", "effgrad fused"]
    if quick:
        shapes = [
            ("classifier 1,000 classes", {"model": "dense", "vocab": 1000, "batch": 16, "features": 32, "repeats": 1})
        ]
        sweep = [2000]
    else:
        shapes = [
            ("GPT2CausalLM T=256 batch 8", {"model": "gpt2", "vocab": 50257, "seq": 256, "batch": 8, "repeats": 5}),
            ("GPT2CausalLM T=1024 batch 4", {"model": "gpt2", "vocab": 50257, "seq": 1024, "batch": 4, "repeats": 5}),
            ("classifier 100,000 classes", {"model": "dense", "vocab": 100_000, "batch": 512, "repeats": 3}),
        ]
        sweep = [8_000, 16_000, 32_000, 64_000, 128_000]
    rows = []
    for name, base in shapes:
        names = methods + (["effgrad fused + checkpoint_model"] if base["model"] == "gpt2" else [])
        # best of 3 interleaved processes each: one process's time per step drifts by 10% on this machine
        results = common.run_rounds(MODULE, [{**base, "method": m} for m in names], rounds=1 if quick else 3)
        group = [{"shape": name, "method": m, **result} for m, result in zip(names, results)]
        keras_row, unfused = group[0], group[1]
        for row in group:
            row["vs_keras"] = row["peak_mib"] / keras_row["peak_mib"]
            row["vs_unfused"] = row["peak_mib"] / unfused["peak_mib"]
            row["time_vs_unfused"] = row["seconds"] / unfused["seconds"]
        rows.extend(group)
    for vocab in sweep:
        for method in methods[1:]:
            # LM-shaped: many positions (2,048) on a narrow projection (64), as a causal LM's batch * T
            batch = 256 if quick else 2048
            config = {"model": "dense", "vocab": vocab, "batch": batch, "features": 64, "repeats": 1, "method": method}
            result = common.run_isolated(MODULE, config)
            rows.append({"shape": f"classifier sweep {vocab}", "vocab": vocab, "method": method, **result})
    title = (
        "Fused projection + sparse cross-entropy: absolute allocator peak of one Adam step, fresh process per "
        "row (a model's rows: the fastest of 3, interleaved); 'logits MiB' = one float32 copy of the logits"
    )
    columns = [
        ("shape", "model", ""),
        ("method", "method", ""),
        ("peak_mib", "peak MiB", ".0f"),
        ("weights_mib", "weights MiB", ".0f"),
        ("logits_mib", "logits MiB", ".0f"),
        ("vs_keras", "vs Keras", ".2f"),
        ("vs_unfused", "vs unfused", ".2f"),
        ("seconds", "s / step", ".3f"),
        ("time_vs_unfused", "time vs unfused", ".2f"),
    ]
    payload = common.publish("fused_loss", title, rows, columns)
    head_table(quick)
    return payload


def head_table(quick: bool = False) -> dict:
    """The head and loss alone (GPT-2's tied [50,257, 256] projection): what they add to memory."""
    rows = []
    for positions in [64] if quick else [2048, 4096]:
        group = [
            {"positions": positions, "method": method, **common.run_isolated(MODULE, config)}
            for method in ("effgrad unfused", "effgrad fused")
            for config in [{"model": "head", "rows": positions, "method": method} | ({"vocab": 5000} if quick else {})]
        ]
        for row in group:
            row["beyond_gradients_mib"] = row["transient_mib"] - row["gradients_mib"]
            row["vs_unfused"] = row["transient_mib"] / group[0]["transient_mib"]
            row["beyond_vs_unfused"] = row["beyond_gradients_mib"] / group[0]["beyond_gradients_mib"]
        rows.extend(group)
    title = (
        "Head + loss alone at GPT-2's tied projection (V=50,257, d=256): memory a tf.function computing the loss "
        "and the gradients of (hidden, kernel) adds, fresh process per row; 'gradients' = those two, which any "
        "method makes"
    )
    columns = [
        ("positions", "positions", ","),
        ("method", "method", ""),
        ("transient_mib", "added MiB", ".1f"),
        ("vs_unfused", "vs unfused", ".3f"),
        ("gradients_mib", "gradients MiB", ".1f"),
        ("beyond_gradients_mib", "beyond gradients MiB", ".1f"),
        ("beyond_vs_unfused", "beyond vs unfused", ".3f"),
    ]
    return common.publish("fused_loss_head", title, rows, columns)


if __name__ == "__main__":
    common.child_main(child)
