"""Pictures of saliency maps: percentile-clipped images, PNG grids, token heat lines.

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


def save_tokens(path, tokens, scores, *, mask=None, signed: bool = False, percentile: float = 99) -> Path:
    """Writes a PNG of each example's tokens on a background coloured by its score (needs matplotlib).

    Example:
        >>> scores = effgrad.saliency(classifier, inputs, layer="token_embedding", reduce="l2")
        >>> words = [tokenizer.id_to_token(i) for i in ...]  # one list of strings per example
        >>> visualize.save_tokens("tokens.png", words, scores, mask=inputs["padding_mask"])

    Args:
        path: Output ``.png`` path.
        tokens: ``[n][T]`` token strings (lists, or an array of str).
        scores: ``[n, T]`` per-token scores (``reduce="l2"``/``"sum"`` at the embedding).
        mask: Optional ``[n, T]``: tokens where it is 0 (padding) are not drawn.
        signed: Diverging colours (``reduce="sum"`` keeps a sign) instead of one hue.
        percentile: Scores are scaled by this percentile of ``|scores|`` over all examples.
    """
    plt = _pyplot()
    scores = np.asarray(scores, dtype="float32")
    keep = np.ones(scores.shape, bool) if mask is None else np.asarray(mask).astype(bool)
    top = np.percentile(np.abs(scores[keep]), percentile) if keep.any() else 0.0
    scaled = np.clip(scores / top, -1, 1) if top > 0 else np.zeros_like(scores)
    cmap = plt.get_cmap("bwr" if signed else "Reds")
    lines = [
        [(str(t), v) for t, v, k in zip(row, values, kept) if k] for row, values, kept in zip(tokens, scaled, keep)
    ]
    width = max((sum(len(t) + 1 for t, _ in line) for line in lines), default=1)
    fig = plt.figure(figsize=(min(0.11 * width + 0.4, 30), 0.32 * len(lines) + 0.2))
    ax = fig.add_axes([0, 0, 1, 1])
    ax.set_xlim(0, width)
    ax.set_ylim(len(lines), 0)
    ax.axis("off")
    for r, line in enumerate(lines):
        x = 0.0
        for text, value in line:
            colour = cmap((value + 1) / 2 if signed else value)
            ax.text(x, r + 0.5, text, va="center", fontsize=9, family="monospace",
                    bbox={"facecolor": colour, "edgecolor": "none", "pad": 1.5})  # fmt: skip
            x += len(text) + 1
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def save_grid(path, images, maps, *, titles=None, columns: int = 4, signed: bool = False) -> Path:
    """Writes a PNG of inputs next to their maps (needs matplotlib).

    Args:
        path: Output ``.png`` path.
        images: ``[n, H, W]`` or ``[n, H, W, C]`` inputs (any range).
        maps: ``[n, ...]`` maps (reduced or not).
        titles: Optional label per example.
        columns: Examples per row (each takes two cells: input, map).
        signed: Diverging colour map (blue-white-red) instead of grayscale.
    """
    plt = _pyplot()
    images, maps = np.asarray(images), np.asarray(maps)
    n = len(images)
    rows = (n + columns - 1) // columns
    fig, axes = plt.subplots(rows, 2 * columns, figsize=(2 * columns * 1.4, rows * 1.5), squeeze=False)
    for ax in axes.ravel():
        ax.axis("off")
    for i in range(n):
        ax_img, ax_map = axes[i // columns, 2 * (i % columns)], axes[i // columns, 2 * (i % columns) + 1]
        img = images[i].astype("float32")
        img = (img - img.min()) / (np.ptp(img) or 1.0)
        ax_img.imshow(img.squeeze(), cmap="gray" if img.squeeze().ndim == 2 else None)
        if titles is not None:
            ax_img.set_title(str(titles[i]), fontsize=8)
        if signed:
            ax_map.imshow(diverging(maps[i]), cmap="bwr", vmin=-1, vmax=1)
        else:
            ax_map.imshow(grayscale(maps[i]), cmap="inferno", vmin=0, vmax=1)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
