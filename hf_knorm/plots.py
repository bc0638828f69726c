"""Figures (matplotlib, Agg backend: no display needed). One function per figure; each writes a PNG and returns its path."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
