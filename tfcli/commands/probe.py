"""`tfcli probe`: what each layer of a model knows about a task. The pooled features of every depth
(the embeddings, then each block) are extracted once, cached, and a linear probe is fitted on each
layer's features: accuracy by depth, printed and drawn, for one model or several on one plot.

    tfcli probe mnli --from runs/<bert run>,hf-minilm/ --data mnli/ --limit 2000
    tfcli probe image-classify --from runs/<mae run> --data cifar.npz --layers 0,3,6

The task's own data reading and encoding are used (a preset such as mnli, classify on your own
labelled text, image-classify), so anything `finetune` reads, `probe` reads: a tfcli run, a Hugging
Face directory or hub id, a GGUF file. Probes: closed-form ridge regression on one-hot labels (its
penalty picked on a fifth of the training features) or multinomial logistic regression (L-BFGS).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..errors import UserError

METHODS = ("ridge", "logistic")


@dataclass
class ProbeRequest:
    task: str  # mnli, classify, image-classify, ...
    sources: list[str]  # models: runs, Hugging Face directories, hub ids, GGUF files
    data: str | None = None
    layers: str = "all"  # all, or comma-separated depths (0: the embeddings)
    pooling: str = "mean"  # mean | last (decoders) | cls (encoders)
    method: str = "ridge"
    limit: int = 2000  # training examples (a seeded balanced sample; 0: all)
    eval_limit: int = 1000  # examples of each evaluation split
    sets: dict = field(default_factory=dict)  # recipe overrides (e.g. classify.text_fields)
    out: Path | None = None  # where probe.json and probe.png go
    seed: int = 0


def run(req: ProbeRequest) -> dict[str, dict]:
    """{model: {split: [accuracy of layer 0, 1, ...]}}, printed, written to probe.json, drawn in probe.png."""
    from ..display import console

    if req.method not in METHODS:
        raise UserError(f"--method {req.method}: choose {', '.join(METHODS)}")
    results, majority = {}, None
    for source in req.sources:
        feats = features(req, source)
        depths = chosen_layers(req.layers, len(feats["train"][0]))
        results[source] = {
            split: {d: probe_accuracy(feats["train"], x, d, req.method) for d in depths}
            for split, x in feats.items()
            if split != "train"
        }
        majority = majority or {s: float(np.bincount(y).max() / len(y)) for s, (_, y) in feats.items() if s != "train"}
        console.print(table(source, results[source], majority))
    out = Path(req.out or ".")
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe.json").write_text(
        json.dumps(
            {
                "task": req.task,
                "pooling": req.pooling,
                "method": req.method,
                "limit": req.limit,
                "majority": majority,
                "results": {
                    m: {s: {str(d): a for d, a in v.items()} for s, v in r.items()} for m, r in results.items()
                },
            },
            indent=1,
        )
    )
    picture = draw(results, majority, out / "probe.png", req)
    console.print(f"wrote {out / 'probe.json'} and {picture}")
    return results


def chosen_layers(text: str, n: int) -> list[int]:
    if text == "all":
        return list(range(n))
    try:
        depths = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--layers {text}: all, or depths such as 0,3,6") from None
    wrong = [d for d in depths if not 0 <= d < n]
    if wrong or not depths:
        raise UserError(f"--layers {text}: this model has depths 0 (the embeddings) to {n - 1}")
    return depths


def features(req: ProbeRequest, source: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{split: ((n_layer + 1, N, D) features, (N,) labels)}, training split first, from the cache when
    this model, data, sample and pooling were read before."""
    from ..data.sources import cache_dir, write_into_place

    path = cache_dir() / "probe" / f"{cache_key(req, source)}.npz"
    if path.is_file():
        stored = np.load(path)
        return {s: (stored[f"{s}.x"], stored[f"{s}.y"]) for s in json.loads(str(stored["splits"]))}
    out = extract(req, source)
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = {f"{s}.{k}": v for s, (x, y) in out.items() for k, v in (("x", x), ("y", y))}

    def save(tmp: Path) -> None:
        with tmp.open("wb") as f:  # a file object: np.savez would add .npz to a path
            np.savez(f, splits=json.dumps(list(out)), **arrays)

    write_into_place(path, save)
    return out


def cache_key(req: ProbeRequest, source: str) -> str:
    """What the features depend on: the model's files (path, size, time), the data's, the task and its
    settings, the sample and the pooling; not the probe (ridge or logistic) nor the layers asked for."""

    def stamp(p: str | None) -> str:
        if not p or not Path(p).exists():
            return str(p)
        files = [Path(p)] if Path(p).is_file() else sorted(x for x in Path(p).rglob("*") if x.is_file())[:200]
        return str(Path(p).resolve()) + "".join(f"|{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)

    text = json.dumps(
        [stamp(source), stamp(req.data), req.task, req.sets, req.limit, req.eval_limit, req.pooling, req.seed],
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def extract(req: ProbeRequest, source: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Read the model and the task's data as `finetune` would, then every layer's pooled features."""
    from .. import recipe as recipes
    from ..data.sampler import sequential_batches
    from ..display import phase
    from ..driver import make_plugin
    from ..engine import model_source
    from ..engine.backbone import for_inference
    from ..engine.runtime import setup_runtime
    from ..tasks.presets import task_target

    key, settings, defaults = task_target(req.task)
    found = model_source.resolve(source)
    rt = setup_runtime("auto")
    family = found.family
    plugin_families = make_plugin("task", key, rt, quiet=True).families
    if family not in plugin_families:
        raise UserError(f"probe {req.task}: it reads {' or '.join(plugin_families)} models, not a {family!r}")
    backbone = for_inference(found, device=str(rt.device))
    overrides = {
        **{f"{key}.{k}": v for k, v in settings.items()},
        f"{key}.head": "classifier",
        f"{key}.pooling": {"mean": "mean", "last": "last", "cls": "cls"}.get(req.pooling, req.pooling),
        **req.sets,
    }
    plugin = make_plugin("task", key, rt, quiet=True)
    recipe = plugin.resolve(recipes.load(defaults.get(family) or next(iter(defaults.values())), overrides), backbone)
    data = plugin.load(recipe, backbone, req.data)
    head = plugin.head(recipe, backbone, data)
    splits = {
        "train": plugin.sample(data.train, req.limit, req.seed),
        **{s: plugin.sample(d, req.eval_limit, req.seed) for s, d in data.evals.items()},
    }
    out = {}
    model = backbone.model.eval()
    for split, rows in splits.items():
        source_ = head.source(rows, train=False)
        layers, labels = None, []
        with phase(f"{Path(source).name}: features of every layer ({split})"), torch.no_grad():
            for batch in sequential_batches(source_, recipe.train.batch_size, 0):
                batch = {k: v.to(rt.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
                per_layer = [f.float().cpu().numpy() for f in model.layer_features(batch, req.pooling)]
                layers = [[f] for f in per_layer] if layers is None else [a + [f] for a, f in zip(layers, per_layer)]
                labels.append(batch["labels"].cpu().numpy())
        out[split] = (np.stack([np.concatenate(a) for a in layers]), np.concatenate(labels))
    return out


def probe_accuracy(
    train: tuple[np.ndarray, np.ndarray], held_out: tuple[np.ndarray, np.ndarray], depth: int, method: str
) -> float:
    """A linear classifier on layer `depth`'s training features, scored on the held-out ones."""
    (xt, yt), (xe, ye) = (train[0][depth], train[1]), (held_out[0][depth], held_out[1])
    mean, std = xt.mean(0), xt.std(0) + 1e-6
    xt, xe = (xt - mean) / std, (xe - mean) / std
    classes = int(max(yt.max(), ye.max())) + 1
    predict = fit_ridge(xt, yt, classes) if method == "ridge" else fit_logistic(xt, yt, classes)
    return float((predict(xe) == ye).mean())


def fit_ridge(x: np.ndarray, y: np.ndarray, classes: int):
    """Ridge regression onto one-hot labels (closed form), its penalty picked on a held-out fifth."""

    def solve(a, b, lam):
        a1 = np.hstack([a, np.ones((len(a), 1))])  # (N, D + 1) with a bias column
        reg = lam * np.eye(a1.shape[1])
        reg[-1, -1] = 0.0
        return np.linalg.solve(a1.T @ a1 + reg, a1.T @ np.eye(classes)[b])  # (D + 1, C)

    def scorer(w):
        return lambda a: (np.hstack([a, np.ones((len(a), 1))]) @ w).argmax(1)

    cut = max(1, len(x) // 5)
    lambdas = [len(x) * f for f in (1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0)]
    best = max(lambdas, key=lambda lam: (scorer(solve(x[cut:], y[cut:], lam))(x[:cut]) == y[:cut]).mean())
    return scorer(solve(x, y, best))


def fit_logistic(x: np.ndarray, y: np.ndarray, classes: int, l2: float = 1e-3):
    """Multinomial logistic regression by L-BFGS (100 iterations), L2-penalised."""
    xt, yt = torch.from_numpy(x).float(), torch.from_numpy(y).long()
    w = torch.zeros(x.shape[1], classes, requires_grad=True)
    b = torch.zeros(classes, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=100, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(xt @ w + b, yt) + l2 * (w**2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    weights, bias = w.detach(), b.detach()
    return lambda a: (torch.from_numpy(a).float() @ weights + bias).argmax(1).numpy()


def table(source: str, results: dict[str, dict[int, float]], majority: dict[str, float]):
    from rich.table import Table

    splits = list(results)
    out = Table("layer", *splits, title=f"linear probe by layer: {source}")
    depths = next(iter(results.values()))
    for d in depths:
        best = [max(results[s].values()) == results[s][d] for s in splits]
        out.add_row(
            "embeddings" if d == 0 else str(d),
            *(f"{'[bold]' if b else ''}{100 * results[s][d]:.2f}%" for s, b in zip(splits, best)),
        )
    out.add_row("majority class", *(f"{100 * majority[s]:.2f}%" for s in splits))
    return out


def draw(results: dict, majority: dict[str, float], path: Path, req: ProbeRequest) -> Path:
    """Accuracy on the first evaluation split against depth, one line per model (relative depth when
    their depths differ), the majority class dashed."""
    from ..engine.plots import figure, save_figure

    plt = figure()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    first = next(iter(majority))
    deepest = {m: max(r[first]) for m, r in results.items()}
    relative = len(set(deepest.values())) > 1
    for model, r in results.items():
        depths = sorted(r[first])
        xs = [d / deepest[model] if relative else d for d in depths]
        ax.plot(xs, [100 * r[first][d] for d in depths], marker="o", label=Path(model).name)
    ax.axhline(100 * majority[first], linestyle="--", color="0.5", linewidth=1, label="majority class")
    ax.set_xlabel("relative depth (0: embeddings, 1: last block)" if relative else "layer (0: embeddings)")
    ax.set_ylabel(f"{first} accuracy (%)")
    ax.set_title(f"{req.task}: a {req.method} probe on {req.pooling}-pooled features of each layer")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, plt, path)
