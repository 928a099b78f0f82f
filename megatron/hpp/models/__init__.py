"""The model, one pipeline stage at a time: ``gpt`` (GPTStage: op-decomposed GPT / LLaMA
layers on megatron.core.tensor_parallel, recompute runs, the head and loss) and ``llama``
(RMSNorm, rotary embeddings, grouped-query and fused attention, SwiGLU).  Imports
megatron.hpp.compat and eth.spec / eth.layout."""
