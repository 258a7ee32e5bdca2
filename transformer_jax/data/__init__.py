"""Parallel text to device batches: where text is read (`data_sources`, `bible_corpus`), the
vocabulary (`tokenizer`, `vocab_cache`), token ids kept on disk (`token_store`), length buckets
and packing (`batching`), the whole pipeline (`input_pipeline`) and batches copied to the
devices ahead (`prefetch`). Never imports the model, checkpoints or training."""
