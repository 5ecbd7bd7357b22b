"""Tokenizers: UTF-8 bytes, a byte-level BPE trained on the run's own corpus, or any tokenizer.json.

All kinds are one `Tokenizer` class wrapping a Hugging Face `tokenizers.Tokenizer` plus the
bos/eos/pad ids, so the trainer can also wrap a pretrained model's own tokenizer
(`Tokenizer(hf_tokenizer, bos_id=..., eos_id=...)`). Special-token strings that occur inside
ordinary text are encoded as text, never as control tokens; chat markup and eos are inserted
by id (`encode_document`).

kind=bpe trains on a deterministic sample of the corpus (the seeded epoch-0 order, at most
`train_bytes`) and saves `workdir/tokenizer.json`; a resumed run loads that file, so it uses
the identical tokenizer even if the corpus or the trainer's version changed in between.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Sequence

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from jaxsb.config import DataConfig, TokenizerConfig
from jaxsb.data.catalog import open_source
from jaxsb.data.sources import IM_END, IM_START, DataError, Document
from jaxsb.data.stats import DataStats

log = logging.getLogger(__name__)

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|endoftext|>"
SPECIAL_TOKENS = (PAD, BOS, EOS, IM_START, IM_END)
TOKENIZER_FILE = "tokenizer.json"
# Names tried, in order, when a tokenizer.json comes without a tokenizer_config.json.
EOS_CANDIDATES = (EOS, "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>", "<|im_end|>")
BOS_CANDIDATES = (BOS, "<s>", "<bos>", "<|begin_of_text|>", "<|startoftext|>")
PAD_CANDIDATES = (PAD, "<pad>", "<|padding|>")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by the ByteLevel pre-tokenizer."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return dict(zip(bs, map(chr, cs)))


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the ids the data pipeline needs (bos, eos, pad)."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, *, bos_id: int, eos_id: int, pad_id: int | None = None,
                 name: str = "", chat_template: str | None = None, _byte_ids: bool = False) -> None:
        # A private copy, so that switching off special-token matching does not touch the caller's object.
        self.hf = tokenizers.Tokenizer.from_str(tokenizer.to_str())
        self.hf.encode_special_tokens = True
        size = self.hf.get_vocab_size(with_added_tokens=True)
        for label, i in (("bos_id", bos_id), ("eos_id", eos_id), ("pad_id", pad_id)):
            if i is not None and not 0 <= i < size:
                raise ValueError(f"Tokenizer: {label}={i} outside the vocabulary [0, {size})")
        self.bos_id, self.eos_id = int(bos_id), int(eos_id)
        self.pad_id = int(pad_id) if pad_id is not None else self.eos_id
        self.name = name
        self.chat_template = chat_template  # a pretrained model's Jinja chat template (jaxsb/data/chat.py)
        self._byte_ids = _byte_ids  # ids 0..255 are the UTF-8 bytes themselves: encode with numpy
        self._cache: dict[str, np.ndarray] = {}

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode_array(self, text: str) -> np.ndarray:
        if self._byte_ids:
            return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)
        return np.asarray(self.hf.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def encode(self, text: str) -> list[int]:
        return self.encode_array(text).tolist()

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        ids = [int(i) for i in ids]
        if self._byte_ids:
            out, run = [], bytearray()
            for i in ids:
                if i < 256:
                    run.append(i)
                else:
                    out.append(run.decode("utf-8", errors="replace"))
                    run = bytearray()
                    out.append(self.hf.id_to_token(i) or "")
            out.append(run.decode("utf-8", errors="replace"))
            return "".join(out)
        return self.hf.decode(ids, skip_special_tokens=False)

    def special_id(self, token: str) -> int | None:
        """The id of an added/special token, or None if this vocabulary has no such token."""
        return self.hf.token_to_id(token)

    def cached_encode(self, text: str) -> np.ndarray:
        """encode_array for short fixed strings (chat markup), memoised."""
        if text not in self._cache:
            self._cache[text] = self.encode_array(text)
        return self._cache[text]

    def save(self, path: str) -> None:
        """Atomically writes tokenizer.json."""
        tmp = f"{path}.tmp{os.getpid()}"
        self.hf.save(tmp)
        os.replace(tmp, path)

    @classmethod
    def from_file(cls, path: str, *, bos_id: int | None = None, eos_id: int | None = None,
                  pad_id: int | None = None) -> "Tokenizer":
        """Loads a tokenizer.json (or a directory holding one); special ids from the arguments,
        else from a sibling tokenizer_config.json, else from common token names."""
        file = os.path.join(path, TOKENIZER_FILE) if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise DataError(f"{file}: no such tokenizer file (tokenizer.path must be a tokenizer.json "
                            f"or a directory containing one)")
        try:
            hf = tokenizers.Tokenizer.from_file(file)
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise DataError(f"{file}: not a readable tokenizers JSON file ({e})") from None
        named = _config_special_tokens(os.path.join(os.path.dirname(file), "tokenizer_config.json"))

        def find(given: int | None, key: str, candidates: tuple[str, ...]) -> int | None:
            if given is not None:
                return given
            for name in ((named.get(key),) if named.get(key) else ()) + candidates:
                i = hf.token_to_id(name)
                if i is not None:
                    return i
            return None

        eos = find(eos_id, "eos_token", EOS_CANDIDATES)
        if eos is None:
            raise DataError(f"{file}: cannot tell the end-of-document token: no tokenizer_config.json "
                            f"eos_token and none of {', '.join(EOS_CANDIDATES)} is in the vocabulary")
        bos = find(bos_id, "bos_token", BOS_CANDIDATES)
        pad = find(pad_id, "pad_token", PAD_CANDIDATES)
        byte_ids = all(hf.token_to_id(t) is not None for t in SPECIAL_TOKENS) and _is_byte_vocab(hf)
        return cls(hf, bos_id=eos if bos is None else bos, eos_id=eos, pad_id=pad,
                   name=os.path.basename(os.path.dirname(os.path.abspath(file))), _byte_ids=byte_ids)

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab_size={self.vocab_size}, bos={self.bos_id}, eos={self.eos_id})"


def _config_special_tokens(path: str) -> dict[str, str]:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}
    out = {}
    for key in ("bos_token", "eos_token", "pad_token"):
        v = cfg.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        if isinstance(v, str):
            out[key] = v
    return out


def _is_byte_vocab(hf: tokenizers.Tokenizer) -> bool:
    """True for the byte tokenizer's layout: exactly 256 byte ids 0..255 with no merges."""
    b2u = _bytes_to_unicode()
    return hf.get_vocab_size(with_added_tokens=False) == 256 and all(hf.token_to_id(b2u[b]) == b for b in (0, 65, 255))


def _byte_level(model: models.Model) -> tokenizers.Tokenizer:
    hf = tokenizers.Tokenizer(model)
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    return hf


def _wrap_own(hf: tokenizers.Tokenizer, name: str, byte_ids: bool = False) -> Tokenizer:
    ids = {t: hf.token_to_id(t) for t in SPECIAL_TOKENS}
    return Tokenizer(hf, bos_id=ids[BOS], eos_id=ids[EOS], pad_id=ids[PAD], name=name, _byte_ids=byte_ids)


def byte_tokenizer() -> Tokenizer:
    """UTF-8 bytes as ids 0..255, then the special tokens (vocab 261). Needs no training or download."""
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    hf = _byte_level(models.BPE(vocab=vocab, merges=[]))
    hf.add_special_tokens(list(SPECIAL_TOKENS))
    return _wrap_own(hf, "bytes", byte_ids=True)


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE (GPT-2 style pre-tokenization) trained on `texts`; special tokens first."""
    hf = _byte_level(models.BPE())
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    hf.train_from_iterator(texts, trainer)
    return _wrap_own(hf, "bpe")


def sample_texts(data_cfg: DataConfig, max_bytes: int) -> list[str]:
    """A deterministic sample of the corpus: texts in the seeded epoch-0 order until `max_bytes`
    of UTF-8, each document capped at 1/16 of the budget so one huge file cannot dominate."""
    source = open_source(data_cfg)
    cap = max(max_bytes // 16, 4096)
    out, total = [], 0
    for text in source.texts(data_cfg.seed, DataStats()):
        text = text[:cap]
        out.append(text)
        total += len(text.encode("utf-8"))
        if total >= max_bytes:
            break
    if not out:
        raise DataError(f"{source.looked_for()}: no usable text to train the BPE tokenizer on")
    return out


def build_tokenizer(cfg: TokenizerConfig, data_cfg: DataConfig, workdir: str | None) -> Tokenizer:
    """The run's tokenizer. kind=auto means bpe here (pretrained models bring their own: the
    trainer wraps it with `Tokenizer(...)`). bpe reloads `workdir/tokenizer.json` if it exists."""
    if cfg.kind == "bytes":
        return byte_tokenizer()
    if cfg.kind == "hf":
        if not cfg.path:
            raise DataError("tokenizer.kind=hf needs tokenizer.path (a tokenizer.json or its directory)")
        return Tokenizer.from_file(cfg.path)
    if cfg.kind == "model":
        raise DataError("tokenizer.kind=model: the pretrained model's own tokenizer is passed in by the "
                        "trainer; build_tokenizer cannot make it (use bpe, bytes or hf)")
    if cfg.kind not in ("bpe", "auto"):
        raise DataError(f"tokenizer.kind={cfg.kind!r}: allowed auto, bpe, bytes, hf, model")
    cached = os.path.join(workdir, TOKENIZER_FILE) if workdir else None
    if cached and os.path.isfile(cached):
        tok = Tokenizer.from_file(cached)
        if tok.vocab_size > cfg.vocab_size:
            log.warning("%s has %d tokens, more than tokenizer.vocab_size=%d; using the saved file so that "
                        "the resumed run tokenizes exactly as before", cached, tok.vocab_size, cfg.vocab_size)
        return tok
    if data_cfg.kind in ("tokens", "mqar"):
        raise DataError(f"data.kind={data_cfg.kind} holds token ids, not text: set tokenizer.kind=bytes (or hf "
                        "with the ids' tokenizer.json); a BPE cannot be trained on token ids")
    tok = train_bpe(sample_texts(data_cfg, cfg.train_bytes), cfg.vocab_size)
    if cached:
        os.makedirs(workdir, exist_ok=True)
        tok.save(cached)
    return tok


def encode_document(doc: Document, tok: Tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """Token ids (eos appended) and per-token target flags: flags[j] says whether token j is a
    trained target when predicted from token j-1 (flags[0] is always False). Chat documents are
    rendered with the tokenizer's chat template when it has one (a pretrained model's,
    jaxsb/data/chat.py), else with ChatML by id; only assistant turns (content and end-of-turn
    markup) train."""
    if doc.messages is not None and tok.chat_template is not None:
        from jaxsb.data.chat import encode_chat, render_with_spans

        try:
            text, spans = render_with_spans(tok.chat_template, doc.messages, tok.hf.id_to_token(tok.bos_id) or "",
                                            tok.hf.id_to_token(tok.eos_id) or "")
        except DataError as e:
            raise DataError(f"{doc.origin}: {e}") from None
        ids, flags = encode_chat(text, spans, tok)
        ids = np.concatenate([ids, np.array([tok.eos_id], np.int32)])
        flags = np.concatenate([flags, [False]])
    elif doc.messages is not None:
        start = tok.special_id(IM_START)
        end = tok.special_id(IM_END)
        start_ids = np.array([start], np.int32) if start is not None else tok.cached_encode(IM_START)
        end_ids = np.array([end], np.int32) if end is not None else tok.cached_encode(IM_END)
        newline = tok.cached_encode("\n")
        parts: list[np.ndarray] = []
        trained: list[bool] = []
        for role, content in doc.messages:
            body = tok.encode_array(content)
            is_assistant = role == "assistant"
            for piece, train in ((start_ids, False), (tok.cached_encode(f"{role}\n"), False),
                                 (body, is_assistant), (end_ids, is_assistant), (newline, False)):
                parts.append(piece)
                trained.append(train)
        parts.append(np.array([tok.eos_id], np.int32))
        trained.append(False)
        ids = np.concatenate(parts).astype(np.int32)
        flags = np.concatenate([np.full(len(p), t, dtype=bool) for p, t in zip(parts, trained)])
    else:
        body = doc.ids if doc.ids is not None else tok.encode_array(doc.text or "")
        if doc.ids is None or not (body.size and body[-1] == tok.eos_id):
            body = np.concatenate([body, np.array([tok.eos_id], np.int32)])
        ids = body.astype(np.int32)
        flags = np.ones(ids.size, dtype=bool)
        if doc.ids is not None and doc.targets is not None:  # only the given targets train
            flags[:] = False
            flags[: doc.targets.size] = doc.targets
    flags[0] = False
    return ids, flags
