"""Training data: ``batches`` (each pipeline's uneven share of a global batch, synthetic
and dataset sources), ``datasets`` (megatron-core indexed datasets, blends, splits),
``tokenizer`` (byte-level or a local HuggingFace tokenizer.json).  The shipped English
corpus is megatron/hpp/corpus/.  Imports megatron.hpp.compat and eth."""
