"""Standard benchmarks scored by log-likelihood, as lm-evaluation-harness scores them: a benchmark is
data (a YAML file: its files, how a row becomes a context and its choices, its few-shot split), the
scorer is one (loglik.py), the report is lm-evaluation-harness's `results` layout (report.py)."""
