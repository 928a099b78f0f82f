"""HPP runtime: Megatron-core extended for data-balanced heterogeneous pipeline parallelism.

Modules (import them directly; this package imports nothing eagerly):
  topology   plan -> rank layout + every process group (one immutable object per rank)
  compat     backend/device selection and the CPU shim for megatron-core
  model      op-decomposed GPT stage on megatron.core.tensor_parallel layers
  data       uneven local-batch slicing of each global batch
  schedule   per-pipeline 1F1B with stage-boundary resharding
  grad_sync  gradient synchronisation across pipelines, AdamW, global-norm clipping
  training   the train loop used by pretrain_gpt.py
"""
