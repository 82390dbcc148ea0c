"""Pictures of saliency maps: percentile-clipped images and PNG grids.

``grayscale`` follows PAIR saliency's ``VisualizeImageGrayscale``: sum of
absolute values over channels, clipped at the 99th percentile, scaled to
[0, 1]. ``diverging`` keeps the sign: scaled by the 99th percentile of
``|map|`` to [-1, 1]. Clipping matters: a few extreme pixels otherwise
compress everything else to black.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["grayscale", "diverging", "save_grid"]


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
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError("save_grid draws with matplotlib: pip install 'effgrad[demo]'") from err
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
