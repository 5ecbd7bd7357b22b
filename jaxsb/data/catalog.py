"""`open_source(cfg)`: the document source of `data.kind` (jaxsb/data/sources.py for files,
JSONL, tokens and MQAR; jaxsb/data/tables.py for Parquet and `datasets` tables)."""

from __future__ import annotations

from jaxsb.config import DataConfig
from jaxsb.data.sources import (EXCLUDED_DIRS, DataError, FileTreeSource, JsonlSource, MqarSource, Source,
                                TokenArraySource, stdlib_root)
from jaxsb.data.tables import DatasetsSource, ParquetSource


def open_source(cfg: DataConfig, vocab_size: int | None = None, eos_id: int | None = None) -> Source:
    """The source for `cfg.kind`; kind=tokens and mqar need the tokenizer's vocab_size and eos_id."""
    if cfg.kind == "stdlib":
        return FileTreeSource(cfg, stdlib_root(), "stdlib", EXCLUDED_DIRS)
    if cfg.kind == "text":
        return FileTreeSource(cfg, cfg.path, "text")
    if cfg.kind in ("jsonl", "chat"):
        return JsonlSource(cfg, cfg.kind)
    if cfg.kind == "parquet":
        return ParquetSource(cfg)
    if cfg.kind == "datasets":
        return DatasetsSource(cfg)
    if cfg.kind == "tokens":
        if vocab_size is None or eos_id is None:
            raise DataError("data.kind=tokens: the tokenizer's vocab_size and eos_id are needed to validate ids")
        return TokenArraySource(cfg, vocab_size, eos_id)
    if cfg.kind == "mqar":
        if vocab_size is None or eos_id is None:
            raise DataError("data.kind=mqar: the tokenizer's vocab_size and eos_id are needed to check the ids")
        return MqarSource(cfg, vocab_size, eos_id)
    raise DataError(f"data.kind={cfg.kind!r}: allowed stdlib, text, jsonl, chat, parquet, datasets, tokens, mqar")
