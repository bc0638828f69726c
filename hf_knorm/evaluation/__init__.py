"""Evaluation: needle-in-a-haystack and passkey grids, teacher-forced perplexity.
May import knorm/, balancing/ and everything below them."""
