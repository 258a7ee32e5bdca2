"""Search with a key/value cache (`decode`: greedy, sampling, beam), batched translation of
text (`translator`), test-set scoring (`evaluation`) and attention heatmaps
(`attention_plot`)."""
