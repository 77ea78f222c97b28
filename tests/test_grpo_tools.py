"""GRPO with tools (issue 72): for the same sampled turns and tool results, tfcli's rollout ids, the
mask of what is trained (the model's turns, never the tool results or the template's tokens between
them), the loss, TRL's tool metrics and every gradient equal TRL's GRPOTrainer(tools=...)'s; tool
schemas equal transformers' get_json_schema; calls are read in each template's own format; the KV
cache continued across turns gives the tokens a fresh read of the whole conversation gives."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Literal

import pytest
import torch

from tfcli.data.chat import ChatTemplate
from tfcli.engine.runtime import Runtime
from tfcli.engine.trainer import ObjectiveModule
from tfcli.generate import generate_batch, generate_turns
from tfcli.hf import convert
from tfcli.hf import llama as llama_table
from tfcli.tasks import rewards as rewarding
from tfcli.tasks.grpo import GRPOConfig, GRPOLoss, Prompt, Rollouts
from tfcli.tasks.grpo import turns as turns_module
from tfcli.tasks.grpo.prompts import PromptBuilder
from tfcli.tasks.grpo.turns import ToolTurns, ToolUse
from tfcli.tools.toolbox import Limits, ToolSet, _tool

from .test_gguf import tiny_backbone

transformers = pytest.importorskip("transformers")

G, LIMIT = 3, 200


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


def divide(a: int, b: int) -> float:
    """Divide one integer by another.

    Args:
        a: The dividend.
        b: The divisor.
    """
    return a / b


def trl_template() -> str:
    trl = pytest.importorskip("trl")
    return (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()


def call(name: str, **arguments) -> str:
    import json

    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


# each completion's turns, as text: what the model "samples" on both sides (each ends its turn)
SCRIPT = [
    [call("multiply", a=12, b=34), "It is 408."],  # a call, its result, the answer
    ["I think 400."],  # no call
    [call("divide", a=1, b=0), call("multiply", a=12, b=34), "408"],  # a tool that raises, then two turns
    [call("square", x=3), "no idea"],  # an unknown tool
    [call("multiply", a=56, b=78), "The product is 4368 " + "and so on " * 80],  # cut at the limit
    [call("multiply", a=5, b=6) + "\n" + call("divide", a=56, b=8), "30 and 7"],  # two calls in one turn
]
QUESTIONS = ["What is 12 times 34?", "What is 56 times 78?"]
REWARDS = [1.0, 0.0, 0.5, 0.0, 0.2, 0.7]


def scripted_ids(tok, eos):
    return [[tok.tok.encode(text, add_special_tokens=False).ids + [eos] for text in turns] for turns in SCRIPT]


def fake_generate_turns(script):
    """generate_turns with the model's sampling replaced by each row's scripted turns (the turn
    callback, the budget and the masks as the real loop has them)."""

    def generate(model, prompts, turns, *, max_new_tokens, stop_ids, **_):
        out_ids, out_sampled = [], []
        for r in range(len(prompts)):
            ids, sampled = [], []
            for turn in script[r]:
                for token in turn:
                    if len(ids) >= max_new_tokens:
                        break
                    ids.append(token)
                    sampled.append(True)
                if len(ids) >= max_new_tokens or ids[-1] not in stop_ids:
                    break
                more = turns(r, ids, max_new_tokens - len(ids))
                if not more:
                    break
                ids += more
                sampled += [False] * len(more)
            out_ids.append(ids)
            out_sampled.append(sampled)
        return out_ids, out_sampled

    return generate


def ours(backbone, cfg, template, script, monkeypatch):
    tok = backbone.tokenizer
    tools = [_tool(multiply, "test"), _tool(divide, "test")]
    builder = PromptBuilder(tok, template, cfg, 10_000, [t.schema for t in tools])
    eos = tok.token_id("<|im_end|>")
    rows = [{"prompt": q} for q in QUESTIONS]
    prompts = [builder.example(row, n + 1) for n, row in enumerate(rows)]
    plugin = SimpleNamespace(rt=Runtime(torch.device("cpu")), tokenizer=tok, agreed=bool)
    turns = ToolTurns(template, tok, {eos}, cfg.max_turns)
    tooling = ToolUse(turns, ToolSet(tools), Limits(), builder.rerender)
    asked = [Prompt(prompts[i // G].ids, QUESTIONS[i // G], {"r": REWARDS[i]}, i + 1) for i in range(2 * G)]
    rewards = [rewarding.Reward("r", 1.0, lambda c: [row["r"] for row in c.rows])]
    rollouts = Rollouts(plugin, cfg, asked, rewards, {eos}, 0, "none", {}, tooling)
    monkeypatch.setattr(turns_module, "generate_turns", fake_generate_turns(script))
    score = Rollouts.score
    rollouts.score = lambda p, c, split, talks=None: score(rollouts, asked, c, split, talks)
    rollouts.prompts = [asked[0], asked[G]]
    model = backbone.model.train()
    batch = {"index": torch.tensor([0, 1]), "seed": torch.tensor([0])}
    (rollout,), metrics = rollouts(ObjectiveModule(model, torch.nn.ModuleDict(), None), [batch])
    loss, loss_metrics = GRPOLoss(cfg)(model, None, rollout)
    loss.backward()
    grads = convert.to_hf({f"model.{n}": p.grad for n, p in model.named_parameters()}, llama_table.rules(model.cfg))
    return float(loss.detach()), {**metrics, **loss_metrics}, grads, rollout


def theirs(tmp_path, backbone, cfg, source, script):
    trl = pytest.importorskip("trl")
    from dataclasses import replace

    import datasets

    from tfcli.hf import interop as hf
    from tfcli.plugin import Backbone

    backbone.tokenizer.specials = replace(backbone.tokenizer.specials, pad="<|endoftext|>")
    hf.export(Backbone(backbone.model, backbone.tokenizer), None, tmp_path / "start")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "start", dtype=torch.float32)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backbone.tokenizer.tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tokenizer.chat_template = source

    def r(prompts, completions, **kw):
        return kw["r"]

    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        num_generations=G,
        per_device_train_batch_size=2 * G,
        max_completion_length=LIMIT,
        max_tool_calling_iterations=cfg.max_turns - 1,
        loss_type=cfg.loss_type,
        temperature=cfg.temperature,
        report_to=[],
        use_cpu=True,
        bf16=False,
        fp16=False,
    )
    inputs = [{"prompt": [{"role": "user", "content": QUESTIONS[i // G]}], "r": REWARDS[i]} for i in range(2 * G)]
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=[r],
        args=args,
        train_dataset=datasets.Dataset.from_list(inputs),
        processing_class=tokenizer,
        tools=[multiply, divide],
    )
    turn = [0] * (2 * G)

    def single_turn(prompt_ids, images, fields, num_generations, has_tool_images=False):
        # the first call asks every row; later ones the rows whose last turn called a tool (each found
        # by its first turn, which every row's script begins differently)
        rows = list(range(2 * G)) if not any(turn) else [row_of(ids) for ids in prompt_ids]
        out = []
        for r_ in rows:
            out.append(list(script[r_][turn[r_]]))
            turn[r_] += 1
        return out, None

    def row_of(ids):  # the row whose first turn comes first after the prompt
        at = {r_: _first(list(ids), script[r_][0]) for r_ in range(2 * G)}
        return min((i, r_) for r_, i in at.items() if i is not None)[1]

    trainer._generate_single_turn = single_turn
    model.train()
    trainer.current_gradient_accumulation_steps = 1
    out = trainer._generate_and_score_completions(inputs)
    loss = trainer.compute_loss(model, out)
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return float(loss.detach()), metrics, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, out


def _first(ids: list[int], part: list[int]) -> int | None:
    return next((i for i in range(len(ids) - len(part) + 1) if ids[i : i + len(part)] == part), None)


@pytest.mark.slow  # 6-13 s: the fast tier keeps under 3 minutes
@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_a_tool_rollouts_ids_mask_loss_and_gradients_equal_trls(tmp_path, monkeypatch, loss_type):
    source = trl_template()
    cfg = GRPOConfig(
        num_generations=G, max_completion_length=LIMIT, max_turns=3, loss_type=loss_type, temperature=0.9,
        tools="calculator",
    )  # fmt: skip
    backbone = tiny_backbone(max_seq_len=1024)
    eos = backbone.tokenizer.token_id("<|im_end|>")
    script = scripted_ids(backbone.tokenizer, eos)
    template = ChatTemplate(source, "qwen2_5.jinja")
    trl_backbone = copy.deepcopy(backbone)
    mine, metrics, grads, rollout = ours(backbone, cfg, template, script, monkeypatch)
    trl_loss, their_metrics, their_grads, out = theirs(tmp_path, trl_backbone, cfg, source, script)

    prompt_ids = [[i for i, m in zip(ids, mask) if m] for ids, mask in zip(out["prompt_ids"], out["prompt_mask"])]
    completion = out["completion_ids"]
    trained = out["completion_mask"] * out["tool_mask"]
    for r in range(2 * G):
        p = prompt_ids[r]
        n = int(out["completion_mask"][r].sum())
        row = rollout["input_ids"][r]
        assert row[: len(p)].tolist() == p
        assert row[len(p) : len(p) + n].tolist() == completion[r, :n].tolist(), r
        targets = rollout["targets"][r, len(p) - 1 : len(p) - 1 + n]
        assert (targets != -100).tolist() == trained[r, :n].bool().tolist(), r
    assert trained.sum() < out["completion_mask"].sum()  # tool results were read, not trained
    assert mine == pytest.approx(trl_loss, abs=1e-5)
    for name in ["tools/call_frequency", "tools/failure_frequency", "completions/mean_length", "reward"]:
        assert float(metrics[name]) == pytest.approx(their_metrics[name], abs=1e-5), name
    assert float(metrics["tools/failure_frequency"]) > 0  # the raising and unknown tools were counted
    assert set(grads) == set(their_grads)
    for name, g in grads.items():
        torch.testing.assert_close(g, their_grads[name], atol=1e-5, rtol=1e-4)


# --- schemas, built-ins, calls within limits ------------------------------------------------------


def test_a_functions_schema_is_transformers_get_json_schema():
    from transformers.utils import get_json_schema

    from tfcli.tools.schema import json_schema

    def search(query: str, limit: int = 5, kinds: list[str] | None = None, mode: Literal["a", "b"] = "a") -> dict:
        """Search the notes.

        Args:
            query: What to look for.
            limit: The most results (choices: [5, 10])
            kinds: Which kinds of note,
                over two lines.
            mode: How.

        Returns:
            The results.
        """

    for fn in (multiply, divide, search):
        assert json_schema(fn) == get_json_schema(fn), fn.__name__


@pytest.mark.parametrize(
    "source,message",
    [
        ("def f(x):\n    '''Doc.\n\n    Args:\n        x: X.\n    '''\n", "has no type hint"),
        ("def f(x: int):\n    return x\n", "has no docstring"),
        ("def f(x: int):\n    '''Doc.'''\n", "no description for its argument 'x'"),
        ("def f(*xs: int):\n    '''Doc.'''\n", "a tool's arguments are named"),
    ],
)
def test_a_tool_without_a_schema_is_one_line(tmp_path, source, message):
    from tfcli.errors import UserError
    from tfcli.tools.toolbox import parse_tools

    (tmp_path / "t.py").write_text(source)
    spec = f"{tmp_path}/t.py:f"
    with pytest.raises(UserError, match=message):
        parse_tools(spec, frozenset({spec}))
    with pytest.raises(UserError, match="imports only when this command's own command line names it"):
        parse_tools(spec, frozenset())


def test_the_calculator_computes_arithmetic_and_runs_nothing_else():
    from tfcli.tools.builtin import calculator

    assert calculator("123 * 4567") == "561741"
    assert calculator("(12 + 30) * 4.5") == "189"
    assert calculator("7 / 2") == "3.5" and calculator("-2 ** 3") == "-8" and calculator("17 % 5") == "2"
    for bad, message in [
        ("__import__('os').system('true')", "not arithmetic"),
        ("open('x')", "not arithmetic"),
        ("2 ** 10 ** 9", "too large"),
        ("1 / 0", "division by zero"),
        ("x + 1", "not arithmetic"),
        ("1 +", "not arithmetic"),
    ]:
        with pytest.raises(ValueError, match=message):
            calculator(bad)


def test_lookup_finds_keys_in_the_users_table(tmp_path):
    from tfcli.errors import UserError
    from tfcli.tools.builtin import lookup_tool

    table = tmp_path / "capitals.jsonl"
    table.write_text('{"key": "France", "value": "Paris"}\n{"country": "Peru", "capital": "Lima", "people": 34}\n')
    lookup = lookup_tool(str(table))
    assert lookup("  france ") == "Paris" and lookup("PERU") == '{"capital": "Lima", "people": 34}'
    with pytest.raises(LookupError, match="no entry"):
        lookup("Mars")
    with pytest.raises(UserError, match="no such file"):
        lookup_tool(str(tmp_path / "absent.jsonl"))
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(UserError, match="line 1 is not JSON"):
        lookup_tool(str(tmp_path / "bad.jsonl"))


def test_every_failure_of_a_call_goes_back_to_the_model_counted_by_kind():
    import time

    from tfcli.tools.toolbox import Toolbox

    def slow(x: int) -> int:
        """Sleep.

        Args:
            x: Seconds.
        """
        time.sleep(x)
        return x

    def chatty(x: int) -> str:
        """Talk.

        Args:
            x: Characters.
        """
        return "a" * x

    box = Toolbox([_tool(multiply, "t"), _tool(divide, "t"), _tool(slow, "t"), _tool(chatty, "t")], Limits(0.2, 100))
    assert box.call("multiply", {"a": 3, "b": 4}).content == "12"
    cases = [
        ("square", {"x": 1}, "unknown_tool"),
        ("multiply", {"a": 3}, "bad_arguments"),
        ("multiply", {"a": 3, "b": "4"}, "bad_arguments"),
        ("multiply", {"a": 3, "b": 4, "c": 5}, "bad_arguments"),
        ("multiply", [3, 4], "bad_arguments"),
        ("divide", {"a": 1, "b": 0}, "raised"),
        ("slow", {"x": 30}, "timeout"),
        ("chatty", {"x": 10**6}, "too_long"),
    ]
    started = time.perf_counter()
    for name, arguments, kind in cases:
        outcome = box.call(name, arguments)
        assert outcome.failure == kind and outcome.content.startswith("{'error': "), (name, outcome)
        assert len(outcome.content) < 300
    assert time.perf_counter() - started < 5  # the hanging tool was left behind, not waited for
    assert box.call("chatty", {"x": 100}).failure is None


# --- call formats -----------------------------------------------------------------------------------


def test_each_templates_call_format_is_found_by_what_it_writes():
    from tfcli.errors import UserError
    from tfcli.tools import calls

    trl = pytest.importorskip("trl")
    folder = Path(trl.__file__).parent / "chat_templates"
    assert calls.format_of(ChatTemplate.load("qwen2.5-instruct")) == "hermes"
    assert calls.format_of(ChatTemplate((folder / "qwen3.jinja").read_text())) == "hermes"
    assert calls.format_of(ChatTemplate((folder / "llama3_1.jinja").read_text())) == "llama3"
    mistral = (
        "{% for m in messages %}{% if m.tool_calls %}[TOOL_CALLS]{{ m.tool_calls | map(attribute='function') "
        "| list | tojson }}</s>{% else %}{{ m.content }}{% endif %}{% endfor %}"
    )
    assert calls.format_of(ChatTemplate(mistral)) == "mistral"
    odd = "{% for m in messages %}{% if m.tool_calls %}CALL {{ m.tool_calls[0].function.name }}{% endif %}{% endfor %}"
    with pytest.raises(UserError, match="format tfcli does not read"):
        calls.format_of(ChatTemplate(odd))


def test_calls_are_read_and_malformed_ones_named():
    from tfcli.tools import calls

    two = calls.hermes('Let me see.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>'
                       '{"name": "g", "arguments": "{\\"y\\": 2}"}</tool_call>')  # fmt: skip
    assert two.content == "Let me see." and [c["function"] for c in two.calls] == [
        {"name": "f", "arguments": {"x": 1}},
        {"name": "g", "arguments": {"y": 2}},
    ]
    assert calls.hermes("just text").calls == [] and calls.hermes("just text").malformed is None
    assert "not JSON" in calls.hermes("<tool_call>{name: f}</tool_call>").malformed
    assert "needs a JSON object with a name" in calls.hermes('<tool_call>{"x": 1}</tool_call>').malformed
    assert calls.llama3('{"name": "f", "parameters": {"x": 1}}').calls[0]["function"]["arguments"] == {"x": 1}
    assert calls.llama3('{"answer": 3}').calls == []  # a reply that is JSON
    assert calls.mistral('[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}]').calls[0]["function"]["name"] == "f"
    assert calls.mistral('[TOOL_CALLS]f[ARGS]{"x": 2}').calls[0]["function"] == {"name": "f", "arguments": {"x": 2}}


# --- the cache across turns -------------------------------------------------------------------------


def test_turns_continue_the_cache_as_a_fresh_read_of_the_whole_conversation_would():
    """Greedy, two rows of different prompt lengths: each row's turn ends at a stop token, reads ids
    it is given, and writes again; the ids equal generating each turn afresh from the whole
    conversation so far (the cache continued across turns holds what a fresh read computes)."""
    backbone = tiny_backbone(max_seq_len=256)
    model = backbone.model.eval()
    prompts = [[5, 17, 300, 41, 9], [77, 12, 8]]
    free = generate_batch(model, prompts, max_new_tokens=6, temperature=0.0)
    stops = {free[0][2], free[1][3]}  # tokens each row writes early on: its turn ends there
    read = [[400, 401, 402], [500, 501]]

    def turn_ended(r, ids, room):
        return read[r] if ids.count(read[r][0]) == 0 else None  # one result read, then the end

    ids, sampled = generate_turns(model, prompts, turn_ended, max_new_tokens=40, stop_ids=stops)
    for r, prompt in enumerate(prompts):
        first = generate_batch(model, [prompt], max_new_tokens=40, stop_ids=stops, keep_stop=True)[0]
        second = generate_batch(
            model, [prompt + first + read[r]], max_new_tokens=40 - len(first) - len(read[r]), stop_ids=stops,
            keep_stop=True,
        )[0]  # fmt: skip
        assert ids[r] == first + read[r] + second, r
        assert sampled[r] == [True] * len(first) + [False] * len(read[r]) + [True] * len(second)


# --- environments -----------------------------------------------------------------------------------

COUNTER_ENV = '''
class Counter:
    """A rollout's own counter: its tool adds to it, and the reward is how close it came to the row's target."""

    def reset(self, target, **row):
        self.total, self.target = 0, target
        return f" (reach {target})"

    def add(self, n: int) -> int:
        """Add to the counter.

        Args:
            n: How much to add.
        """
        self.total += n
        return self.total

    def get_reward(self) -> float:
        return -abs(self.target - self.total)
'''


def test_an_environment_keeps_state_per_rollout_adds_to_the_prompt_and_gives_the_reward(tmp_path, monkeypatch):
    from tfcli.tasks.grpo.turns import Conversation  # noqa: F401
    from tfcli.tools.toolbox import EnvironmentClass

    (tmp_path / "env.py").write_text(COUNTER_ENV)
    spec = f"{tmp_path}/env.py:Counter"
    env = EnvironmentClass(spec, frozenset({spec}))
    assert list(env.schemas) == ["add"] and env.rewards
    assert env.schemas["add"]["function"]["parameters"]["required"] == ["n"]
    backbone = tiny_backbone(max_seq_len=1024)
    tok = backbone.tokenizer
    template = ChatTemplate.load("qwen2.5-instruct")
    cfg = GRPOConfig(num_generations=2, max_completion_length=200, env=spec)
    builder = PromptBuilder(tok, template, cfg, 10_000, list(env.schemas.values()))
    eos = tok.token_id("<|im_end|>")
    tooling = ToolUse(ToolTurns(template, tok, {eos}, 4), ToolSet([], env), Limits(), builder.rerender)
    prompts = [builder.example({"prompt": "Count.", "target": t}, 1) for t in (5, 9)]
    ids, conversations = tooling.start(prompts)
    assert tok.decode(ids[0], skip_special_tokens=False).count("Count. (reach 5)") == 1
    assert ids[0] != prompts[0].ids  # rendered again with the environment's text
    script = [
        [tok.tok.encode(call("add", n=2), add_special_tokens=False).ids + [eos]] * 2 + [[eos]],
        [tok.tok.encode(call("add", n=9), add_special_tokens=False).ids + [eos], [eos]],
    ]
    monkeypatch.setattr(turns_module, "generate_turns", fake_generate_turns(script))
    tooling.turns.run(None, ids, conversations, max_new_tokens=200, sampling={}, seed=0, pad_id=0)
    assert [c.environment.total for c in conversations] == [4, 9]  # each rollout its own instance
    reward = rewarding.environment_reward("Counter")
    asked = rewarding.Completions(["q", "q"], ["", ""], [[], []], [{}, {}], 200, conversations)
    assert reward.score(asked) == [-1, 0] and reward.name == "Counter"
    assert [c.calls for c in conversations] == [2, 1] and not any(c.failures for c in conversations)


@pytest.mark.parametrize(
    "source,message",
    [
        ("class E:\n    def reset(self, **row):\n        pass\n", "E has no tool methods"),
        ("class E:\n    def add(self, n: int) -> int:\n        '''Add.\n\n        Args:\n            n: N.\n        '''\n",
         "E has no reset method"),
        ("def E():\n    pass\n", "E is not a class"),
    ],
)  # fmt: skip
def test_an_environment_that_is_not_one_is_one_line(tmp_path, source, message):
    from tfcli.errors import UserError
    from tfcli.tools.toolbox import EnvironmentClass

    (tmp_path / "env.py").write_text(source)
    spec = f"{tmp_path}/env.py:E"
    with pytest.raises(UserError, match=message):
        EnvironmentClass(spec, frozenset({spec}))


# --- the command line -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    from .test_gguf import chat_gguf_file

    return chat_gguf_file(tmp_path_factory, max_seq_len=512)


def tool_args(tmp_path, model, steps, *more):
    from .conftest import write_jsonl

    rows = [{"prompt": f"What is {100 + 7 * i} times {20 + i}?", "answer": str((100 + 7 * i) * (20 + i))}
            for i in range(12)]  # fmt: skip
    data = write_jsonl(tmp_path / "prompts.jsonl", rows)
    return [
        "finetune", "grpo", "--from", model, "--data", data, "--reward", "final-number", "--tools", "calculator",
        "--chat-template", "qwen2.5-instruct", "--steps", steps, "--batch-size", 2, "--lr", 3e-3,
        "--set", "grpo.max_completion_length=40", "--set", "grpo.num_generations=3", "--set", "grpo.eval_prompts=2",
        "--set", "data.val_fraction=0.25", "--set", "train.log_interval=1", *more,
    ]  # fmt: skip


def calling_first(call_ids):
    """generate_turns whose every row first writes `call_ids` (a calculator call), then goes on
    sampling for real after the call's result."""
    real = turns_module.generate_turns

    def generate(model, prompts, turns, *, max_new_tokens, stop_ids, **kw):
        heads = [list(call_ids) + (turns(r, list(call_ids), max_new_tokens - len(call_ids)) or [])
                 for r in range(len(prompts))]  # fmt: skip
        rows, sampled = real(
            model, [p + h for p, h in zip(prompts, heads)], lambda r, ids, room: turns(r, heads[r] + ids, room),
            max_new_tokens=max_new_tokens - max(map(len, heads)), stop_ids=stop_ids, **kw,
        )  # fmt: skip
        written = [[True] * len(call_ids) + [False] * (len(h) - len(call_ids)) for h in heads]
        return [h + r for h, r in zip(heads, rows)], [w + s for w, s in zip(written, sampled)]

    return generate


def test_finetune_grpo_with_the_calculator_logs_its_calls_and_evaluates_with_them(tmp_path, chat_model, monkeypatch):
    from .conftest import invoke, read_metrics

    backbone = tiny_backbone()
    tok = backbone.tokenizer
    eos = tok.token_id("<|im_end|>")
    calls_ids = tok.tok.encode(call("calculator", expression="107 * 21"), add_special_tokens=False).ids + [eos]
    monkeypatch.setattr(turns_module, "generate_turns", calling_first(calls_ids))
    more = ["--set", "train.eval_interval=2", "--set", "grpo.max_completion_length=120"]
    result = invoke(*tool_args(tmp_path, chat_model, 2, "--out", tmp_path / "run", *more))
    assert result.exit_code == 0, result.output
    train = [m for m in read_metrics(tmp_path / "run") if m["split"] == "train"]
    assert train[-1]["tools/call_frequency"] >= 1 and train[-1]["tools/valid_frequency"] == 1.0
    assert "tools/failures/timeout" in train[-1] and "tools/turns" in train[-1]
    samples = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    turns = samples[0]["turns"]
    assert turns[0]["tool_calls"][0]["function"] == {"name": "calculator", "arguments": {"expression": "107 * 21"}}
    assert turns[1] == {"role": "tool", "name": "calculator", "content": "2247"}
    assert "tools:" in result.output and "calls a question" in result.output
    monkeypatch.undo()
    evaluated = invoke("eval", "grpo", "--checkpoint", tmp_path / "run", "--limit", 2)
    assert evaluated.exit_code == 0 and "tools:" in evaluated.output, evaluated.output


def test_a_run_with_tools_resumes_bit_for_bit(tmp_path, chat_model):
    from .conftest import invoke
    from .test_grpo import logged_training
    from .test_resume_matrix import EVERY_STEP, cut_and_resume

    more = ["--set", "train.eval_interval=100", "--set", "grpo.temperature=1.5", *EVERY_STEP]
    whole = invoke(*tool_args(tmp_path, chat_model, 3, "--out", tmp_path / "whole", "--quiet", *more))
    assert whole.exit_code == 0, whole.output
    cut_and_resume("finetune", tmp_path / "whole", tmp_path)
    assert logged_training(tmp_path / "cut") == logged_training(tmp_path / "whole")
    assert len(logged_training(tmp_path / "whole")) == 3


@pytest.mark.parametrize(
    "more,message",
    [
        (["--tools", "nowhere.py:f"], "no such file"),
        (["--tools", "{d}/t.py:g"], "has no function g"),
        (["--tools", "{d}/t.py:f"], "has no type hint"),
        (["--env", "{d}/t.py:E"], "E has no tool methods"),
        (["--tools", "adder"], "not a built-in tool"),
        (["--chat-template", "chatml"], "has no tool format"),
    ],
)
def test_bad_tools_are_one_line_and_create_nothing(tmp_path, chat_model, more, message):
    from .conftest import invoke

    (tmp_path / "t.py").write_text("def f(x):\n    'Doc.'\n    return x\n\n\nclass E:\n    def reset(self, **kw):\n"
                                   "        pass\n")  # fmt: skip
    more = [str(m).replace("{d}", str(tmp_path)) for m in more]
    result = invoke(*tool_args(tmp_path, chat_model, 1, "--out", tmp_path / "run", *more))
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output, result.output
    assert result.output.strip().count("\n") <= 2 and not (tmp_path / "run").exists(), result.output


def test_chat_with_the_calculator_shows_the_call_and_gives_the_result_back(chat_model, monkeypatch):
    """tfcli chat --tools calculator: the model's call is run and shown, its result goes back through
    the template as a tool message, and the model's next turn answers (the model's turns scripted)."""
    import tfcli.generate

    from .conftest import invoke

    seen = []

    def scripted(backbone, template, messages, tools=None, **kw):
        seen.append((list(messages), tools))
        yield call("calculator", expression="123 * 45") if len(seen) == 1 else "It is 5535."

    monkeypatch.setattr(tfcli.generate, "reply", scripted)
    args = ["chat", "--checkpoint", chat_model, "--chat-template", "qwen2.5-instruct", "--tools", "calculator"]
    result = invoke(*args, input="What is 123 times 45?\n")
    assert result.exit_code == 0, result.output
    assert "[calculator(expression='123 * 45') -> 5535]" in result.output and "It is 5535." in result.output
    (first, tools), (second, _) = seen
    assert tools[0]["function"]["name"] == "calculator"
    assert second[-1] == {"role": "tool", "name": "calculator", "content": "5535"}
    assert second[-2]["tool_calls"][0]["function"]["arguments"] == {"expression": "123 * 45"}
    refused = invoke("chat", "--checkpoint", chat_model, "--chat-template", "chatml", "--tools", "calculator", input="")
    assert refused.exit_code == 2 and "has no tool format" in refused.output, refused.output
