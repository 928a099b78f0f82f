"""The model, one pipeline stage at a time: ``gpt`` (GPTStage: op-decomposed GPT / LLaMA
layers on megatron.core.tensor_parallel, recompute runs, the head and loss), ``llama``
(RMSNorm, rotary embeddings, grouped-query and fused attention, SwiGLU) and ``boundary``
(the tensors that cross a stage boundary inside a layer, packed into one p2p buffer).  Imports
megatron.hpp.compat and eth.spec / eth.layout."""
