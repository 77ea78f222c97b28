"""Online reinforcement learning with verifiable rewards: GRPO (`tfcli finetune grpo`; Shao et al. 2024),
as TRL's GRPOTrainer defines it (trl/trainer/grpo_trainer.py, grpo_config.py).

    tfcli finetune grpo --from MODEL --data prompts.jsonl --reward final-number
    tfcli finetune grpo --from MODEL --data gsm8k/ --set grpo.preset=gsm8k --train lora
    tfcli eval grpo --checkpoint RUN --data test.jsonl --limit 200

Each step draws train.batch_size prompts; the model samples grpo.num_generations (G) completions of
each (grpo.temperature, top_p, top_k; at most max_completion_length tokens, ending at the end-of-turn
token, which is trained); the rewards (tasks/rewards.py) score them; a completion's advantage is its
reward less its group's mean, over the group's standard deviation + 1e-4 (scale_rewards group; batch:
the whole batch's deviation; none: unscaled). The loss, token by token t of completion i, is

    -min(r A_i, clip(r, 1 - epsilon, 1 + epsilon_high) A_i) + beta (exp(ref - logp) - (ref - logp) - 1)

with r = exp(logp - logp_old): 1 (with its gradient) unless grpo.num_iterations > 1 trains several
steps on one rollout, and the k3 KL estimate against the frozen reference only when beta > 0 (TRL's
default is 0), times r as TRL's use_bias_correction_kl (default on) has it. loss_type normalises it: grpo (each completion's mean, then their mean), dapo (the mean
over every completion token of the global batch, TRL's default), dr_grpo (the sum over completions x
max_completion_length). Log-probabilities are of logits / temperature, as TRL computes them. Metrics
are named as TRL names them. Completions run to the right of their prompt in one right-padded row
(positions as in generation; no attention mask needed: padding only follows).

The package, a module a job: config (the `grpo:` section), prompts (rows to prompts, the batches a
step draws), loss (advantages and the clipped surrogate), rollouts (sampling, scoring, the rows the
loss reads) and plugin (the task put together, its evaluation and report).
"""

from .config import EPS, GRPOConfig, fields_of, reward_spec
from .loss import GRPOLoss, advantages, completion_logprobs, nanstd, rows_of
from .plugin import GRPO
from .prompts import Prompt, PromptBatches, PromptBuilder, Prompts
from .rollouts import Rollouts, planned_rollout, pooled_nanstd, reward_names

__all__ = [
    "EPS",
    "GRPO",
    "GRPOConfig",
    "GRPOLoss",
    "Prompt",
    "PromptBatches",
    "PromptBuilder",
    "Prompts",
    "Rollouts",
    "advantages",
    "completion_logprobs",
    "fields_of",
    "nanstd",
    "planned_rollout",
    "pooled_nanstd",
    "reward_names",
    "reward_spec",
    "rows_of",
]
