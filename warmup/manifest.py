"""Manifests: one path per line, or a CSV or Parquet file with a path column."""

import csv
from pathlib import Path

from cachefs.errors import UsageError

PATH_COLUMNS = ("path", "file", "filename", "key", "filepath")


def read_manifest(path: str, column: str | None = None) -> list[str]:
    p = Path(path)
    try:
        if p.suffix.lower() == ".parquet":
            return _parquet(p, column)
        if p.suffix.lower() in (".csv", ".tsv"):
            return _csv(p, column, "\t" if p.suffix.lower() == ".tsv" else ",")
        return [line.strip() for line in p.read_text().splitlines() if line.strip() and not line.startswith("#")]
    except OSError as exc:
        raise UsageError(f"manifest {path}: {exc.strerror or exc}") from None


def _pick(columns: list[str], column: str | None, path: Path) -> str:
    if column is not None:
        if column not in columns:
            raise UsageError(f"manifest {path}: no column {column!r} (columns: {', '.join(columns)})")
        return column
    for name in PATH_COLUMNS:
        if name in columns:
            return name
    raise UsageError(f"manifest {path}: no path column (looked for {', '.join(PATH_COLUMNS)}; use --column)")


def _csv(path: Path, column: str | None, delimiter: str) -> list[str]:
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh, delimiter=delimiter)
        name = _pick(list(reader.fieldnames or []), column, path)
        return [row[name].strip() for row in reader if row.get(name, "").strip()]


def _parquet(path: Path, column: str | None) -> list[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UsageError("Parquet manifests need pyarrow (pip install 'cachefs[packer]')") from None
    try:
        schema = pq.read_schema(path)
        name = _pick(list(schema.names), column, path)
        return [str(v) for v in pq.read_table(path, columns=[name]).column(name).to_pylist() if v]
    except UsageError:
        raise
    except Exception as exc:          # pyarrow raises its own error types for a bad file
        raise UsageError(f"manifest {path}: not a readable Parquet file: {exc}") from None
