"""What runs a job: the trainer, runtime, checkpoints, backbone loading, prefetch, evaluation, perf, loggers, plots."""
