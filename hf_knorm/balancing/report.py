"""What K/V balancing measured and did: per-channel norms before and after, the scales, the exactness check.

:class:`BalanceReport` is returned by :func:`hf_knorm.balance_kv`; ``report.plot(path)`` draws TransMLA's Fig. 4a
(arXiv 2502.07864): per-channel L2 norms of the cached keys (blue) and values (orange) of one layer, "Original kv-norm"
over "Balanced kv-norm"; ``report.save(directory)`` writes that figure, the per-layer K/V ratio summary and the JSON.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class KVNorms:
    """Per-layer, per-channel L2 norms over the calibration tokens (post-RoPE keys; channel ``h * head_dim + d``).

    Attributes:
        keys, values (list of torch.Tensor): One fp64 ``(H_kv * D,)`` tensor per layer.
        tokens (int): Calibration tokens per layer.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    tokens: int

    def ratios(self) -> torch.Tensor:
        """``(L,)`` mean key-channel norm / mean value-channel norm per layer."""
        return torch.stack([k.mean() / v.mean() for k, v in zip(self.keys, self.values)])


@dataclass
class BalanceReport:
    """What :func:`balance_kv` did: norms before and after (both measured), the scales folded, the check.

    Attributes:
        mode (str): ``"layer"`` or ``"channel"``.
        alpha (float or None): Migration strength (``"channel"`` only).
        before, after (KVNorms): Norms of the model before and after this balancing, both measured.
        key_scales, value_scales (list of torch.Tensor): Per layer the fp64 ``(H_kv, D)`` ``s`` and ``t`` of this call
            (K' = K / s, V' = V * t).
        max_logit_change (float): Max |logits after - logits before| on the verification tokens.
        tolerance (float): The bound it had to meet.
    """

    mode: str
    alpha: float | None
    before: KVNorms
    after: KVNorms
    key_scales: list[torch.Tensor]
    value_scales: list[torch.Tensor]
    max_logit_change: float
    tolerance: float

    def default_layer(self) -> int:
        """The layer whose keys dominate its values most before balancing (largest mean-norm ratio)."""
        return int(self.before.ratios().argmax())

    def plot(self, path: str | Path, layer: int | None = None) -> Path:
        """The seed figure for ``layer`` (default: :meth:`default_layer`).

        Two stacked panels, "Original kv-norm" over "Balanced kv-norm"; x = channel, keys blue, values orange.
        """
        from ..plots import plot_kv_norms

        layer = self.default_layer() if layer is None else layer
        if not 0 <= layer < len(self.before.keys):
            raise ValueError(f"layer must be in 0..{len(self.before.keys) - 1}, got {layer}.")
        before, after = self.before.ratios()[layer].item(), self.after.ratios()[layer].item()
        title = f"layer {layer}, mode={self.mode}: mean key / mean value norm {before:.2f} -> {after:.2f}"
        return plot_kv_norms(self.before.keys[layer], self.before.values[layer], self.after.keys[layer],
                             self.after.values[layer], path, title=title)

    def plot_summary(self, path: str | Path) -> Path:
        """K/V mean-norm ratio per layer, before and after."""
        from ..plots import plot_kv_ratios

        return plot_kv_ratios(self.before.ratios(), self.after.ratios(), path, title=f"mode={self.mode}")

    def save(self, directory: str | Path, layer: int | None = None) -> dict[str, Path]:
        """Write the seed figure for ``layer``, the per-layer ratio summary and :meth:`to_dict` (JSON).

        Returns the paths by kind: ``figure``, ``summary``, ``json``.
        """
        directory = Path(directory)
        layer = self.default_layer() if layer is None else layer
        paths = {"figure": self.plot(directory / f"kv_norms_layer{layer}_{self.mode}.png", layer),
                 "summary": self.plot_summary(directory / f"kv_ratios_{self.mode}.png"),
                 "json": directory / f"kv_norms_{self.mode}.json"}
        paths["json"].write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return paths

    def to_dict(self) -> dict:
        """JSON-ready numbers: settings, the check, and per layer the norms, means and ratios before and after."""
        layers = []
        for i in range(len(self.before.keys)):
            entry = {"layer": i}
            for name, norms in (("before", self.before), ("after", self.after)):
                k, v = norms.keys[i], norms.values[i]
                entry[name] = {"key_mean": k.mean().item(), "value_mean": v.mean().item(),
                               "ratio": (k.mean() / v.mean()).item(), "keys": k.tolist(), "values": v.tolist()}
            layers.append(entry)
        return {"mode": self.mode, "alpha": self.alpha, "calibration_tokens": self.before.tokens,
                "max_logit_change": self.max_logit_change, "tolerance": self.tolerance, "layers": layers}
