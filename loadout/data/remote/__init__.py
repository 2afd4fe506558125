"""Data that lives elsewhere: WebDataset shards and parquet on a disk, HTTP or an S3-compatible store, with a
bounded node cache and fetch-ahead."""
