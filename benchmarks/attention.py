"""Attention without its scores: one layer's step, block sizes, whole LMs, and the longest sequence a budget holds.

Fresh process per row. Tables:

* ``attention``: causal attention forward + backward (the gradients of q, k and
  v; batch 2, 8 heads, depth 64) at T = 512 ... 4096: ``effgrad.attention``
  against ``keras.ops.dot_product_attention(is_causal=True)``. ``added MiB``:
  what the step adds to memory beyond its inputs (activations and the three
  gradients); seconds: median of the repeats, both methods in one run, side by
  side. Then a block-size sweep at T = 4096 (and 1024).
* ``attention_lm``: one Adam step of keras_hub ``GPT2CausalLM`` (V = 50,257,
  2 layers, hidden 256, 4 heads) at T = 1024 batch 4 and T = 256 batch 8, and
  of a Llama-style LM (``LlamaCausalLM``: untied head, 4 query / 2 key-value
  heads, V = 32,000) at T = 1024 batch 4: Keras ``train_on_batch`` (compiled
  with ``weighted_metrics=[]``), effgrad with ``attention=False``, with
  ``recompute_activations=False`` and effgrad's default (fused loss, attention
  and activation recompute ``"auto"``); allocator peak, seconds (best of the
  interleaved rounds). ``lm_table()`` runs this table alone.
* ``attention_longest``: the longest T (doubling from 512) at which one
  GPT-2 step (batch 1) stays within a fixed budget, Keras against effgrad's
  default.

PyTorch's numbers in the plot are quoted from issue 64 (measured on this
machine for the single-layer shape), not measured here.
"""

from __future__ import annotations

import json
import sys

from benchmarks import common

MODULE = "benchmarks.attention"
TABLES = ["attention", "attention_lm", "attention_longest"]
# Quoted from issue 64 (this machine, unloaded, same shape): T -> seconds. PyTorch 2.15 CPU
# scaled_dot_product_attention's flash and math backends, and Keras's own row for scale: a run under
# load is slower by the load's factor (the ratios within one run are what this suite measures).
TORCH_FLASH = {1024: 0.099, 4096: 1.27}
TORCH_MATH = {4096: 8.16}
KERAS_QUOTED = {1024: 0.231, 4096: 3.48}


def layer_child(config: dict) -> dict:
    import keras
    import tensorflow as tf

    import effgrad

    b, t, h, d = config["batch"], config["seq"], config["heads"], config["depth"]
    q, k, v = (tf.random.stateless_normal([b, t, h, d], seed=[i, 0]) for i in range(3))
    block = config.get("block", "auto")

    @tf.function(autograph=False)
    def step(q, k, v):
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            if config["method"] == "keras":
                out = keras.ops.dot_product_attention(q, k, v, is_causal=True)
            else:
                out = effgrad.attention(q, k, v, causal=True, block_size=block)
            loss = tf.reduce_sum(out * out)
        return tape.gradient(loss, [q, k, v])

    step(q, k, v)
    report = effgrad.memory.measure(step, q, k, v)
    seconds = common.median_time(lambda: [g.numpy() for g in step(q, k, v)], warmup=0, repeats=config["repeats"])
    return {"added_mib": report.extra_mib, "peak_mib": report.peak_mib, "seconds": seconds}


def _lm(config: dict):
    import keras
    import keras_hub

    keras.utils.set_random_seed(0)
    size = config["size"]
    if config["model"] == "tiny":  # --quick: the same inputs as keras_hub's LMs, a second to trace
        tokens = keras.Input((config["seq"],), dtype="int32", name="token_ids")
        padding = keras.Input((config["seq"],), dtype="int32", name="padding_mask")
        h = keras.layers.Embedding(config["vocab"], size["hidden"])(tokens)
        keep = keras.ops.cast(padding, "bool")[:, None, :]
        h = keras.layers.MultiHeadAttention(size["heads"], size["hidden"] // size["heads"])(
            h, h, attention_mask=keep, use_causal_mask=True
        )
        return keras.Model({"token_ids": tokens, "padding_mask": padding}, keras.layers.Dense(config["vocab"])(h))
    if config["model"] == "llama":
        backbone = keras_hub.models.LlamaBackbone(
            vocabulary_size=config["vocab"], num_layers=2, num_query_heads=size["heads"], num_key_value_heads=2,
            hidden_dim=size["hidden"], intermediate_dim=4 * size["hidden"],
        )  # fmt: skip
        return keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=config["vocab"], num_layers=2, num_heads=size["heads"], hidden_dim=size["hidden"],
        intermediate_dim=4 * size["hidden"], max_sequence_length=config["seq"],
    )  # fmt: skip
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def lm_child(config: dict) -> dict:
    import keras
    import numpy as np
    import tensorflow as tf

    import effgrad

    rng = np.random.default_rng(0)
    batch, seq, vocab = config["batch"], config["seq"], config["vocab"]
    model = _lm(config)
    tokens = rng.integers(1, vocab, (batch, seq)).astype("int32")
    mask = np.ones((batch, seq), "int32")
    mask[:, -seq // 8 :] = 0  # some padding
    x = {"token_ids": tf.constant(tokens), "padding_mask": tf.constant(mask)}
    y, w = tf.constant(np.roll(tokens, -1, axis=1)), tf.constant(mask.astype("float32"))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt = keras.optimizers.Adam(1e-4)
    method, routed = config["method"], None
    if method == "keras":
        model.compile(optimizer=opt, loss=loss, weighted_metrics=[])
        model.optimizer.build(model.trainable_variables)  # else the first call traces twice

        def one_step():
            return model.train_on_batch(x, y, sample_weight=w)
    else:
        options = {"attention": False} if method == "effgrad attention=False" else {}
        options = {"recompute_activations": False} if method == "effgrad recompute_activations=False" else options
        step = effgrad.build_train_step(model, loss, opt, **options)

        def one_step():
            return step(x, y, w)["loss"].numpy()

    try:
        one_step()
        report = effgrad.memory.measure(one_step)
    except tf.errors.ResourceExhaustedError:
        return {"peak_mib": float("inf"), "seconds": float("nan"), "attention": None}
    if method != "keras":
        routed = bool(step.attention)
    seconds = common.median_time(one_step, warmup=0, repeats=config["repeats"])
    return {"peak_mib": report.peak_mib, "seconds": seconds, "attention": routed}


def child(config: dict) -> dict:
    return layer_child(config) if config["kind"] == "layer" else lm_child(config)


def _layer_rows(quick: bool) -> list[dict]:
    shape = {"batch": 1, "heads": 2, "depth": 16} if quick else {"batch": 2, "heads": 8, "depth": 64}
    lengths = [64] if quick else [512, 1024, 2048, 4096]
    rows = []
    for t in lengths:
        configs = [
            {"kind": "layer", "seq": t, "method": m, "repeats": 1 if quick else 3, **shape}
            for m in ("keras", "effgrad")
        ]
        results = common.run_rounds(MODULE, configs, rounds=1)
        group = [{"table": "scaling", "seq": t, "method": c["method"], **r} for c, r in zip(configs, results)]
        for row in group:
            row["memory_vs_keras"] = row["added_mib"] / group[0]["added_mib"]
            row["time_vs_keras"] = row["seconds"] / group[0]["seconds"]
            row["scores_mib"] = shape["batch"] * shape["heads"] * t * t * 4 / 2**20
        rows.extend(group)
    sweep = {64: [16]} if quick else {1024: [64, 128, 256, "auto"], 4096: [128, 256, 512, 1024, "auto"]}
    for t, blocks in sweep.items():
        for block in blocks:
            config = {"kind": "layer", "seq": t, "method": "effgrad", "block": block, "repeats": 1 if quick else 3}
            result = common.run_isolated(MODULE, {**config, **shape})
            keras_row = next(r for r in rows if r["seq"] == t and r["method"] == "keras")
            rows.append({"table": "block sweep", "seq": t, "method": f"effgrad block {block}", "block": str(block),
                         **result, "time_vs_keras": result["seconds"] / keras_row["seconds"],
                         "memory_vs_keras": result["added_mib"] / keras_row["added_mib"]})  # fmt: skip
    return rows


def _lm_rows(quick: bool) -> list[dict]:
    methods = ["keras", "effgrad attention=False", "effgrad recompute_activations=False", "effgrad default"]
    small = {"hidden": 256, "heads": 4}
    if quick:
        shapes = [("tiny LM T=64 batch 2", {"model": "tiny", "vocab": 1000, "seq": 64, "batch": 2})]
        small = {"hidden": 32, "heads": 2}
    else:
        shapes = [
            ("GPT2CausalLM T=1024 batch 4", {"model": "gpt2", "vocab": 50257, "seq": 1024, "batch": 4}),
            ("GPT2CausalLM T=256 batch 8", {"model": "gpt2", "vocab": 50257, "seq": 256, "batch": 8}),
            ("Llama-style LM T=1024 batch 4", {"model": "llama", "vocab": 32000, "seq": 1024, "batch": 4}),
        ]
    rows = []
    for name, base in shapes:
        configs = [{"kind": "lm", **base, "size": small, "method": m, "repeats": 1 if quick else 3} for m in methods]
        results = common.run_rounds(MODULE, configs, rounds=1 if quick else 2)
        group = [{"shape": name, "method": m, **r} for m, r in zip(methods, results)]
        keras_row, unrouted = group[0], group[1]
        for row in group:
            row["vs_keras"] = row["peak_mib"] / keras_row["peak_mib"]
            row["vs_no_attention"] = row["peak_mib"] / unrouted["peak_mib"]
            row["time_vs_no_attention"] = row["seconds"] / unrouted["seconds"]
        rows.extend(group)
    return rows


def _longest_rows(quick: bool) -> list[dict]:
    budget = 96 if quick else 1024  # MiB
    start, limit = (64, 64) if quick else (512, 16384)
    small = {"hidden": 32, "heads": 2} if quick else {"hidden": 256, "heads": 4}
    vocab = 1000 if quick else 50257
    rows = []
    for method in ("keras", "effgrad default"):
        seq, longest = start, None
        while seq <= limit:
            model = "tiny" if quick else "gpt2"
            config = {"kind": "lm", "model": model, "vocab": vocab, "seq": seq, "batch": 1, "size": small,
                      "method": method, "repeats": 1}  # fmt: skip
            result = common.run_isolated(MODULE, config, timeout=3600)
            fits = result["peak_mib"] <= budget
            rows.append({"method": method, "seq": seq, "budget_mib": budget, "fits": fits, **result})
            if not fits:
                break
            longest, seq = seq, seq * 2
        for row in rows:
            if row["method"] == method:
                row["longest_seq"] = longest
    return rows


def run(quick: bool = False) -> dict:
    layer = _layer_rows(quick)
    columns = [
        ("table", "table", ""),
        ("seq", "T", ""),
        ("method", "method", ""),
        ("added_mib", "added MiB", ".1f"),
        ("scores_mib", "one scores copy MiB", ".0f"),
        ("memory_vs_keras", "memory vs Keras", ".3f"),
        ("seconds", "s / step", ".3f"),
        ("time_vs_keras", "time vs Keras", ".2f"),
    ]
    title = (
        "Causal attention forward + backward (batch 2, 8 heads, depth 64): memory added beyond the inputs and time, "
        "effgrad.attention vs keras.ops.dot_product_attention, fresh process per row"
    )
    payload = common.publish("attention", title, layer, columns)
    lm_table(quick)
    longest = _longest_rows(quick)
    columns = [
        ("method", "method", ""),
        ("seq", "T", ""),
        ("peak_mib", "peak MiB", ".0f"),
        ("fits", "fits", ""),
        ("seconds", "s / step", ".2f"),
        ("longest_seq", "longest T that fits", ""),
    ]
    budget = longest[0]["budget_mib"]
    title = f"Longest sequence of one GPT-2 step (batch 1, V=50,257, 2 layers, hidden 256) within {budget} MiB"
    common.publish("attention_longest", title, longest, columns)
    plot(layer)
    return payload


def lm_table(quick: bool = False) -> None:
    """The ``attention_lm`` table alone (``python -c "from benchmarks import attention; attention.lm_table()"``)."""
    lm = _lm_rows(quick)
    columns = [
        ("shape", "model", ""),
        ("method", "method", ""),
        ("attention", "routed", ""),
        ("peak_mib", "peak MiB", ".0f"),
        ("vs_keras", "vs Keras", ".2f"),
        ("vs_no_attention", "vs attention=False", ".2f"),
        ("seconds", "s / step", ".3f"),
        ("time_vs_no_attention", "time vs attention=False", ".2f"),
    ]
    title = (
        "One Adam step of a keras_hub LM (2 layers, hidden 256, fused loss where effgrad applies it): allocator peak "
        "with and without efficient attention and activation recompute, and Keras train_on_batch compiled with "
        "weighted_metrics=[]"
    )
    common.publish("attention_lm", title, lm, columns)


def plot(rows: list[dict]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scaling = [r for r in rows if r["table"] == "scaling"]
    fig, (mem, sec) = plt.subplots(1, 2, figsize=(10, 3.8))
    for method, style in (("keras", "s--"), ("effgrad", "o-")):
        mine = [r for r in scaling if r["method"] == method]
        label = "keras.ops.dot_product_attention" if method == "keras" else "effgrad.attention"
        mem.plot([r["seq"] for r in mine], [r["added_mib"] for r in mine], style, label=label)
        sec.plot([r["seq"] for r in mine], [r["seconds"] for r in mine], style, label=label)
    lengths = sorted({r["seq"] for r in scaling})
    if lengths[-1] >= 4096:
        quoted = {t: s for t, s in TORCH_FLASH.items() if t in lengths}
        sec.plot(list(quoted), list(quoted.values()), "^:", color="gray", label="PyTorch flash (quoted)")
        sec.plot(list(TORCH_MATH), list(TORCH_MATH.values()), "v", color="gray", label="PyTorch math (quoted)")
        sec.plot(list(KERAS_QUOTED), list(KERAS_QUOTED.values()), "s", mfc="none", color="C0", label="Keras (quoted)")
    mem.set(xscale="log", yscale="log", xlabel="T", ylabel="MiB added by the step", title="memory")
    sec.set(xscale="log", yscale="log", xlabel="T", ylabel="seconds / step", title="time (forward + backward)")
    for ax in (mem, sec):
        ax.set_xticks(lengths, [str(t) for t in lengths])
        ax.minorticks_off()
        ax.legend(fontsize=7)
    fig.suptitle("causal attention, batch 2, 8 heads, depth 64 (CPU); quoted: issue 64, unloaded machine", fontsize=9)
    fig.tight_layout()
    path = common.RESULTS / "attention_scaling.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    if sys.argv[1:] == ["--plot"]:  # redraw from the published results
        print(plot(json.loads((common.RESULTS / "attention.json").read_text())["rows"]))
    else:
        common.child_main(child)
