"""Images in a vision-language model's prompts: rows that name images, the marker where each goes, and
the image tokens the marker becomes (what transformers' LlavaProcessor and Idefics3Processor write).

Rows, as TRL's vision SFT reads them:
  {"images": ["cat.png"], "messages": [{"role": "user", "content": [{"type": "image"},
      {"type": "text", "text": "What is in this picture?"}]}, {"role": "assistant", "content": "a cat"}]}
  {"image": "cat.png", "prompt": "<image>What is in this picture?", "completion": "a cat"}
Paths are relative to the data file (or the data folder). Each image part, or `<image>` in a text, is one
image, in order; a row whose markers and images differ in number, or that names an image that cannot
be read, stops the run in one line naming the row, before anything is trained or created.

A marker becomes, per model (VLMConfig.tiled_prompt):
  llava     <image> x image_seq_len
  idefics3  <fake_token_around_image><global-img><image> x image_seq_len<fake_token_around_image>, after
            one <fake_token_around_image><row_r_col_c><image> x image_seq_len per tile when it is split
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import Tensor

from ..errors import UserError
from ..models import kinds
from ..models.vlm import ImageProcessing
from .chat import ImageMarks, joined
from .conversations import DecoderExamples, Examples
from .image_processor import frames, grid, open_image

FAKE, GLOBAL = "<fake_token_around_image>", "<global-img>"
_REPEATED = re.compile(r"(<[^<>\s]{1,40}>)\1{7,}")


def readable(text: str) -> str:
    """A decoded prompt with every run of one special token (an image's hundreds) written as `<image>x576`."""
    return _REPEATED.sub(lambda m: f"{m.group(1)}x{len(m.group(0)) // len(m.group(1))}", text)


@dataclass(frozen=True)
class ImageRef:
    """One image of an example: read and prepared when its batch is made (not held in memory)."""

    path: Path
    processing: ImageProcessing

    def pixels(self) -> Tensor:
        """(F, 3, S, S) frames."""
        return frames(self.processing, open_image(self.path, str(self.path)))[0]


class ImagePrompts:
    """A vision-language model's image markers and the tokens each becomes."""

    def __init__(self, cfg, tokenizer):
        self.cfg, self.marker = cfg, cfg.image_token
        needed = [self.marker] + ([FAKE, GLOBAL] if cfg.tiled_prompt else [])
        missing = [t for t in needed if tokenizer.token_id(t) is None]
        if missing:
            raise UserError(f"this model's tokenizer has no {missing[0]} token; it cannot hold an image")
        if tokenizer.token_id(self.marker) != cfg.image_token_id:
            raise UserError(
                f"this model's image token {self.marker} is id {tokenizer.token_id(self.marker)} in its tokenizer, "
                f"{cfg.image_token_id} in its config (model.image_token_id)"
            )
        self.tokenizer = tokenizer

    def image_text(self, rows: int, cols: int) -> str:
        """What one image's marker becomes."""
        n = self.cfg.image_seq_len
        if not self.cfg.tiled_prompt:
            return self.marker * n
        whole = f"{FAKE}{GLOBAL}{self.marker * n}{FAKE}"
        if not rows:
            return whole
        tiles = "".join(
            "".join(f"{FAKE}<row_{r + 1}_col_{c + 1}>{self.marker * n}" for c in range(cols)) + "\n"
            for r in range(rows)
        )
        return f"{tiles}\n{whole}"

    def expand(self, text: str, grids: list[tuple[int, int]]) -> str:
        """`text` with its markers, in order, replaced by each image's tokens."""
        pieces = text.split(self.marker)
        out = [pieces[0]]
        for (rows, cols), piece in zip(grids, pieces[1:]):
            out += [self.image_text(rows, cols), piece]
        return "".join(out)

    def refs(self, paths: list[Path], where: str) -> tuple[list[ImageRef], list[tuple[int, int]]]:
        """Each image checked (read whole once) -> (its reference, its tile grid)."""
        p = self.cfg.processing
        refs, grids = [], []
        for path in paths:
            image = open_image(path, where)
            refs.append(ImageRef(path, p))
            grids.append(grid(p, image.height, image.width))
        return refs, grids

    def prompt(self, text: str, paths: list[Path]) -> tuple[str, list[ImageRef]]:
        """A prompt typed on the command line with --image (no chat template): the markers where the
        text has them, else first, each on a line of its own."""
        if paths and self.marker not in text:
            text = self.marker * len(paths) + ("\n" + text if text else "")
        if text.count(self.marker) != len(paths):
            raise UserError(f"--prompt holds {text.count(self.marker)} {self.marker} markers for {len(paths)} --image")
        refs, grids = self.refs(paths, "--image")
        return self.expand(text, grids), refs

    def messages(self, messages: list[dict], paths: list[Path]) -> tuple[list[dict], list[ImageRef], ImageMarks]:
        """A chat's messages with --image: where no message has a marker, the first user message
        becomes image parts and its text (as TRL's rows write it), for the chat template to place as
        it places an image when training; the images' marks for ChatTemplate.render."""
        messages = [dict(m) for m in messages]
        if paths and not any(self.marker in joined(m["content"], self.marker) for m in messages):
            first = next(m for m in messages if m["role"] == "user")
            text = [{"type": "text", "text": first["content"]}] if first["content"] else []
            first["content"] = [{"type": "image"} for _ in paths] + text
        found = sum(joined(m["content"], self.marker).count(self.marker) for m in messages)
        if found != len(paths):
            raise UserError(f"the conversation holds {found} {self.marker} markers for {len(paths)} --image")
        refs, grids = self.refs(paths, "--image")
        return messages, refs, self.marks(grids)

    def marks(self, grids: list[tuple[int, int]]) -> ImageMarks:
        """These images' marker and expansion, for a chat template's rendering."""
        return ImageMarks(self.marker, len(grids), lambda text: self.expand(text, grids))

    def expand_messages(self, messages: list[dict], grids: list[tuple[int, int]]) -> None:
        """Every message's markers, in order through the conversation, expanded in place."""
        at = 0
        for m in messages:
            n = m["content"].count(self.marker)
            m["content"], at = self.expand(m["content"], grids[at : at + n]), at + n

    def inputs(self, refs: list[ImageRef]) -> dict:
        """The model inputs of these images: their frames, in order."""
        return {"pixel_values": torch.cat([r.pixels() for r in refs])} if refs else {}


def image_prompts(backbone, paths) -> ImagePrompts | None:
    """The image prompts of a model that reads images (None without --image); one line for --image
    given to a model that does not."""
    if not paths:
        return None
    if not kinds.reads_images(backbone.model):
        raise UserError(f"--image: {backbone.checkpoint} holds a {backbone.family!r} model, which reads no images")
    return ImagePrompts(backbone.cfg, backbone.tokenizer)


TABLES = (".jsonl", ".json", ".csv", ".tsv", ".parquet")  # split files: a directory of them is no image folder
LABEL_COLUMNS = ("text", "caption", "label", "answer", "completion")  # a metadata file's reply, the first present


def folder_rows(root: Path, question: str, marker: str) -> dict[str, list[dict]] | None:
    """A folder of images as SFT rows ({split: rows}; None when `root` is not one): class sub-folders
    (the reply is the folder's name), or images beside a labels file as Hugging Face's imagefolder
    has it (metadata.jsonl or metadata.csv: `file_name` and the reply in one of LABEL_COLUMNS);
    train/ and test/ (or val/) sub-folders, when present, are the splits. Each row asks `question`."""
    from .images import has_images, image_files

    root = Path(root)
    if not root.is_dir() or any(f.suffix.lower() in TABLES and f.stem != "metadata" for f in root.iterdir()):
        return None  # not a folder, or a folder of split files (train.jsonl, ...)
    parts = {p.name.lower(): p for p in root.iterdir() if p.is_dir()}
    if "train" in parts:
        held = parts.get("test") or parts.get("val")
        out = {"train": _folder(parts["train"], question, marker)}
        return {**out, "test": _folder(held, question, marker)} if held is not None else out
    if not (_labels_file(root) or image_files(root) or any(has_images(p) for p in parts.values())):
        if parts:  # class sub-folders with nothing in them: a folder of images, empty
            raise UserError(f"{root}: its sub-folders ({', '.join(sorted(parts)[:4])}) hold no images")
        return None
    return {"train": _folder(root, question, marker)}


def _labels_file(root: Path) -> Path | None:
    return next((root / n for n in ("metadata.jsonl", "metadata.csv") if (root / n).is_file()), None)


def _folder(root: Path, question: str, marker: str) -> list[dict]:
    from .images import has_images, image_files
    from .tables import read_table

    labels = _labels_file(root)
    prompt = f"{marker}{question}"
    if labels is None:
        classes = sorted(p for p in root.iterdir() if p.is_dir() and has_images(p))
        if not classes:
            raise UserError(f"{root}: images without a label (class sub-folders, or metadata.jsonl / metadata.csv)")
        return [{"image": str(f), "prompt": prompt, "completion": c.name} for c in classes for f in image_files(c)]
    rows, _ = read_table(labels)
    column = next((c for c in LABEL_COLUMNS if rows and c in rows[0]), None)
    if not rows or "file_name" not in rows[0] or column is None:
        raise UserError(f"{labels}: needs a file_name column and the reply in one of {', '.join(LABEL_COLUMNS)}")
    return [{"image": str(root / r["file_name"]), "prompt": prompt, "completion": str(r[column])} for r in rows]


class ImageExamples(DecoderExamples):
    """A vision-language model's examples: the decoder's, with each row's images checked and their
    markers expanded into image tokens; an example carries its images (ImageRef) to its batch."""

    def __init__(self, *args, prompts: ImagePrompts, root: Path, **kwargs):
        super().__init__(*args, **kwargs)
        self.prompts, self.root = prompts, Path(root)

    reads_parts = True  # TRL's rows: a message's content a list of text and image parts

    def build_all(self, rows: list, places: list[str] | None = None) -> Examples:
        self.places = iter(places or [f"row {n}" for n in range(1, len(rows) + 1)])  # for one-line errors
        return super().build_all(rows, places)

    def example(self, row: dict):
        self.where = next(self.places)
        self.named = self.paths(row, self.where)
        return super().example(row)

    def build(self, parsed):
        """The row's images checked against its markers (or image parts) and read, the images carried.
        With a chat template, the template places each image's marker as training and generation
        both render it (ChatTemplate.render), then the markers become image tokens; a plain text or
        a base model's prompt has its markers expanded where they are."""
        marker, paths = self.prompts.marker, self.named
        texts = [parsed] if isinstance(parsed, str) else [joined(m["content"], marker) for m in parsed]
        markers = sum(t.count(marker) for t in texts)
        if markers != len(paths):
            raise UserError(
                f"{self.where}: {len(paths)} image{'s' * (len(paths) != 1)} and {markers} {marker} marker"
                f'{"s" * (markers != 1)}; put {marker} (or a {{"type": "image"}} content part) where each image goes'
            )
        refs, grids = self.prompts.refs(paths, self.where)
        if isinstance(parsed, str):
            parsed = self.prompts.expand(parsed, grids)
        elif self.template is None:  # a base model's prompt and reply: the markers where the texts have them
            parsed = [{**m, "content": t} for m, t in zip(parsed, texts)]
            self.prompts.expand_messages(parsed, grids)
        else:
            self.images = self.prompts.marks(grids)
        try:
            example = super().build(parsed)
        finally:
            self.images = None
        return example if isinstance(example, str) else replace(example, images=tuple(refs))

    def paths(self, row: dict, where: str) -> list[Path]:
        """The row's image files (`images`: a list, or `image`: one), relative to the data; a relative path
        that leaves the data's folder (`../../etc/passwd`) is refused before anything is opened (an
        absolute path is taken as given on purpose)."""
        named = row.get("images", row.get("image", []))
        named = [named] if isinstance(named, str) else named
        if not isinstance(named, list) or not all(isinstance(p, str) and p for p in named):
            raise UserError(f"{where}: images must be a list of file paths (or image: one path)")
        out = []
        for path in map(Path, named):
            if not path.is_absolute() and ".." in Path(os.path.normpath(path)).parts:
                raise UserError(
                    f"{where}: image {str(path)!r} leaves the data's folder {self.root}; put it inside, "
                    "or give its absolute path"
                )
            out.append(path if path.is_absolute() else self.root / path)
        return out
