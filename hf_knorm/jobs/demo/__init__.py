"""The main job of ``make demo``: every capability on the default model, one step each, and one HTML report.
May import every layer below it (hub, training, evaluation, knorm, balancing, ...); only the CLI imports it."""
