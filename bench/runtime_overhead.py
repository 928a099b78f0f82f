"""Step time of the HPP runtime vs megatron-core's GPTModel + schedule, same config.

    OMP_NUM_THREADS=1 python bench/runtime_overhead.py [--model small] [--gbs 16] [--mbs 4]

World size 1 (gloo, CPU; CUDA if present).  Both sides run the same shape of GPT
(learned positions, untied head, fp32, dropout 0) over the same number of
micro-batches, then global-norm clipping and torch AdamW:

* ours: megatron.hpp.training.loop.Trainer.step on a one-pipeline, one-stage plan;
* megatron: GPTModel(local layer spec) driven by forward_backward_no_pipelining,
  with megatron's CUDA calls redirected by megatron.hpp.compat.cuda_calls_on_cpu.

Steps alternate between the two in rounds; the medians are compared.  Prints the
ratio ours / megatron (target <= 1.05).  A bench, not a test.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def one_stage_plan(model_name: str, gbs: int, mbs: int):
    from eth.spec.cluster import Cluster
    from eth.spec.model_source import load_model
    from eth.spec.plan import PipelinePlan, Plan, StagePlan

    cluster = Cluster.from_dict({"name": "one", "inter_node_gbps": 100,
                                 "nodes": [{"type": "A100", "devices_per_node": 1}]})
    model = load_model(model_name)
    stage = StagePlan([0], "A100", 1, 1, (0, model.num_layers))
    return Plan(model=model, cluster=cluster, gbs=gbs, pipelines=[PipelinePlan(mbs, gbs, [stage])])


def build_megatron(spec, gbs: int, mbs: int, seed: int):
    """GPTModel + a step function using megatron's no-pipelining schedule."""
    import torch
    import torch.distributed as dist
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig

    from megatron.hpp.compat import cuda_calls_on_cpu, tp_group_globals
    from megatron.hpp.data.batches import SyntheticData, batch

    from megatron.core import parallel_state

    if parallel_state._GLOBAL_MEMORY_BUFFER is None:  # DotProductAttention's scratch buffer
        parallel_state._set_global_memory_buffer()
    group = dist.new_group([0])
    pgs = ProcessGroupCollection(tp=group, cp=group, pp=group, embd=group, pos_embd=group,
                                 dp=group, dp_cp=group)
    config = TransformerConfig(
        num_layers=spec.num_layers, hidden_size=spec.hidden, num_attention_heads=spec.heads,
        ffn_hidden_size=spec.ffn, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, params_dtype=torch.float32, bias_activation_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False,
        gradient_accumulation_fusion=False, apply_rope_fusion=False)
    with cuda_calls_on_cpu():
        model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=spec.vocab,
                         max_sequence_length=spec.seq_len, parallel_output=True,
                         share_embeddings_and_output_weights=False, pg_collection=pgs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8)
    data = SyntheticData(spec.vocab, spec.seq_len, seed)
    positions = torch.arange(spec.seq_len).unsqueeze(0).expand(mbs, -1)

    def forward_step(iterator, model):
        tokens = next(iterator)
        loss = model(tokens[:, :-1], positions, None, labels=tokens[:, 1:])  # [b, s]

        def loss_func(output):
            value = output.float().mean(dim=1).sum() / gbs
            return value, {"lm loss": value.detach()}
        return loss, loss_func

    def step(iteration: int):
        optimizer.zero_grad(set_to_none=True)
        micro = iter([batch(data, iteration, i, i + mbs) for i in range(0, gbs, mbs)])
        with cuda_calls_on_cpu(), tp_group_globals(group):  # cross entropy reads the global
            forward_backward_no_pipelining(
                forward_step_func=forward_step, data_iterator=micro, model=model,
                num_microbatches=gbs // mbs, seq_length=spec.seq_len, micro_batch_size=mbs,
                pg_collection=pgs)
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0)
        optimizer.step()

    return model, step


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small",
                        help="model: a preset (default: small), a model YAML file or a HuggingFace config.json")
    parser.add_argument("--gbs", type=int, default=16)
    parser.add_argument("--mbs", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps-per-round", type=int, default=3)
    args = parser.parse_args(argv)
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    os.environ.setdefault("MASTER_PORT", "29533")

    from megatron.hpp.compat import quiet_megatron_warnings

    quiet_megatron_warnings()
    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")
    import torch.distributed as dist

    from megatron.hpp.parallel.topology import check_plan
    from megatron.hpp.training.loop import Trainer, TrainConfig

    plan = one_stage_plan(args.model, args.gbs, args.mbs)
    with tempfile.TemporaryDirectory() as tmp:
        plan.save(Path(tmp) / "plan.json")
        cfg = TrainConfig(plan=str(Path(tmp) / "plan.json"), train_iters=10**6, lr=1e-4)
        trainer = Trainer(cfg, check_plan(plan, 1), 0)
    try:
        try:
            model, megatron_step = build_megatron(plan.model, args.gbs, args.mbs, cfg.seed)
        except Exception as exc:  # report why megatron's model cannot run here
            print(f"megatron GPTModel could not be built on this machine: {type(exc).__name__}: {exc}")
            return 1
        n_ours = sum(p.numel() for p in trainer.model.parameters())
        n_meg = sum(p.numel() for p in model.parameters())
        print(f"model {plan.model.name}: {plan.model.num_layers} layers, hidden {plan.model.hidden}, "
              f"seq {plan.model.seq_len}, vocab {plan.model.vocab}; gbs {args.gbs}, mbs {args.mbs} "
              f"({args.gbs // args.mbs} micro-batches); params ours {n_ours}, megatron {n_meg}; "
              f"device {trainer.backend.device}")
        ours, theirs, it = [], [], 0
        trainer.step(it)
        megatron_step(it)  # warm-up
        for _ in range(args.rounds):
            for times, fn in ((ours, trainer.step), (theirs, megatron_step)):
                for _ in range(args.steps_per_round):
                    it += 1
                    t0 = time.perf_counter()
                    fn(it)
                    times.append(time.perf_counter() - t0)
        a, b = statistics.median(ours), statistics.median(theirs)
        print(f"step time (median of {len(ours)}): HPP runtime {a * 1e3:.1f} ms, "
              f"megatron-core GPTModel + forward_backward_no_pipelining {b * 1e3:.1f} ms")
        print(f"ratio ours / megatron = {a / b:.3f} (target <= 1.05)")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
