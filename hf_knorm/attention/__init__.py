"""The attention itself: normalizations (softmax, x^p/c), the chunked kernel, its plain reference, the function
registered with Transformers' AttentionInterface, and the taps it reports to. Imports nothing of hf_knorm above it."""
