"""The typed, versioned descriptions everything else reads (docs/FORMATS.md).

  cluster    device catalog (eth/data/devices.yaml) and cluster YAML -> Cluster
  model      ModelSpec, presets, the ops of a layer with their shapes and FLOPs
  model_source  --model as a preset, a model YAML file or a HuggingFace config.json, and
             Megatron's model flags on top
  precision  the training setup a plan is made for: precision, ZeRO stage
  plan       the plan: dataclasses, versioned JSON, validation
  plan_flags Megatron's flags for what a plan decides, checked against it

Imports only eth.errors and eth.fileio.
"""
