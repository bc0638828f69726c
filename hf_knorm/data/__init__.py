"""The training data: datasets (embedded, local files, ``datasets`` names) loaded and checked, the three record
formats (text, conversations, prompt/completion) tokenized with their loss masks, the held-out examples and their
perplexity through the Trainer's evaluation, and the digits of the attention-norms ViT. May import evaluation/ and
everything below it."""
