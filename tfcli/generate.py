"""Autoregressive generation for decoders (GPT) and encoder-decoders (T5): greedy, temperature,
top-k, top-p, a seed, a key/value cache, tokens streamed as text as they are made. One sampling
loop serves both; only how the next logits are computed differs.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from torch import Tensor, nn

from .adapters import held_for_generation
from .data.image_prompts import image_prompts
from .errors import UserError
from .models import kinds
from .models.blocks import product_by_slices


def sample_next(
    logits: Tensor, *, temperature: float, top_k: int, top_p: float, generator: torch.Generator | None
) -> Tensor:
    """(B, V) logits of the last position -> (B,) next ids. temperature 0 means greedy."""
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if 0 < top_p < 1:
        sorted_logits, order = logits.sort(-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) > top_p  # keep the smallest set reaching top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return draw(logits.softmax(-1), generator)


def draw(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """(B, V) probabilities -> (B,) ids, each drawn with its probability: one uniform number a row
    against the running sum. torch.multinomial draws an exponential number for every entry of the
    vocabulary, on one thread: 12 ms a step for 8 rows of a 49k vocabulary on the CPU, against 0.4 ms
    here. A zero-probability id (top-k, top-p) is never drawn."""
    cumulative = probs.cumsum(-1)
    u = torch.rand(probs.size(0), 1, generator=generator, device=probs.device, dtype=cumulative.dtype)
    picked = torch.searchsorted(cumulative, u * cumulative[:, -1:], right=True)
    return picked.clamp(max=probs.size(-1) - 1).squeeze(-1)


def decode_logits(model: nn.Module, device: torch.device) -> Callable[[Tensor], Tensor]:
    """model.logits for decoding: (B, D) -> (B, V). On the CPU through the head's (D, V) layout,
    copied once per generation, in column blocks, one per torch thread (see ColumnSplitHead).
    GPUs read either layout at full speed and use every core on their own: model.logits there."""
    if device.type != "cpu":
        return model.logits
    weight, parts = model.lm_head_weight, torch.get_num_threads()
    if weight.requires_grad:  # a trained head: an optimizer may update it without a version bump (fused)
        return ColumnSplitHead(weight, parts)
    key = (weight.data_ptr(), weight._version, parts)  # (`p.data = ...` keeps the tensor, not its storage)
    held = _laid_out.get("head")
    if held is None or held[0]() is not weight or held[1] != key:
        held = _laid_out["head"] = (weakref.ref(weight), key, ColumnSplitHead(weight, parts))
    return held[2]


# the last frozen head laid out, kept while its weight is unchanged (same tensor, same in-place
# version): a frozen head (LoRA, a teacher) is copied once, not per generation
_laid_out: dict[str, tuple] = {}


class ColumnSplitHead:
    """hidden @ weight.T for one position at a time, the way the CPU is fastest at it.

    A batch-1 decoding step is a matrix-vector product over the whole vocabulary, bound by reading
    the weight. MKL reads the (V, D) weight row by row at half the speed of the (D, V) layout, and
    on one thread only. Cut into column blocks, the (D, V) head becomes a batched product that torch
    spreads over its threads (blocks.product_by_slices); the figures are in docs/results/measured.md.
    (A Python thread per block was faster alone, but its product ran beside torch's own spinning
    OpenMP workers and the whole step got slower.) The block linears slice their (out, in) weights as
    views instead (blocks.linear): a copy of every weight would double the model's memory."""

    def __init__(self, weight: Tensor, parts: int):
        v, d = weight.shape
        self.vocab, width = v, -(-v // max(1, parts))
        blocks = weight.detach().new_zeros(max(1, parts), d, width)  # (P, D, V/P), the last one zero-padded
        head_t = weight.detach().t()  # (D, V)
        for i, start in enumerate(range(0, v, width)):
            blocks[i, :, : min(width, v - start)] = head_t[:, start : start + width]
        self.blocks = blocks

    def __call__(self, hidden: Tensor) -> Tensor:
        return product_by_slices(hidden, self.blocks)[:, : self.vocab]  # (B, V)


@torch.no_grad()
def sampling_loop(
    next_logits: Callable[[Tensor | None], Tensor],
    *,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    top_p: float,
    eos_id: int | None,
    seed: int | None,
    device: torch.device,
    stop_ids: Iterable[int] = (),
) -> Iterator[int]:
    """Sample up to max_new_tokens ids, stopping at EOS (or any of stop_ids: a chat model's end of
    turn), for any autoregressive model.

    next_logits(previous) gets the id just sampled, (B, 1), or None before the first step, and
    returns the (B, V) logits of the next position: the model-specific part (cache, windows)."""
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    previous, stops = None, set(stop_ids) | ({eos_id} if eos_id is not None else set())
    for _ in range(max_new_tokens):
        nxt = sample_next(next_logits(previous), temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
        token = int(nxt[0])
        if token in stops:
            return
        yield token
        previous = nxt[:, None]


@torch.no_grad()
def generate_tokens(
    model: nn.Module,
    prompt: Tensor,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_id: int | None = None,
    use_cache: bool = True,
    seed: int | None = None,
    stop_ids: Iterable[int] = (),
    inputs: dict | None = None,
) -> Iterator[int]:
    """Yield new token ids for a decoder (`model(ids, caches) -> hidden`, `model.logits(hidden)`).

    prompt (1, T). The model sees at most its context of the latest tokens; once a sequence
    outgrows it, learned positions shift and each step recomputes the window (cache or not).
    `inputs`: what every pass over the whole prompt reads besides its tokens (a vision-language
    model's pixel_values); such a prompt never slides out of the window: generation stops at the context.
    """
    ctx = model.cfg.max_seq_len
    extra = {k: v.to(prompt.device) for k, v in (inputs or {}).items()}
    if extra:
        max_new_tokens = max(0, min(max_new_tokens, ctx - prompt.size(1)))
    ids = prompt[:, -ctx:]
    caches = model.new_caches(ctx) if use_cache else None
    logits = decode_logits(model, prompt.device)

    def next_logits(previous: Tensor | None) -> Tensor:
        nonlocal ids, caches
        pending = ids if previous is None else previous  # tokens the cache has not seen
        if previous is not None:
            ids = torch.cat([ids, previous], dim=1)
        if caches is not None and stale(model, caches[0].length, ids.size(1)):
            caches = model.new_caches(ctx)
            pending = ids
        if caches is not None and caches[0].length + pending.size(1) <= ctx:
            hidden = model(pending, caches, **(extra if caches[0].length == 0 else {}))
        else:
            caches = None  # the window slides: positions change, the cache no longer applies
            hidden = model(ids[:, -ctx:], **extra)
        return logits(hidden[:, -1])

    return sampling_loop(
        next_logits,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        eos_id=eos_id,
        seed=seed,
        device=prompt.device,
        stop_ids=stop_ids,
    )


def stale(model: nn.Module, cached: int, total: int) -> bool:
    """Whether a decoder's cache of `cached` positions no longer holds what a pass over all `total`
    would compute, so the sequence is read again whole (a model whose rotary frequencies switch with
    the sequence's length says so: LongRoPE, as transformers' Phi-3 recomputes its cache)."""
    ask = getattr(model, "cache_stale", None)
    return bool(ask and ask(cached, total))


@torch.no_grad()
def generate_seq2seq(
    model: nn.Module,
    input_ids: Tensor,
    *,
    start_id: int,
    max_new_tokens: int,
    attention_mask: Tensor | None = None,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_id: int | None = None,
    use_cache: bool = True,
    seed: int | None = None,
) -> Iterator[int]:
    """Yield new target ids for input_ids (1, S). The decoder starts from `start_id` (T5: pad) and
    may produce at most model.cfg.max_seq_len tokens; without the cache every step re-decodes all."""
    encoded = model.encode(input_ids, attention_mask)  # (1, S, D), computed once
    steps = min(max_new_tokens, model.cfg.max_seq_len)
    caches = model.new_caches(steps) if use_cache else None
    dec = torch.full((input_ids.size(0), 1), start_id, dtype=torch.long, device=input_ids.device)
    logits = decode_logits(model, input_ids.device)

    def next_logits(previous: Tensor | None) -> Tensor:
        nonlocal dec
        if previous is not None:
            dec = torch.cat([dec, previous], dim=1)
        if caches is not None:  # only the newest token goes in; the cache holds the rest
            hidden = model.decode(dec[:, -1:] if previous is not None else dec, encoded, attention_mask, caches)
        else:
            hidden = model.decode(dec, encoded, attention_mask)  # (1, t, D): re-decode everything
        return logits(hidden[:, -1])

    return sampling_loop(
        next_logits,
        max_new_tokens=steps,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        eos_id=eos_id,
        seed=seed,
        device=input_ids.device,
    )


@torch.no_grad()
def generate_batch(
    model: nn.Module,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    stop_ids: Iterable[int] = (),
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    start_id: int = 0,
    pad_id: int = 0,
    keep_stop: bool = False,
    finished: Callable[[bool], bool] = bool,
    inputs: dict | None = None,
) -> list[list[int]]:
    """The new ids of every prompt, generated together (B rows, one cache of (B, nh, L, hs) per layer),
    each row ending at its first stop token (included with keep_stop: an on-policy loss trains it) or
    after max_new_tokens. `finished(all rows stopped)` decides when to stop early: processes that must
    run the same forward passes (FSDP) agree through it. A decoder reads
    the prompts left-padded (pads masked, positions counted per row); an encoder-decoder (a model with
    `encode`) reads them right-padded and starts every row's decoder from `start_id`. Greedy output is
    the batch-1 output, row by row. `inputs`: what the prompts' pass reads besides their tokens (a
    vision-language model's pixel_values, the frames of the rows' image tokens in order)."""
    with held_for_generation(model):
        first, step, steps, device = _prefill(model, prompts, max_new_tokens, start_id, pad_id, inputs)
        sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p)
        rows, _ = _rows_until_stop(
            first, step, decode_logits(model, device), steps, set(stop_ids), sampling, seed, device, keep_stop, finished
        )
    return rows


@torch.no_grad()
def generate_turns(
    model: nn.Module,
    prompts: list[list[int]],
    turns: Callable[[int, list[int], int], list[int] | None],
    *,
    max_new_tokens: int,
    stop_ids: Iterable[int],
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    pad_id: int = 0,
    finished: Callable[[bool], bool] = bool,
) -> tuple[list[list[int]], list[list[bool]]]:
    """A decoder's conversations continued past its turns: when row r samples a stop token,
    `turns(r, its ids so far, room)` gives the ids to read before it writes again (a tool's result and
    the next turn's header, at most `room` of them) or None to end it. Those ids are fed one per step
    into the same KV cache (nothing is read twice) while the other rows go on sampling; they count
    toward max_new_tokens. -> (each row's ids after its prompt, whether each id was sampled)."""
    with held_for_generation(model):
        first, step, steps, device = _prefill(model, prompts, max_new_tokens, 0, pad_id, None)
        sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p)
        logits = decode_logits(model, device)
        return _rows_until_stop(
            first, step, logits, steps, set(stop_ids), sampling, seed, device, True, finished, turns
        )


def _prefill(model: nn.Module, prompts: list[list[int]], max_new_tokens: int, start_id: int, pad_id: int, inputs):
    """The prompts' pass: (its last hidden states, the step that feeds (B, 1) new ids, the steps the
    context leaves, the device)."""
    device = next(model.parameters()).device
    inputs = {k: v.to(device) for k, v in (inputs or {}).items()}
    lengths = [len(p) for p in prompts]
    if not prompts or min(lengths) == 0:
        raise UserError("every prompt needs at least one token")
    width = max(lengths)
    if kinds.is_seq2seq(model):  # the input right-padded, the decoder from start_id
        ids, mask = _right_padded(prompts, pad_id, device)
        encoded = model.encode(ids, mask)  # (B, S, D)
        steps = min(max_new_tokens, model.cfg.max_seq_len)
        caches = model.new_caches(steps)
        first = model.decode(torch.full((len(prompts), 1), start_id, device=device), encoded, mask, caches)

        def step(tokens: Tensor) -> Tensor:
            return model.decode(tokens, encoded, mask, caches)
    else:
        # a prompt asked several times (GRPO's G completions) is read once, its cache then copied to its rows
        # (not with images: each row's pixels go with it)
        distinct = dict.fromkeys(map(tuple, prompts))
        read = [list(p) for p in distinct] if len(distinct) < len(prompts) and not inputs else prompts
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in read], device=device)  # (B, L) left pads
        ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in read], device=device)
        steps = min(max_new_tokens, model.cfg.max_seq_len - width)
        caches = model.new_caches(width + steps)
        first = model(ids, caches, key_mask=mask, **inputs)
        if read is not prompts:
            where = {p: i for i, p in enumerate(distinct)}
            rows = torch.tensor([where[tuple(p)] for p in prompts], device=device)
            for cache in caches:
                cache.select(rows)
            first, mask, ids = first.index_select(0, rows), mask.index_select(0, rows), ids.index_select(0, rows)

        def step(tokens: Tensor) -> Tensor:
            nonlocal mask, ids, caches
            mask = torch.cat([mask, mask.new_ones(mask.size(0), 1)], dim=1)
            ids = torch.cat([ids, tokens], dim=1)  # (B, L + 1)
            if stale(model, caches[0].length, ids.size(1)):  # all of it again, into a fresh cache
                caches = model.new_caches(width + steps)
                return model(ids, caches, key_mask=mask, **inputs)[:, -1:]
            return model(tokens, caches, key_mask=mask)

    return first, step, steps, device


def _right_padded(prompts: list[list[int]], pad_id: int, device) -> tuple[Tensor, Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([list(p) + [pad_id] * (width - len(p)) for p in prompts], device=device)  # (B, S)
    mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in prompts], device=device)
    return ids, mask


def _rows_until_stop(
    hidden: Tensor,
    step: Callable[[Tensor], Tensor],
    logits: Callable[[Tensor], Tensor],
    steps: int,
    stop: set[int],
    sampling: dict,
    seed: int | None,
    device,
    keep_stop: bool = False,
    finished: Callable[[bool], bool] = bool,
    turns: Callable[[int, list[int], int], list[int] | None] | None = None,
) -> tuple[list[list[int]], list[list[bool]]]:
    """Sample every row until each has met a stop token (a finished row's later tokens are dropped);
    `turns` (generate_turns) may give a stopped row ids to read and go on. -> (rows, which ids were
    sampled). Every step draws a token for every row, so a row's draws do not depend on the others'."""
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    rows: list[list[int]] = [[] for _ in range(hidden.size(0))]
    sampled: list[list[bool]] = [[] for _ in rows]
    pending: list[deque[int]] = [deque() for _ in rows]
    done = [False] * len(rows)
    for i in range(steps):
        chosen = sample_next(logits(hidden[:, -1]), generator=generator, **sampling).tolist()  # (B,)
        for r, token in enumerate(chosen):
            if done[r]:
                continue
            if pending[r]:  # a token the row reads (a tool's result), not one it writes
                chosen[r] = pending[r].popleft()
                rows[r].append(chosen[r])
                sampled[r].append(False)
                continue
            stopped = token in stop
            if keep_stop or not stopped:
                rows[r].append(token)
                sampled[r].append(True)
            if stopped:
                more = turns(r, rows[r], steps - len(rows[r])) if turns is not None else None
                pending[r].extend(more or ())
                done[r] = not more
        if finished(all(done)) or i == steps - 1:
            break
        hidden = step(torch.tensor(chosen, device=device)[:, None])
    return rows, sampled


class TextStreamer:
    """Turns a growing list of ids into newly printable text (never splits a multi-byte character)."""

    def __init__(self, decode):
        self.decode, self.ids, self.printed = decode, [], 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""  # wait for the rest of the character
        new, self.printed = text[self.printed :], len(text)
        return new


def stream(
    backbone,
    prompt: str,
    *,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    top_p: float,
    use_cache: bool = True,
    seed: int | None = None,
    images: list[Path] = (),
) -> Iterator[str]:
    """The text a run generates after `prompt`, piece by piece: a decoder continues the prompt (which
    comes first); an encoder-decoder encodes it once and answers (sentinels shown). `images`: a
    vision-language model reads them where the prompt's markers are (first where it has none)."""
    tok, model = backbone.tokenizer, backbone.model
    prompts = image_prompts(backbone, list(images))
    device = next(model.parameters()).device
    sampling = dict(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        eos_id=tok.eos_id,
        use_cache=use_cache,
        seed=seed,
    )
    if prompts is not None:
        text, refs = prompts.prompt(prompt, list(images))
        yield prompt
        yield from continuation(model, tok, tok.encode(text), inputs=prompts.inputs(refs), **sampling)
        return
    if not kinds.is_seq2seq(model):
        ids = tok.encode(prompt) if prompt else []
        if not ids:
            if tok.eos_id is None:
                raise UserError("give a non-empty --prompt (this tokenizer has no end-of-text token to start from)")
            ids = [tok.eos_id]
        yield prompt
        yield from continuation(model, tok, ids, **sampling)
        return
    if not prompt:
        raise UserError(
            "give a --prompt: an encoder-decoder model answers an input, e.g. "
            '"Thank you <extra_id_0> me to your party <extra_id_1> week."'
        )
    ids = torch.tensor([tok.encode(prompt) + [tok.eos_id]], device=device)  # T5 inputs end with </s>
    streamer = TextStreamer(lambda t: tok.decode(t, skip_special_tokens=False))
    for token in generate_seq2seq(model, ids, start_id=type(model).pad_id(tok), **sampling):
        yield streamer.push(token)


def continuation(model: nn.Module, tok, ids: list[int], **sampling) -> Iterator[str]:
    """A decoder's text after `ids`, piece by piece as its tokens are sampled (generate_tokens'
    keyword arguments: max_new_tokens, temperature, ..., eos_id, stop_ids)."""
    streamer = TextStreamer(tok.decode)
    for token in generate_tokens(model, torch.tensor([ids], device=next(model.parameters()).device), **sampling):
        yield streamer.push(token)


def reply(
    backbone,
    template,
    messages: list[dict],
    *,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    top_p: float,
    seed: int | None = None,
    use_cache: bool = True,
    images: list[Path] = (),
    tools: list | None = None,
) -> Iterator[str]:
    """A chat model's next turn, piece by piece (`tools`: the schemas the template lists): the conversation rendered by `template` (a
    data.chat.ChatTemplate) with the assistant's header, then tokens until an end-of-turn or
    end-of-text token. Oldest exchanges are left out (the system message kept) while the
    conversation and the reply would not fit the context. `images`: read where the messages' markers
    are, or as image parts of the first user message where none has any (placed by the template, as
    in training); those exchanges are never left out."""
    from .data.chat import stop_ids

    tok, model = backbone.tokenizer, backbone.model
    if model.kind != kinds.DECODER:
        raise UserError(f"chat needs a decoder; this is a {backbone.family} ({model.kind})")
    messages, inputs, marks = list(messages), {}, None
    prompts = image_prompts(backbone, list(images))
    if prompts is not None:
        messages, refs, marks = prompts.messages(messages, list(images))
        inputs = prompts.inputs(refs)
    ids = template.render(tok, messages, add_generation_prompt=True, images=marks, tools=tools).ids
    while (
        not inputs
        and len(ids) + max_new_tokens > model.cfg.max_seq_len
        and sum(m["role"] != "system" for m in messages) > 1
    ):
        first = next(i for i, m in enumerate(messages) if m["role"] != "system")
        upto = next((i for i in range(first + 1, len(messages)) if messages[i]["role"] == "user"), len(messages))
        del messages[first:upto]  # a user turn and the replies to it (tool calls and results among them)
        ids = template.render(tok, messages, add_generation_prompt=True, tools=tools).ids
    yield from continuation(
        model,
        tok,
        ids,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        eos_id=tok.eos_id,
        use_cache=use_cache,
        seed=seed,
        stop_ids=stop_ids(tok),
        inputs=inputs,
    )
