"""Figures (matplotlib, Agg backend: no display needed). One function per figure; each writes a PNG and returns its path."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

# --- K/V balancing (issue 3) ---------------------------------------------------------------------------------------


def plot_kv_norms(keys_before, values_before, keys_after, values_after, path, title: str | None = None):
    """TransMLA's Fig. 4a: per-channel key (blue) and value (orange) L2 norms, "Original kv-norm" over "Balanced kv-norm".

    Args:
        keys_before, values_before, keys_after, values_after: ``(C,)`` norms, ``C = H_kv * head_dim``.
        path: the PNG to write; title: an optional suptitle.
    """
    import matplotlib.pyplot as plt
    import numpy as np
    from pathlib import Path

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for ax, keys, values, name in ((axes[0], keys_before, values_before, "Original kv-norm"),
                                   (axes[1], keys_after, values_after, "Balanced kv-norm")):
        keys, values = np.asarray(keys, dtype=float), np.asarray(values, dtype=float)
        channels = np.arange(len(keys))
        ax.bar(channels - 0.22, keys, width=0.45, color="tab:blue", label="Key")  # side by side: no colour mixing
        ax.bar(channels + 0.22, values, width=0.45, color="tab:orange", label="Value")
        ax.set_title(name)
        ax.set_ylabel("L2 norm")
        ax.set_xlim(-0.5, len(keys) - 0.5)
        ax.legend(loc="upper right")
    axes[1].set_xlabel("channel (KV heads side by side)")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_kv_ratios(ratios_before, ratios_after, path, title: str | None = None):
    """Per layer, mean key-channel norm / mean value-channel norm, before and after balancing (log y)."""
    import matplotlib.pyplot as plt
    import numpy as np
    from pathlib import Path

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 3.5))
    layers = np.arange(len(ratios_before))
    ax.plot(layers, np.asarray(ratios_before, dtype=float), "o-", color="tab:red", label="original")
    ax.plot(layers, np.asarray(ratios_after, dtype=float), "s-", color="tab:green", label="balanced")
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("mean ||K_c|| / mean ||V_c||")
    ax.set_title(title or "K/V mean-norm ratio per layer")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

