"""Constant-size decoding for linear attention (x/1, x/16): the layers that hold a state, not K and V (``state.py``,
``window_cache.py``), the cache made of them (``cache.py``) and ``generate``'s choice of it (``generation.py``), in
that order of imports. May import attention/ and compat; models/ (patching) imports it."""
