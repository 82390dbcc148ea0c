"""PNG plots of the benchmark results (matplotlib)."""

from __future__ import annotations

import json

from benchmarks import common


def _load(name):
    path = common.RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def plot_all() -> list:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    acc = _load("accumulation")
    if acc:
        groups = sorted({(r["batch"], r["optimizer"]) for r in acc["rows"]})
        fig, axes = plt.subplots(1, len(groups), figsize=(4.5 * len(groups), 3.6), squeeze=False)
        for ax, (batch, opt) in zip(axes[0], groups):
            rows = [r for r in acc["rows"] if r["batch"] == batch and r["optimizer"] == opt]
            for prefix, style in (("effgrad", "o-"), ("keras", "s--")):
                mine = [r for r in rows if r["method"].startswith(prefix)]
                ax.plot([r["k"] for r in mine], [r["peak_mib"] for r in mine], style, label=prefix)
            floor = [r for r in rows if r["method"].startswith("effgrad")]
            ax.plot([r["k"] for r in floor], [r["floor_mib"] for r in floor], ":", color="gray", label="floor")
            ks = sorted({r["k"] for r in rows})
            ax.set(xscale="log", xlabel="micro-batches k", ylabel="peak MiB", title=f"batch {batch}, {opt}")
            ax.set_xticks(ks, [str(k) for k in ks])
            ax.minorticks_off()
            ax.legend(fontsize=7)
        written.append(_save(fig, plt, "accumulation_memory.png"))
    fused = _load("fused_loss")
    sweep = [r for r in (fused or {"rows": []})["rows"] if r.get("vocab")]
    if sweep:
        fig, ax = plt.subplots(figsize=(5.5, 3.6))
        for method, style in (("effgrad unfused", "s--"), ("effgrad fused", "o-")):
            mine = [r for r in sweep if r["method"] == method]
            ax.plot([r["vocab"] for r in mine], [r["peak_mib"] for r in mine], style, label=method)
        mine = [r for r in sweep if r["method"] == "effgrad fused"]
        ax.plot([r["vocab"] for r in mine], [r["logits_mib"] for r in mine], ":", color="gray", label="one logits copy")
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="classes (vocabulary)",
            ylabel="peak MiB",
            title="one Adam step, 2,048 positions, 64 features",
        )
        ax.legend(fontsize=7)
        written.append(_save(fig, plt, "fused_loss_vocabulary.png"))
    compact = _load("compact_state")
    curves = (compact or {"config": {}})["config"].get("curves")
    if curves:
        tasks = sorted({key.split("|")[0] for key in curves})
        fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 3.6), squeeze=False)
        for ax, task in zip(axes[0], tasks):
            for state, style in (("float32", "-"), ("int8", "--"), ("bfloat16", ":")):
                values = curves.get(f"{task}|{state}")
                if values is None:
                    continue
                window = max(1, len(values) // 40)  # a moving average: steps are noisy
                smooth = [
                    sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
                    for i in range(len(values))
                ]
                ax.plot(range(1, len(values) + 1), smooth, style, label=f"Adam, {state} state")
            ax.set(xlabel="step", ylabel="training loss (mean of 3 seeds)", title=task, yscale="log")
            ax.legend(fontsize=7)
        written.append(_save(fig, plt, "compact_state_convergence.png"))
    ckpt = _load("checkpointing")
    if ckpt:
        models = sorted({r["model"] for r in ckpt["rows"]})
        fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 3.6), squeeze=False)
        for ax, model in zip(axes[0], models):
            rows = [r for r in ckpt["rows"] if r["model"] == model]
            for r in rows:
                ax.scatter(r["time_ratio"], r["memory_ratio"], s=40)
                ax.annotate(r["method"], (r["time_ratio"], r["memory_ratio"]), fontsize=7)
            ax.set(xlabel="time vs none", ylabel="activation memory vs none", title=model, ylim=(0, 1.15))
        written.append(_save(fig, plt, "checkpointing_tradeoff.png"))
    seg = _load("segments")
    if seg:
        rows = [r for r in seg["rows"] if r["segments"] > 0]
        fig, ax = plt.subplots(figsize=(5.5, 3.6))
        ax.plot([r["segments"] for r in rows], [r["memory_ratio"] for r in rows], "o-", label="activation memory")
        ax.plot([r["segments"] for r in rows], [r["time_ratio"] for r in rows], "s--", label="time")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set(xscale="log", xlabel="segments", ylabel="vs no checkpointing", title="checkpoint_sequential")
        ax.legend(fontsize=7)
        written.append(_save(fig, plt, "checkpointing_segments.png"))
    sal = _load("saliency")
    if sal:
        fig, axes = plt.subplots(1, 3, figsize=(15, 3.6))
        for method in sorted({r["method"] for r in sal["rows"]}):
            rows = [r for r in sal["rows"] if r["method"] == method]
            for ax, key in zip(axes, ("examples_per_s", "device_peak_mib", "host_max_rss_mib")):
                ax.plot([r["n"] for r in rows], [r[key] for r in rows], "o-", label=method)
                ax.set(xscale="log", xlabel="examples N", ylabel=key)
        axes[0].legend(fontsize=7)
        written.append(_save(fig, plt, "saliency_scaling.png"))
    diag = _load("diagnostics")
    if diag:
        extra = diag["config"]
        steps = extra["trajectory"]
        fig, ax = plt.subplots(figsize=(6, 3.6))
        ax.plot([r["step"] for r in steps], [r["noise_scale"] for r in steps], label="B_simple (noise scale)")
        ax.set(xlabel="step", ylabel="B_simple", title="digits CNN, batch 256, micro_batches=8")
        loss_ax = ax.twinx()
        loss_ax.plot([r["step"] for r in steps], [r["loss"] for r in steps], color="gray", lw=0.8, label="loss")
        loss_ax.set(ylabel="loss")
        handles = ax.get_legend_handles_labels()[0] + loss_ax.get_legend_handles_labels()[0]
        ax.legend(handles=handles, fontsize=7, loc="upper center")
        written.append(_save(fig, plt, "noise_scale.png"))
        fig, ax = plt.subplots(figsize=(5.5, 3.6))
        for name, style in (("clean", "o-"), ("leaking", "s--")):
            values = extra["monitor"][name]["memory_current_mib"]
            ax.plot(range(1, len(values) + 1), values, style, label=f"{name} fit")
        ax.set(xlabel="epoch", ylabel="device MiB in use at epoch end", title="effgrad.MemoryMonitor")
        ax.legend(fontsize=7)
        written.append(_save(fig, plt, "memory_monitor.png"))
    return written


def _save(fig, plt, name):
    fig.tight_layout()
    path = common.RESULTS / name
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
