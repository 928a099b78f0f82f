"""The cost model (paper section 4.2.3).

  equations  Eq. 1 (pipeline time), Eq. 5 (stage end times), Eq. 6 (All-Reduce) over StageCost
  model      CostModel: stage time and memory from profiles, plan evaluation
  floors     lower bounds of a stage's time over every fitting recompute set (pruning)
  sync       the gradient sync and model-state bytes of a plan's block-wise All-Reduce

Imports eth.spec, eth.layout, eth.profiles.
"""
