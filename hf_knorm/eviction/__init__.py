"""KNorm KV-cache compression (Devoto et al., arXiv 2406.11430): the evicting cache, its plain reference, and
knorm_generate with the knorm-text-generation pipeline. May import balancing/ and everything below it."""
