"""K/V balancing (TransMLA Balanced Key-Value, per layer or per channel): calibration and exact fold, the before/after
report, and the K/V codecs that measure what it buys. May import recording/, models/, attention/, plots and assets/."""
