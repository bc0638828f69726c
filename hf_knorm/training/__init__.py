"""Training: NormLoggerCallback (per-layer norms while a Trainer trains), the norm history and its figure, fine-tuning
on any text dataset with held-out perplexity, and the attention-norms figure job. May import evaluation/ (perplexity),
knorm/, balancing/ and everything below them."""
