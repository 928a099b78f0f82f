"""Where the model's parameters live under a plan, for block-wise All-Reduce (section 4.3).

  params   the logical parameters of the runtime's GPT/LLaMA: names, full shapes, tp
           partitioning, gradient blocks
  blocks   GradLayout: which ranks reduce which piece of which block, fused buffers,
           buckets (the runtime's megatron.hpp.distributed.grad_sync communicates on it)

Imports eth.spec.
"""
