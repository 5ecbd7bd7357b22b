"""Table sources: Parquet files and Hugging Face `datasets` directories (`save_to_disk`).

One row is one unit. `data.record` says what a row holds: `text` (the string column
`data.text_field`) or `chat` (a `messages` column of lists of {"role", "content"}, as in
kind=chat). Both formats are Apache Arrow underneath and read with pyarrow:

* kind=parquet: `data.path` is a .parquet file or a directory of them (sorted, recursively);
  rows are read one row group at a time, the last few row groups kept.
* kind=datasets: `data.path` is a directory written by `Dataset.save_to_disk` (its
  `state.json` lists the Arrow stream files, memory-mapped here) or by
  `DatasetDict.save_to_disk` (`dataset_dict.json`; `data.split` picks the split).

Bad input follows the other sources' rules: a missing or mistyped column stops at start-up
naming the file, the column and the columns present; a null or malformed row is a
`DataError` naming `file[row i]` (data.on_malformed=error) or a counted skip; empty text is
counted as skipped_empty.
"""

from __future__ import annotations

import collections
import json
import os

import numpy as np

from jaxsb.config import DataConfig
from jaxsb.data.sources import DataError, Document, Source, chat_document, walk_files
from jaxsb.data.stats import DataStats

ROW_GROUPS_KEPT = 4  # Parquet row groups held in memory (a seeded order revisits groups at random)


def _column_name(cfg: DataConfig) -> str:
    return cfg.text_field if cfg.record == "text" else "messages"


def _check_column(schema, column: str, record: str, where: str) -> None:
    """The column exists and has the type `record` needs (text: string; chat: a list of structs
    with string role and content)."""
    import pyarrow as pa

    if column not in schema.names:
        field = "data.text_field" if record == "text" else "data.record=chat's 'messages'"
        raise DataError(f"{where}: no column {column!r} ({field}); the table has columns "
                        f"{schema.names[:12]}")
    t = schema.field(column).type
    if record == "text":
        if not (pa.types.is_string(t) or pa.types.is_large_string(t)):
            raise DataError(f"{where}: column {column!r} must hold strings (data.record=text), got {t}")
        return
    ok = (pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_struct(t.value_type)
    names = {t.value_type.field(i).name for i in range(t.value_type.num_fields)} if ok else set()
    if not ok or not {"role", "content"} <= names:
        raise DataError(f"{where}: column 'messages' must be a list of {{role, content}} structs "
                        f"(data.record=chat), got {t}")


class TableSource(Source):
    """Rows of Arrow tables as documents; subclasses list their files and rows and provide
    `_value(part, row)`."""

    unit_name = "rows"

    def __init__(self, cfg: DataConfig, kind: str, parts: list[str], rows: list[int]) -> None:
        super().__init__(cfg)
        self.kind, self.parts = kind, parts
        self.first_row = np.concatenate([[0], np.cumsum(np.asarray(rows, np.int64))])
        if self.first_row[-1] == 0:
            raise DataError(f"{cfg.path}: no rows in {', '.join(parts)} (data.kind={kind})")

    def __len__(self) -> int:
        return int(self.first_row[-1])

    def describe(self) -> str:
        return f"kind={self.kind} path={self.cfg.path} ({len(self.parts)} files, {len(self):,} rows)"

    def looked_for(self) -> str:
        what = f"string column {self.cfg.text_field!r}" if self.cfg.record == "text" else "'messages' lists"
        return f"{self.cfg.path}: rows with a {what} in {len(self.parts)} file(s), {len(self):,} rows"

    def _value(self, part: int, row: int):
        """The python value of the record's column at `row` of file `part`."""
        raise NotImplementedError

    def read(self, unit: int, stats: DataStats) -> Document | None:
        part = int(np.searchsorted(self.first_row, unit, side="right") - 1)
        row = unit - int(self.first_row[part])
        where = f"{self.parts[part]}[row {row}]"
        stats.add("records_read")
        value = self._value(part, row)

        def malformed(expected: str) -> None:
            self._malformed(where, expected, stats)

        if value is None:
            malformed(f"a value in column {_column_name(self.cfg)!r}, got null")
            return None
        if self.cfg.record == "chat":
            return chat_document(value, where, stats, malformed)
        if not value.strip():
            stats.add("skipped_empty", origin=where)
            return None
        return Document(origin=where, text=value)


class ParquetSource(TableSource):
    """kind=parquet: a .parquet file or a directory of them."""

    def __init__(self, cfg: DataConfig) -> None:
        import pyarrow.parquet as pq

        path = cfg.path
        if not os.path.exists(path):
            raise DataError(f"{path}: no such file or directory (data.path for data.kind=parquet)")
        parts = walk_files(path, (".parquet",))
        if not parts:
            raise DataError(f"{path}: no files ending in .parquet found (data.kind=parquet)")
        self.files, rows, self.group_starts = [], [], []
        for p in parts:
            try:
                f = pq.ParquetFile(p)
            except Exception as e:  # pyarrow raises ArrowInvalid / OSError for files that are not Parquet
                raise DataError(f"{p}: not a readable Parquet file ({e})") from None
            _check_column(f.schema_arrow, _column_name(cfg), cfg.record, p)
            md = f.metadata
            sizes = [md.row_group(i).num_rows for i in range(md.num_row_groups)]
            self.files.append(f)
            self.group_starts.append(np.concatenate([[0], np.cumsum(np.asarray(sizes, np.int64))]))
            rows.append(md.num_rows)
        self._groups: collections.OrderedDict = collections.OrderedDict()
        super().__init__(cfg, "parquet", parts, rows)

    def _value(self, part: int, row: int):
        starts = self.group_starts[part]
        g = int(np.searchsorted(starts, row, side="right") - 1)
        key = (part, g)
        if key not in self._groups:
            column = self.files[part].read_row_group(g, columns=[_column_name(self.cfg)]).column(0)
            self._groups[key] = column
            while len(self._groups) > ROW_GROUPS_KEPT:
                self._groups.popitem(last=False)
        self._groups.move_to_end(key)
        return self._groups[key][row - int(starts[g])].as_py()


def _dataset_dir(path: str, split: str) -> str:
    """The directory of one saved Dataset: `path` itself, or its `split` of a saved DatasetDict."""
    dict_file = os.path.join(path, "dataset_dict.json")
    if not os.path.exists(dict_file):
        return path
    try:
        with open(dict_file) as f:
            splits = json.load(f)["splits"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{dict_file}: expected a JSON object with a 'splits' list ({e})") from None
    if split not in splits:
        raise DataError(f"{path}: a DatasetDict without split {split!r} (data.split); it has {list(splits)}")
    return os.path.join(path, split)


class DatasetsSource(TableSource):
    """kind=datasets: a Hugging Face `datasets` directory written by `save_to_disk`."""

    def __init__(self, cfg: DataConfig) -> None:
        import pyarrow as pa

        if not os.path.isdir(cfg.path):
            raise DataError(f"{cfg.path}: no such directory (data.path for data.kind=datasets: "
                            "a directory written by Dataset.save_to_disk)")
        root = _dataset_dir(cfg.path, cfg.split)
        state_file = os.path.join(root, "state.json")
        try:
            with open(state_file) as f:
                state = json.load(f)
            names = [d["filename"] for d in state["_data_files"]]
        except FileNotFoundError:
            raise DataError(f"{root}: no state.json; data.kind=datasets expects a directory written by "
                            "Dataset.save_to_disk or DatasetDict.save_to_disk") from None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(f"{state_file}: expected '_data_files': [{{'filename': ...}}, ...] ({e})") from None
        if state.get("_indices_data_files"):
            raise DataError(f"{state_file}: an indices mapping is saved beside the data; save the dataset "
                            "after .flatten_indices() (jaxsb reads the rows as stored)")
        parts = [os.path.join(root, n) for n in names]
        self.columns, rows = [], []
        for p in parts:
            try:
                table = pa.ipc.open_stream(pa.memory_map(p)).read_all()
            except (OSError, pa.ArrowInvalid) as e:
                raise DataError(f"{p}: not a readable Arrow stream file ({e})") from None
            _check_column(table.schema, _column_name(cfg), cfg.record, p)
            self.columns.append(table.column(_column_name(cfg)))
            rows.append(table.num_rows)
        super().__init__(cfg, "datasets", parts, rows)

    def _value(self, part: int, row: int):
        return self.columns[part][row].as_py()
