"""Models: the architecture registry, where each family keeps q/k/v/o (K/V layouts), patch/unpatch, and saving and
loading with the normalization kept. May import attention/, assets/ and version."""
