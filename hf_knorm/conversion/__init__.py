"""Conversion: a pretrained softmax model made to work under another normalization (``hf_knorm.convert``,
``hf-knorm convert``): attention transfer, then LoRA or full recovery, held-out perplexity at every stage (LoLCATs,
arXiv 2410.10254); its job is :mod:`hf_knorm.jobs.convert`. May import hub/, runs/, training/, data/, evaluation/ and
everything below them."""
