"""Pictures of saliency maps: percentile-clipped images, PNG grids with a colour bar, wrapped token heat text.

``grayscale`` follows PAIR saliency's ``VisualizeImageGrayscale``: sum of
absolute values over channels, clipped at the 99th percentile, scaled to
[0, 1]. ``diverging`` keeps the sign: scaled by the 99th percentile of
``|map|`` to [-1, 1]. Clipping matters: a few extreme pixels otherwise
compress everything else to black.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["grayscale", "diverging", "save_grid", "save_tokens"]


def _per_pixel(saliency_map: np.ndarray, channel_axis: bool) -> np.ndarray:
    m = np.asarray(saliency_map, dtype="float32")
    return np.sum(np.abs(m), axis=-1) if channel_axis else np.abs(m)


def grayscale(saliency_map: np.ndarray, percentile: float = 99, channels: bool | None = None) -> np.ndarray:
    """One map -> [0, 1] image ``[H, W]``.

    Args:
        saliency_map: ``[H, W, C]`` or already reduced ``[H, W]``.
        percentile: Values above this percentile become 1.
        channels: Whether the last axis is channels (default: rank 3).
    """
    m = _per_pixel(saliency_map, np.ndim(saliency_map) == 3 if channels is None else channels)
    top = np.percentile(m, percentile)
    low = np.min(m)
    return np.clip((m - low) / (top - low), 0, 1) if top > low else np.zeros_like(m)


def diverging(saliency_map: np.ndarray, percentile: float = 99, channels: bool | None = None) -> np.ndarray:
    """One map -> [-1, 1] image ``[H, W]`` keeping the sign (channels summed)."""
    m = np.asarray(saliency_map, dtype="float32")
    if np.ndim(m) == 3 if channels is None else channels:
        m = m.sum(axis=-1)
    top = np.percentile(np.abs(m), percentile)
    return np.clip(m / top, -1, 1) if top > 0 else np.zeros_like(m)


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError("effgrad draws with matplotlib: pip install 'effgrad[demo]'") from err
    return plt


def _wrap(line: list, width: int) -> list[list]:
    """Token runs of at most ``width`` characters (a longer token gets a line of its own)."""
    wrapped, current, used = [], [], 0
    for text, value in line:
        if current and used + len(text) > width:
            wrapped.append(current)
            current, used = [], 0
        current.append((text, value))
        used += len(text) + 1
    return wrapped + [current] if current or not wrapped else wrapped


def save_tokens(
    path, tokens, scores, *, mask=None, signed: bool = False, percentile: float = 99, width: int = 80
) -> Path:
    """Writes a PNG of each example's tokens on a background coloured by its score (needs matplotlib).

    Tokens wrap at ``width`` characters, so a long sequence reads as a
    paragraph at normal size; examples are separated by a rule and numbered.
    A colour bar says what the colours mean.

    Example:
        >>> scores = effgrad.saliency(classifier, inputs, layer="token_embedding", method="integrated_gradients")
        >>> words = [tokenizer.id_to_token(i) for i in ...]  # one list of strings per example
        >>> visualize.save_tokens("tokens.png", words, scores.sum(-1), mask=inputs["padding_mask"], signed=True)

    Args:
        path: Output ``.png`` path.
        tokens: ``[n][T]`` token strings (lists, or an array of str).
        scores: ``[n, T]`` per-token scores (``reduce="l2"``/``"sum"`` at the embedding).
        mask: Optional ``[n, T]``: tokens where it is 0 (padding) are not drawn.
        signed: Diverging colours (``reduce="sum"`` keeps a sign) instead of one hue.
        percentile: Scores are scaled by this percentile of ``|scores|`` over all examples.
        width: Characters per line before a token wraps.
    """
    plt = _pyplot()
    scores = np.asarray(scores, dtype="float32")
    keep = np.ones(scores.shape, bool) if mask is None else np.asarray(mask).astype(bool)
    top = np.percentile(np.abs(scores[keep]), percentile) if keep.any() else 0.0
    scaled = np.clip(scores / top, -1, 1) if top > 0 else np.zeros_like(scores)
    cmap = plt.get_cmap("bwr" if signed else "Reds")
    examples = [
        _wrap([(str(t), v) for t, v, k in zip(row, values, kept) if k], width)
        for row, values, kept in zip(tokens, scaled, keep)
    ]
    lines = sum(len(e) for e in examples) + len(examples)  # one gap line between examples
    fig = plt.figure(figsize=(0.085 * width + 1.4, 0.3 * lines + 0.9))
    ax = fig.add_axes([0.07, 0.9 / (0.3 * lines + 0.9), 0.9, 1 - 0.95 / (0.3 * lines + 0.9)])
    ax.set_xlim(0, width)
    ax.set_ylim(lines, 0)
    ax.axis("off")
    y = 0.5
    for number, example in enumerate(examples):
        ax.text(-1, y, f"{number}", ha="right", va="center", fontsize=8, color="0.4")
        for line in example:
            x = 0.0
            for text, value in line:
                colour = cmap((value + 1) / 2 if signed else value)
                ax.text(x, y, text, va="center", fontsize=9, family="monospace",
                        bbox={"facecolor": colour, "edgecolor": "none", "pad": 1.5})  # fmt: skip
                x += len(text) + 1
            y += 1
        ax.axhline(y, color="0.85", linewidth=0.6)
        y += 1
    bar_ax = fig.add_axes([0.3, 0.25 / (0.3 * lines + 0.9), 0.4, 0.12 / (0.3 * lines + 0.9)])
    mappable = plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(-1 if signed else 0, 1))
    bar = fig.colorbar(mappable, cax=bar_ax, orientation="horizontal")
    bar.set_label(
        f"score / its {percentile:g}th percentile of |score|" + (" (sign kept)" if signed else ""), fontsize=8
    )
    bar.ax.tick_params(labelsize=7)
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def save_grid(path, images, maps, *, titles=None, columns: int = 4, signed: bool = False) -> Path:
    """Writes a PNG of inputs next to their maps, with a labelled colour bar (needs matplotlib).

    Each example takes two cells: the input (grayscale or RGB, its own range
    stretched) and its map. Unsigned maps are drawn with :func:`grayscale`'s
    scaling (|map| summed over channels, 99th percentile = 1) in the
    ``inferno`` colour map; ``signed=True`` draws :func:`diverging`'s [-1, 1]
    in blue-white-red. The colour bar at the bottom says which.

    Args:
        path: Output ``.png`` path.
        images: ``[n, H, W]`` or ``[n, H, W, C]`` inputs (any range).
        maps: ``[n, ...]`` maps (reduced or not).
        titles: Optional label per example.
        columns: Examples per row (each takes two cells: input, map).
        signed: Diverging colour map (blue-white-red, the sign kept) instead of ``inferno`` on |map|.
    """
    plt = _pyplot()
    images, maps = np.asarray(images), np.asarray(maps)
    n = len(images)
    rows = (n + columns - 1) // columns
    fig, axes = plt.subplots(rows, 2 * columns, figsize=(2 * columns * 1.4, rows * 1.5 + 0.6), squeeze=False)
    for ax in axes.ravel():
        ax.axis("off")
    cmap, low = ("bwr", -1) if signed else ("inferno", 0)
    for i in range(n):
        ax_img, ax_map = axes[i // columns, 2 * (i % columns)], axes[i // columns, 2 * (i % columns) + 1]
        img = images[i].astype("float32")
        img = (img - img.min()) / (np.ptp(img) or 1.0)
        ax_img.imshow(img.squeeze(), cmap="gray" if img.squeeze().ndim == 2 else None)
        if titles is not None:
            ax_img.set_title(str(titles[i]), fontsize=8)
        ax_map.imshow(diverging(maps[i]) if signed else grayscale(maps[i]), cmap=cmap, vmin=low, vmax=1)
        if i < columns:
            ax_map.set_title("saliency", fontsize=8)
    fig.tight_layout(rect=(0, 0.6 / (rows * 1.5 + 0.6), 1, 1))
    bar_ax = fig.add_axes([0.3, 0.2 / (rows * 1.5 + 0.6), 0.4, 0.12 / (rows * 1.5 + 0.6)])
    bar = fig.colorbar(
        plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(low, 1)), cax=bar_ax, orientation="horizontal"
    )
    label = "signed saliency / 99th pct of |map|" if signed else "|saliency| (channels summed) / its 99th percentile"
    bar.ax.set_title(label, fontsize=8)
    bar.ax.tick_params(labelsize=7)
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
