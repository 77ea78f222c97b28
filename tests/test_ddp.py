"""Two processes under torchrun (gloo on CPU) train exactly like one at the same global batch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from .conftest import near, read_metrics, tiny_gpt_recipe

pytestmark = pytest.mark.slow  # the whole module is left out of the fast tier


def run_tfcli(args, nproc: int):
    """`tfcli ARGS` in one process, or in `nproc` as `torchrun --standalone` starts them."""
    argv = [sys.executable, "-m", "tfcli", *map(str, args)]
    result = (
        torchrun_workers(argv, nproc)
        if nproc > 1
        else subprocess.run(
            argv, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300
        )
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def torchrun_workers(argv: list[str], nproc: int, timeout: float = 300) -> subprocess.CompletedProcess:
    """The processes `torchrun --standalone --nproc-per-node=N` starts, without its agent (2.6 s of
    starting torch and a rendezvous at every launch on this machine): each with the environment
    torchrun gives it, and all stopped once one fails, as torchrun stops them. torchrun itself runs
    the documented commands (test_readme) and the tests of rendezvous and collective timeouts here.
    Output: each rank's stdout, then each rank's stderr, in rank order."""
    import socket
    import tempfile
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    common = {"WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "OMP_NUM_THREADS": "1"}
    common |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    outs = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in range(nproc)]
    procs = [
        subprocess.Popen(
            argv, env={**os.environ, **common, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=out, stderr=err, text=True
        )
        for r, (out, err) in enumerate(outs)
    ]
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.returncode for p in procs):
            break
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    texts = []
    for files in zip(*outs):
        for f in files:
            f.seek(0)
        texts.append("".join(f.read() for f in files))
    code = next((p.returncode for p in procs if p.returncode), 0)
    return subprocess.CompletedProcess(argv, code, texts[0], texts[1])


def shares_of_two_processes(script: Path, out: Path) -> list[dict]:
    """Run `script` on 2 processes as torchrun starts them; each writes out/share-RANK.json (a file
    each: two prints on one pipe interleave). Returns them in rank order."""
    result = torchrun_workers([sys.executable, str(script)], 2)
    assert result.returncode == 0, result.stderr[-2000:]
    return [json.loads(path.read_text()) for path in sorted(out.glob("share-*.json"))]


def train_rows(run) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_metrics(run) if m.get("split") == "train"}


def val_rows(run) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_metrics(run) if m.get("split") == "val"}


# One recipe's runs, made once and compared by several tests below (each launch costs seconds of
# starting torch; the tests copy a run before resuming it). 12 steps at a global batch of 8, a
# checkpoint every 4, and every held-out block evaluated: they do not split evenly over 2 ranks x 4.
@pytest.fixture(scope="module")
def gpt_recipe(tmp_path_factory, small_text) -> Path:
    recipe = tmp_path_factory.mktemp("gpt") / "tiny.yaml"
    train = {"steps": 12, "eval_interval": 4, "ckpt_interval": 4, "keep_checkpoints": 5, "eval_batches": 1000}
    recipe.write_text(yaml.safe_dump(tiny_gpt_recipe(small_text, train=train)))
    return recipe


@pytest.fixture(scope="module")
def one_process_run(gpt_recipe) -> Path:
    run = gpt_recipe.parent / "one"
    run_tfcli(["pretrain", "--recipe", gpt_recipe, "--out", run, "--batch-size", 8, "--quiet"], nproc=1)
    return run


@pytest.fixture(scope="module")
def ddp_run(gpt_recipe) -> tuple[Path, str]:
    """Two processes under DDP, not quiet: (the run, what it printed)."""
    run = gpt_recipe.parent / "ddp"
    result = run_tfcli(["pretrain", "--recipe", gpt_recipe, "--out", run, "--batch-size", 4], nproc=2)
    return run, result.stdout


@pytest.fixture(scope="module")
def fsdp_run(gpt_recipe) -> Path:
    """Two processes under FSDP2, with recomputation and a collective timeout set."""
    run = gpt_recipe.parent / "fsdp"
    sets = ["train.strategy=fsdp", "train.activation_checkpointing=true", "train.collective_timeout=0.5"]
    args = ["pretrain", "--recipe", gpt_recipe, "--out", run, "--batch-size", 4, "--quiet"]
    run_tfcli([*args, *(a for s in sets for a in ("--set", s))], nproc=2)
    return run


def copied_back_to(source: Path, run: Path, step: int) -> Path:
    """A copy of `source` as if it had stopped right after its checkpoint at `step`."""
    shutil.copytree(source, run)
    cut_back(run, step)
    return run


def cut_back(run, step: int) -> None:
    """The run as if it had stopped right after its checkpoint at `step`."""
    for ckpt in (run / "checkpoints").glob("step-*"):
        if int(ckpt.name.split("-")[1]) > step:
            shutil.rmtree(ckpt)
    (run / "checkpoints" / "latest").write_text(f"step-{step:07d}")


def test_two_process_ddp_matches_one_process_at_the_same_global_batch(one_process_run, ddp_run):
    ddp, printed = ddp_run
    one_log, two_log = read_metrics(one_process_run), read_metrics(ddp)
    assert [m["step"] for m in one_log] == [m["step"] for m in two_log]  # rank 0 alone logs
    for a, b in zip(one_log, two_log):  # held-out blocks split unevenly over 2 x 4: their mean differs a little
        assert abs(a["loss"] - b["loss"]) < (0.02 if a["split"] == "val" else 1e-5), (a, b)
    assert printed.count("step     12/12") == 1  # and rank 0 alone prints
    assert sorted(p.name for p in (ddp / "checkpoints").iterdir()) == [
        "latest",
        "step-0000004",
        "step-0000008",
        "step-0000012",
    ]


def test_fsdp_matches_one_process_and_its_checkpoints_move_between_strategies(tmp_path, one_process_run, fsdp_run):
    """FSDP2 on 2 processes (gloo) at the global batch of one process: the same losses; its step-4
    checkpoint resumed by one process, and a one-process checkpoint resumed under FSDP, continue them."""
    one, fsdp = train_rows(one_process_run), train_rows(fsdp_run)
    assert sorted(one) == sorted(fsdp) and all(near(one[s], fsdp[s], 1e-5) for s in one), (one, fsdp)
    # the held-out blocks do not split evenly over 2 ranks x 4, yet every evaluation ran and agrees
    val_one, val_fsdp = val_rows(one_process_run), val_rows(fsdp_run)
    assert sorted(val_fsdp) == [4, 8, 12] and all(abs(val_one[s] - val_fsdp[s]) < 0.02 for s in val_one), (
        val_one,
        val_fsdp,
    )
    # each process wrote its own shard (safetensors, offsets in the header); nothing was gathered
    step4 = fsdp_run / "checkpoints" / "step-0000004"
    assert not (step4 / "model.safetensors").exists()
    assert len(list((step4 / "shards").glob("*.safetensors"))) == 2
    for name, source, nproc, extra in (
        ("fsdp-then-one", fsdp_run, 1, ["--batch-size", 8, "--set", "train.strategy=auto"]),
        ("fsdp-then-fsdp", fsdp_run, 2, ["--batch-size", 4]),
        ("one-then-fsdp", one_process_run, 2, ["--batch-size", 4, "--set", "train.strategy=fsdp"]),
    ):
        run = copied_back_to(source, tmp_path / name, 4)
        run_tfcli(["pretrain", "--resume", run, "--quiet", *extra], nproc=nproc)
        resumed = train_rows(run)
        assert all(near(resumed[s], one[s], 1e-5) for s in range(5, 13)), (name, resumed, one)
        if name == "fsdp-then-fsdp":  # the same processes: the uninterrupted run's losses exactly
            assert all(near(resumed[s], fsdp[s], 1e-6) for s in range(5, 13)), (resumed, fsdp)


def test_a_sharded_checkpoint_exports_a_directory_transformers_loads(tmp_path, fsdp_run):
    """export consolidates the shards: transformers' GPT-2 gives the run's own logits."""
    import torch
    from transformers import AutoModelForCausalLM

    from tfcli.engine.backbone import from_run

    assert (fsdp_run / "checkpoints" / "step-0000012" / "shards").is_dir()
    run_tfcli(["export", "--checkpoint", fsdp_run, "--hf", tmp_path / "hf"], nproc=1)
    model = from_run(fsdp_run).model
    ids = torch.randint(0, 60, (2, 16), generator=torch.Generator().manual_seed(0))
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()(ids).logits
    torch.testing.assert_close(theirs, model.logits(model(ids)), atol=1e-4, rtol=1e-4)


def damaged(fsdp_run: Path, tmp_path: Path, how: str) -> Path:
    """A copy of the FSDP run whose latest checkpoint's shards are damaged `how` (tests/hostile/README.md)."""
    run = tmp_path / "damaged"
    shutil.copytree(fsdp_run, run)
    folder = run / "checkpoints" / "step-0000012" / "shards"
    first, second = sorted(folder.glob("*.safetensors"))
    if how in ("missing", "missing-first-unlisted"):
        (second if how == "missing" else first).unlink()
    if how == "missing-first-unlisted":  # a checkpoint written before index.json
        (folder / "index.json").unlink()
    if how == "truncated":
        second.write_bytes(second.read_bytes()[:-100])
    if how == "pickled":  # what torch.distributed.checkpoint's own FileSystemWriter leaves
        for f in folder.iterdir():
            f.unlink()
        (folder / ".metadata").write_bytes(b"\x80\x04K\x01.")
        (folder / "__0_0.distcp").write_bytes(b"")
    return run


@pytest.mark.parametrize(
    "how,message",
    [
        ("missing", "is missing (2 shard files listed)"),
        ("missing-first-unlisted", "values in the shard files (a process's file is missing)"),
        ("truncated", "the file is damaged"),
        ("pickled", "a pickled .metadata"),
    ],
)
def test_a_damaged_sharded_checkpoint_is_refused_before_anything_reads_or_writes(tmp_path, fsdp_run, how, message):
    from .conftest import invoke
    from .test_hostile import refused, tree

    run = damaged(fsdp_run, tmp_path, how)
    before = tree(run)
    refused(invoke("generate", "--checkpoint", run, "--prompt", "a", "--max-new-tokens", 2), message)
    refused(invoke("pretrain", "--resume", run, "--steps", 14, "--set", "train.strategy=auto", "--quiet"), message)
    refused(invoke("export", "--checkpoint", run, "--hf", tmp_path / "hf"), message)
    refused(invoke("eval", "--checkpoint", run), message)
    assert tree(run) == before and not (tmp_path / "hf").exists()


def test_resume_on_another_number_of_processes_continues_the_same_global_batches(tmp_path, one_process_run, ddp_run):
    """2 processes to step 4, then 1 process (grad_accum 2 keeps the global batch of 8) to step 8,
    then 2 processes again to step 12: the losses of one uninterrupted process."""
    run = copied_back_to(ddp_run[0], tmp_path / "moving", 4)
    result = run_tfcli(["pretrain", "--resume", run], nproc=1)
    assert "train.grad_accum 1 -> 2 keeps the global batch of 8" in " ".join(result.stdout.split())
    cut_back(run, 8)
    run_tfcli(["pretrain", "--resume", run, "--quiet"], nproc=2)
    one, moved = train_rows(one_process_run), train_rows(run)
    assert sorted(moved) == list(range(1, 13))
    assert all(near(one[s], moved[s], 1e-5) for s in one), (one, moved)


def test_two_nodes_rendezvous_on_localhost(tmp_path, gpt_recipe, one_process_run):
    """Multi-node as torchrun does it: two 'nodes' of one process each meet at a c10d rendezvous on
    127.0.0.1 and train like one process at the same global batch."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                "--nproc-per-node=1",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-id=tfcli-test",
                "-m",
                "tfcli",
                "pretrain",
                "--recipe",
                str(gpt_recipe),
                "--out",
                str(tmp_path / "two-nodes"),
                "--batch-size",
                "4",
                "--quiet",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [n.communicate(timeout=300)[0] for n in nodes]
    assert all(n.returncode == 0 for n in nodes), outputs
    one, two = train_rows(one_process_run), train_rows(tmp_path / "two-nodes")
    assert sorted(one) == sorted(two) and all(near(one[s], two[s], 1e-5) for s in one)


def test_a_collective_that_times_out_ends_the_run_in_one_line_naming_the_rank(tmp_path):
    """Ranks that disagree on their collectives stop after train.collective_timeout with exit 2 and one
    line naming the rank and what it was doing, instead of waiting forever."""
    script = tmp_path / "mismatch.py"
    script.write_text(
        "import torch, torch.distributed as dist\n"
        "from tfcli.engine.runtime import abort_on_collective_failure, setup_runtime\n"
        "rt = setup_runtime('cpu', 1, 'ddp', collective_timeout_min=0.05)\n"
        "try:\n"
        "    dist.all_reduce(torch.ones(2))\n"
        "    if rt.rank == 0:\n"
        "        dist.broadcast(torch.ones(2), 0)\n"
        "    else:\n"
        "        dist.all_reduce(torch.ones(2))\n"
        "except Exception as e:\n"
        "    abort_on_collective_failure(rt, 'a test', e)\n"
        "    raise\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: rank")]
    assert result.returncode != 0 and errors, result.stderr[-2000:]
    # The rank whose collective times out first says so; its peer may instead see the connection close
    # as the first rank exits, which is the same failure seen from the other side.
    assert all(
        "a collective failed during a test (" in line and "collective_timeout is 0.05 min" in line for line in errors
    ), errors
    assert any("a collective failed during a test (Timed out" in line for line in errors), errors


def test_a_dpo_reference_is_sharded_under_fsdp_and_trains_as_one_process(tmp_path, tmp_path_factory):
    """dpo.reference copy under FSDP: the reference is sharded like the trained model (each process holds
    half of its block weights) and the losses are one process's at the same global batch."""
    from .conftest import write_jsonl
    from .test_dpo import PAIRS
    from .test_gguf import chat_gguf_file

    model = chat_gguf_file(tmp_path_factory, max_seq_len=128)
    data = write_jsonl(tmp_path / "pairs.jsonl", PAIRS * 4)
    common = ["finetune", "dpo", "--from", model, "--data", data, "--train", "all", "--steps", 4, "--quiet"]
    common += ["--set", "dpo.reference=copy", "--set", "train.log_interval=1", "--set", "train.eval_interval=4"]
    run_tfcli([*common, "--out", tmp_path / "one", "--batch-size", 4], nproc=1)
    run_tfcli([*common, "--out", tmp_path / "fsdp", "--batch-size", 2, "--set", "train.strategy=fsdp"], nproc=2)
    one, fsdp = train_rows(tmp_path / "one"), train_rows(tmp_path / "fsdp")
    assert sorted(one) == [1, 2, 3, 4] and all(near(one[s], fsdp[s], 1e-5) for s in one), (one, fsdp)
    script = tmp_path / "shares.py"
    script.write_text(
        "import json, torch\n"
        "from tfcli.engine.backbone import for_inference\n"
        "from tfcli.engine.runtime import setup_runtime\n"
        "from tfcli.models import transformer_blocks\n"
        f"model = for_inference({str(model)!r}).model\n"
        "whole = sum(p.numel() for b in transformer_blocks(model) for p in b.parameters())\n"
        "rt = setup_runtime('cpu', 1, 'fsdp')\n"
        "rt.strategy.wrap_frozen(model.requires_grad_(False))\n"
        "local = sum(p.to_local().numel() for b in transformer_blocks(model) for p in b.parameters())\n"
        f"out = {str(tmp_path)!r} + f'/share-{{rt.rank}}.json'\n"  # a file each: two prints on one pipe interleave
        "open(out, 'w').write(json.dumps({'rank': rt.rank, 'whole': whole, 'local': local}))\n"
    )
    shares = shares_of_two_processes(script, tmp_path)
    assert len(shares) == 2 and all(s["local"] * 2 == s["whole"] for s in shares), shares


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_grpo_samples_each_process_share_and_trains_under_two_processes(tmp_path, tmp_path_factory, strategy):
    """GRPO under torchrun: each process samples completions of its own prompts (FSDP's processes agree
    on when every row has stopped, since they run each forward pass together), rank 0 logs the pooled
    metrics, the held-out evaluation answers both shares, and the run resumes on one process."""
    from .conftest import write_jsonl
    from .test_gguf import chat_gguf_file
    from .test_grpo import PROMPTS

    model = chat_gguf_file(tmp_path_factory, max_seq_len=128)
    data = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    (tmp_path / "r.py").write_text("def n(completions, **kw):\n    return [float(len(c) % 3) for c in completions]\n")
    args = ["finetune", "grpo", "--from", model, "--data", data, "--reward", f"{tmp_path}/r.py:n", "--quiet"]
    args += ["--steps", 4, "--batch-size", 2, "--set", f"train.strategy={strategy}", "--set", "train.log_interval=1"]
    args += ["--set", "grpo.max_completion_length=8", "--set", "grpo.num_generations=4", "--set", "grpo.eval_prompts=4"]
    args += ["--set", "train.eval_interval=2", "--set", "train.ckpt_interval=2", "--set", "data.val_fraction=0.125"]
    run_tfcli([*args, "--out", tmp_path / "two"], nproc=2)
    rows = [m for m in read_metrics(tmp_path / "two") if m["split"] == "train"]
    assert [m["step"] for m in rows] == [1, 2, 3, 4] and all(m["completions/mean_length"] > 0 for m in rows)
    held = [m for m in read_metrics(tmp_path / "two") if m["split"] == "val"]
    assert len(held) == 2 and all("reward" in m for m in held)
    resumed = ["finetune", "--resume", tmp_path / "two", "--steps", 6, "--quiet", "--set", "train.strategy=auto"]
    resumed += ["--reward", f"{tmp_path}/r.py:n"]  # a recorded file reward is imported only when named
    run_tfcli(resumed, nproc=1)
    assert max(m["step"] for m in read_metrics(tmp_path / "two")) == 6


def test_qlora_under_ddp_and_fsdp_trains_as_one_process_and_a_sharded_run_resumes_on_one(tmp_path, tmp_path_factory):
    """--train qlora on 2 processes. DDP: each process reads and quantizes the same base (frozen: nothing
    of it is broadcast or synchronised), the adapters' gradients are all-reduced. FSDP: every process
    holds half of each NF4 block matrix (torchao's NF4 tensor splits for FSDP2). Both give one process's
    losses at the same global batch, and the sharded checkpoint (the adapters) resumes on one process
    with the uninterrupted run's losses."""
    from .conftest import hf_llama_dir, write_jsonl
    from .test_from_runs import ROWS

    base = hf_llama_dir(tmp_path_factory.mktemp("qlora") / "base", hidden=128, inner=256)
    data = write_jsonl(tmp_path / "rows.jsonl", ROWS * 4)
    common = ["finetune", "sft", "--from", base, "--data", data, "--train", "qlora", "--lr", 1e-2, "--steps", 4]
    common += ["--quiet", "--set", "train.log_interval=1", "--set", "train.ckpt_interval=2"]
    run_tfcli([*common, "--out", tmp_path / "one", "--batch-size", 4], nproc=1)
    for strategy in ("ddp", "fsdp"):
        run_tfcli([*common, "--out", tmp_path / strategy, "--batch-size", 2, "--set", f"train.strategy={strategy}"], 2)
    one, ddp, two = (train_rows(tmp_path / name) for name in ("one", "ddp", "fsdp"))
    assert sorted(one) == [1, 2, 3, 4] and all(near(one[s], ddp[s], 1e-5) for s in one), (one, ddp)
    assert all(near(one[s], two[s], 1e-5) for s in one), (one, two)
    assert len(list((tmp_path / "fsdp" / "checkpoints" / "step-0000002" / "shards").glob("*.safetensors"))) == 2
    run = copied_back_to(tmp_path / "fsdp", tmp_path / "on-one", 2)  # DCP reshards the adapters' shares; the
    # base is read and quantized again
    run_tfcli(["finetune", "--resume", run, "--quiet", "--batch-size", 4, "--set", "train.strategy=auto"], nproc=1)
    resumed = train_rows(run)
    assert all(near(resumed[s], two[s], 1e-5) for s in (3, 4)), (resumed, two)
    script = tmp_path / "shares.py"
    script.write_text(
        "import json, torch\n"
        "from tfcli import adapters\n"
        "from tfcli.engine.backbone import for_inference\n"
        "from tfcli.engine.runtime import setup_runtime\n"
        "from tfcli.models import nf4\n"
        "from tfcli.recipe import AdapterConfig\n"
        f"model = for_inference({str(base)!r}).model\n"
        "adapters.apply(model, 'qlora', AdapterConfig())\n"
        "held = [m for m in model.modules() if isinstance(m, nf4.NF4Linear)]\n"
        "whole = sum(m.weight_bytes() for m in held)\n"
        "rt = setup_runtime('cpu', 1, 'fsdp')\n"
        "rt.strategy.wrap(model)\n"
        "local = sum(m.weight_bytes() for m in held)\n"
        f"out = {str(tmp_path)!r} + f'/share-{{rt.rank}}.json'\n"
        "open(out, 'w').write(json.dumps({'whole': whole, 'local': local, 'count': len(held)}))\n"
    )
    shares = shares_of_two_processes(script, tmp_path)
    # half of each matrix's codes and scales; the 16-value NF4 table and a mean stay whole in both
    assert len(shares) == 2 and all(s["count"] == 10 for s in shares), shares
    assert all(abs(s["local"] - s["whole"] / 2) < 0.01 * s["whole"] for s in shares), shares


def test_a_low_bit_optimizer_under_fsdp_saves_each_share_resumes_bit_for_bit_on_as_many_and_on_one(
    tmp_path, small_text
):
    """optim.name adamw8bit under FSDP: torchao's 8-bit moments are each process's share (a DTensor), the
    checkpoint keeps every share's 8-bit codes and scales as they are (DCP cannot reshard blocks
    quantized per share), the run resumes on 2 processes with the uninterrupted run's losses exactly,
    and on 1 (the shares rebuilt whole and quantized in that process's blocks) within 1e-4 of them
    (read without its moments, step 5 was 7e-2 off: measured); that one process's whole checkpoint
    resumes on 2 FSDP processes, re-divided the same way, within 1e-4 of the one-process run. Equal
    shares: the four launches share inductor's cached step (test_optimizers covers unequal ones)."""
    from safetensors import safe_open

    text = tmp_path / "text.txt"  # 62 characters: every share of 31 rows, one compiled step for both
    text.write_text(small_text.read_text() + "\u00a7")
    recipe = tmp_path / "tiny.yaml"
    raw = tiny_gpt_recipe(
        text,
        model={"d_model": 64, "d_ff": 256},  # the MLP's and qkv's shares hold 4,096 values and more: quantized
        optim={"name": "adamw8bit"},
        train={"steps": 6, "eval_interval": 6, "ckpt_interval": 3, "keep_checkpoints": 5},
    )
    recipe.write_text(yaml.safe_dump(raw))
    fsdp = ["--batch-size", 4, "--quiet", "--set", "train.strategy=fsdp"]
    run_tfcli(["pretrain", "--recipe", recipe, "--out", tmp_path / "fsdp", *fsdp], nproc=2)
    losses = train_rows(tmp_path / "fsdp")
    assert losses[6] < losses[1] - 0.5, losses

    def assert_eight_bit_shares(ckpt):
        shards = sorted((ckpt / "shards").glob("*.safetensors"))
        assert len(shards) == 2
        for rank, path in enumerate(shards):
            with safe_open(path, "pt") as f:
                codes = [k for k in f.keys() if k.endswith(f"@{rank}of2.codes")]
                assert codes and all(f.get_slice(k).get_dtype() == "U8" for k in codes), list(f.keys())[:20]

    assert_eight_bit_shares(tmp_path / "fsdp" / "checkpoints" / "step-0000003")
    one = ["--set", "train.strategy=auto", "--batch-size", 8, "--set", "train.ckpt_interval=1"]  # whole checkpoints
    for name, nproc, extra in (("on-two", 2, []), ("on-one", 1, one)):
        run = copied_back_to(tmp_path / "fsdp", tmp_path / name, 3)
        run_tfcli(["pretrain", "--resume", run, "--quiet", *extra], nproc=nproc)
        resumed = train_rows(run)
        if nproc == 2:
            assert all(resumed[s] == losses[s] for s in (4, 5, 6)), (resumed, losses)
        else:
            assert all(abs(resumed[s] - losses[s]) < 1e-4 for s in (4, 5, 6)), (resumed, losses)
    run = copied_back_to(tmp_path / "on-one", tmp_path / "back-to-two", 4)  # a whole checkpoint's 8-bit states
    # re-divided over FSDP's processes
    run_tfcli(["pretrain", "--resume", run, *fsdp], nproc=2)
    again, one_run = train_rows(run), train_rows(tmp_path / "on-one")
    assert all(abs(again[s] - one_run[s]) < 1e-4 for s in (5, 6)), (again, one_run)
    assert_eight_bit_shares(run / "checkpoints" / "step-0000006")  # still 8-bit states, not fp32 ones
