"""Vision-language models (models/vlm.py) against transformers on the same weights: LLaVA with a CLIP
tower, LLaVA with a SigLIP tower, and Idefics3 (SmolVLM's architecture), tiny random models written by
transformers, fp32. Image preprocessing equals transformers' PIL processors on real photographs; logits
with images within 1e-4; greedy generation with an image identical for 16 tokens; a LoRA step's loss and
gradients equal peft's; `export --hf` reloads in transformers with the same logits; SFT on rows with
images trains, evaluates and resumes; `generate --image`; bad rows refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from tokenizers import AddedToken  # noqa: E402

from tfcli.data import image_processor  # noqa: E402
from tfcli.data.chat import ChatTemplate  # noqa: E402
from tfcli.data.image_prompts import ImagePrompts  # noqa: E402
from tfcli.data.tokenizers import load_tokenizer_files  # noqa: E402
from tfcli.engine.backbone import for_inference  # noqa: E402
from tfcli.generate import generate_batch  # noqa: E402
from tfcli.hf import interop as hf  # noqa: E402
from tfcli.hf import towers  # noqa: E402

from .conftest import close, invoke, train_losses, write_jsonl  # noqa: E402
from .test_llama import spread_  # noqa: E402

SPECIALS = ["<|im_start|>", "<|im_end|>", "<image>", "<fake_token_around_image>", "<global-img>"]
SPECIALS += [f"<row_{r}_col_{c}>" for r in range(1, 4) for c in range(1, 4)]
TEXT = dict(
    model_type="llama",
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
TOWER = dict(
    hidden_size=24, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, image_size=32, patch_size=8
)
ARCHITECTURES = ("llava-clip", "llava-siglip", "idefics3", "smolvlm")
TILED = ("idefics3", "smolvlm")  # SmolVLM: Idefics3's architecture under its own name (SmolVLM2)


def tokenizer():
    tok = load_tokenizer_files("builtin:gpt2", ["<|endoftext|>"])
    tok.tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return tok


def hf_vlm(arch: str):
    """(a tiny random transformers model of `arch` over GPT-2's tokenizer and SPECIALS, its processor)."""
    tok = tokenizer()
    text = {**TEXT, "vocab_size": tok.vocab_size}
    image_token = tok.token_id("<image>")
    torch.manual_seed(0)
    if arch in TILED:
        prefix = "Idefics3" if arch == "idefics3" else "SmolVLM"
        config = getattr(transformers, f"{prefix}Config")(
            text_config=text, vision_config={**TOWER, "model_type": f"{arch}_vision"}, image_token_id=image_token
        )
        model = getattr(transformers, f"{prefix}ForConditionalGeneration")(config)
        processor = getattr(transformers, f"{prefix}ImageProcessorPil")(
            size={"longest_edge": 64}, max_image_size={"longest_edge": 32}
        )
    else:
        tower = towers.CLIP if arch == "llava-clip" else towers.SIGLIP
        config = transformers.LlavaConfig(
            text_config=text,
            vision_config={**TOWER, "model_type": tower},
            image_token_id=image_token,
            vision_feature_layer=-2 if tower == towers.CLIP else -1,
            vision_feature_select_strategy="default" if tower == towers.CLIP else "full",
        )
        model = transformers.LlavaForConditionalGeneration(config)
        processor = (
            transformers.CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
            if tower == towers.CLIP
            else transformers.SiglipImageProcessorPil(size={"height": 32, "width": 32})
        )
    spread_(model)
    return model.eval(), processor, tok


def save_vlm(arch: str, path: Path):
    model, processor, tok = hf_vlm(arch)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    tok.tok.save(str(path / "tokenizer.json"))
    chatml = ChatTemplate.load("chatml").source
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": chatml}))
    return model, processor, tok


@pytest.fixture(scope="module", params=ARCHITECTURES)
def pair(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    theirs, processor, tok = save_vlm(request.param, directory)
    return request.param, theirs, processor, directory, for_inference(directory)


def photos():
    from PIL import Image
    from skimage import data

    return [Image.fromarray(data.astronaut()), Image.fromarray(data.coffee()), Image.fromarray(data.camera())]


def hf_inputs(arch, processor, backbone, image, prompt: str = "What is this?"):
    """(transformers' pixel values for one image, the prompt its processor writes: tfcli's expansion
    of the marker, checked against transformers' processor where it ships one for the model)."""
    out = processor(image, return_tensors="pt", **({"return_row_col_info": True} if arch in TILED else {}))
    grid = (int(out["rows"][0][0]), int(out["cols"][0][0])) if arch in TILED else (0, 0)
    text = ImagePrompts(backbone.cfg, backbone.tokenizer).expand("<|im_start|>user\n<image>" + prompt, [grid])
    pixels = out["pixel_values"]
    return (pixels.flatten(0, 1) if pixels.dim() == 5 else pixels), torch.tensor([backbone.tokenizer.encode(text)])


def theirs_pixels(arch, pixels):
    return pixels[None] if arch in TILED else pixels


def test_image_preprocessing_equals_transformers_on_photographs(pair):
    arch, _, processor, directory, ours = pair
    steps = ours.cfg.processing
    for image in photos():
        kwargs = {"return_row_col_info": True} if arch in TILED else {}
        want = processor(image, return_tensors="pt", **kwargs)
        frames, rows, cols = image_processor.frames(steps, image)
        reference = want["pixel_values"].flatten(0, 1) if want["pixel_values"].dim() == 5 else want["pixel_values"]
        assert frames.shape == reference.shape
        assert close(frames, reference, 1e-5)
        if arch in TILED:
            assert (
                (rows, cols)
                == (want["rows"][0][0], want["cols"][0][0])
                == image_processor.grid(steps, image.height, image.width)
            )
            assert rows * cols + 1 == len(frames) and rows > 1  # tiles and the whole image


def test_logits_with_an_image_match_transformers(pair):
    arch, theirs, processor, _, ours = pair
    pixels, ids = hf_inputs(arch, processor, ours, photos()[1])
    with torch.no_grad():
        want = theirs(input_ids=ids, pixel_values=theirs_pixels(arch, pixels)).logits
        got = ours.model.logits(ours.model(ids, pixel_values=pixels))
        blank = ours.model.logits(ours.model(ids, pixel_values=torch.zeros_like(pixels)))
    assert got.shape == want.shape
    assert (got - want).abs().max() < 1e-4
    assert (got - blank).abs().max() > 1e-2  # the image is read


def test_greedy_generation_with_an_image_matches_transformers(pair):
    arch, theirs, processor, _, ours = pair
    pixels, ids = hf_inputs(arch, processor, ours, photos()[0])
    with torch.no_grad():
        out = theirs.generate(
            input_ids=ids,
            pixel_values=theirs_pixels(arch, pixels),
            max_new_tokens=16,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    want = out[0, ids.size(1) :].tolist()
    got = generate_batch(ours.model, [ids[0].tolist()], max_new_tokens=16, inputs={"pixel_values": pixels})[0]
    assert got == want and len(set(want)) > 3


def test_the_image_tokens_are_those_transformers_processor_writes(pair):
    arch, _, processor, _, ours = pair
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=ours.tokenizer.tok, eos_token="<|im_end|>")
    if arch == "idefics3":
        whole = transformers.Idefics3Processor(processor, fast, image_seq_len=ours.cfg.image_seq_len)
    elif arch == "smolvlm":  # its processor needs num2words and torchvision: its prompt function, with the grid
        from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

        def whole(images, text, return_tensors):
            out = processor(images, return_tensors="pt", return_row_col_info=True)
            expanded = get_image_prompt_string(
                out["rows"][0][0],
                out["cols"][0][0],
                ours.cfg.image_seq_len,
                "<fake_token_around_image>",
                "<image>",
                "<global-img>",
            )
            return {"input_ids": torch.tensor([ours.tokenizer.encode(text.replace("<image>", expanded))])}
    else:
        whole = transformers.LlavaProcessor(
            processor,
            fast,
            patch_size=8,
            vision_feature_select_strategy="default" if arch == "llava-clip" else "full",
            num_additional_image_tokens=int(arch == "llava-clip"),
        )
    for image in photos():
        want = whole(images=image, text="<|im_start|>user\n<image>What is this?", return_tensors="pt")["input_ids"]
        _, ids = hf_inputs(arch, processor, ours, image)
        assert ids.tolist() == want.tolist()


def test_a_lora_step_gives_the_loss_and_gradients_of_peft(pair):
    """LoRA on the decoder's q and v (the tower frozen), the projector trained whole, as peft with the
    projector left trainable: the same loss, adapter gradients and projector gradients."""
    peft = pytest.importorskip("peft")
    from tfcli import adapters
    from tfcli.recipe import AdapterConfig

    arch, _, processor, directory, _ = pair
    ours = for_inference(directory)
    pixels, ids = hf_inputs(arch, processor, ours, photos()[2], "Describe it in detail please.")
    base = transformers.AutoModelForImageTextToText.from_pretrained(directory, attn_implementation="eager")
    decoder = "language_model" if arch not in TILED else "text_model"
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=rf".*{decoder}.*\.(q_proj|v_proj)", lora_dropout=0.0)
    theirs = peft.get_peft_model(base, config).train()
    bridge = "multi_modal_projector" if arch not in TILED else "connector"
    for name, p in theirs.named_parameters():
        p.requires_grad_(f".{bridge}." in name or "lora_" in name)
    model = ours.model.train()
    adapters.apply(model, "lora", AdapterConfig(rank=4, alpha=8, dropout=0.0, targets=("q", "v")))
    assert not any(p.requires_grad for p in model.vision.parameters())
    assert all(p.requires_grad for p in model.projector.parameters())
    params = dict(theirs.named_parameters())
    lora = {n: m for n, m in model.named_modules() if isinstance(m, adapters.LoRALinear)}
    assert lora and all(n.startswith("decoder.") for n in lora)
    stem = lambda name, part: [k for k in params if f".{name}.{part}_proj.lora_" in k]  # noqa: E731
    prefix = "base_model.model." + ("model.language_model" if arch not in TILED else "model.text_model")
    with torch.no_grad():
        for name, module in lora.items():
            layer = name.split(".")[2]
            for i, part in enumerate(("q", "v")):
                at = f"{prefix}.layers.{layer}.self_attn.{part}_proj"
                params[f"{at}.lora_B.default.weight"].normal_(0, 0.1)
                module.lora_a[i].copy_(params[f"{at}.lora_A.default.weight"])
            module.lora_b.copy_(
                torch.cat([params[f"{prefix}.layers.{layer}.self_attn.{p}_proj.lora_B.default.weight"] for p in "qv"])
            )
    labels = ids.clone()
    labels[:, : ids.size(1) - 4] = -100  # the last tokens trained
    want = theirs(input_ids=ids, pixel_values=theirs_pixels(arch, pixels), labels=labels).loss
    want.backward()
    from tfcli.tasks.reply_batches import decoder_loss

    targets = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
    got, _ = decoder_loss(model, torch.nn.ModuleDict(), {"input_ids": ids, "targets": targets, "pixel_values": pixels})
    got.backward()
    assert abs(got.item() - want.item()) < 1e-4
    for name, module in lora.items():
        layer = name.split(".")[2]
        ats = [f"{prefix}.layers.{layer}.self_attn.{p}_proj" for p in "qv"]
        assert (
            module.lora_a.grad - torch.stack([params[f"{a}.lora_A.default.weight"].grad for a in ats])
        ).abs().max() < 1e-4
        assert (
            module.lora_b.grad - torch.cat([params[f"{a}.lora_B.default.weight"].grad for a in ats])
        ).abs().max() < 1e-4
    mine = {f"model.{n}": p.grad for n, p in model.named_parameters() if n.startswith("projector.")}
    rules = [r for r in hf.registry.NATIVE[ours.cfg.hf_model_type].table.rules(ours.cfg) if r.ours in mine]
    from tfcli.hf.convert import to_hf

    named = to_hf(mine, rules)
    for theirs_name, grad in named.items():
        reference = next(
            p.grad for k, p in params.items() if k.endswith(theirs_name.split("model.", 1)[-1]) and bridge in k
        )
        assert (grad - reference).abs().max() < 1e-4
    assert named and stem  # something was compared


def test_export_reloads_in_transformers_with_the_same_logits(pair, tmp_path):
    arch, theirs, processor, _, ours = pair
    name, how = hf.export(ours, None, tmp_path / "out")
    assert name == type(theirs).__name__ and "AutoModelForImageTextToText" in how
    reloaded = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "out").eval()
    again = transformers.AutoImageProcessor.from_pretrained(tmp_path / "out")
    pixels, ids = hf_inputs(arch, processor, ours, photos()[1])
    with torch.no_grad():
        want = theirs(input_ids=ids, pixel_values=theirs_pixels(arch, pixels)).logits
        assert (reloaded(input_ids=ids, pixel_values=theirs_pixels(arch, pixels)).logits - want).abs().max() < 1e-4
    image = photos()[1]
    kwargs = {"return_row_col_info": True} if arch in TILED else {}
    assert torch.equal(
        again(image, return_tensors="pt", **kwargs)["pixel_values"],
        processor(image, return_tensors="pt", **kwargs)["pixel_values"],
    )
    assert for_inference(tmp_path / "out").cfg == ours.cfg  # and tfcli reads its own export as the same model


# --- the tool --------------------------------------------------------------------------------------


def image_rows(directory: Path, n: int = 24) -> Path:
    """Red and blue pictures (sizes vary), as TRL's messages with image parts and as prompt rows with
    <image>; the reply names the colour."""
    from PIL import Image

    rng = np.random.default_rng(0)
    (directory / "imgs").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        red = i % 2 == 0
        pixels = np.zeros((40 + 8 * (i % 3), 48, 3), np.uint8)
        pixels[..., 0 if red else 2] = 150 + rng.integers(0, 100)
        Image.fromarray(pixels).save(directory / "imgs" / f"{i}.png")
        answer = "red" if red else "blue"
        if i % 3 == 0:
            content = [{"type": "image"}, {"type": "text", "text": "What colour is this?"}]
            rows.append(
                {
                    "images": [f"imgs/{i}.png"],
                    "messages": [{"role": "user", "content": content}, {"role": "assistant", "content": answer}],
                }
            )
        else:
            rows.append({"image": f"imgs/{i}.png", "prompt": "<image>What colour is this?", "completion": answer})
    return Path(write_jsonl(directory / "rows.jsonl", rows))


SFT = [
    "--steps",
    8,
    "--batch-size",
    4,
    "--lr",
    3e-3,
    "--set",
    "data.val_fraction=0.25",
    "--set",
    "train.log_interval=1",
    "--set",
    "sft.max_new_tokens=2",
    "--set",
    "sft.chat_template=chatml",
    "--set",
    "train.ckpt_interval=4",
    "--set",
    "train.eval_interval=4",
]


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llava")
    save_vlm("llava-clip", directory)
    return directory


def test_sft_with_images_trains_evaluates_generates_and_exports(tmp_path, llava_dir):
    data = image_rows(tmp_path)
    result = invoke(
        "finetune", "sft", "--from", llava_dir, "--data", data, "--train", "lora", "--out", tmp_path / "run", *SFT
    )
    assert result.exit_code == 0, result.output
    assert "<image>x16What colour is this?" in result.output  # the preview folds an image's tokens
    assert "a vision-language model (llava)" in result.output and "recipe sft-vlm-mini" in result.output
    hint = next(line for line in result.output.splitlines() if line.startswith("chat with it:"))
    assert "--image" in hint and Path(hint.split("--image ")[1].strip()).is_file()  # a hint that runs
    losses = train_losses(tmp_path / "run")
    assert np.mean([losses[s] for s in (6, 7, 8)]) < np.mean([losses[s] for s in (1, 2, 3)])
    report = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert report["dev"]["generated"] == 6
    prediction = json.loads((tmp_path / "run" / "predictions.jsonl").read_text().splitlines()[0])
    assert "<image>x16" in prediction["prompt"]
    image = tmp_path / "imgs" / "0.png"
    generated = invoke(
        "generate",
        "--checkpoint",
        tmp_path / "run",
        "--image",
        image,
        "--prompt",
        "What colour?",
        "--greedy",
        "--max-new-tokens",
        3,
    )
    assert generated.exit_code == 0 and generated.output.startswith("What colour?"), generated.output
    chat = invoke(
        "chat",
        "--checkpoint",
        tmp_path / "run",
        "--image",
        image,
        "--greedy",
        "--max-new-tokens",
        2,
        input="What colour is this?\n/exit\n",
    )
    assert chat.exit_code == 0, chat.output
    peft_dir = invoke("export", "--checkpoint", tmp_path / "run", "--peft", tmp_path / "peft")
    assert peft_dir.exit_code == 2 and "export --peft of a vision-language model" in peft_dir.output
    assert not (tmp_path / "peft").exists()
    listed = invoke("runs", tmp_path)
    assert listed.exit_code == 0 and "vlm" in listed.output and "sft" in listed.output, listed.output
    assert invoke("plot", tmp_path / "run").exit_code == 0
    exported = invoke("export", "--checkpoint", tmp_path / "run", "--hf", tmp_path / "hf")
    assert exported.exit_code == 0 and "AutoModelForImageTextToText" in exported.output, exported.output
    model = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "hf")
    assert type(model).__name__ == "LlavaForConditionalGeneration"
    from .conftest import transformers_runs_the_export

    transformers_runs_the_export(tmp_path / "hf")


@pytest.mark.slow  # compare runs each cell in a process of its own; the fast tier keeps the other runs
def test_compare_puts_the_methods_of_a_vision_language_model_side_by_side(tmp_path, llava_dir):
    data = image_rows(tmp_path)
    result = invoke(
        "compare",
        "--task",
        "sft",
        "--from",
        llava_dir,
        "--train",
        "lora,projector",
        "--budget",
        "2steps",
        "--data",
        data,
        "--out",
        tmp_path / "study",
        "--set",
        "sft.chat_template=chatml",
        "--set",
        "sft.max_new_tokens=2",
        "--set",
        "train.batch_size=4",
        "--quiet",
    )
    assert result.exit_code == 0, result.output
    table = (tmp_path / "study" / "results.md").read_text()
    assert "| lora |" in table and "| projector |" in table
    projector = next(line for line in table.splitlines() if "| projector |" in line)
    assert "1.86K" in projector  # the projector alone trains: 24 x 32 + 32 and 32 x 32 + 32


def test_a_vlm_sft_run_resumes_bit_for_bit(tmp_path, llava_dir):
    import shutil

    data = image_rows(tmp_path)
    first = invoke(
        "finetune",
        "sft",
        "--from",
        llava_dir,
        "--data",
        data,
        "--train",
        "lora",
        "--out",
        tmp_path / "a",
        "--quiet",
        *SFT,
        "--set",
        "sft.generate_limit=0",
    )
    assert first.exit_code == 0, first.output
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "step-0000008")  # crashed after step 4's checkpoint
    (tmp_path / "b" / "checkpoints" / "latest").write_text("step-0000004")
    resumed = invoke("finetune", "--resume", tmp_path / "b", "--quiet")
    assert resumed.exit_code == 0, resumed.output
    assert train_losses(tmp_path / "a") == train_losses(tmp_path / "b") and len(train_losses(tmp_path / "a")) == 8


def test_bad_images_and_rows_without_the_marker_are_one_line_and_create_nothing(tmp_path, llava_dir):
    data = image_rows(tmp_path)
    rows = [json.loads(line) for line in Path(data).read_text().splitlines()]
    cases = {
        "missing": ({**rows[1], "image": "imgs/nope.png"}, "row 2: image"),
        "unreadable": ({**rows[1], "image": "rows.jsonl"}, "not a readable image"),
        "no marker": ({**rows[1], "prompt": "What colour is this?"}, "1 image and 0 <image> markers"),
    }
    for hostile in ("escape", "escape_hidden"):  # paths that leave the data's folder: refused unopened
        bad = json.loads((Path(__file__).parent / "hostile" / "images" / f"{hostile}.jsonl").read_text())
        cases[hostile] = (bad, "leaves the data's folder")
    for name, (bad, message) in cases.items():
        broken = write_jsonl(tmp_path / f"{name}.jsonl", [rows[0], bad] + rows[2:])
        result = invoke(
            "finetune",
            "sft",
            "--from",
            llava_dir,
            "--data",
            broken,
            "--train",
            "lora",
            "--out",
            tmp_path / name.replace(" ", "-"),
            *SFT,
        )
        assert result.exit_code == 2, result.output
        assert message in result.output and len(result.output.strip().splitlines()[-1]) < 300
        assert f"{name}.jsonl: row 2" in result.output or "held-out" in result.output, result.output
        assert not (tmp_path / name.replace(" ", "-")).exists()
    from tfcli import recipe as recipes
    from tfcli.data.labelled import held_out_rows

    seed = recipes.load("sft-vlm-mini").train.seed
    held_out = held_out_rows(Path(data), 0.25, seed)[0]  # a row of the held-out split: named by its file's number
    number = rows.index(held_out) + 1
    bad = [{**r, "image": "imgs/nope.png"} if i + 1 == number else r for i, r in enumerate(rows)]
    held = write_jsonl(tmp_path / "held.jsonl", bad)
    result = invoke(
        "finetune", "sft", "--from", llava_dir, "--data", held, "--train", "lora", "--out", tmp_path / "h", *SFT
    )
    assert result.exit_code == 2 and f"held.jsonl (held-out 0.25): row {number}: image" in result.output, result.output
    (tmp_path / "empty" / "red").mkdir(parents=True)
    (tmp_path / "empty" / "blue").mkdir()
    empty = invoke("finetune", "sft", "--from", llava_dir, "--data", tmp_path / "empty", "--out", tmp_path / "e", *SFT)
    assert empty.exit_code == 2 and "sub-folders (blue, red) hold no images" in empty.output, empty.output
    refused = invoke("generate", "--checkpoint", llava_dir, "--image", tmp_path / "nope.png", "--prompt", "hi")
    assert refused.exit_code == 2 and "--image: image" in refused.output
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "Colour?", "chosen": "red", "rejected": "blue"}] * 8)
    dpo = invoke("finetune", "dpo", "--from", llava_dir, "--data", pairs, "--out", tmp_path / "dpo", "--steps", 1)
    assert dpo.exit_code == 2 and "describes a 'vlm' model; task 'dpo' trains 'gpt' or 'llama'" in dpo.output
    assert not (tmp_path / "dpo").exists()
    fresh = invoke("finetune", "sft", "--recipe", "sft-vlm-mini", "--data", data, "--out", tmp_path / "fresh")
    assert fresh.exit_code == 2 and "is built from pretrained parts" in fresh.output, fresh.output
    assert not (tmp_path / "fresh").exists()
    gguf = invoke("export", "--checkpoint", llava_dir, "--gguf", tmp_path / "m.gguf")
    assert gguf.exit_code == 2 and "this is a 'llava'" in gguf.output, gguf.output


def test_a_vit_run_and_a_decoder_run_compose_a_llava_that_trains_exports_and_resumes(tmp_path, small_text):
    """--from a llama run --vision-from an MAE run: the tower and decoder as the runs left them, a fresh
    projector; --train projector trains it alone (LLaVA's first stage); the export is a LLaVA whose
    CLIP tower computes what tfcli's ViT does (its patch bias folded into the positions)."""
    import shutil

    from .conftest import mae_overrides, pretrained_run, set_args, tiny_npz

    (tmp_path / "text").mkdir()
    decoder = pretrained_run(
        tmp_path / "text",
        small_text,
        "clm",
        {"family": "llama", "n_layer": 1, "n_head": 2, "d_model": 32, "d_ff": 64, "max_seq_len": 160},
    )
    mae = invoke(
        "pretrain",
        "--objective",
        "mae",
        "--out",
        tmp_path / "mae",
        "--quiet",
        *set_args(mae_overrides(tiny_npz(tmp_path / "x.npz"), **{"train.steps": 2})),
    )
    assert mae.exit_code == 0, mae.output
    data = image_rows(tmp_path)
    args = [
        "finetune",
        "sft",
        "--from",
        decoder,
        "--vision-from",
        tmp_path / "mae",
        "--data",
        data,
        "--train",
        "projector",
        *SFT,
        "--set",
        "sft.chat_template=none",
        "--set",
        "sft.generate_limit=0",
    ]
    result = invoke(*args, "--out", tmp_path / "run")
    assert result.exit_code == 0, result.output
    assert "training 2,112 of" in result.output  # the projector alone: 32x32 + 32 and 32x32 + 32
    assert "the projector between" in result.output and "is new" in result.output
    from tfcli import recipe as recipes

    assert recipes.load("sft-vlm-mini", {"finetune.train": "projector"}).optim.lr == 1e-3  # not SFT's 2e-5
    from tfcli.engine.backbone import from_run

    run, vit, llama = from_run(tmp_path / "run"), from_run(tmp_path / "mae"), from_run(decoder)
    assert torch.equal(run.model.vision.blocks[0].attn.qkv.weight, vit.model.blocks[0].attn.qkv.weight)
    assert torch.equal(run.model.decoder.blocks[0].attn.qkv.weight, llama.model.blocks[0].attn.qkv.weight)
    assert run.tokenizer.token_id("<image>") == llama.tokenizer.vocab_size == run.cfg.image_token_id
    assert json.loads((tmp_path / "run" / "run.json").read_text())["vision_from"] == str((tmp_path / "mae").resolve())
    exported = invoke("export", "--checkpoint", tmp_path / "run", "--hf", tmp_path / "hf")
    assert exported.exit_code == 0, exported.output
    from .conftest import transformers_runs_the_export

    transformers_runs_the_export(tmp_path / "hf")  # the tower's pooler was "MISSING": written whole now
    theirs = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "hf").eval()
    pixels = image_processor.frames(run.cfg.processing, photos()[0])[0]
    ids = torch.tensor([run.tokenizer.encode("<image>" * run.cfg.image_seq_len + " a picture of")])
    with torch.no_grad():
        assert (
            theirs(input_ids=ids, pixel_values=pixels).logits - run.model.logits(run.model(ids, pixel_values=pixels))
        ).abs().max() < 1e-4
    shutil.copytree(tmp_path / "run", tmp_path / "again")  # resumed from its first checkpoint
    shutil.rmtree(tmp_path / "again" / "checkpoints" / "step-0000008")
    (tmp_path / "again" / "checkpoints" / "latest").write_text("step-0000004")
    resumed = invoke("finetune", "--resume", tmp_path / "again", "--quiet")
    assert resumed.exit_code == 0, resumed.output
    assert train_losses(tmp_path / "run") == train_losses(tmp_path / "again")


def test_a_folder_of_images_is_rows_asking_the_question(tmp_path, llava_dir):
    """Class sub-folders (the reply is the folder's name) with train/ and test/, or images beside a
    labels file (Hugging Face imagefolder's metadata.csv): SFT rows asking sft.image_question."""
    from PIL import Image

    for split, n in (("train", 8), ("test", 2)):
        for colour, channel in (("red", 0), ("blue", 2)):
            (tmp_path / "classes" / split / colour).mkdir(parents=True)
            for i in range(n):
                pixels = np.zeros((24, 24, 3), np.uint8)
                pixels[..., channel] = 200
                Image.fromarray(pixels).save(tmp_path / "classes" / split / colour / f"{i}.png")
    result = invoke(
        "finetune",
        "sft",
        "--from",
        llava_dir,
        "--data",
        tmp_path / "classes",
        "--train",
        "lora",
        "--out",
        tmp_path / "run",
        *SFT,
        "--set",
        "sft.image_question=Which colour?",
    )
    assert result.exit_code == 0, result.output
    assert "sft train: 16 examples" in result.output and "sft test: 4 examples" in result.output
    assert "<image>x16Which colour?" in result.output
    captions = tmp_path / "captions"
    captions.mkdir()
    lines = ["file_name,text"]
    for i in range(4):
        Image.fromarray(np.full((20, 30, 3), 60 * i, np.uint8)).save(captions / f"{i}.png")
        lines.append(f"{i}.png,grey number {i}")
    (captions / "metadata.csv").write_text("\n".join(lines) + "\n")
    evaluated = invoke(
        "eval", "sft", "--checkpoint", tmp_path / "run", "--data", captions, "--set", "sft.max_new_tokens=2"
    )
    assert evaluated.exit_code == 0, evaluated.output
    predictions = [
        json.loads(line) for line in (tmp_path / "run" / "predictions-sft-captions.jsonl").read_text().splitlines()
    ]
    assert [p["reference"] for p in predictions] == [f"grey number {i}" for i in range(4)]
    (captions / "metadata.csv").write_text("name,text\n0.png,x\n")
    refused = invoke("eval", "sft", "--checkpoint", tmp_path / "run", "--data", captions)
    assert refused.exit_code == 2 and "needs a file_name column" in refused.output


def test_a_vision_language_architecture_with_no_native_family_is_one_line(tmp_path):
    """LLaVA-NeXT (a config of sub-configs, no layer count of its own) reached the generic path, which
    reads text models only, and stopped there with an internal error."""
    config = transformers.LlavaNextConfig(
        text_config={**TEXT, "vocab_size": 64}, vision_config={**TOWER, "model_type": "clip_vision_model"}
    )
    transformers.LlavaNextForConditionalGeneration(config).save_pretrained(tmp_path / "next")
    result = invoke("generate", "--checkpoint", tmp_path / "next", "--prompt", "hi")
    assert result.exit_code == 2, result.output
    assert "'llava_next'" in result.output and "llava, idefics3, smolvlm" in result.output


def test_a_directory_saved_by_transformers_5_is_processed_as_its_processor_says(tmp_path):
    """transformers 5 saves a whole processor's image settings inside processor_config.json (no
    preprocessor_config.json): tfcli read defaults instead and cut images into 4x4 tiles where
    transformers cuts 2x2. A directory with neither file is one line."""
    model, processor, tok = hf_vlm("idefics3")
    model.save_pretrained(tmp_path / "m")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.tok, eos_token="<|im_end|>")
    transformers.Idefics3Processor(processor, fast, image_seq_len=4).save_pretrained(tmp_path / "m")
    tok.tok.save(str(tmp_path / "m" / "tokenizer.json"))  # the processor adds <end_of_utterance>
    assert not (tmp_path / "m" / "preprocessor_config.json").exists()
    ours = for_inference(tmp_path / "m")
    image = photos()[0]
    want = processor(image, return_tensors="pt", return_row_col_info=True)
    frames, rows, cols = image_processor.frames(ours.cfg.processing, image)
    assert (rows, cols) == (want["rows"][0][0], want["cols"][0][0]) == (2, 2)
    assert close(frames, want["pixel_values"].flatten(0, 1), 1e-5)
    pixels, ids = hf_inputs("idefics3", processor, ours, image)
    with torch.no_grad():
        theirs = model(input_ids=ids, pixel_values=pixels[None]).logits
        assert (ours.model.logits(ours.model(ids, pixel_values=pixels)) - theirs).abs().max() < 1e-4
    settings = json.loads((tmp_path / "m" / "processor_config.json").read_text())
    settings["image_processor"]["size"] = {"longest_edge": 0}
    (tmp_path / "m" / "processor_config.json").write_text(json.dumps(settings))
    bad = invoke("generate", "--checkpoint", tmp_path / "m", "--prompt", "hi")
    assert bad.exit_code == 2 and "processor_config.json: model.processing: size >= 1" in bad.output, bad.output
    (tmp_path / "m" / "processor_config.json").unlink()
    missing = invoke("generate", "--checkpoint", tmp_path / "m", "--prompt", "hi")
    assert missing.exit_code == 2 and "no image processor settings" in missing.output, missing.output


# llava-hf's chat template: it reads a message's content as parts, images first, and marks the replies
LLAVA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}"
    "{% endif %}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' '}}"
    "{% endfor %}{% else %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


def test_chat_with_an_image_is_the_prompt_transformers_chat_template_writes(tmp_path):
    """`generate --chat --image` without a marker put `<image>\\n` before the text, which neither the
    model's template (an image part) nor training (rows with image parts) writes: the message is now
    an image part and its text, placed by the template; greedy tokens as transformers' processor and
    generate give them. Training on the same row renders the same prompt."""
    from tfcli.data.conversations import Fields
    from tfcli.data.image_prompts import ImageExamples

    model, processor, tok = hf_vlm("llava-clip")
    save_vlm("llava-clip", tmp_path / "m")
    config = json.loads((tmp_path / "m" / "tokenizer_config.json").read_text())
    (tmp_path / "m" / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": LLAVA_TEMPLATE}))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.tok, eos_token="<|im_end|>")
    whole = transformers.LlavaProcessor(
        processor,
        fast,
        patch_size=8,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=LLAVA_TEMPLATE,
    )
    photos()[1].save(tmp_path / "coffee.png")
    image = tmp_path / "coffee.png"
    asked = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    text = whole.apply_chat_template(asked, add_generation_prompt=True)
    inputs = whole(images=photos()[1], text=text, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    want = out[0, inputs["input_ids"].size(1) :].tolist()
    ours = for_inference(tmp_path / "m")
    prompts = ImagePrompts(ours.cfg, ours.tokenizer)
    messages, refs, marks = prompts.messages([{"role": "user", "content": "What is this?"}], [image])
    template = ChatTemplate(ours.tokenizer.chat_template)
    ids = template.render(ours.tokenizer, messages, add_generation_prompt=True, images=marks).ids
    assert ids == inputs["input_ids"][0].tolist()
    got = generate_batch(ours.model, [ids], max_new_tokens=8, inputs=prompts.inputs(refs))[0]
    assert got == want
    said = invoke(
        "generate", "--checkpoint", tmp_path / "m", "--chat", "--image", image, "--prompt", "What is this?",
        "--greedy", "--max-new-tokens", 8,
    )  # fmt: skip
    assert said.exit_code == 0 and said.output.strip() == ours.tokenizer.decode(want).strip(), said.output
    row = {"images": ["coffee.png"], "messages": asked + [{"role": "assistant", "content": "coffee"}]}
    builder = ImageExamples(ours.tokenizer, template, "assistant", 4096, Fields(), prompts=prompts, root=tmp_path)
    example = builder.build_all([row]).examples[0]
    assert example.prompt == ids and example.reply == "coffee"
    trained = [i for i, t in zip(example.ids.tolist(), example.trained.tolist()) if t]
    assert ours.tokenizer.decode(trained).strip() == "coffee"
    chatml = ChatTemplate.load("chatml")  # a template that reads texts: the image part flattened first
    flat, _, marks = prompts.messages([{"role": "user", "content": "What is this?"}], [image])
    rendered = chatml.render(ours.tokenizer, flat, add_generation_prompt=True, images=marks)
    assert "user\n<image>" in readable_text(ours.tokenizer, rendered.ids) and "What is this?" in rendered.text
    trained_row = ImageExamples(ours.tokenizer, chatml, "assistant", 4096, Fields(), prompts=prompts, root=tmp_path)
    assert trained_row.build_all([row]).examples[0].prompt == rendered.ids


def readable_text(tokenizer, ids) -> str:
    from tfcli.data.image_prompts import readable

    return readable(tokenizer.decode(ids, skip_special_tokens=False))
