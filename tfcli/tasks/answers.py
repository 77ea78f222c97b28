"""Scoring generated replies against references: exact match, containment, or the final number (GSM8K:
the number after '####' in the reference; in a generation the number after '####' if it wrote one,
else the last number it wrote, as lm-evaluation-harness's flexible extraction does)."""

from __future__ import annotations

import re

import torch

METRICS = ("exact", "contains", "final-number")
_NUMBER = re.compile(r"-?[$]?\d[\d,]*(?:\.\d+)?")


def normalise(text: str) -> str:
    """Case and runs of whitespace do not count."""
    return " ".join(text.lower().split())


def final_number(text: str, strict: bool = False) -> str | None:
    """The number after '####' (strict), or failing that the last number in the text, as a canonical
    string ('1,000.50' -> '1000.5'); None where there is none."""
    marked = text.split("####")[-1] if "####" in text else None
    if marked is None and strict:
        return None
    found = _NUMBER.findall(marked if marked is not None else text)
    if not found:
        return None
    value = (found[0] if marked is not None else found[-1]).replace(",", "").replace("$", "")
    try:
        number = float(value)
    except ValueError:
        return None
    return str(int(number)) if number.is_integer() else repr(number)


def correct(prediction: str, reference: str, metric: str) -> bool:
    if metric == "final-number":
        expected = final_number(reference)
        return expected is not None and final_number(prediction) == expected
    if metric == "contains":
        return normalise(reference) in normalise(prediction)
    return normalise(prediction) == normalise(reference)


SCORE_NAMES = {"exact": "exact_match", "final-number": "exact_match", "contains": "contains_match"}


def scores(predictions: list[str], references: list[str], metric: str) -> dict[str, float]:
    """The share of replies right, named for how they are matched (SCORE_NAMES: exact_match, as
    lm-evaluation-harness names it, for the whole reply or GSM8K's final number; contains_match), and
    for final-number the strict share (only replies that wrote '#### N' count)."""
    n = max(1, len(predictions))
    out = {SCORE_NAMES[metric]: sum(correct(p, r, metric) for p, r in zip(predictions, references)) / n}
    if metric == "final-number":
        out["strict_exact_match"] = (
            sum(
                final_number(p, strict=True) is not None and final_number(p, strict=True) == final_number(r)
                for p, r in zip(predictions, references)
            )
            / n
        )
    return out


def generate(
    model,
    tokenizer,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float,
    batch_size: int,
    stops: set[int],
    pad_id: int,
    what: str = "replies",
    seed: int = 0,
    images: list[tuple] | None = None,
) -> list[str]:
    """The reply generated for every prompt (greedy at temperature 0), in the prompts' order. Prompts
    of similar length go together (less padding), `batch_size` at a time, each row ending at its
    first stop token (end of text, end of turn). `images`: each prompt's (data.image_prompts.ImageRef),
    for a vision-language model."""
    from ..display import phase
    from ..generate import generate_batch

    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[str] = [""] * len(prompts)
    groups = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    with phase(f"generating {what}", len(prompts), "rows") as advance:
        for group in groups:
            frames = [ref.pixels() for i in group for ref in (images[i] if images else ())]
            rows = generate_batch(
                model,
                [prompts[i] for i in group],
                max_new_tokens=max_new_tokens,
                stop_ids=stops,
                temperature=temperature,
                top_k=0,
                top_p=1.0,
                seed=seed,
                start_id=pad_id,
                pad_id=pad_id,
                inputs={"pixel_values": torch.cat(frames)} if frames else None,
            )
            for i, ids in zip(group, rows):
                out[i] = tokenizer.decode(ids).strip()
            advance(len(group))
    return out
