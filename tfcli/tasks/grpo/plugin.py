"""The GRPO plug-in: its data, rewards, rollouts and loss put together into a Job, its evaluation
(greedy completions of held-out prompts, their mean reward) and its report."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ...data.chat import stop_ids, tool_templates
from ...display import console, note, phase
from ...engine.backbone import from_run
from ...engine.perf import training_flops_multiplier
from ...errors import UserError
from ...models import kinds
from ...plugin import EvalOptions, Job, OnPolicy
from ...tools.toolbox import EnvironmentClass, Limits, ToolSet, parse_tools
from .. import rewards as rewarding
from ..reference import reference_mode, starting_model
from ..replies import ReplyTask, report_rows
from .config import GRPOConfig, fields_of, reward_spec
from .loss import GRPOLoss
from .packing import Packer
from .prompts import Prompt, PromptBatches, PromptBuilder
from .rollouts import Completed, Rollouts, planned_rollout
from .turns import ToolTurns, ToolUse, public, tool_sums

# grpo.eval_sampled's seed (plus each group's offset): the same draws at every evaluation, so that
# checkpoints are compared on the same random numbers
EVAL_SEED = 20_251

SHOWN = (  # the log line's metrics (metrics.jsonl keeps every one)
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "completions/mean_length",
    "completions/clipped_ratio",
    "kl",
    "clip_ratio/region_mean",
    "loss",
    "grad_norm",
)


class GRPO(ReplyTask):
    key = "grpo"
    noun = "prompts"
    eval_limit_hint = 100
    model_kinds = (kinds.DECODER,)
    recipe_pattern = "grpo-{family}-mini"
    Config = GRPOConfig
    describe = "GRPO (online RL, verifiable rewards)"

    def title(self, recipe, backbone) -> str:
        cfg = recipe.settings
        return (
            f"grpo ({cfg.preset or 'own prompts'}, reward {reward_spec(cfg)}, G {cfg.num_generations}, {cfg.loss_type})"
        )

    def text_columns(self, cfg: GRPOConfig) -> tuple[str, ...]:
        return fields_of(cfg)

    def agreed(self, mine: bool) -> bool:
        """Whether every process's rows have stopped: FSDP's processes run every forward pass together."""
        if not self.rt.strategy.lockstep or not self.rt.distributed:
            return mine
        return self.rt.mean({"done": float(mine)})["done"] >= 1.0

    def prompts(self, recipe, backbone, data: str | None = None, need_train: bool = True, say: bool = True):
        """Every split's prompts (the training split first), each split's skipped rows named (say)."""
        cfg = recipe.settings
        room = min(recipe.data.seq_len, backbone.cfg.max_seq_len) - cfg.max_completion_length
        if room < 1:
            raise UserError(
                f"grpo.max_completion_length {cfg.max_completion_length} leaves no room for a prompt in "
                f"data.seq_len {min(recipe.data.seq_len, backbone.cfg.max_seq_len)} (prompt + completion); "
                f"raise data.seq_len or lower grpo.max_completion_length"
            )
        schemas = self.toolset(recipe, self.named_code).schemas if cfg.uses_tools else None
        build = PromptBuilder(backbone.tokenizer, self.template(recipe, backbone), cfg, room, schemas)
        self.builder = build
        return self.read(recipe, build, data, need_train, say)

    def toolset(self, recipe, named: frozenset[str]) -> ToolSet:
        """The run's tools and environment class, read once per command (a user's file is imported only
        when this command's own command line names it)."""
        cfg = recipe.settings
        if getattr(self, "_toolset", None) is None:
            tools = parse_tools(cfg.tools, named) if cfg.tools else []
            env = EnvironmentClass(cfg.env, named) if cfg.env else None
            self._toolset = ToolSet(tools, env)
        return self._toolset

    def tooling(self, recipe, backbone, stops: set[int]) -> ToolUse | None:
        """The rollouts' tool use (None without tools): one line when the template cannot take part."""
        cfg = recipe.settings
        if not cfg.uses_tools:
            return None
        template = self.template(recipe, backbone)
        if template is None:
            raise UserError(f"grpo with tools needs a chat template (grpo.chat_template: shipped {tool_templates()})")
        found = self.toolset(recipe, self.named_code)
        turns = ToolTurns(template, backbone.tokenizer, stops, cfg.max_turns)
        limits = Limits(cfg.tool_timeout, cfg.tool_result_chars)
        return ToolUse(turns, found, limits, self.builder.rerender)

    def rewards(self, recipe, prompts: list[Prompt], named: frozenset[str] | None = None) -> list:
        """The run's rewards, tried on its first rows with an empty completion before anything is
        created: a missing column, a function that raises or miscounts stops here, in one line. An
        environment's get_reward comes last (tried on no row: it reads a finished rollout)."""
        cfg = recipe.settings
        named = self.named_code if named is None else named
        env = self.toolset(recipe, named).env if cfg.env else None
        owned = [rewarding.environment_reward(env.name)] if env is not None and env.rewards else []
        if owned and not reward_spec(cfg):
            return owned
        rewards = rewarding.parse(reward_spec(cfg), fields_of(cfg)[1], named)
        for r in rewards:
            if r.reads and prompts and r.reads not in prompts[0].row:
                raise UserError(
                    f"reward {r.name} compares completions with each row's {r.reads!r} column, which the rows do "
                    f"not have (grpo.answer_field names it)"
                )
        sample = prompts[:2]
        rewarding.scored(
            rewards,
            rewarding.Completions(
                [p.asked for p in sample],
                [""] * len(sample),
                [[] for _ in sample],
                [p.row for p in sample],
                cfg.max_completion_length,
            ),
            lambda i: f"training row {sample[i].number} (an empty completion, tried before training)",
        )
        return rewards + owned

    def scorable(self, prompts: list[Prompt], rewards: list, split: str) -> list[Prompt]:
        """The prompts some reward can score: a row no reward can ever reward (final-number of an answer
        with no final number) would train on a group of zeros; they are dropped, counted in a note."""
        kept = [p for p in prompts if not all(r.scores_nothing_of(p.row) for r in rewards)]
        if len(kept) < len(prompts):
            field = next(r.reads for r in rewards if r.reads)
            why = f"{len(prompts) - len(kept)} of {len(prompts)} rows skipped: no reward can score them (their {field!r} has no final number or is empty)"
            if not kept:
                raise UserError(f"grpo {split}: {why}; check grpo.answer_field and the rows")
            if self.rt.is_main and not self.quiet:
                console.print(f"[yellow]note:[/] grpo {split}: {why}")
        return kept

    def reference(self, recipe) -> str:
        """grpo.reference resolved; "none" without the KL term (beta 0), which reads no reference."""
        return reference_mode(recipe) if recipe.settings.beta > 0 else "none"

    def frozen_copies(self, recipe) -> int:
        return int(self.reference(recipe) == "copy")

    def setup(self, recipe, backbone) -> Job:
        ft, cfg = recipe.finetune, recipe.settings
        self.check(recipe, backbone)
        splits = self.prompts(recipe, backbone)
        (train_split, train), *held_out = splits.items()
        self.usable(train_split, train)
        rewards = self.rewards(recipe, train.examples)
        train.examples = self.scorable(train.examples, rewards, train_split)
        held = next((self.scorable(p.examples, rewards, s) for s, p in held_out if p.examples), [])
        mode = self.reference(recipe)
        frozen = {"reference": starting_model(self.run_dir, recipe, backbone)} if mode == "copy" else {}
        frozen.update({f"reward_model_{i}": r.holds for i, r in enumerate(rewards) if r.holds is not None})
        self.tokenizer = backbone.tokenizer
        template = self.template(recipe, backbone)
        if template is not None:  # the run keeps the template it trained in (chat, export), as SFT's does
            backbone.tokenizer.chat_template = template.source
        stops = stop_ids(backbone.tokenizer) if template is not None else {backbone.tokenizer.eos_id}
        pad = type(backbone.model).pad_id(backbone.tokenizer)
        loss = GRPOLoss(cfg)
        tooling = self.tooling(recipe, backbone, stops)
        packer = self.packer(recipe, backbone)
        rollouts = Rollouts(self, cfg, train.examples, rewards, stops, pad, mode, frozen, tooling, packer)
        self.held = (held, rollouts)
        prompt_len = int(np.mean([len(p.ids) for p in train.examples[:500]]))
        full = backbone.model.flops_per_token(prompt_len + cfg.max_completion_length // 2)
        extra = 2.0 * (cfg.reads_old + (cfg.beta > 0)) + 2.0  # old and reference passes, sampling
        return Job(
            heads=nn.ModuleDict(),
            loss=loss,
            train=PromptBatches(train.examples),
            val=None,
            flops_per_item=full * (training_flops_multiplier(ft.train) + extra) / 6.0,
            count_items=lambda b: int(b["input_ids"].numel()),
            evaluate=self.evaluation(recipe) if held and cfg.eval_prompts else None,
            best_key="reward" if held and cfg.eval_prompts else "",
            held_out=bool(held),
            examples=len(train.examples),
            loss_weight=loss.weight,
            frozen=frozen,
            plan_batch=lambda b: planned_rollout(b, cfg, recipe.data.seq_len, backbone.cfg.max_seq_len, pad, packer),
            online=OnPolicy(rollouts, reuse=cfg.num_iterations, curve="reward", shown=SHOWN),
        )

    def packer(self, recipe, backbone) -> Packer | None:
        """How rollouts read each prompt once for its completions (grpo.share_prompt), where the model
        can (the generic path's transformers modules cannot: a row per completion, said once)."""
        model = backbone.model
        if not recipe.settings.share_prompt:
            return None
        if not getattr(model, "reads_shared_prompt", True):
            note("grpo: this model reads a row per completion (grpo.share_prompt false): each prompt is read G times")
            return None
        weights, attention = model.flops_per_token(0), model.flops_per_token(1) - model.flops_per_token(0)
        row_cost = lambda n: n * (weights + attention * n)  # noqa: E731 (a token's attention grows with its row)
        return Packer(row_cost, getattr(model, "shortest_window", 0))

    def evaluation(self, recipe):
        """Job.evaluate: the mean reward of greedy (grpo.eval_sampled: sampled) completions of the first
        grpo.eval_prompts held-out prompts; they are written to samples/eval-NNN.jsonl and the first
        grpo.show printed."""

        def evaluate(module: nn.Module, run_dir: Path) -> dict[str, float]:
            held, rollouts = self.held
            prompts = held[: recipe.settings.eval_prompts]  # through the module's forward, as sampling (FSDP)
            metrics, lines = module(None, lambda model, heads, _: self.answered(model, rollouts, prompts))
            if self.rt.is_main:
                folder = Path(run_dir) / "samples"
                folder.mkdir(exist_ok=True)
                path = folder / f"eval-{len(list(folder.glob('eval-*.jsonl'))) + 1:03d}.jsonl"
                path.write_text("".join(json.dumps(line) + "\n" for line in lines))
                self.show(lines[: recipe.settings.show])
            return metrics

        return evaluate

    @torch.no_grad()
    def answered(
        self, model: nn.Module, rollouts: Rollouts, prompts: list[Prompt], alone: bool = False
    ) -> tuple[dict[str, float], list[dict]]:
        """Greedy (grpo.eval_sampled: sampled) completions of this process's share of `prompts` (equal
        shares), scored: (metrics pooled over the processes, this process's lines). `alone`: all of them
        here (the final report runs on rank 0 after the processes have parted)."""
        cfg, rt = rollouts.cfg, self.rt
        shared = rt.distributed and not alone
        share = len(prompts) // rt.world_size * rt.world_size if shared else len(prompts)
        mine = prompts[:share][rt.rank :: rt.world_size] if shared else prompts
        was = model.training
        model.eval()
        parts: list[Completed] = []
        try:
            with phase("answering held-out prompts", len(mine), "prompts") as advance:
                for s in range(0, len(mine), cfg.generate_batch):
                    group = mine[s : s + cfg.generate_batch]
                    sampled = (EVAL_SEED + s, cfg.temperature) if cfg.eval_sampled else (None, 0.0)
                    parts.append(rollouts.complete(model, group, *sampled, self.agreed if shared else bool))
                    advance(len(group))
        finally:
            model.train(was)
        done = Completed.joined(parts) if parts else Completed([], [], None, None)
        completions, talks = done.ids, done.conversations
        per_reward = (
            rollouts.score(mine, completions, "held-out", talks) if mine else torch.zeros(0, len(rollouts.rewards))
        )
        total = (per_reward * rollouts.weights[None]).nansum(1)
        sums = {"reward": float(total.sum())}
        for i, name in enumerate(rollouts.names):
            sums[f"rewards/{name}/mean"] = float(torch.nan_to_num(per_reward[:, i]).sum())
        sums["completions/mean_length"] = float(sum(len(c) for c in done.written))
        sums["completions/clipped_ratio"] = float(sum(not (c and c[-1] in rollouts.stops) for c in completions))
        if talks is not None:  # tool calls per question and the kinds of their failures, as sums
            sums.update({k: v * len(talks) for k, v in tool_sums(talks).items()})
        metrics = rt.pooled_mean(sums, len(mine)) if shared else {k: v / max(1, len(mine)) for k, v in sums.items()}
        texts = rollouts.texts(completions, talks)
        lines = [
            {
                "row": p.number,
                "prompt": p.asked,
                "completion": text,
                **({"turns": public(talks[i].messages)} if talks is not None else {}),
                "reward": round(float(t), 6),
                **{
                    f"rewards/{n}": (None if math.isnan(v) else round(float(v), 6))
                    for n, v in zip(rollouts.names, r.tolist())
                },
            }
            for i, (p, text, t, r) in enumerate(zip(mine, texts, total, per_reward))
        ]
        return metrics, lines

    def show(self, lines: list[dict]) -> None:
        if self.quiet:
            return
        for line in lines:
            prompt = line["prompt"] if isinstance(line["prompt"], str) else line["prompt"][-1]["content"]
            console.print(
                f"[dim]prompt:[/] {_clip(prompt)}\n[dim]completion (reward {line['reward']:g}):[/] {_clip(line['completion'], 400)}",
                highlight=False,
                markup=True,
            )

    def report(self, recipe, run_dir: Path) -> dict[str, Any]:
        """The best checkpoint's mean reward on the first report_rows(recipe) held-out prompts: printed,
        eval.json, and its completions in samples.jsonl."""
        held, rollouts = self.held
        backbone = from_run(run_dir, device=str(self.rt.device))
        n = report_rows(recipe)
        metrics, lines = self.answered(backbone.model, rollouts, held[:n], alone=True)
        results = {"held_out": {**metrics, "n": min(n, len(held))}}
        if self.rt.is_main:
            (Path(run_dir) / "samples.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
            self.write_report(run_dir, backbone.checkpoint, results)
            self.say(results)
            if not self.quiet:
                console.print(f"completions: {Path(run_dir) / 'samples.jsonl'}")
        return results

    def evaluate(self, recipe, backbone, options: EvalOptions) -> dict[str, Any]:
        """`tfcli eval grpo`: the mean reward of greedy (grpo.eval_sampled: sampled) completions of the
        held-out prompts (the first --limit N of each split), written beside the run (or --out) with
        their completions."""
        splits = self.prompts(recipe, backbone, options.data, need_train=False, say=not options.quiet)
        held = {s: p.examples[: options.limit or None] for s, p in self.held_out(splits).items()}
        rewards = self.rewards(recipe, [], options.named_code)
        template = self.template(recipe, backbone)
        stops = stop_ids(backbone.tokenizer) if template is not None else {backbone.tokenizer.eos_id}
        self.tokenizer = backbone.tokenizer
        pad = type(backbone.model).pad_id(backbone.tokenizer)
        tooling = self.tooling(recipe, backbone, stops)
        rollouts = Rollouts(self, recipe.settings, [], rewards, stops, pad, "none", {}, tooling)
        results, lines = {}, []
        for split, prompts in held.items():
            metrics, answered = self.answered(backbone.model, rollouts, prompts, alone=True)
            results[split] = {**metrics, "n": len(prompts)}
            lines += [{"split": split, **line} for line in answered]
        out, samples = self.evaluation_files(backbone, options, "samples")
        out.write_text(
            json.dumps(
                {
                    "checkpoint": str(backbone.checkpoint),
                    "data": options.data,
                    "reward": reward_spec(recipe.settings),
                    **results,
                },
                indent=1,
            )
        )
        samples.write_text("".join(json.dumps(line) + "\n" for line in lines))
        self.say(results)
        if not self.quiet:
            console.print(f"report: {out}\ncompletions: {samples}")
        return results

    def say(self, results: dict[str, dict]) -> None:
        if self.quiet:
            return
        for split, m in results.items():
            parts = ", ".join(f"{k.split('/')[1]} {v:.4f}" for k, v in m.items() if k.startswith("rewards/"))
            console.print(
                f"grpo {split} ({m['n']} prompts, greedy): mean reward {m['reward']:.4f} ({parts}); completions "
                f"{m['completions/mean_length']:.1f} tokens, {100 * m['completions/clipped_ratio']:.1f}% cut at the limit",
                highlight=False,
            )
            if "tools/call_frequency" in m:
                failed = ", ".join(
                    f"{k.rsplit('/', 1)[1]} {v:.2f}" for k, v in m.items() if k.startswith("tools/failures/") and v
                )
                console.print(
                    f"  tools: {m['tools/call_frequency']:.2f} calls a question, {m['tools/turns']:.2f} turns; "
                    f"failed calls per question: {failed or 'none'}",
                    highlight=False,
                )


def _clip(text: str, n: int = 200) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 3] + "..."
