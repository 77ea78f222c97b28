"""Distillation from a teacher (`tfcli finetune distill --teacher MODEL`): a student learns to match a
teacher's next-token distribution, as TRL's DistillationTrainer (on-policy: the student samples its
own completions and the teacher scores every token; Agarwal et al.'s GKD) and on the data's replies
(off-policy), mixed by `distill.lmbda`.

    tfcli finetune distill --from STUDENT --teacher TEACHER --data prompts.jsonl            # on-policy
    tfcli finetune distill --from STUDENT --teacher TEACHER --data rows.jsonl --set distill.lmbda=0
    tfcli eval distill --checkpoint RUN --data rows.jsonl

The loss at each completion token is the generalized Jensen-Shannon divergence between the student's
distribution p_s and the teacher's p_t (both of logits / distill.temperature): with m = (1 - beta) p_s +
beta p_t, beta KL(p_t || m) + (1 - beta) KL(p_s || m); beta 0 is the forward KL(p_t || p_s), beta 1 the
reverse KL(p_s || p_t) (TRL's default), summed over the batch's completion tokens and divided by
their count. Each step is on-policy with probability lmbda (drawn from the step's own seed, so a
resumed run repeats it); an on-policy step samples up to distill.max_completion_length tokens at the
temperature. The teacher is any model tfcli reads (a run, a Hugging Face directory, a GGUF file; a GGUF
teacher is dequantized), in its own precision or, with distill.teacher_quantize nf4, its block linears
frozen in NF4 as QLoRA's base is; it must share the student's vocabulary: one line otherwise.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..adapters import frozen_in_nf4
from ..data import IGNORE
from ..data.chat import stop_ids
from ..data.conversations import DecoderExamples, Example, built
from ..data.preferences import as_messages, reply_text
from ..data.sampler import Draw, Source, sequential_batches
from ..display import console, phase
from ..engine.backbone import for_inference, from_run
from ..engine.evaluate import held_out_metrics
from ..engine.perf import training_flops_multiplier
from ..engine.trainer import ObjectiveModule
from ..errors import UserError
from ..generate import generate_batch
from ..models import kinds
from ..objectives.losses import CHUNK_ELEMENTS, capped_in_place, give_back, lm_head, scratch_like, scratch_logits
from ..plugin import EvalOptions, Job, OnPolicy
from ..recipe import require
from .grpo.loss import rows_of
from .replies import ReplyConfig, ReplyTask
from .reply_batches import count_tokens, decoder_rows, hidden_states


@dataclass(frozen=True)
class DistillConfig(ReplyConfig):
    """The `distill:` recipe section (a reply task's fields, and these)."""

    teacher: str = field(
        default="",
        metadata={"help": "the teacher: a tfcli run, a Hugging Face directory or a GGUF file", "path": "path"},
    )
    teacher_quantize: Literal["none", "nf4"] = field(
        default="none",
        metadata={
            "help": "nf4: the teacher's block linears frozen in 4-bit NF4, as QLoRA holds its base (about a "
            "quarter of its memory; the divergence is from the NF4 weights' distribution)"
        },
    )
    completion_field: str = field(
        default="completion", metadata={"help": "the column holding a reply (off-policy steps train on it)"}
    )
    beta: float = field(
        default=1.0, metadata={"help": "0: forward KL(teacher || student); 1: reverse KL; between: generalized JSD"}
    )
    lmbda: float = field(
        default=1.0,
        metadata={"help": "the share of steps on the student's own completions (1: on-policy, TRL's; 0: the data's)"},
    )
    temperature: float = field(default=1.0, metadata={"help": "of both distributions, and of the sampling"})
    max_completion_length: int = field(default=256, metadata={"help": "tokens an on-policy step samples (TRL: 512)"})

    presets: ClassVar[bool] = False  # no preset of rows yet

    def __post_init__(self):
        super().__post_init__()
        require(0 <= self.beta <= 1, "distill.beta", "in [0, 1]", self.beta)
        require(0 <= self.lmbda <= 1, "distill.lmbda", "in [0, 1]", self.lmbda)
        require(self.temperature > 0, "distill.temperature", "> 0", self.temperature)
        require(self.max_completion_length >= 1, "distill.max_completion_length", ">= 1", self.max_completion_length)


def generalized_jsd(student: Tensor, teacher: Tensor, beta: float) -> Tensor:
    """(N,) the divergence of each row of log-probabilities (N, V): beta 0 KL(t || s), 1 KL(s || t),
    else beta KL(t || m) + (1 - beta) KL(s || m) with m = (1 - beta) p_s + beta p_t (TRL's)."""
    if beta == 0.0:
        return (teacher.exp() * (teacher - student)).sum(-1)
    if beta == 1.0:
        return (student.exp() * (student - teacher)).sum(-1)
    mix = torch.logaddexp(student + math.log(1 - beta), teacher + math.log(beta))
    return beta * (teacher.exp() * (teacher - mix)).sum(-1) + (1 - beta) * (student.exp() * (student - mix)).sum(-1)


def tempered(logits: Tensor, softcap: float, temperature: float) -> Tensor:
    """(N, V) log-softmax of logits (softcapped as the model softcaps them) / temperature."""
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    return F.log_softmax(logits / temperature, dim=-1)


@torch.compiler.disable
def divergence(student_model: nn.Module, teacher_model: nn.Module, student: Tensor, teacher: Tensor, cfg):
    """(summed divergence, summed student entropy) over the rows of the two models' hidden states at
    the completion tokens (N, D each), in chunks of rows whose logits stay under
    losses.CHUNK_ELEMENTS (128 MB) a model, each chunk's gradient taken as it is formed
    (_ChunkedDivergence). Outside a compiled graph, as the fused cross-entropy is: dynamo cannot
    trace its in-place buffers, and it is a few large products already."""
    mine, theirs = lm_head(student_model, student), lm_head(teacher_model, teacher)
    rows, caps = distill_rows(mine.weight.size(0)), (mine.softcap, theirs.softcap)
    return _ChunkedDivergence.apply(mine.hidden, mine.weight, theirs.hidden, theirs.weight, caps, cfg, rows)


def distill_rows(vocab: int) -> int:
    """The completion tokens of one chunk of the divergence: CHUNK_ELEMENTS of logits a model."""
    return max(1, CHUNK_ELEMENTS // max(vocab, 1))


SCRATCH = ("student", "teacher", "probs")  # the divergence's reused CPU buffers, each a chunk's (c, V)


def chunk_logits(h: Tensor, w: Tensor, name: str) -> Tensor:
    """(c, V) fp32 logits of a chunk, into the reused CPU buffer `name` (losses.scratch_logits)."""
    return scratch_logits(h.float(), w.float(), name)


def log_softmax_in_place(logits: Tensor, softcap: float, temperature: float, spare: Tensor) -> Tensor | None:
    """logits -> log-softmax(cap(logits) / temperature), in place; `spare` (same shape) left holding
    the softmax. Returns the cap's slope (None without a cap). Three passes, no new (c, V) tensor."""
    slope = capped_in_place(logits, softcap)
    if temperature != 1.0:
        logits.div_(temperature)
    logits.sub_(logits.amax(-1, keepdim=True))
    total = torch.exp(logits, out=spare).sum(-1, keepdim=True)
    spare.div_(total)
    logits.sub_(total.log_())
    return slope


def row_dots(a: Tensor, b: Tensor) -> Tensor:
    """(c,) sum_v a[r, v] b[r, v]: one read of each, no (c, V) product kept."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


def kl_with_gradient(h: Tensor, w: Tensor, theirs: Tensor, caps, cfg, want_grad: bool):
    """The reverse (beta 1) or forward (beta 0) KL summed over a chunk's rows, its student entropy,
    and the gradient with respect to the student's logits (None unless want_grad), in closed form:
    reverse, p (log p - t - KL_row) / T; forward, (p - e^t) / T; times the cap's slope. `theirs` is
    the teacher's log-softmax, overwritten. The same as autograd's through the generalized JSD
    (tested against TRL's), in a few passes over the chunk's buffers instead of autograd's dozen."""
    mine = chunk_logits(h.detach(), w.detach(), "student")
    probs = scratch_like(mine, "probs")
    slope = log_softmax_in_place(mine, caps[0], cfg.temperature, probs)
    entropy = -row_dots(probs, mine).sum()
    if cfg.beta == 1.0:
        diff = theirs.neg_().add_(mine)  # log p - t
        per_row = row_dots(probs, diff)
        grad = diff.sub_(per_row[:, None]).mul_(probs) if want_grad else None
    else:
        diff = mine.neg_().add_(theirs)  # t - log p
        per_row = row_dots(theirs.exp_(), diff)
        grad = probs.sub_(theirs) if want_grad else None
    if grad is not None:
        grad.div_(cfg.temperature)
        if slope is not None:
            grad.mul_(slope)
    return per_row.sum(), entropy, grad


def jsd_with_gradient(h: Tensor, w: Tensor, theirs: Tensor, caps, cfg, want_grad: bool):
    """The generalized JSD between the two (0 < beta < 1) through autograd, as generalized_jsd."""
    with torch.enable_grad():
        logits = chunk_logits(h.detach(), w.detach(), "student").requires_grad_()
        mine = tempered(logits, caps[0], cfg.temperature)
        part = generalized_jsd(mine, theirs, cfg.beta).sum()
        grad = torch.autograd.grad(part, logits)[0] if want_grad else None
    mine = mine.detach()
    return part.detach(), -row_dots(mine.exp(), mine).sum(), grad


class _ChunkedDivergence(torch.autograd.Function):
    """The generalized JSD summed over the rows, `rows` at a time: each chunk's logits, divergence and
    its gradient with respect to the student's logits are formed together, and only the gradient's
    products with the head (the hidden states' (N, D) and the head weight's (V, D)) kept for the
    backward pass, as a fused cross-entropy keeps them: a 1,024-token batch of a 152k vocabulary peaked
    at 5.3 GB in one piece, 1.6 GB in chunks (python -m benchmarks distill_chunks). On the CPU the
    chunks are written into three buffers of a chunk's (c, V), reused from chunk to chunk and given
    back at the end. Reverse and forward KL take their gradient in closed form (kl_with_gradient),
    the JSD between them through autograd."""

    @staticmethod
    def forward(ctx, hidden, weight, teacher_hidden, teacher_weight, caps, cfg, rows):
        train_head, train_hidden = ctx.needs_input_grad[1], ctx.needs_input_grad[0]
        want_grad = train_head or train_hidden
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if want_grad else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if train_head else None
        total = hidden.new_zeros((), dtype=torch.float32)
        entropy = total.clone()
        w = weight.float()
        closed_form = kl_with_gradient if cfg.beta in (0.0, 1.0) else jsd_with_gradient
        for i in range(0, hidden.size(0), rows):
            h = hidden[i : i + rows].float()
            with torch.no_grad():
                theirs = chunk_logits(teacher_hidden[i : i + rows], teacher_weight, "teacher")
                log_softmax_in_place(theirs, caps[1], cfg.temperature, scratch_like(theirs, "probs"))
                part, chunk_entropy, grad_logits = closed_form(h, w, theirs, caps, cfg, want_grad)
            total += part
            entropy += chunk_entropy
            if grad_hidden is not None:
                torch.mm(grad_logits, w, out=grad_hidden[i : i + rows])
            if grad_weight is not None:
                grad_weight.addmm_(grad_logits.t(), h)
        give_back(*SCRATCH)  # not held through the backward pass and the optimizer's step
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.dtypes = hidden.dtype, weight.dtype
        ctx.mark_non_differentiable(entropy)
        return total, entropy

    @staticmethod
    def backward(ctx, grad_total, _grad_entropy):
        grad_hidden, grad_weight = ctx.saved_tensors
        grad_h = (grad_hidden * grad_total).to(ctx.dtypes[0]) if grad_hidden is not None else None
        grad_w = (grad_weight * grad_total).to(ctx.dtypes[1]) if grad_weight is not None else None
        return grad_h, grad_w, None, None, None, None, None


class Divergence:
    """The loss for the trainer: the student's divergence from the teacher at the batch's completion
    tokens (`targets` not IGNORE), summed and divided by their count; the student's entropy logged.
    Both models read rows of like width together, each only as far as its completion ends
    (reply_batches.hidden_states): a long completion does not pad the step's other rows."""

    def __init__(self, cfg: DistillConfig, frozen: dict):
        self.cfg, self.frozen = cfg, frozen

    def __call__(self, model: nn.Module, heads: nn.ModuleDict, batch: dict[str, Tensor]):
        valid = batch["targets"] != IGNORE
        teacher_model, student = self.frozen["teacher"], hidden_states(model, batch)[valid]
        with torch.no_grad():
            teacher = hidden_states(teacher_model, batch)[valid]
        total, entropy = divergence(model, teacher_model, student, teacher, self.cfg)
        count = valid.sum().clamp(min=1)
        loss = total / count
        return loss, {"loss": loss.detach(), "entropy": entropy / count}


def token_count(batch: dict[str, Tensor]) -> Tensor:
    """A batch's completion tokens: what its loss averages over."""
    return (batch["targets"] != IGNORE).sum()


@dataclass(frozen=True)
class Item:
    """A prompt (what generation starts from) and, where the row has one, its reply as an example."""

    prompt: list[int]
    example: Example | None


class ItemBuilder:
    """Rows -> items: a prompt (text, or messages ending with the user's turn) and its optional reply."""

    def __init__(self, examples: DecoderExamples, cfg: DistillConfig):
        self.examples, self.cfg = examples, cfg

    def build_all(self, rows: list, places: list[str] | None = None) -> Items:
        return Items(*built(rows, self.item))

    def item(self, row: dict) -> Item | str:
        c = self.cfg
        prompt = row.get(c.messages_field) if isinstance(row.get(c.messages_field), list) else row.get(c.prompt_column)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else as_messages(prompt)
        if not messages:
            return f"skip:no {c.prompt_column!r} text or {c.messages_field!r} list"
        if c.system:
            messages = [{"role": "system", "content": c.system}] + messages
        reply = reply_text(row.get(c.completion_field)) if row.get(c.completion_field) is not None else None
        b, tok = self.examples, self.examples.tok
        if reply is None:
            if b.template is None:
                ids = tok.encode(messages[-1]["content"] + "\n")
            else:
                ids = b.template.render(tok, messages, add_generation_prompt=True).ids
            return Item(list(ids), None) if len(ids) < b.max_length else "skip:prompt alone longer than data.seq_len"
        example = b.within_length(b.build(messages + [{"role": "assistant", "content": reply}]))
        if isinstance(example, str):
            return example
        start = int(np.flatnonzero(example.trained)[0])
        return Item(example.ids[:start].tolist(), example)


@dataclass
class Items:
    items: list[Item]
    skipped: Counter = field(default_factory=Counter)


class ItemBatches(Source):
    """Batches of item indices and a seed of the draw's own (whether the step samples, and what)."""

    def __init__(self, items: list[Item]):
        self.items = items
        self.lengths = np.array([len(i.example.ids) if i.example is not None else len(i.prompt) for i in items])

    def epoch_size(self, epoch: int) -> int:
        return len(self.items)

    def batch(self, draw: Draw) -> dict[str, Tensor]:
        seed = int(np.random.default_rng(draw.keys[0].tolist()).integers(2**62))
        return {"index": torch.from_numpy(draw.indices.astype(np.int64)), "seed": torch.tensor([seed])}


class ReplyRows(Source):
    """The held-out items' replies as decoder rows: the divergence on the data's own replies."""

    def __init__(self, items: list[Item], pad: int):
        self.items, self.pad = items, pad
        self.lengths = np.array([len(i.example.ids) for i in items])

    def epoch_size(self, epoch: int) -> int:
        return len(self.items)

    def batch(self, draw: Draw) -> dict[str, Tensor]:
        return decoder_rows([[self.items[i].example] for i in draw.indices], self.pad)


class Completions:
    """Job.online.rollout: each drawn batch's rows, the student's own completions (on-policy, with
    probability lmbda from the batch's seed) or the data's replies."""

    def __init__(self, plugin, cfg: DistillConfig, items: list[Item], stops: set[int], pad: int):
        self.plugin, self.cfg, self.items, self.stops, self.pad = plugin, cfg, items, stops, pad

    def __call__(self, module: nn.Module, batches: list[dict]):
        return module(batches, lambda model, heads, drawn: self.rollout(model, drawn))

    def rollout(self, model: nn.Module, batches: list[dict]) -> tuple[list[dict], dict[str, Tensor]]:
        started, device, out, sampled, lengths = time.perf_counter(), batches[0]["index"].device, [], 0, []
        for b in batches:
            items, seed = [self.items[i] for i in b["index"].tolist()], int(b["seed"])
            if np.random.default_rng(seed).random() < self.cfg.lmbda:  # on-policy
                completions = self.sample(model, [it.prompt for it in items], seed)
                rows = rows_of([it.prompt for it in items], completions, [False] * len(items), self.pad)
                sampled += 1
                lengths += [len(c) for c in completions]
            else:
                rows = decoder_rows([[it.example] for it in items], self.pad)
                lengths += [int((e.example.trained > 0).sum()) for e in items]
            out.append({k: v.to(device) for k, v in rows.items()})
        metrics = {
            "on_policy": torch.tensor(sampled / len(batches)),
            "completions/mean_length": torch.tensor(float(np.mean(lengths))),
            "rollout_s": torch.tensor(time.perf_counter() - started),  # sampling (GRPO's metric)
        }
        return out, {k: v.to(device) for k, v in metrics.items()}

    @torch.no_grad()
    def sample(self, model: nn.Module, prompts: list[list[int]], seed: int) -> list[list[int]]:
        was = model.training
        model.eval()
        try:
            return generate_batch(
                model, prompts, max_new_tokens=self.cfg.max_completion_length, stop_ids=self.stops,
                temperature=self.cfg.temperature, seed=seed, pad_id=self.pad, keep_stop=True,
                finished=self.plugin.agreed,
            )  # fmt: skip
        finally:
            model.train(was)


def teacher_for(cfg: DistillConfig, backbone, device: str):
    """The teacher, read as data (weights, config, tokenizer), or one line when there is none or its
    vocabulary is not the student's."""
    if not cfg.teacher:
        raise UserError("distill needs a teacher: --teacher MODEL (a tfcli run, a Hugging Face directory, a GGUF)")
    teacher = for_inference(cfg.teacher, device=device)
    theirs, ours = teacher.tokenizer, backbone.tokenizer
    rows = (lm_head_rows(teacher.model), lm_head_rows(backbone.model))
    if theirs is None or theirs.tok.get_vocab() != ours.tok.get_vocab() or rows[0] != rows[1]:
        raise UserError(
            f"distill.teacher {cfg.teacher}: its vocabulary is not the student's ({rows[0]:,} against {rows[1]:,} "
            "output rows, or other tokens): distillation compares the two distributions token by token"
        )
    model = teacher.model.eval().requires_grad_(False)
    return frozen_in_nf4(model) if cfg.teacher_quantize == "nf4" else model


def lm_head_rows(model: nn.Module) -> int:
    return int(lm_head(model, torch.zeros(1, model.cfg.d_model)).weight.shape[0])


class Distill(ReplyTask):
    key = "distill"
    noun = "rows"
    model_kinds = (kinds.DECODER,)
    recipe_pattern = "distill-{family}-mini"
    Config = DistillConfig
    describe = "distillation from a teacher"

    def agreed(self, mine: bool) -> bool:
        if not self.rt.strategy.lockstep or not self.rt.distributed:
            return mine
        return self.rt.mean({"done": float(mine)})["done"] >= 1.0

    def items_of(self, recipe, backbone, data: str | None = None, need_train: bool = True, say: bool = True):
        length = min(recipe.data.seq_len, backbone.cfg.max_seq_len)
        examples = DecoderExamples(backbone.tokenizer, self.template(recipe, backbone), "assistant", length)
        return self.read(recipe, ItemBuilder(examples, recipe.settings), data, need_train, say)

    @staticmethod
    def items(built: Items) -> list:
        return built.items

    def text_columns(self, cfg: DistillConfig) -> tuple[str, ...]:
        return (cfg.prompt_column, cfg.completion_field)

    def setup(self, recipe, backbone) -> Job:
        ft, cfg = recipe.finetune, recipe.settings
        self.check(recipe, backbone)
        teacher = teacher_for(cfg, backbone, str(self.rt.device))
        (train_split, train), *held_out = self.items_of(recipe, backbone).items()
        items = self.usable(train_split, train)
        if cfg.lmbda < 1 and any(i.example is None for i in items):
            raise UserError(
                f"distill.lmbda {cfg.lmbda} trains some steps on the data's replies: every {train_split} row needs "
                f"a {cfg.completion_field!r} (or set distill.lmbda 1, on-policy)"
            )
        held_split, held = next(
            ((s, [i for i in b.items if i.example is not None]) for s, b in held_out if b.items), ("", [])
        )
        template = self.template(recipe, backbone)
        if template is not None:  # the run keeps the template it trained in (chat, export), as SFT's does
            backbone.tokenizer.chat_template = template.source
        stops = stop_ids(backbone.tokenizer) if template is not None else {backbone.tokenizer.eos_id}
        pad = type(backbone.model).pad_id(backbone.tokenizer)
        frozen = {"teacher": teacher}
        loss = Divergence(cfg, frozen)
        val = ReplyRows(held, pad) if held else None
        self.held = (held_split, val)
        tokens = int(np.mean([len(i.prompt) for i in items[:500]])) + cfg.max_completion_length // 2
        full = backbone.model.flops_per_token(tokens)
        teacher_flops = teacher.flops_per_token(tokens) * 2.0 / 6.0  # its forward pass
        return Job(
            heads=nn.ModuleDict(),
            loss=loss,
            train=ItemBatches(items),
            val=val,
            flops_per_item=full * (training_flops_multiplier(ft.train) + 2.0 * cfg.lmbda) / 6.0 + teacher_flops,
            count_items=count_tokens,
            best_key="loss" if held else "",
            best_lowest=True,
            held_out=bool(held),
            examples=len(items),
            loss_weight=token_count,
            frozen=frozen,
            plan_batch=lambda b: planned_rows(b, recipe.data.seq_len, backbone.cfg.max_seq_len, pad),
            online=OnPolicy(Completions(self, cfg, items, stops, pad), reuse=1, curve="loss", shown=("on_policy",)),
        )

    def report(self, recipe, run_dir: Path) -> dict[str, Any]:
        split, val = self.held
        if val is None:
            return {}
        backbone = from_run(run_dir, device=str(self.rt.device))
        results = {split: self.measure(recipe, backbone, val, split)}
        self.say(results)
        self.write_report(run_dir, backbone.checkpoint, results)
        return results

    def measure(self, recipe, backbone, rows: ReplyRows, split: str, teacher=None) -> dict[str, float]:
        device = next(backbone.model.parameters()).device
        teacher = teacher if teacher is not None else teacher_for(recipe.settings, backbone, str(device))
        module = ObjectiveModule(backbone.model, nn.ModuleDict(), Divergence(recipe.settings, {"teacher": teacher}))
        with phase(f"scoring {split} replies"):
            m = held_out_metrics(
                module,
                sequential_batches(rows, recipe.train.batch_size, 0),
                device,
                recipe.train.precision,
                token_count,
            )
        return {**m, "n": rows.epoch_size(0)}

    def evaluate(self, recipe, backbone, options: EvalOptions) -> dict[str, Any]:
        """`tfcli eval distill`: the divergence from the run's teacher on the held-out replies (the first
        --limit N of each split)."""
        splits = self.items_of(recipe, backbone, options.data, need_train=False, say=not options.quiet)
        pad = type(backbone.model).pad_id(backbone.tokenizer)
        results = {}
        for split, read in self.held_out(splits).items():
            replies = [i for i in read.items if i.example is not None][: options.limit or None]
            if not replies:
                raise UserError(f"eval distill {split}: no rows with a {recipe.settings.completion_field!r} reply")
            results[split] = self.measure(recipe, backbone, ReplyRows(replies, pad), split)
        self.say(results)
        self.write_evaluation(backbone, options, results)
        return results

    def say(self, results: dict[str, dict]) -> None:
        if self.quiet:
            return
        for split, m in results.items():
            console.print(
                f"distill {split} ({m['n']} replies): divergence from the teacher {m['loss']:.4f} per token, "
                f"student entropy {m['entropy']:.4f}"
            )


def planned_rows(batch: dict, seq_len: int, context: int, pad: int) -> dict[str, Tensor]:
    """The memory plan's batch: rows of data.seq_len (prompt and completion), every position trained."""
    rows, width = batch["index"].numel(), min(seq_len, context)
    device = batch["index"].device
    return {
        "input_ids": torch.full((rows, width), pad, dtype=torch.long, device=device),
        "targets": torch.full((rows, width), pad, dtype=torch.long, device=device),
    }
