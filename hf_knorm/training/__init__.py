"""Training: NormLoggerCallback (per-layer norms while a Trainer trains), the norm history and its figure. The data
pipeline is data/, what the jobs build a run from is runs/, the jobs are jobs/. May import data/, evaluation/ and
everything below them (it uses recording/ and models/)."""
