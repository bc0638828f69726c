"""What every training job's run is built from: sources and extras checked before any model loads, the run folder
(atomic JSON, the settings and inputs compared on resume), the TrainingArguments every job shares, mixed precision,
FSDP sharding, and finetune's SFTTrainer. May import training/, data/ and everything below them; conversion/ and the
jobs build on it."""
