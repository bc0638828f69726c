"""Attention normalizations: one typed, frozen object per family, one file per family (:mod:`.base` says what each
family defines; :mod:`.registry` parses spellings and saved records). Imports nothing of hf_knorm above it (torch
only): the attention, the models and every job import it."""

from .base import Learnable, Normalization
from .grammar import SpellingError
from .polynomial import Polynomial
from .rectified import Rectified
from .registry import (FAMILIES, from_record, list_normalizations, normalization_grammar, parse_normalization,
                       representative_spellings)
from .sigmoid import Sigmoid
from .sink_softmax import SinkSoftmax
from .softmax import Softmax
from .softpick import Softpick
from .ssmax import SSMax
from .stick_breaking import StickBreaking
from .windowed import Windowed, with_clusters, with_sparse, with_window

PAPER_NORMALIZATIONS = ("softmax", "x/1", "x/16", "x^3/1", "x^3/16", "x^3/sqrtN")
"""The spellings of "Rethinking Softmax"'s figure legend (arXiv 2410.18613)."""

__all__ = ["FAMILIES", "PAPER_NORMALIZATIONS", "Learnable", "Normalization", "Polynomial", "Rectified", "SSMax",
           "Sigmoid", "SinkSoftmax", "Softmax", "Softpick", "SpellingError", "StickBreaking", "Windowed", "from_record",
           "list_normalizations", "normalization_grammar", "parse_normalization", "representative_spellings",
           "with_clusters", "with_sparse", "with_window"]
