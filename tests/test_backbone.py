"""engine/backbone.py: a run starts from the weights it is given (a tfcli run, a Hugging Face
directory), and generate reads what eval reads."""

from __future__ import annotations

import json

from .conftest import invoke, read_metrics
from .test_cli_behaviour import gpt_run


def test_continued_pretraining_starts_from_the_weights_it_is_given(tmp_path, small_text, hf_bert, hf_bert_mlm):
    """pretrain --from: a GPT run continues next-token training where it stopped (the objective
    follows the family); a BERT without an MLM head gets fresh heads, named in one line."""
    source = gpt_run(tmp_path, small_text, "source", steps=30, ckpt_interval=30, eval_interval=30)
    ended = [m["loss"] for m in read_metrics(source) if m.get("split") == "train"][-1]
    result = invoke(
        "pretrain",
        "--from",
        source,
        "--data",
        small_text,
        "--steps",
        1,
        "--out",
        tmp_path / "more",
        "--set",
        "schedule.warmup_steps=0",
        "--set",
        "data.seq_len=32",
        "--set",
        "train.log_interval=1",
    )
    assert result.exit_code == 0, result.output
    first = [m["loss"] for m in read_metrics(tmp_path / "more") if m.get("split") == "train"][0]
    assert abs(first - ended) < 0.3 and first < 3.7, (first, ended)  # a fresh model starts near ln(65) = 4.2
    assert json.loads((tmp_path / "more" / "run.json").read_text())["from"] == str(source.resolve())
    text = tmp_path / "paragraphs.txt"
    text.write_text("\n\n".join(small_text.read_text()[i : i + 400] for i in range(0, 20_000, 400)))
    for model, missing in ((hf_bert, "mlm and nsp heads"), (hf_bert_mlm, "nsp head")):
        result = invoke(
            "pretrain",
            "--objective",
            "mlm",
            "--from",
            model,
            "--data",
            text,
            "--steps",
            1,
            "--batch-size",
            4,
            "--out",
            tmp_path / model.name,
            "--set",
            "data.seq_len=64",
        )
        assert result.exit_code == 0, result.output
        assert f"has no weights for the objective's {missing}; initialised as a new run's" in " ".join(
            result.output.split()
        )


def test_generate_takes_a_hugging_face_directory_as_eval_does(tmp_path, small_text):
    """`generate --checkpoint` reads what `eval --checkpoint` reads: a run's export generates the same
    greedy text as the run."""
    run = gpt_run(tmp_path, small_text)
    assert invoke("export", "--checkpoint", run, "--hf", tmp_path / "hf").exit_code == 0
    texts = [
        invoke("generate", "--checkpoint", where, "--prompt", "ROMEO:", "--max-new-tokens", 12, "--greedy")
        for where in (run, tmp_path / "hf")
    ]
    assert all(t.exit_code == 0 for t in texts), [t.output for t in texts]
    assert texts[0].output.strip().splitlines()[-1] == texts[1].output.strip().splitlines()[-1]
    missing = invoke("generate", "--checkpoint", tmp_path / "nothing-here", "--prompt", "x")
    assert missing.exit_code == 2 and missing.output.startswith("error:")


def test_reading_a_model_draws_no_random_weights_and_initialises_only_what_the_file_lacks(
    tmp_path, small_text, hf_bert_mlm
):
    """A model whose weights are all read next is built without drawing random ones (torch.nn.init's
    initialisers are skipped: 3.6 of 3.6 s building SmolLM2-135M on one core): reading a Hugging Face
    directory or a tfcli run leaves the global random state where it was and gives the file's weights;
    the part a file lacks (BertForMaskedLM's pooler) is initialised as before, from seed 0. A model
    built to be trained from scratch (T5's own initialisation included) still draws its weights."""
    import torch
    from safetensors.torch import load_file

    from tfcli.engine.backbone import for_inference
    from tfcli.models import build_model
    from tfcli.recipe import load as load_recipe

    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    bert = for_inference(hf_bert_mlm)
    assert torch.equal(torch.random.get_rng_state(), state), "reading the model drew random numbers"
    theirs = load_file(hf_bert_mlm / "model.safetensors")
    assert torch.equal(bert.model.wte.weight, theirs["bert.embeddings.word_embeddings.weight"])
    with torch.random.fork_rng():
        torch.manual_seed(0)
        pooler = torch.nn.Linear(32, 32)  # its construction draws what the loader's reset_parameters draws
    assert torch.equal(bert.model.pooler.weight, pooler.weight) and torch.equal(bert.model.pooler.bias, pooler.bias)
    run = gpt_run(tmp_path, small_text)
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    ours = for_inference(run).model
    assert torch.equal(torch.random.get_rng_state(), state), "reading the run drew random numbers"
    ids = torch.randint(0, 60, (1, 12))
    with torch.no_grad():
        assert torch.equal(ours(ids), for_inference(run).model(ids))
    cfg = load_recipe("t5-mini", {"model.vocab_size": 64, "model.n_layer": 1, "model.n_decoder_layer": 1}).model
    torch.manual_seed(0)
    scratch = build_model(cfg)
    assert not torch.equal(torch.random.get_rng_state(), state) and scratch.shared.weight.std() > 0.5  # std 1
    state = torch.random.get_rng_state()
    read = build_model(cfg, weights_follow=True)
    assert torch.equal(torch.random.get_rng_state(), state), "T5's initialisation drew random numbers"
    read.load_state_dict(scratch.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(read.state_dict().values(), scratch.state_dict().values()))


def test_every_familys_initialisation_is_skipped_when_its_weights_are_read_next():
    """Each shipped recipe's model (shrunk) draws no random number when built to be read into: every
    family initialises through torch.nn.init (docs/design/adding-a-family.md), which loaders skip."""
    import dataclasses

    import torch

    from tfcli import recipe as recipes
    from tfcli.engine.memory import probe_config
    from tfcli.models import build_model

    seen = set()
    for name in recipes.available():
        cfg = recipes.load(name).model
        if cfg.family == "vlm":  # a vision-language model starts from a file
            continue
        seen.add(cfg.family)
        cfg = probe_config(cfg, 1)  # one block per stack, as the memory plan's probes
        if getattr(cfg, "vocab_size", None) is not None:
            cfg = dataclasses.replace(cfg, vocab_size=64)
        state = torch.random.get_rng_state()
        build_model(cfg, weights_follow=True)
        assert torch.equal(torch.random.get_rng_state(), state), f"{name}: its initialisation drew numbers"
    assert {"gpt", "llama", "t5", "bert", "vit"} <= seen, seen
