"""HPP runtime: Megatron-core extended for data-balanced heterogeneous pipeline parallelism.

Modules (import them directly; this package imports nothing eagerly):
  topology   plan -> rank layout + every process group (one immutable object per rank)
  compat     backend/device selection and the CPU shim for megatron-core
  model      op-decomposed GPT stage on megatron.core.tensor_parallel layers
  data       uneven local-batch slicing of each global batch
  schedule   per-pipeline 1F1B with stage-boundary resharding
  grad_sync  gradient buffers on eth.blocks' layout, reduced during backward; global norm
  optimizer  ZeRO-sharded AdamW on fp32 main weights, weight write-back, fp16 loss scale
  training   the train loop used by pretrain_gpt.py
"""
