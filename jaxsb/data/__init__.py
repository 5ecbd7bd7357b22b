"""Host-side data pipeline: document sources, tokenizers, packing into rows, a resumable iterator.

    tok = build_tokenizer(cfg.tokenizer, cfg.data, workdir)
    it = DataIterator(cfg.data, tok, num_rows=devices * cfg.data.rows_per_device)
    batch = it.next()          # Batch of numpy [R, T] arrays (the rows path)
    step = DataIterator(cfg.data, tok).next_pieces()  # StepPieces: a planned step's pieces, unpacked
    state = it.state()         # JSON-serialisable; it.restore(state) resumes exactly
    print(it.stats.summary())  # what was read, skipped, split, truncated, dropped, packed
"""

from jaxsb.data.batching import ATTENTION_COST_C, Batch, Packing, Piece, StepPieces, cost, cut_pieces, pack_rows
from jaxsb.data.iterator import DataIterator
from jaxsb.data.catalog import open_source
from jaxsb.data.sources import DataError, Document, Source, render_chat
from jaxsb.data.stats import DataStats
from jaxsb.data.tokenizer import Tokenizer, build_tokenizer, byte_tokenizer, encode_document, train_bpe

__all__ = [
    "ATTENTION_COST_C", "Batch", "DataError", "DataIterator", "DataStats", "Document", "Packing", "Piece",
    "Source", "StepPieces", "Tokenizer", "build_tokenizer", "byte_tokenizer", "cost", "cut_pieces", "encode_document",
    "open_source", "pack_rows", "render_chat", "train_bpe",
]
