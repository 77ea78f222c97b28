"""GRPO on tiny random models: given the same prompts, completions and rewards, tfcli's loss,
TRL's metrics and every gradient equal TRL's GRPOTrainer's (each loss_type, beta 0 and > 0, and a second
iteration on the same rollout, where the ratio is clipped); rewards parse, score and fail in one line;
the CLI trains, evaluates, resumes bit for bit; bad input is one line with nothing created."""

from __future__ import annotations

import copy
import json
import math
from types import SimpleNamespace

import pytest
import torch

from tfcli.engine.runtime import Runtime
from tfcli.engine.trainer import ObjectiveModule
from tfcli.errors import UserError
from tfcli.hf import convert
from tfcli.hf import interop as hf
from tfcli.hf import llama as llama_table
from tfcli.tasks import rewards as rewarding
from tfcli.tasks.grpo import GRPOConfig, GRPOLoss, Prompt, Rollouts, advantages, nanstd
from tfcli.tasks.grpo.packing import Packer

from .conftest import invoke, read_metrics, write_jsonl
from .test_gguf import chat_gguf_file, tiny_backbone
from .test_resume_matrix import EVERY_STEP, cut_and_resume

G, LIMIT = 4, 6  # completions per prompt; grpo.max_completion_length
# two rewards per completion (the second does not apply to one of them); the first group's second
# reward is the same for all four completions
REWARDS_A = [1.0, 0.0, 0.5, 1.0, 0.2, 0.2, 0.9, 0.0]
REWARDS_B = [1.0, 1.0, 1.0, 1.0, None, 0.0, 1.0, 0.3]
WEIGHTS = (1.0, 0.5)


def fixed_rollout(backbone):
    """Two prompts of 5 tokens, G completions each (one cut at the length limit), token ids from the
    ordinary vocabulary; each completion that stopped ends with <|im_end|>."""
    eos = backbone.tokenizer.token_id("<|im_end|>")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(100, 1000, (5,), generator=g).tolist() for _ in range(2)]
    lengths = [3, 5, LIMIT, 2, 4, 1, 3, 5]
    completions = []
    for i, n in enumerate(lengths):
        body = torch.randint(100, 1000, (n,), generator=g).tolist()
        completions.append(body if i == 2 else body[:-1] + [eos])  # completion 2 runs to the limit
    return prompts, completions


def column(name):
    return lambda c: [row[name] for row in c.rows]


def ours(backbone, reference, cfg: GRPOConfig, prompts, completions, perturb, packer=None):
    """tfcli's rollout of the fixed completions (sampling replaced), then the loss on it after
    `perturb` (an update between iterations): (loss, metrics, grads by transformers' names). `packer`:
    each prompt read once for its completions (grpo.share_prompt)."""
    rows = [
        [{"ra": REWARDS_A[p * G + k], "rb": REWARDS_B[p * G + k]} for k in range(G)] for p in range(2)
    ]  # each completion's reward columns: the rollout asks them of the prompt's row, so one prompt per completion
    asked = [Prompt(prompts[p], "q", rows[p][k], p * G + k + 1) for p in range(2) for k in range(G)]
    rewards = [
        rewarding.Reward("ra", WEIGHTS[0], column("ra")),
        rewarding.Reward("rb", WEIGHTS[1], column("rb")),
    ]
    eos = backbone.tokenizer.token_id("<|im_end|>")
    plugin = SimpleNamespace(rt=Runtime(torch.device("cpu")), tokenizer=backbone.tokenizer, agreed=bool)
    mode = "copy" if cfg.beta > 0 else "none"
    rollouts = Rollouts(plugin, cfg, asked, rewards, {eos}, 0, mode, {"reference": reference}, packer=packer)
    model = backbone.model.train()
    sampled = iter([completions])
    rollouts.sample = lambda m, p, seed, finished=None: next(sampled)
    batch = {"index": torch.tensor([0, 1]), "seed": torch.tensor([0])}
    rollouts.prompts = [asked[0], asked[G]]
    rollouts.score = _scoring_each_row(rollouts, asked)
    (rollout,), metrics = rollouts(ObjectiveModule(model, torch.nn.ModuleDict(), None), [batch])
    perturb(model)
    loss, loss_metrics = GRPOLoss(cfg)(model, None, rollout)
    loss.backward()
    grads = convert.to_hf({f"model.{n}": p.grad for n, p in model.named_parameters()}, llama_table.rules(model.cfg))
    return float(loss.detach()), {**metrics, **loss_metrics}, grads, rollout


def _scoring_each_row(rollouts, asked):
    """Score as the rollout does, with each completion's own row (the fixed rewards)."""
    score = Rollouts.score

    def scored(prompts, completions, split, conversations=None):
        return score(rollouts, asked, completions, split, conversations)

    return scored


def theirs(tmp_path, backbone, cfg: GRPOConfig, prompts, completions, perturb):
    """TRL's GRPOTrainer on the same weights, prompts, completions and rewards (its tokenization and
    generation replaced): (loss, metrics, grads)."""
    transformers = pytest.importorskip("transformers")
    trl = pytest.importorskip("trl")
    from dataclasses import replace

    import datasets

    from tfcli.plugin import Backbone

    backbone.tokenizer.specials = replace(backbone.tokenizer.specials, pad="<|endoftext|>")
    hf.export(Backbone(backbone.model, backbone.tokenizer), None, tmp_path / "start")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "start", dtype=torch.float32)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backbone.tokenizer.tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )

    def ra(prompts, completions, **kw):
        return kw["ra"]

    def rb(prompts, completions, **kw):
        return kw["rb"]

    rloo = cfg.loss_type == "rloo"  # TRL's RLOOTrainer: no loss types nor reward scaling, its own normalisation
    kind = {"normalize_advantages": cfg.normalize_advantages} if rloo else {
        "loss_type": cfg.loss_type, "scale_rewards": cfg.scale_rewards
    }  # fmt: skip
    args = (trl.RLOOConfig if rloo else trl.GRPOConfig)(
        output_dir=str(tmp_path / "trl"),
        num_generations=G,
        per_device_train_batch_size=2 * G,
        max_completion_length=LIMIT,
        beta=cfg.beta,
        epsilon=cfg.epsilon,
        epsilon_high=cfg.upper,
        num_iterations=cfg.num_iterations,
        temperature=cfg.temperature,
        mask_truncated_completions=cfg.mask_truncated_completions,
        reward_weights=list(WEIGHTS),
        report_to=[],
        use_cpu=True,
        bf16=False,
        fp16=False,
        **kind,
    )
    inputs = [{"prompt": "q", "ra": REWARDS_A[i], "rb": REWARDS_B[i]} for i in range(2 * G)]
    trainer = (trl.RLOOTrainer if rloo else trl.GRPOTrainer)(
        model=model,
        reward_funcs=[ra, rb],
        args=args,
        train_dataset=datasets.Dataset.from_list(inputs),
        processing_class=tokenizer,
    )
    trainer._tokenize_prompts = lambda p: ([prompts[i // G] for i in range(2 * G)], None, {})
    made = [list(c) for c in completions]  # GRPO's generation returns (ids, logprobs), RLOO's the ids
    trainer._generate_single_turn = lambda *a, **k: made if rloo else (made, None)
    model.train()
    trainer.current_gradient_accumulation_steps = 1  # what its training loop sets before each step
    out = trainer._generate_and_score_completions(inputs)
    perturb_hf(model, perturb, backbone)
    loss = trainer.compute_loss(model, out)
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return float(loss.detach()), metrics, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, out


def perturb_hf(model, perturb, backbone):
    """The same update as tfcli's model gets, on transformers' names."""
    shadow = copy.deepcopy(backbone.model)
    before = {n: p.detach().clone() for n, p in shadow.named_parameters()}
    perturb(shadow)
    delta = {f"model.{n}": p.detach() - before[n] for n, p in shadow.named_parameters()}
    with torch.no_grad():
        params = dict(model.named_parameters())
        for name, d in convert.to_hf(delta, llama_table.rules(shadow.cfg)).items():
            params[name].add_(d)


def nudge(model):
    """An update between two iterations on one rollout: large enough that some ratios leave the clip range."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


CASES = [  # the last field: each prompt read once for its completions (grpo.share_prompt)
    pytest.param("rloo", 0.0, 1, "group", False, True, id="rloo"),
    pytest.param("rloo", 0.05, 2, "batch", True, True, id="rloo-beta-mu2-normalized-masked"),
    pytest.param("dapo", 0.0, 1, "group", False, True, id="dapo"),
    pytest.param("grpo", 0.1, 2, "group", True, True, id="grpo-beta-mu2-masked"),
    pytest.param("grpo", 0.1, 2, "group", True, False, id="grpo-beta-mu2-masked-row-each"),
    pytest.param("dr_grpo", 0.0, 2, "batch", False, True, id="dr_grpo-mu2-batch", marks=pytest.mark.slow),
    pytest.param("dapo", 0.04, 2, "none", False, False, id="dapo-beta-mu2-none-row-each", marks=pytest.mark.slow),
    pytest.param("grpo", 0.0, 1, "batch", False, True, id="grpo", marks=pytest.mark.slow),
    pytest.param("dr_grpo", 0.1, 1, "group", True, True, id="dr_grpo-beta-masked", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("loss_type,beta,iterations,scale,masked,share", CASES)
def test_loss_metrics_and_gradients_equal_trls(tmp_path, loss_type, beta, iterations, scale, masked, share):
    cfg = GRPOConfig(
        num_generations=G,
        max_completion_length=LIMIT,
        beta=beta,
        num_iterations=iterations,
        loss_type=loss_type,
        scale_rewards=scale,
        epsilon=0.1,
        epsilon_high=0.15,
        temperature=0.7,
        mask_truncated_completions=masked,
        normalize_advantages=loss_type == "rloo" and scale == "batch",  # RLOO's own: over the batch
    )
    backbone = tiny_backbone()
    prompts, completions = fixed_rollout(backbone)
    reference = copy.deepcopy(backbone.model).eval()
    if beta > 0:  # a policy that has moved away from its reference
        torch.manual_seed(1)
        with torch.no_grad():
            for p in backbone.model.parameters():
                p.add_(torch.randn_like(p) * 0.02)
    update = nudge if iterations > 1 else (lambda m: None)
    trl_backbone, policy = copy.deepcopy(backbone), copy.deepcopy(backbone)
    if beta > 0:  # TRL reads its reference from the directory the policy came from: the reference's
        trl_backbone.model.load_state_dict(reference.state_dict())
    packer = Packer(lambda n: n) if share else None  # rows cost their tokens: every prompt's completions in one
    mine, metrics, grads, rollout = ours(backbone, reference, cfg, prompts, completions, update, packer)
    assert ("packed_ids" in rollout) == share and (not share or rollout["packed_ids"].size(0) == 2)
    if beta > 0:
        trl_loss, their_metrics, their_grads, out = theirs_with_policy(
            tmp_path, trl_backbone, policy, cfg, prompts, completions, update
        )
    else:
        trl_loss, their_metrics, their_grads, out = theirs(tmp_path, trl_backbone, cfg, prompts, completions, update)
    torch.testing.assert_close(rollout["advantages"], out["advantages"], atol=1e-5, rtol=1e-5)
    assert mine == pytest.approx(trl_loss, abs=1e-5)
    names = ["reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "completions/clipped_ratio"]
    names += [
        "rewards/ra/mean",
        "rewards/rb/mean",
        "clip_ratio/region_mean",
        "clip_ratio/low_mean",
        "clip_ratio/high_mean",
    ]
    names += ["kl"] if beta > 0 else []
    for name in names:
        assert float(metrics[name]) == pytest.approx(their_metrics[name], abs=1e-5), name
    if iterations > 1:
        assert their_metrics["clip_ratio/region_mean"] > 0  # the clipped case is exercised
    assert set(grads) == set(their_grads) and max(float(g.abs().max()) for g in grads.values()) > 1e-3
    for name, g in grads.items():
        torch.testing.assert_close(g, their_grads[name], atol=1e-5, rtol=1e-4)


def theirs_with_policy(tmp_path, reference_backbone, policy_backbone, cfg, prompts, completions, perturb):
    """TRL with beta > 0: its model is loaded from the reference's directory (where it reads its
    reference from), then given the policy's weights."""
    import transformers

    original = transformers.AutoModelForCausalLM.from_pretrained

    def policy_weights(*args, **kwargs):
        model = original(*args, **kwargs)
        hf.export(policy_backbone, None, tmp_path / "policy")
        policy = original(tmp_path / "policy", dtype=torch.float32)
        model.load_state_dict(policy.state_dict())
        transformers.AutoModelForCausalLM.from_pretrained = original  # the reference is read as saved
        return model

    transformers.AutoModelForCausalLM.from_pretrained = policy_weights
    try:
        return theirs(tmp_path, reference_backbone, cfg, prompts, completions, perturb)
    finally:
        transformers.AutoModelForCausalLM.from_pretrained = original


def test_packing_holds_a_prompts_completions_while_that_costs_less_and_the_window_allows():
    """Packer.layout: consecutive completions of one prompt share a row while adding one costs less
    than a row of its own (a linear cost: always; a quadratic one: two a row here) and the row fits a
    sliding window; completions with nothing trained are left out; the unpack index finds each
    completion token where the rows_of layout has it."""
    from tfcli.data import IGNORE
    from tfcli.tasks.grpo.loss import rows_of

    prompts = [[1, 2, 3, 4, 5]] * 3 + [[6, 7, 8, 9, 10]] * 3
    completions = [[11, 12, 13], [14, 15, 16], [17, 18, 19], [20, 21, 22], [23, 24, 25], [26, 27, 28]]
    rows = rows_of(prompts, completions, [False, False, False, False, True, False], 0)
    linear = Packer(lambda n: n)
    assert linear.layout(prompts, completions, rows["targets"]) == [(0, [0, 1, 2]), (3, [3, 5])]
    assert Packer(lambda n: n * n).layout(prompts, completions, rows["targets"]) == [(0, [0, 1]), (2, [2]), (3, [3, 5])]
    assert Packer(lambda n: n, window=8)(prompts, completions, rows, 0) is None  # one a row: rows_of's
    packed = linear(prompts, completions, rows, 0)
    assert packed["packed_ids"].tolist() == [
        [1, 2, 3, 4, 5, 11, 12, 5, 14, 15, 5, 17, 18],
        [6, 7, 8, 9, 10, 20, 21, 10, 26, 27, 0, 0, 0],
    ]
    assert packed["shared_prompt"].tolist() == [[4, 7, 10], [4, 7, 13]]
    trained = rows["targets"] != IGNORE
    flat_targets = packed["packed_targets"].reshape(-1)[packed["unpack"]]
    assert torch.equal(flat_targets[trained], rows["targets"][trained])


def test_a_rollouts_memory_plan_is_laid_out_as_its_rollouts():
    from tfcli.tasks.grpo.rollouts import planned_rollout

    cfg = GRPOConfig(num_generations=4, max_completion_length=6)
    batch = {"index": torch.tensor([3, 5])}
    plain = planned_rollout(batch, cfg, 16, 64, 0)
    assert plain["input_ids"].shape == (8, 16) and "packed_ids" not in plain
    packed = planned_rollout(batch, cfg, 16, 64, 0, Packer(lambda n: n))
    assert packed["packed_ids"].shape == (2, 9 + 4 * 6) and packed["shared_prompt"].shape == (2, 4)


# --- advantages and rewards ---------------------------------------------------------------------


def test_advantages_are_group_relative_and_scaled_as_trl_scales_them():
    per = torch.tensor([[1.0], [0.0], [1.0], [1.0], [0.5], [0.5], [0.5], [0.5]])
    adv, total, zero = advantages(per, torch.tensor([1.0]), 4, "group")
    group = torch.tensor([1.0, 0.0, 1.0, 1.0])
    expected = (group - group.mean()) / (group.std() + 1e-4)
    torch.testing.assert_close(adv[:4], expected)
    assert adv[4:].abs().max() == 0 and zero.tolist() == [False] * 4 + [True] * 4
    unscaled, _, _ = advantages(per, torch.tensor([1.0]), 4, "none")
    torch.testing.assert_close(unscaled[:4], group - group.mean())
    batch, _, _ = advantages(per, torch.tensor([1.0]), 4, "batch")
    torch.testing.assert_close(batch[:4], (group - group.mean()) / (per.std() + 1e-4))
    assert math.isnan(float(nanstd(torch.tensor([1.0, math.nan]))))


def scored(spec, texts, rows, ids=None, limit=8):
    rewards = rewarding.parse(spec, "answer", rewarding.user_functions(spec))
    c = rewarding.Completions(["p"] * len(texts), texts, ids or [[1] * 3 for _ in texts], rows, limit)
    return rewards, rewarding.scored(rewards, c, lambda i: f"row {i + 1}")


def test_built_in_rewards_score_a_completion_against_its_row():
    rows = [{"answer": "Natalia sold 48/2 = 24 clips.\n#### 72"}, {"answer": "#### 1,000"}]
    rewards, values = scored("final-number,contains,exact", ["so 72", "it is 1000 apples"], rows)
    assert [r.name for r in rewards] == ["final-number", "contains", "exact"]
    assert values[:, 0].tolist() == [1.0, 1.0] and values[:, 1].tolist() == [0.0, 0.0]
    _, values = scored("regex:^<think>.*</think>:0.5", ["<think>a\nb</think> 4", "4"], [{}, {}])
    assert values[:, 0].tolist() == [1.0, 0.0]
    rewards, values = scored("length:4", ["a", "b", "c"], [{}] * 3, ids=[[1] * 4, [1] * 6, [1] * 8])
    assert values[:, 0].tolist() == [0.0, -0.5, -1.0]  # 0 up to 8 - 4 tokens, then down to -1 at 8


def test_weights_and_commas_inside_a_pattern_parse():
    rewards = rewarding.parse("final-number:2,regex:a{1,3}b:0.25,length:64", "answer")
    assert [(r.name, r.weight) for r in rewards] == [("final-number", 2.0), ("regex:a{1,3}b", 0.25), ("length:64", 1.0)]


def test_a_users_function_gets_prompts_completions_and_columns(tmp_path):
    (tmp_path / "mine.py").write_text(
        "def shout(prompts, completions, completion_ids, answer, **kw):\n"
        "    return [float(c.isupper()) + 0 * len(a) for c, a in zip(completions, answer)]\n"
    )
    _, values = scored(f"{tmp_path}/mine.py:shout", ["YES", "no"], [{"answer": "x"}, {"answer": "y"}])
    assert values[:, 0].tolist() == [1.0, 0.0]


@pytest.mark.parametrize(
    "spec,body,message",
    [
        ("speed", None, "not a built-in reward"),
        ("regex:(", None, "not a regular expression"),
        ("{d}/absent.py:f", None, "no such file"),
        ("{d}/r.py:missing", "def f(**kw):\n    return []\n", "has no function missing"),
        ("{d}/r.py:f", "raise ValueError('bad import')\n", "importing"),
        ("{d}/r.py:f", "def f(completions, **kw):\n    return [1.0]\n", "returned 1 values for 2 completions"),
        ("{d}/r.py:f", "def f(completions, **kw):\n    return ['x', 'y']\n", "returned 'x' for row 1"),
        ("{d}/r.py:f", "def f(completions, **kw):\n    return [1 / len(c) for c in completions]\n", "failed on row 2"),
    ],
)
def test_a_bad_reward_is_one_line_naming_it(tmp_path, spec, body, message):
    if body is not None:
        (tmp_path / "r.py").write_text(body)
    with pytest.raises(UserError, match=message):
        scored(spec.format(d=tmp_path), ["ok", ""], [{}, {}])


# --- the command line ---------------------------------------------------------------------------

PROMPTS = [{"prompt": f"What is {a} plus {b}?", "answer": str(a + b)} for a in range(1, 9) for b in range(1, 5)]
VOWELS = "def vowels(prompts, completions, **kw):\n    return [sum(ch in 'aeiou' for ch in c) / max(1, len(c)) for c in completions]\n"


@pytest.fixture(scope="module")
def char_model(tmp_path_factory):
    """A tiny character-level GPT (two pretraining steps): with 65 tokens, a few completions cover the
    vocabulary, so a reward on its characters (vowels) is learned in a few dozen steps."""
    out = tmp_path_factory.mktemp("char") / "run"
    args = ["pretrain", "--objective", "clm", "--recipe", "gpt-shakespeare-char", "--steps", 2, "--out", out]
    result = invoke(*args, "--set", "model.n_layer=2", "--set", "model.d_model=64", "--set", "model.n_head=2")
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return chat_gguf_file(tmp_path_factory, max_seq_len=128)


def grpo_args(tmp_path, model, steps, *more):
    data = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    (tmp_path / "reward.py").write_text(VOWELS)
    return [
        "finetune", "grpo", "--from", model, "--data", data, "--reward", f"{tmp_path}/reward.py:vowels",
        "--steps", steps, "--lr", 3e-3, "--batch-size", 2,
        "--set", "grpo.max_completion_length=24", "--set", "grpo.num_generations=4", "--set", "grpo.eval_prompts=4",
        "--set", "data.val_fraction=0.125", "--set", "train.log_interval=1", *more,
    ]  # fmt: skip


def test_finetune_grpo_raises_the_reward_and_reports_it(tmp_path, char_model):
    result = invoke(*grpo_args(tmp_path, char_model, 30, "--out", tmp_path / "run", "--set", "train.eval_interval=15"))
    assert result.exit_code == 0, result.output
    train = [m for m in read_metrics(tmp_path / "run") if m["split"] == "train"]
    first, last = sum(m["reward"] for m in train[:4]) / 4, sum(m["reward"] for m in train[-4:]) / 4
    assert last > first + 0.1, (first, last)
    for key in (
        "reward_std",
        "frac_reward_zero_std",
        "completions/mean_length",
        "completions/clipped_ratio",
        "clip_ratio/region_mean",
    ):
        assert key in train[-1]
    report = json.loads((tmp_path / "run" / "eval.json").read_text())["held_out"]
    assert report["n"] == 4 and 0 <= report["reward"] <= 1
    samples = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4 and {"prompt", "completion", "reward", "rewards/vowels"} <= set(samples[0])
    assert (tmp_path / "run" / "samples" / "eval-002.jsonl").is_file()
    evaluated = invoke(
        "eval", "grpo", "--checkpoint", tmp_path / "run", "--limit", 2, "--reward", f"{tmp_path}/reward.py:vowels"
    )
    assert evaluated.exit_code == 0 and "mean reward" in evaluated.output, evaluated.output


def test_a_resumed_run_samples_and_trains_as_the_uninterrupted_one(tmp_path, char_model):
    """Cut back to step 2 of 3, in the middle of a rollout (3 steps train on each): the checkpoint keeps
    the rollout, and the resumed run logs every metric of the uninterrupted one exactly."""
    more = ["--set", "grpo.num_iterations=3", "--set", "train.eval_interval=100", *EVERY_STEP]
    whole = invoke(*grpo_args(tmp_path, char_model, 3, "--out", tmp_path / "whole", "--quiet", *more))
    assert whole.exit_code == 0, whole.output
    cut_and_resume("finetune", tmp_path / "whole", tmp_path, "--reward", f"{tmp_path}/reward.py:vowels")
    assert logged_training(tmp_path / "cut") == logged_training(tmp_path / "whole")
    assert len(logged_training(tmp_path / "whole")) == 3


def test_rloo_raises_the_reward_and_resumes_as_the_uninterrupted_run(tmp_path, char_model):
    """grpo.loss_type=rloo through the command line: the same rollouts and rewards as GRPO, RLOO's
    advantages and sequence-level loss, its KL in the reward (logged as kl); the reward rises, and a run
    cut at step 2 of 3 resumes with every logged metric equal."""
    rloo = ["--set", "grpo.loss_type=rloo", "--set", "grpo.beta=0.05"]
    result = invoke(*grpo_args(tmp_path, char_model, 30, "--out", tmp_path / "run", *rloo))
    assert result.exit_code == 0, result.output
    train = [m for m in read_metrics(tmp_path / "run") if m["split"] == "train"]
    first, last = sum(m["reward"] for m in train[:4]) / 4, sum(m["reward"] for m in train[-4:]) / 4
    assert last > first + 0.05 and "kl" in train[-1] and math.isfinite(train[-1]["loss"]), (first, last)
    more = ["--set", "train.eval_interval=100", *EVERY_STEP, *rloo]
    whole = invoke(*grpo_args(tmp_path, char_model, 3, "--out", tmp_path / "whole", "--quiet", *more))
    assert whole.exit_code == 0, whole.output
    cut_and_resume("finetune", tmp_path / "whole", tmp_path, "--reward", f"{tmp_path}/reward.py:vowels")
    assert logged_training(tmp_path / "cut") == logged_training(tmp_path / "whole")


def logged_training(run) -> list[dict]:
    """A run's logged training metrics without its timings (what a resumed run must repeat exactly)."""
    timing = ("_s", "_per_s", "mfu", "mem_mb")
    return [{k: v for k, v in m.items() if not k.endswith(timing)} for m in read_metrics(run) if m["split"] == "train"]


@pytest.mark.parametrize(
    "more,message",
    [
        (["--set", "grpo.num_generations=1"], "grpo.num_generations"),
        (["--set", "grpo.max_completion_length=128"], "leaves no room for a prompt"),
        (["--reward", "fast"], "not a built-in reward"),
        (["--reward", "nowhere.py:f"], "no such file"),
        (["--reward", "final-number", "--set", "grpo.answer_field=solution"], "'solution' column"),
    ],
)
def test_bad_input_is_one_line_and_creates_nothing(tmp_path, chat_model, more, message):
    result = invoke(*grpo_args(tmp_path, chat_model, 2, "--out", tmp_path / "run", *more))
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output, result.output
    assert not (tmp_path / "run").exists()


def test_a_reward_that_fails_on_the_first_rows_stops_before_training(tmp_path, chat_model):
    (tmp_path / "bad.py").write_text("def f(completions, answer, **kw):\n    return [1 / 0 for _ in completions]\n")
    result = invoke(*grpo_args(tmp_path, chat_model, 2, "--out", tmp_path / "run", "--reward", f"{tmp_path}/bad.py:f"))
    assert result.exit_code == 2 and "reward" in result.output and "ZeroDivisionError" in result.output, result.output
    assert "training row 1" in result.output and not (tmp_path / "run").exists()


def test_eval_names_the_settings_it_takes(chat_model):
    result = invoke("eval", "grpo", "--checkpoint", chat_model, "--set", "data.seq_len=128")
    assert result.exit_code == 2 and "grpo.<field> with a field of preset, prompt_field" in result.output, result.output


def test_a_sampled_evaluation_draws_the_same_completions_every_time_and_not_the_greedy_ones(tmp_path, char_model):
    """grpo.eval_sampled: the held-out prompts answered at grpo.temperature with the evaluation's own
    seed (the reward the policy expects, as TRL's evaluation samples it): two evaluations of the same
    model draw the same completions (checkpoints are compared on the same numbers), which are not the
    greedy ones; a higher temperature draws others."""
    data = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    (tmp_path / "reward.py").write_text(VOWELS)

    def completions(name, *more):
        out = tmp_path / f"{name}.json"
        args = ["eval", "grpo", "--checkpoint", char_model, "--data", data, "--limit", 6, "--out", out]
        result = invoke(
            *args, "--reward", f"{tmp_path}/reward.py:vowels", "--set", "grpo.max_completion_length=16", *more
        )
        assert result.exit_code == 0, result.output
        rows = [json.loads(x) for x in (tmp_path / f"{name}-samples.jsonl").read_text().splitlines()]
        return [r["completion"] for r in rows]

    greedy = completions("greedy")
    sampled = completions("sampled", "--set", "grpo.eval_sampled=true")
    assert len(sampled) == 6 and sampled == completions("again", "--set", "grpo.eval_sampled=true")
    assert sampled != greedy and len(set(sampled)) > 1
    hotter = completions("hotter", "--set", "grpo.eval_sampled=true", "--set", "grpo.temperature=2.0")
    assert hotter != sampled
