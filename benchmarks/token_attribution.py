"""Token attribution on a BERT-shaped classifier: effgrad ``layer=`` vs a hand-written tape loop.

Model: keras_hub ``BertTextClassifier`` from constructor arguments (random
weights): vocabulary 5,000, 2 layers, hidden 64, 2 heads, intermediate 128,
sequence length 64, 2 classes; token ids with random padding (a padding mask)
and segment ids. Each example's map is the L2 norm over the embedding axis of
the gradient of its arg-max logit with respect to the token embedding
output: one score per token.

The baseline is what a TensorFlow user writes without effgrad: a batched
``tf.function`` that replays the backbone's layers by hand (token embedding,
position and segment embeddings, layer norm, transformer layers, pooler,
head) so that a ``GradientTape`` can watch the token embeddings, reduces on
the device and copies each batch into a preallocated host array. effgrad
gets the same maps from ``saliency(model, inputs, layer="token_embedding",
reduce="l2")``, into memory and into a ``.npy`` file. A ``check`` row
compares the two on 256 examples (max abs difference). Every row runs in a
fresh process, fastest of 3 interleaved rounds, tracing included.
"""

from __future__ import annotations

import time
from pathlib import Path

from benchmarks import common
from benchmarks.saliency import fresh, sweep, with_ratios

MODULE = "benchmarks.token_attribution"
KINDS = ["tape_loop", "effgrad", "effgrad_npy"]
VOCAB, T, BATCH = 5_000, 64, 64
LAYERS = 1 if common.QUICK else 2  # --quick: the code paths on one transformer layer


def bert_classifier():
    import keras
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=VOCAB,
        num_layers=LAYERS,
        num_heads=2,
        hidden_dim=64,
        intermediate_dim=128,
        max_sequence_length=T,
    )
    return keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=2, preprocessor=None)


def tokens(n: int) -> dict:
    import numpy as np

    rng = np.random.default_rng(0)
    lengths = rng.integers(8, T + 1, n)
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype("int32")
    return {
        "token_ids": (rng.integers(1, VOCAB, (n, T)) * mask).astype("int32"),
        "segment_ids": np.zeros((n, T), "int32"),
        "padding_mask": mask,
    }


def tape_loop(model, x: dict):
    """The hand-written baseline: the backbone replayed so that a tape can watch the token embeddings."""
    import numpy as np
    import tensorflow as tf

    backbone = model.backbone
    spec = tf.TensorSpec([None, T], tf.int32)

    @tf.function(input_signature=[spec, spec, spec])
    def scores(ids, segments, mask):
        with tf.GradientTape() as tape:
            embedded = backbone.token_embedding(ids)
            tape.watch(embedded)
            h = backbone.embeddings_add(
                (embedded, backbone.position_embedding(embedded), backbone.segment_embedding(segments))
            )
            h = backbone.embeddings_dropout(backbone.embeddings_layer_norm(h), training=False)
            for layer in backbone.transformer_layers:
                h = layer(h, padding_mask=mask, training=False)
            pooled = backbone.pooled_dense(h[:, 0, :])
            logits = model.output_dense(model.output_dropout(pooled, training=False))
            chosen = tf.gather(logits, tf.argmax(logits, axis=-1), batch_dims=1)
        return tf.norm(tape.gradient(chosen, embedded), axis=-1)

    n = len(x["token_ids"])
    out = np.empty((n, T), "float32")
    for i in range(0, n, BATCH):
        rows = slice(i, i + BATCH)
        out[rows] = scores(x["token_ids"][rows], x["segment_ids"][rows], x["padding_mask"][rows]).numpy()
    return out


def child(config: dict) -> dict:
    import numpy as np

    import effgrad

    model, kind, n = bert_classifier(), config["kind"], config["n"]
    x = tokens(n)
    out = Path(config["data"]).with_name(f"tokens_{n}.npy")
    if kind == "check":
        ours = effgrad.saliency(model, x, layer="token_embedding", reduce="l2", batch_size=BATCH, progress=False)
        return {"seconds": 0.0, "max_abs_diff": float(np.abs(ours - tape_loop(model, x)).max())}

    def run_effgrad(target):
        return effgrad.saliency(
            model, x, layer="token_embedding", reduce="l2", batch_size=BATCH, out=target, progress=False
        )

    run = {
        "tape_loop": lambda: tape_loop(model, x),
        "effgrad": lambda: run_effgrad(None),
        "effgrad_npy": lambda: run_effgrad(fresh(out)),
    }[kind]
    model(tokens(1))  # builds the model; every row traces its own functions in the timing
    start = time.perf_counter()
    report = effgrad.memory.measure(run)
    seconds = time.perf_counter() - start
    fresh(out)
    return {"examples_per_s": n / seconds, "seconds": seconds, "device_peak_mib": report.peak_mib}


def run(quick: bool = False) -> dict:
    sizes = [64] if quick else [1_024, 4_096, 16_384]
    kinds = KINDS[:2] if quick else KINDS  # quick: it runs (the .npy sink runs in the other suites)
    rows = with_ratios(sweep(MODULE, sizes, kinds, {}, {}, rounds=1 if quick else 3), "tape_loop")
    check = sweep(MODULE, [64 if quick else 256], ["check"], {}, {}, rounds=1)[0]
    title = (
        f"Token attribution (L2 of the gradient at the token embedding, arg-max class) on a BERT-shaped "
        f"classifier ({LAYERS} layers, hidden 64, T={T}), batch {BATCH}: throughput vs a hand-written tape loop, "
        "device allocator peak, host max RSS; fresh process per row, fastest of 3 interleaved rounds, tracing "
        f"included. effgrad vs the loop's maps: max abs difference {check['max_abs_diff']:.1e}"
    )
    columns = [
        ("n", "N", ",d"),
        ("method", "method", ""),
        ("examples_per_s", "examples/s", ",.0f"),
        ("vs_baseline", "vs tape loop", ".2f"),
        ("device_peak_mib", "device peak MiB", ",.1f"),
        ("host_max_rss_mib", "host max RSS MiB", ",.0f"),
    ]
    return common.publish("token_attribution", title, rows, columns, sizes=sizes, max_abs_diff=check["max_abs_diff"])


if __name__ == "__main__":
    common.child_main(child)
