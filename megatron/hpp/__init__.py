"""HPP runtime: megatron-core extended for data-balanced heterogeneous pipeline parallelism.

Packages (import modules directly; no package imports anything eagerly), each importing
only those above it in this list, and eth (never the other way round):
  compat, rank_exit  backend/device selection and the CPU shim for megatron-core; how a
                     rank's process ends
  models/       GPT and LLaMA pipeline stages built op by op on megatron.core.tensor_parallel
  data/         uneven local-batch slicing, indexed datasets and blends, tokenizers
  parallel/     plan -> topology (ranks, every process group), the launch check, the
                per-pipeline 1F1B schedule with stage-boundary resharding
  distributed/  the gradient path: block-wise All-Reduce buffers, ZeRO-sharded AdamW
  training/     the train loop, checkpoints, metrics, evaluation, failures
  profiling/    measured op profiles (may import models, data and distributed; never training)
  cli/          bodies of tools/profile_ops.py and tools/preprocess_data.py
"""
