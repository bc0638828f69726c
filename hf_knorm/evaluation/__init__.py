"""Evaluation: needle-in-a-haystack and passkey grids, teacher-forced perplexity.
May import eviction/, balancing/ and everything below them."""
