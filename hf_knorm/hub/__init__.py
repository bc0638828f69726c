"""The Hub: saving a model with its card, pushing it in one commit, the card template's inputs (origin, measurements).
May import runs/, training/, data/, evaluation/ and everything below them."""

from .card import render_card
from .push import HubPushError, push_folder, push_to_hub
from .saving import save_pretrained

__all__ = ["HubPushError", "push_folder", "push_to_hub", "render_card", "save_pretrained"]
