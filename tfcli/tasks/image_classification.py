"""Image classification on a ViT encoder: a linear head on the [CLS] vector or on the mean of the
patch vectors (no BatchNorm). `task.train: head` is a linear probe (frozen encoder), `all` full
finetuning. The encoder comes from a tfcli MAE run, a Hugging Face ViT/ViT-MAE directory, or a
fresh initialisation (the baseline a probe on a pretrained encoder must beat).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..data.image_batches import ImageSampler, ImageTransform, sequential_batches
from ..data.images import ImageSet, ImageSplits, load_images
from ..errors import UserError

DEFAULT_RECIPE = "vit-tiny-image-classify"
CLASSES_FILE = "classes.json"


def check_pooling(pooling: str) -> None:
    if pooling not in ("cls", "mean"):
        raise UserError(f"--pooling {pooling}: image-classify pools the 'cls' vector or the 'mean' of the patches")


def make_loss(pooling: str):
    """Cross-entropy of the linear head on the pooled encoder features; metrics loss and acc."""
    def loss(model: nn.Module, heads: nn.ModuleDict, batch: dict[str, Tensor]):
        feats = model.pool(model.forward_features(batch["pixels"]), pooling)  # (B, D)
        logits = heads["classifier"](feats)  # (B, n_classes)
        value = F.cross_entropy(logits.float(), batch["labels"])
        acc = (logits.argmax(-1) == batch["labels"]).float().mean()
        return value, {"loss": value.detach(), "acc": acc}
    return loss


def build_head(d_model: int, n_classes: int) -> nn.ModuleDict:
    """A plain linear layer (MAE's probe initialisation: truncated normal, std 0.01)."""
    head = nn.Linear(d_model, n_classes)
    nn.init.trunc_normal_(head.weight, std=0.01)
    nn.init.zeros_(head.bias)
    return nn.ModuleDict({"classifier": head})


@torch.no_grad()
def predict(model, heads, images: ImageSet, transform: ImageTransform, pooling: str, batch_size: int = 128,
            device: torch.device = torch.device("cpu")) -> np.ndarray:
    """Predicted class of every image, in order."""
    was = model.training
    model.eval()
    preds = []
    for batch in sequential_batches(images, transform, batch_size):
        feats = model.pool(model.forward_features(batch["pixels"].to(device)), pooling)
        preds.append(heads["classifier"](feats).argmax(-1).cpu().numpy())
    model.train(was)
    return np.concatenate(preds)


def load_encoder(recipe, from_: Optional[Path]) -> nn.Module:
    """The encoder from a tfcli run, a Hugging Face directory, or fresh from the recipe. recipe.model
    (and the normalisation in recipe.images) become the encoder's, so the run describes itself."""
    from ..models import build_model

    if from_ is not None and not Path(from_).exists():
        raise UserError(f"--from {from_}: not found")
    if from_ is not None and (Path(from_) / "config.json").is_file():
        from ..hf import vit as hf_vit

        cfg, state = hf_vit.read_hf_dir(Path(from_))
        model = build_model(cfg)
        model.load_state_dict(state)
    elif from_ is not None:
        from ..inference import load_run

        loaded = load_run(Path(from_))
        if loaded.recipe.model.family != "vit":
            raise UserError(f"--from {from_}: holds a {loaded.recipe.model.family!r} model; this task needs a ViT")
        model, cfg = loaded.model.train(), loaded.recipe.model
        recipe.images.mean, recipe.images.std = loaded.recipe.images.mean, loaded.recipe.images.std
    else:
        cfg = recipe.model
        torch.manual_seed(recipe.train.seed)
        model = build_model(cfg)
    recipe.model = cfg
    return model


def load_labelled(recipe, data: Optional[str] = None) -> ImageSplits:
    """The task's images (task.data, else data.source); they must carry labels."""
    source = data or recipe.task.data or recipe.data.source
    splits = load_images(source, recipe.data.val_fraction, recipe.train.seed)
    if splits.train.labels is None:
        raise UserError(f"{source}: images without labels; image-classify needs class sub-folders, "
                        f"y_train/y_test in a .npz, or a labelled dataset")
    return splits


def finetune(recipe, from_: Optional[Path] = None, out: Optional[Path] = None, quiet: bool = False) -> Path:
    """Train the head (and with task.train=all the encoder); accuracy on the test split at each
    evaluation keeps the best checkpoint, which is then reported with its confusion matrix."""
    from ..objectives import Prepared
    from ..pretrain import open_run_dir
    from ..train import Evaluation, fit, setup_runtime, teardown
    from .sequence_classification import _optimizer  # head lr, frozen backbone for --train head

    tc, t = recipe.train, recipe.task
    check_pooling(t.pooling)
    rt = setup_runtime(tc.device, tc.threads)
    try:
        model = load_encoder(recipe, from_)
        splits = load_labelled(recipe)
        train, test = splits.train.subset(t.limit), (splits.test or splits.train).subset(t.eval_limit)
        names = splits.train.class_names or [str(i) for i in range(int(splits.train.labels.max()) + 1)]
        if t.epochs > 0:
            tc.steps = max(1, math.ceil(t.epochs * len(train) / (tc.batch_size * tc.grad_accum * rt.world_size)))
        heads = build_head(model.cfg.d_model, len(names))
        eval_tf = ImageTransform.from_recipe(recipe, train=False)

        def run_eval(module) -> dict[str, float]:
            pred = predict(module.model, module.heads, test, eval_tf, t.pooling, tc.batch_size, rt.device)
            return {"test_acc": float((pred == test.labels).mean())}

        n_params = sum(p.numel() for p in model.parameters())
        tokens = model.cfg.n_patches + 1
        prepared = Prepared(
            train=ImageSampler(train, ImageTransform.from_recipe(recipe, train=True), tc.batch_size, tc.seed,
                               rt.rank, rt.world_size),
            val=lambda: (b for b, _ in zip(sequential_batches(test, eval_tf, tc.batch_size), range(tc.eval_batches))),
            loss=make_loss(t.pooling), items_per_batch=lambda b: int(b["labels"].numel()),
            flops_per_item=(6.0 if t.train == "all" else 2.0) * n_params * tokens, heads=heads, item_name="img")
        run_dir = open_run_dir(recipe, out, rt)
        (run_dir / CLASSES_FILE).write_text(json.dumps(names))
        if not quiet:
            from ..display import console

            console.print(f"[bold]{recipe.name}[/]: image-classify ({'linear probe' if t.train == 'head' else 'full finetuning'}, "
                          f"{t.pooling} pooling) of a {n_params / 1e6:.2f}M-parameter ViT from {from_ or 'scratch'}: "
                          f"{len(train):,} training images, {len(names)} classes, {tc.steps} steps, run [green]{run_dir}[/]")
        fit(model, prepared, recipe, run_dir, rt, evaluation=Evaluation(run_eval, "test_acc"),
            optimizer=_optimizer(model, heads, recipe, rt.device), quiet=quiet)
    finally:
        teardown(rt)
    if rt.is_main:
        report(run_dir, "best", None, 0, quiet)  # the whole test split, whatever eval_limit was
    return run_dir


def report(path: Path, which: str = "best", data: Optional[str] = None, limit: int = 0, quiet: bool = False) -> dict:
    """Accuracy and confusion matrix of a finetuned checkpoint on the test split; saved as eval.json."""
    from ..checkpoint import run_dir_of
    from ..display import console
    from ..inference import load_run
    from .classification_report import metrics, tables

    loaded = load_run(Path(path), which)
    if "classifier.weight" not in loaded.heads:
        raise UserError(f"{loaded.checkpoint} has no classifier head; is it an image-classify run?")
    recipe, model = loaded.recipe, loaded.model
    heads = build_head(model.cfg.d_model, loaded.heads["classifier.weight"].shape[0])
    heads.load_state_dict({k: v for k, v in loaded.heads.items() if k.startswith("classifier.")})
    classes_file = run_dir_of(loaded.checkpoint) / CLASSES_FILE
    names = tuple(json.loads(classes_file.read_text())) if classes_file.is_file() else \
        tuple(str(i) for i in range(heads["classifier"].out_features))
    splits = load_labelled(recipe, data)
    test = (splits.test or splits.train).subset(limit)
    if int(test.labels.max()) >= len(names):
        raise UserError(f"{data or recipe.task.data or recipe.data.source}: labels go up to {int(test.labels.max())}, "
                        f"but the classifier has {len(names)} classes")
    pred = predict(model, heads.eval(), test, ImageTransform.from_recipe(recipe, train=False), recipe.task.pooling)
    result = metrics(pred, test.labels, names)
    if not quiet:
        for table in tables("test", result, names):
            console.print(table)
    (run_dir_of(loaded.checkpoint) / "eval.json").write_text(
        json.dumps({"checkpoint": str(loaded.checkpoint), "test": result}, indent=1))
    return result


def evaluate(checkpoint: Path, options) -> None:
    """`tfcli eval image-classify --checkpoint RUN`: accuracy and confusion matrix on the test split."""
    report(checkpoint, "best", options.data, options.limit or 0)
