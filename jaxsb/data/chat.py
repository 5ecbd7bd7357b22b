"""Chat documents through a checkpoint's own chat template (a Jinja template, as Hugging Face
tokenizers ship it in tokenizer_config.json or chat_template.jinja).

`render_with_spans(template, messages, bos, eos)` renders the conversation and finds the
character spans of the assistant turns: turn i's span runs from the end of the conversation up
to turn i rendered with the generation prompt, to the end of the conversation up to and
including turn i — its content and the end-of-turn markup the template puts after it (e.g.
`<|im_end|>\\n`). That needs a template that renders conversations incrementally (each prefix
renders as a prefix of the whole), which chat templates are written to do; one that does not
is refused with the message index. `encode_chat` tokenizes the rendering — the tokenizer's
special tokens written in the text become their ids — and flags the tokens that start inside an
assistant span as trained.
"""

from __future__ import annotations

import functools
import re
from typing import Sequence

import numpy as np

from jaxsb.data.sources import DataError


@functools.lru_cache(maxsize=8)
def _compile(template: str):
    """The template compiled once (every chat document of a run renders with the same one)."""
    from jinja2 import StrictUndefined, TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=StrictUndefined)

    def raise_exception(message):
        raise DataError(f"chat template: {message}")

    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template)
    except TemplateError as e:
        raise DataError(f"chat template does not parse: {e}") from None


def render_with_spans(template: str, messages: Sequence[tuple[str, str]], bos_token: str = "",
                      eos_token: str = "") -> tuple[str, list[tuple[int, int]]]:
    """(rendered text, [(start, end) character span of each assistant turn])."""
    from jinja2 import TemplateError

    compiled = _compile(template)
    as_dicts = [{"role": r, "content": c} for r, c in messages]

    def render(upto: int, prompt: bool) -> str:
        try:
            return compiled.render(messages=as_dicts[:upto], add_generation_prompt=prompt, bos_token=bos_token,
                                   eos_token=eos_token)
        except TemplateError as e:
            raise DataError(f"chat template failed on messages[:{upto}]: {e}") from None

    full = render(len(as_dicts), False)
    spans = []
    for i, (role, _) in enumerate(messages):
        if role != "assistant":
            continue
        before, through = render(i, True), render(i + 1, False)
        if not (through.startswith(before) and full.startswith(through)):
            raise DataError(f"chat template does not render conversations incrementally at message {i} "
                            "(assistant): cannot tell which tokens are the assistant's")
        spans.append((len(before), len(through)))
    return full, spans


def encode_chat(text: str, spans: Sequence[tuple[int, int]], tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """(ids, flags) of the rendered text: flags[j] = token j starts inside an assistant span.
    `tokenizer` is a jaxsb.data.Tokenizer; its added special tokens written literally in the
    text become their ids (the rest is encoded as text)."""
    specials = sorted((t.content for t in tokenizer.hf.get_added_tokens_decoder().values() if t.special),
                      key=len, reverse=True)
    pieces = re.split("(" + "|".join(map(re.escape, specials)) + ")", text) if specials else [text]
    ids, starts, at = [], [], 0
    for piece in pieces:
        if not piece:
            continue
        if piece in specials:
            ids.append(tokenizer.special_id(piece))
            starts.append(at)
        else:
            enc = tokenizer.hf.encode(piece, add_special_tokens=False)
            ids.extend(enc.ids)
            starts.extend(at + s for s, _ in enc.offsets)
        at += len(piece)
    starts_arr = np.asarray(starts, np.int64)
    flags = np.zeros(len(ids), bool)
    for s, e in spans:
        flags |= (starts_arr >= s) & (starts_arr < e)
    return np.asarray(ids, np.int32), flags
