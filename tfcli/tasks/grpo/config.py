"""The `grpo:` recipe section (TRL's GRPOConfig names), and what it names: the answer column, the reward."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ...recipe import require
from ..replies import ReplyConfig

EPS = 1e-4  # TRL's: advantages are divided by std + EPS


@dataclass(frozen=True)
class GRPOConfig(ReplyConfig):
    """The `grpo:` recipe section: a reply task's fields, and TRL's GRPOConfig names with its defaults
    where a CPU allows them."""

    reward: str = field(
        default="",
        metadata={
            "help": "--reward: final-number, exact, contains, regex:P, length:N, file.py:fn; weights as :W",
            "path": "code",
        },
    )
    tools: str = field(
        default="",
        metadata={
            "help": "--tools: calculator, lookup:TABLE.jsonl, file.py:fn (the model calls them; multi-turn)",
            "path": "code",
        },
    )
    env: str = field(
        default="",
        metadata={
            "help": "--env file.py:Class: an environment per rollout (reset(**row), its methods the tools, "
            "get_reward() optional)",
            "path": "code",
        },
    )
    max_turns: int = field(
        default=4,
        metadata={"help": "with tools: the most assistant turns a rollout has (TRL's max_tool_calling_iterations + 1)"},
    )
    tool_timeout: float = field(default=10.0, metadata={"help": "with tools: seconds a call may run"})
    tool_result_chars: int = field(
        default=2000, metadata={"help": "with tools: a longer result goes back to the model as an error"}
    )
    preset: str = field(
        default="", metadata={"help": "gsm8k: GSM8K's fields and splits, and final-number as the default reward"}
    )
    answer_field: str = field(
        default="",
        metadata={"help": 'what final-number, exact and contains compare with ("": the preset\'s, else answer)'},
    )
    messages_field: str = field(
        default="messages", metadata={"help": "a row's conversation so far (ending with the user's turn)"}
    )
    num_generations: int = field(default=8, metadata={"help": "G: completions sampled per prompt"})
    max_completion_length: int = field(default=256, metadata={"help": "tokens (TRL: 512)"})
    share_prompt: bool = field(
        default=True,
        metadata={"help": "a prompt's completions in one row after it, the prompt read once (false: a row each)"},
    )
    temperature: float = field(
        default=1.0,
        metadata={"help": "sampling temperature of the completions (log-probabilities are of logits / temperature)"},
    )
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling of the completions (1: off)"})
    top_k: int = field(default=0, metadata={"help": "0: all"})
    beta: float = field(default=0.0, metadata={"help": "the KL term's weight (0: no reference model)"})
    reference: Literal["auto", "copy", "base"] = field(
        default="auto", metadata={"help": "with beta > 0; auto: base for lora/qlora/ia3, else copy"}
    )
    use_bias_correction_kl: bool = field(
        default=True, metadata={"help": "the KL term times the ratio (TRL's default, DeepSeek-V3.2)"}
    )
    epsilon: float = field(default=0.2, metadata={"help": "clipping of the ratio, below"})
    epsilon_high: float = field(default=0.0, metadata={"help": "and above (0: epsilon; DAPO: 0.28)"})
    num_iterations: int = field(
        default=1, metadata={"help": "steps trained on each rollout (mu; > 1 makes the ratio and its clipping matter)"}
    )
    scale_rewards: Literal["group", "batch", "none"] = field(
        default="group",
        metadata={
            "help": "advantages over the group's reward deviation (group), the batch's (batch), or unscaled (none)"
        },
    )
    loss_type: Literal["grpo", "dapo", "dr_grpo", "rloo"] = field(
        default="dapo",
        metadata={
            "help": "grpo: each completion's mean then their mean; dapo: the mean over every completion token; "
            "dr_grpo: over completions x max_completion_length; rloo: RLOO (leave-one-out baseline, the "
            "sequence's ratio, the KL in the reward: TRL's RLOOTrainer)"
        },
    )
    normalize_advantages: bool = field(
        default=False, metadata={"help": "rloo: advantages standardised over the batch (TRL's RLOOConfig)"}
    )
    mask_truncated_completions: bool = field(
        default=False, metadata={"help": "completions cut at the length limit are left out of the loss"}
    )
    eval_prompts: int = field(
        default=64,
        metadata={
            "resumable": True,
            "help": "held-out prompts answered at each evaluation (greedy unless eval_sampled)",
        },
    )
    eval_sampled: bool = field(
        default=False,
        metadata={
            "resumable": True,
            "help": "held-out prompts answered by sampling (temperature, top_k, top_p; the same seed at every "
            "evaluation) instead of greedily: the reward the policy expects, as TRL's evaluation samples",
        },
    )
    generate_batch: int = field(
        default=64, metadata={"resumable": True, "help": "rows generated together at an evaluation"}
    )
    show: int = field(default=2, metadata={"resumable": True, "help": "completions printed at each evaluation"})

    def __post_init__(self):
        super().__post_init__()
        require(
            self.num_generations >= 2,
            "grpo.num_generations",
            ">= 2 (advantages compare a prompt's completions)",
            self.num_generations,
        )
        require(self.max_completion_length >= 1, "grpo.max_completion_length", ">= 1", self.max_completion_length)
        require(self.temperature > 0, "grpo.temperature", "> 0 (completions are sampled)", self.temperature)
        require(0 < self.top_p <= 1, "grpo.top_p", "in (0, 1]", self.top_p)
        require(self.top_k >= 0, "grpo.top_k", ">= 0", self.top_k)
        require(self.beta >= 0, "grpo.beta", ">= 0", self.beta)
        require(0 <= self.epsilon < 1, "grpo.epsilon", "in [0, 1)", self.epsilon)
        require(self.epsilon_high >= 0, "grpo.epsilon_high", ">= 0", self.epsilon_high)
        require(self.num_iterations >= 1, "grpo.num_iterations", ">= 1", self.num_iterations)
        require(self.max_turns >= 1, "grpo.max_turns", ">= 1", self.max_turns)
        require(self.tool_timeout > 0, "grpo.tool_timeout", "> 0 seconds", self.tool_timeout)
        require(self.tool_result_chars >= 1, "grpo.tool_result_chars", ">= 1", self.tool_result_chars)
        require(self.eval_prompts >= 0, "grpo.eval_prompts", ">= 0", self.eval_prompts)
        require(self.generate_batch >= 1, "grpo.generate_batch", ">= 1", self.generate_batch)

    @property
    def uses_tools(self) -> bool:
        return bool(self.tools or self.env)

    @property
    def reads_old(self) -> bool:
        """Whether a rollout keeps the sampling model's log-probabilities: later iterations' ratios
        compare with them, and RLOO's KL penalty reads them."""
        return self.num_iterations > 1 or (self.loss_type == "rloo" and self.beta > 0)

    @property
    def upper(self) -> float:
        return self.epsilon_high or self.epsilon


def fields_of(cfg: GRPOConfig) -> tuple[str, str]:
    """(prompt column, answer column): the recipe's, else the preset's, else prompt and answer."""
    p = cfg.reply_preset
    return cfg.prompt_column, cfg.answer_field or (p.response_field if p else "answer")


def reward_spec(cfg: GRPOConfig) -> str:
    """The rewards: the recipe's, else the preset's metric (GSM8K's final number)."""
    p = cfg.reply_preset
    return cfg.reward or (p.metric if p else "")
