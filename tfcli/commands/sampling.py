"""generate and chat: a decoder (or encoder-decoder) run, Hugging Face directory or GGUF, sampled with one set of flags."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from ..errors import UserError
from .common import DEVICE, PRECISION, QUIET, check_device, newest, user_errors

SAMPLING_HELP = dict(
    max_new_tokens="Most tokens to generate.",
    temperature="Sampling temperature; 0 is greedy.",
    top_k="Sample among the k most likely tokens (0: all).",
    top_p="Nucleus sampling: smallest set with this much probability (1: off).",
)
GENERATOR_HELP = (
    "A run or checkpoint, a Hugging Face directory, a GGUF file or a hub id in the local cache "
    "[default: the newest run under runs/ that can generate]."
)
TEMPLATE_HELP = (
    "A chat template tfcli ships (chatml, llama-3-instruct, ...) or a .jinja file [default: the model's own]."
)
GENERATOR = typer.Option(None, help=GENERATOR_HELP)
CHAT_TEMPLATE = typer.Option(None, help=TEMPLATE_HELP)
TOP_K = typer.Option(50, help=SAMPLING_HELP["top_k"])
GREEDY = typer.Option(False, "--greedy", help="Always take the most likely token (same as --temperature 0).")
SAMPLING_SEED = typer.Option(None, help="Random seed for reproducible samples [default: unseeded].")


def generator(command: str, checkpoint: Path | None, device: str | None, kinds_wanted=None):
    """(the backbone a generating command runs, its device): a decoder or encoder-decoder, refused in
    one line otherwise."""
    from ..engine.backbone import for_inference
    from ..engine.runtime import pick_device
    from ..models import families_of, kinds

    wanted = kinds_wanted or kinds.GENERATIVE
    check_device(device)
    dev = pick_device(device or "auto")
    backbone = for_inference(newest(checkpoint, families=families_of(wanted)), device=str(dev))
    if backbone.model.kind not in wanted:
        described = " or ".join(f"{k} ({', '.join(families_of((k,)))})" for k in wanted)
        raise UserError(
            f"{backbone.checkpoint} holds a {backbone.family!r} model; {command} needs a {described} checkpoint"
        )
    return backbone, dev


def check_sampling(max_new_tokens: int, temperature: float, top_k: int, top_p: float) -> None:
    if max_new_tokens < 0 or temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
        raise UserError("--max-new-tokens, --temperature and --top-k must be >= 0 and --top-p in (0, 1]")


@user_errors
def generate(
    prompt: str = typer.Option("", help="Text to continue (with --chat: the user's message)."),
    checkpoint: Path | None = GENERATOR,
    chat: bool = typer.Option(False, "--chat", help="Answer --prompt as one chat turn, in the model's chat template."),
    system: str | None = typer.Option(None, help="--chat: a system message first."),
    chat_template: str | None = CHAT_TEMPLATE,
    max_new_tokens: int = typer.Option(200, help=SAMPLING_HELP["max_new_tokens"]),
    temperature: float = typer.Option(0.8, help=SAMPLING_HELP["temperature"]),
    top_k: int = TOP_K,
    top_p: float = typer.Option(1.0, help=SAMPLING_HELP["top_p"]),
    greedy: bool = GREEDY,
    no_cache: bool = typer.Option(
        False, "--no-cache", help="Recompute every position each step (for checking the cache)."
    ),
    seed: int | None = SAMPLING_SEED,
    image: list[Path] = typer.Option(
        None,
        "--image",
        help="A vision-language model: an image it reads; repeat for several. With --chat, an image part of the "
        "message, placed by the model's chat template as in training; without, where --prompt says <image>, "
        "else first, on a line of its own.",
    ),
    images: int = typer.Option(
        0, help="An igpt run: complete the bottom half of N held-out images and draw N samples, as a PNG grid."
    ),
    out: Path | None = typer.Option(None, help="--images: the PNG to write [default: RUN/samples.png]."),
    device: str | None = DEVICE,
    precision: str | None = PRECISION,
    quiet: bool = QUIET,
):
    """Generate text from a decoder (or encoder-decoder) checkpoint, streaming tokens as they are made;
    or, from an ImageGPT run (--images N), images."""
    from ..data.chat import for_model
    from ..engine.runtime import autocast_context
    from ..generate import reply, stream
    from ..models import kinds

    check_sampling(max_new_tokens, temperature, top_k, top_p)
    backbone, dev = generator(
        "generate --chat" if chat else "generate", checkpoint, device, (kinds.DECODER,) if chat else None
    )
    reads_colours = backbone.recipe is not None and backbone.recipe.objective == "igpt"
    if images > 0 or reads_colours:
        if not reads_colours:
            raise UserError(
                f"--images needs an igpt run (tfcli pretrain --objective igpt); {backbone.checkpoint} "
                f"holds a text model"
            )
        from ..objectives.igpt import sample_grid

        path = sample_grid(
            backbone,
            images or 8,
            out or backbone.run_dir / "samples.png",
            0.0 if greedy else temperature,
            top_k,
            seed or 0,
        )
        typer.echo(f"wrote {path}")
        return
    sampling = dict(
        max_new_tokens=max_new_tokens,
        temperature=0.0 if greedy else temperature,
        top_k=top_k,
        top_p=top_p,
        use_cache=not no_cache,
        seed=seed,
    )
    if chat:
        if not prompt:
            raise UserError("--chat answers --prompt: give the user's message")
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        pieces = reply(backbone, for_model(backbone.tokenizer, chat_template), messages, images=image or [], **sampling)
    else:
        pieces = stream(backbone, prompt, images=image or [], **sampling)
    with autocast_context(precision or "fp32", dev):
        for text in pieces:
            sys.stdout.write(text)
            sys.stdout.flush()
    sys.stdout.write("\n")


CHAT_TOOL_TURNS = 5  # the most turns a reply takes with tools (one tool round each but the last)


def _chat_tools(spec: str | None, template):
    """chat --tools: (the toolbox, the template's call reader), or (None, None) without tools. The
    user's functions are those this command line names."""
    if not spec:
        return None, None
    from ..data.chat import tool_templates
    from ..tools import calls
    from ..tools.toolbox import Toolbox, parse_tools
    from .common import named_code

    if not template.writes_tool_calls:
        raise UserError(f"--tools: {template.where} has no tool format; give --chat-template one of {tool_templates()}")
    toolbox = Toolbox(parse_tools(spec, named_code({"tools": spec}, [])))
    return toolbox, calls.FORMATS[calls.format_of(template)]


def _called(toolbox, said, text: str) -> list[dict]:
    """The turn's calls run (each shown): its message and the tool messages that answer it."""
    if said.malformed:
        sys.stdout.write(f"[{said.malformed}]\n")
        return [
            {"role": "assistant", "content": text},
            {"role": "tool", "name": "invalid", "content": str({"error": said.malformed})},
        ]
    out = [said.message]
    for one in said.calls:
        function = one["function"]
        outcome = toolbox.call(function["name"], function["arguments"])
        shown = (
            ", ".join(f"{k}={v!r}" for k, v in function["arguments"].items())
            if isinstance(function["arguments"], dict)
            else ""
        )
        sys.stdout.write(f"[{function['name']}({shown}) -> {outcome.content}]\n")
        out.append({"role": "tool", "name": outcome.name, "content": outcome.content})
    return out


@user_errors
def chat_command(
    checkpoint: Path | None = GENERATOR,
    chat_template: str | None = CHAT_TEMPLATE,
    greedy: bool = GREEDY,
    max_new_tokens: int = typer.Option(256, help=SAMPLING_HELP["max_new_tokens"]),
    temperature: float = typer.Option(0.7, help=SAMPLING_HELP["temperature"]),
    top_k: int = TOP_K,
    top_p: float = typer.Option(0.9, help=SAMPLING_HELP["top_p"]),
    system: str | None = typer.Option(None, help="A system message, kept through /reset."),
    image: list[Path] = typer.Option(
        None, "--image", help="A vision-language model: an image the conversation is about; repeat for several."
    ),
    seed: int | None = SAMPLING_SEED,
    device: str | None = DEVICE,
    precision: str | None = PRECISION,
    tools: str | None = typer.Option(
        None, help="Tools the model may call: calculator, lookup:TABLE.jsonl, file.py:function (yours, named here)."
    ),
):
    """Chat with a decoder (a run, a Hugging Face directory or a GGUF) in its chat template: replies stream;
    Ctrl-C stops a reply, /reset starts over, /exit, Ctrl-D or Ctrl-C at the prompt ends. With --tools,
    a call the model writes runs and its result is shown and given back to it."""
    from ..data.chat import for_model
    from ..data.image_prompts import image_prompts
    from ..engine.runtime import autocast_context
    from ..generate import reply
    from ..models import kinds

    check_sampling(max_new_tokens, temperature, top_k, top_p)
    backbone, dev = generator("chat", checkpoint, device, (kinds.DECODER,))
    template = for_model(backbone.tokenizer, chat_template)
    toolbox, read_calls = _chat_tools(tools, template)
    if image:  # read and checked before the first question, not after it
        image_prompts(backbone, image).refs(image, "--image")
    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    sampling = dict(
        max_new_tokens=max_new_tokens, temperature=0.0 if greedy else temperature, top_k=top_k, top_p=top_p, seed=seed
    )
    interactive = sys.stdin.isatty()
    if interactive:
        about = f" about {', '.join(str(p) for p in image)}" if image else ""
        sys.stdout.write(
            f"chatting with {backbone.checkpoint}{about} (Ctrl-C stops a reply, /reset starts over, /exit or "
            "Ctrl-D ends)\n"
        )
    while True:
        if interactive:
            sys.stdout.write("> ")
            sys.stdout.flush()
        try:
            line = sys.stdin.readline()
        except KeyboardInterrupt:  # Ctrl-C at the prompt (a second one, after a stopped reply): the end
            sys.stdout.write("\n")
            return
        if not line or line.strip() == "/exit":
            return
        if line.strip() == "/reset":
            messages = list(start)
            kept = " (the system message kept)" if start else ""
            sys.stdout.write(f"[conversation reset{kept}]\n")
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        schemas = toolbox.schemas if toolbox else None
        for _ in range(CHAT_TOOL_TURNS if toolbox else 1):  # with tools: until a turn calls none
            answer, stopped = [], False
            try:
                with autocast_context(precision or "fp32", dev):
                    for text in reply(backbone, template, messages, images=image or [], tools=schemas, **sampling):
                        answer.append(text)
                        sys.stdout.write(text)
                        sys.stdout.flush()
            except KeyboardInterrupt:  # Ctrl-C stops this reply (what it wrote is kept) and returns to the prompt
                sys.stdout.write(" [stopped]")
                stopped = True
            sys.stdout.write("\n")
            said = read_calls("".join(answer)) if toolbox and not stopped else None
            if said is None or not (said.calls or said.malformed):
                messages.append({"role": "assistant", "content": "".join(answer)})
                break
            messages += _called(toolbox, said, "".join(answer))
