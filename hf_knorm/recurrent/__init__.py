"""Constant-size decoding for linear attention (x/1, x/16): a cache that holds a state, not K and V, and the generate
that uses it. May import attention/ and compat; models/ (patching) imports it."""
