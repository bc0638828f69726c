"""The training jobs' common ground and ``hf-knorm finetune``: sources and extras checked before a model loads, the
run folder (atomic JSON, the settings compared on resume), the Trainer arguments every job shares. May import hub/,
training/, evaluation/ and everything below them; conversion/ builds on it."""
