"""The gradient path after the backward pass: ``grad_sync`` (gradient buffers on
eth.layout.blocks' layout, block-wise All-Reduce launched during the backward, the global
norm) and ``optimizer`` (AdamW on fp32 main weights, sharded by ZeRO stage, fp16 loss
scale).  Imports megatron.hpp.models and eth."""
