"""The training run behind pretrain_gpt.py: ``loop`` (argument checks, the Trainer, the
order of work on every rank), ``checkpoint`` (layout-independent checkpoints on
torch.distributed.checkpoint), ``metrics``, ``evaluation`` (validation loss), ``failures``
(NaN guard, rank failures).  May import every other runtime package except profiling
and cli."""
