"""The main job of ``make demo``: every capability on the default model, one step each, and one HTML report.
May import every layer below it (conversion, hub, training, evaluation, eviction, balancing, ...); only the CLI imports it."""
