"""The typed, versioned descriptions everything else reads (docs/FORMATS.md).

  cluster    device catalog (eth/data/devices.yaml) and cluster YAML -> Cluster
  model      ModelSpec, presets, the ops of a layer with their shapes and FLOPs
  precision  the training setup a plan is made for: precision, ZeRO stage
  plan       the plan: dataclasses, versioned JSON, validation

Imports only eth.errors and eth.fileio.
"""
