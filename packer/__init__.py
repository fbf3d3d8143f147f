"""`cachefs pack` / `cachefs unpack`: many small files into TFRecord shards with a Parquet index
(the format lives in ``cachefs.packfmt``), and back."""
