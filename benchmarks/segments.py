"""Checkpointing: activation memory and time against the number of segments.

The residual MLP of the checkpointing suite, split by
``checkpoint_sequential`` into 1 ... n segments: few segments keep few
boundaries but recompute long stretches at once; many keep many boundaries.
The minimum of memory sits near sqrt(n) (``segments="sqrt"``).
"""

from __future__ import annotations

from benchmarks import checkpointing, common


def run(quick: bool = False) -> dict:
    if quick:
        config, counts = {"model": "residual_mlp", "depth": 4, "width": 32, "batch": 32, "repeats": 1}, [1, 4]
    else:
        config = {"model": "residual_mlp", "depth": 64, "width": 256, "batch": 1024, "repeats": 3}
        counts = [1, 2, 4, 8, 16, 32, 64]
    configs = [{**config, "method": "none", "segments": 0}] + [
        {**config, "method": f"effgrad {n} segments", "segments": n} for n in counts
    ]
    results = common.run_rounds(checkpointing.MODULE, configs, rounds=1 if quick else 2)
    plain = results[0]
    rows = [
        {
            **c,
            **r,
            "memory_ratio": r["step_mib"] / plain["step_mib"],
            "time_ratio": r["seconds"] / plain["seconds"],
        }
        for c, r in zip(configs, results)
    ]
    title = (
        f"Checkpointing segments sweep: {config['depth']}-block residual MLP, batch {config['batch']}, "
        "one forward+backward pass (segments 0 = no checkpointing; ratios vs no checkpointing)"
    )
    columns = [
        ("segments", "segments", "d"),
        ("step_mib", "activation MiB", ".1f"),
        ("memory_ratio", "memory ratio", ".2f"),
        ("seconds", "s / pass", ".3f"),
        ("time_ratio", "time ratio", ".2f"),
    ]
    return common.publish("segments", title, rows, columns, config=config)
