"""``effgrad demo``: train on a real dataset and show the measured savings.

Uses scikit-learn's bundled handwritten digits (1,797 8x8 images, no network
needed; ``pip install effgrad[demo]``), trains a small model with
micro-batches through ``model.fit`` and prints the peak allocator memory of one
train step with and without micro-batching.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """Digits as float32 images ``[N, 8, 8, 1]`` in [0, 1] and int labels."""
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError as err:
        raise SystemExit("The demo uses scikit-learn's bundled digits dataset: pip install 'effgrad[demo]'") from err
    data = sklearn_digits()
    images = (data.images / 16.0).astype("float32")[..., None]
    return images, data.target.astype("int64")


def _model(width: int = 512):
    import keras

    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Flatten(),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


def _step_memory(micro_batches: int, x, y) -> float:
    """Allocator peak (MiB above the resident model) of one train step."""
    import keras

    import effgrad

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    step = effgrad.build_train_step(_model(), loss, keras.optimizers.Adam(1e-3), micro_batches=micro_batches)
    step(x, y)  # trace outside the measurement
    return effgrad.memory.measure(step, x, y).extra_mib


def run(out_dir: str = "effgrad-demo") -> dict:
    import keras

    import effgrad

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    x, y = load_digits()
    print(f"digits: {len(x)} images of 8x8, 10 classes")

    print("\n1. model.fit with effgrad micro-batches (batch 256 as 8 micro-batches of 32)")
    model = _model()
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    effgrad.attach(model, micro_batches=8)
    history = model.fit(x, y, batch_size=256, epochs=8, validation_split=0.2, verbose=2)

    print("\n2. peak memory of one train step on a batch of 1024 images (same update either way)")
    big_x, big_y = np.concatenate([x] * 1)[:1024], np.concatenate([y] * 1)[:1024]
    rows = {k: _step_memory(k, big_x, big_y) for k in (1, 4, 16)}
    print(f"   {'micro_batches':>14} {'step MiB':>9} {'vs plain':>9}")
    for k, mib in rows.items():
        print(f"   {k:>14} {mib:>9.2f} {mib / rows[1]:>8.2f}x")

    summary = {
        "dataset": "sklearn digits",
        "examples": int(len(x)),
        "final_train_accuracy": float(history.history["accuracy"][-1]),
        "final_val_accuracy": float(history.history["val_accuracy"][-1]),
        "step_memory_mib_by_micro_batches": {str(k): v for k, v in rows.items()},
        "seconds": time.perf_counter() - start,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\nwrote {out / 'summary.json'} ({summary['seconds']:.0f} s)")
    return summary
