"""The jobs: one module (the demo: one package) per ``hf-knorm`` command, each holding the command's settings
dataclass and its run function (finetune, convert, niah, kv-norms, attention-norms, push, demo). May import every
layer below it; only the CLI (and ``hf_knorm.convert``) imports it."""
