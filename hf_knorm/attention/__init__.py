"""The attention itself (every family of :mod:`hf_knorm.normalizations`): the chunked kernel, the linear-time kernel for p = 1 and
the choice between them, its plain reference, the function registered with Transformers' AttentionInterface, and the
taps it reports to. Imports nothing of hf_knorm above it."""
