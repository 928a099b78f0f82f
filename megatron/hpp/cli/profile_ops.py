"""Measure every op of a model on this device type and write a profile JSON ("measured");
installed as ``hpp-profile``.

    python tools/profile_ops.py --model tiny --device-type cpu --mbs 1,2,4 --tp 1,2 \
        -o profiles/measured/cpu.json
    torchrun --nproc-per-node 8 tools/profile_ops.py --model gpt3-13b --device-type H100 \
        --mbs 1,2,4,8 --tp 1,2,4,8 --collectives -o profiles/measured/H100.json
    torchrun --nproc-per-node 4 tools/profile_ops.py --device-type cpu --collectives-only \
        -o profiles/measured/cpu.json      # add collective tables to an existing profile

Ops are the runtime's own (megatron/hpp/models/gpt.py), one tp rank's shard each; what is
measured and how: megatron/hpp/profiling/ops.py and docs/RUNTIME.md; the file and its
merging: megatron/hpp/profiling/file.py.  An existing measured file of the same device
keeps its other model shapes (same shape: replaced).  Timings
taken on the CPU are refused under a catalog GPU/NPU name (``--device-type A100``) unless
``--force`` is given (other names that do not start with "cpu" get a warning): they would make the planner believe an A100 is as slow as a CPU.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from eth.cli.common import int_list, run_main
from eth.errors import SpecError


def parse_args(argv=None) -> argparse.Namespace:
    from eth.spec.model_source import add_model_args

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    add_model_args(p, required=False, model_help="model: a preset, a model YAML file or a HuggingFace "
                                                 "config.json; required unless --collectives-only")
    p.add_argument("--attention", choices=("unfused", "fused"),
                   help="attention op set override (default: the preset's; eth.spec.model.ModelSpec.attention)")
    p.add_argument("--device-type", required=True, help="catalog / cluster device type to file the profile under")
    p.add_argument("--mbs", default="1,2,4", help="comma-separated micro-batch sizes")
    p.add_argument("--tp", default="1", help="comma-separated tp degrees")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--repeats", type=int, default=10, help="timed runs per op (median kept)")
    p.add_argument("--warmup", type=int, default=3, help="untimed runs per op first")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--collectives", action="store_true",
                   help="also time collectives (under torchrun, world size >= 2; rank 0 writes)")
    p.add_argument("--collectives-only", action="store_true",
                   help="time only the collectives (under torchrun) and add their tables to the existing "
                        "profile -o, whose op entries stay as they are")
    p.add_argument("--collective-sizes", help="comma-separated message sizes in bytes "
                                              "(default 1 KiB .. 64 MiB, x4 steps)")
    p.add_argument("-o", "--output", required=True, help="profile JSON to write (merged if present)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-overheads", action="store_true",
                   help="time the ops only: no runtime stages (1-2 layers, recomputed ones, an optimizer "
                        "step; they hold memory) and no overhead_ms in the entries")
    p.add_argument("--real-tp", action="store_true",
                   help="CPU: time tp > 1 with tp processes on a real gloo tp group (as the runtime runs a tp "
                        "stage), the tp collectives inside the op times (the profile says tp_comm_included); "
                        "default: one process, a fake tp group, the shard's compute only")
    p.add_argument("--force", action="store_true",
                   help="file CPU timings under a GPU/NPU --device-type all the same")
    return p.parse_args(argv)


def _main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    from eth.profiles.db import load_profile
    from eth.spec.model_source import model_from_args

    if args.collectives_only:
        return _collectives_only(args, argv)
    if args.model is None:
        raise SpecError("--model is required (unless --collectives-only)")
    model = model_from_args(args, attention=args.attention)
    mbs, tp = int_list(args.mbs), int_list(args.tp)
    sizes = int_list(args.collective_sizes) if args.collective_sizes else None
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if args.collectives and world < 2:
        raise SpecError(f"--collectives needs torchrun with >= 2 processes, WORLD_SIZE is {world}")

    import torch

    from megatron.hpp.profiling import file as profile_file, ops as profiler

    cfg = profiler.ProfileConfig(model, args.device_type, mbs, tp,
                                 args.dtype or ("bf16" if torch.cuda.is_available() else "fp32"),
                                 args.repeats, args.warmup, args.seed, overheads=not args.no_overheads,
                                 real_tp=args.real_tp)
    device = profiler.local_device()
    warning = profiler.device_type_warning(cfg.device_type, device)
    if warning and device.type == "cpu" and _is_accelerator(cfg.device_type) and not args.force:
        raise SpecError(f"{warning}; measure on that device, name the profile cpu-..., "
                        f"or give --force")  # every rank, before any work
    out = Path(args.output)
    profile_file.check_output_path(out)
    old = None
    if out.exists():
        old = load_profile(out).data
        profile_file.check_merge_target(old, cfg.device_type, str(out))

    collectives = None
    if args.collectives:
        collectives = _collectives(profiler, sizes, args.repeats, args.warmup)
    if rank != 0:  # under torchrun only rank 0 measures the ops and writes
        return 0
    if warning:
        print(f"warning: {warning}", file=sys.stderr)

    from tqdm import tqdm

    bar = tqdm(total=len(mbs) * len(tp) * len(profiler.all_ops(model)), file=sys.stderr, unit="op",
               disable=args.no_progress, leave=False)
    try:
        entries = profiler.measure_entries(
            cfg, device, lambda m, t, op: (bar.set_postfix_str(f"mbs {m} tp {t} {op}"), bar.update()))
    except (RuntimeError, MemoryError) as exc:   # torch.OutOfMemoryError is a RuntimeError
        text = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        if not isinstance(exc, MemoryError) and "alloc" not in text.lower() and "out of memory" not in text.lower():
            raise
        raise SpecError(f"--mbs {','.join(map(str, mbs))} --tp {','.join(map(str, tp))}: the ops do not fit in "
                        f"{device.type} memory ({text}); give smaller --mbs") from None
    finally:
        bar.close()
    prov = profile_file.provenance(cfg, device, "python tools/profile_ops.py " + shlex.join(argv))
    if collectives:
        prov["collectives"] = {"world_size": world, "sizes_bytes": "full buffer per rank (fp32)",
                               "statistic": "median over repeats, max over ranks"}
    data = profile_file.profile_dict(cfg, entries, prov, collectives)
    if old is not None:
        data = profile_file.merge_profiles(old, data, str(out))
    from eth.profiles.db import save_profile

    try:
        save_profile(data, out)
    except OSError as exc:
        raise SpecError(f"cannot write {out}: {exc.strerror or exc}") from None
    print(profile_file.summary_table(cfg, entries))
    print(f"wrote {out} ({len(entries)} (mbs, tp) entries for {model.name} on {cfg.device_type}"
          f"{', collectives ' + ','.join(collectives) if collectives else ''})")
    return 0


def _collectives_only(args, argv) -> int:
    """``--collectives-only``: time the collectives on every rank and merge their tables
    into the existing measured profile ``-o`` of ``--device-type`` (rank 0 writes)."""
    from eth.profiles.db import load_profile, save_profile
    from megatron.hpp.profiling import file as profile_file, ops as profiler

    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if world < 2:
        raise SpecError(f"--collectives-only needs torchrun with >= 2 processes, WORLD_SIZE is {world}")
    out = Path(args.output)
    if not out.exists():
        raise SpecError(f"--collectives-only adds tables to an existing profile; {out} does not exist")
    old = load_profile(out).data
    profile_file.check_merge_target(old, args.device_type, str(out))
    sizes = int_list(args.collective_sizes) if args.collective_sizes else None
    collectives = _collectives(profiler, sizes, args.repeats, args.warmup)
    if rank != 0:
        return 0
    data = profile_file.add_collectives(old, collectives, {
        "world_size": world, "sizes_bytes": "full buffer per rank (fp32)",
        "statistic": "median over repeats, max over ranks",
        "command": "python tools/profile_ops.py " + shlex.join(argv)})
    try:
        save_profile(data, out)
    except OSError as exc:
        raise SpecError(f"cannot write {out}: {exc.strerror or exc}") from None
    sizes_n = sorted({n for table in collectives.values() for n in table}, key=int)
    print(f"wrote {out} (collectives {','.join(collectives)} over {','.join(sizes_n)} ranks; op entries kept)")
    return 0


def _is_accelerator(device_type: str) -> bool:
    """A GPU/NPU of the device catalog (A100, 910B2, ...), not a CPU type."""
    from eth.spec.cluster import catalog

    return device_type in catalog() and not device_type.lower().startswith("cpu")


def _collectives(profiler, sizes, repeats, warmup) -> dict:
    """Every rank: join the world, time the collectives, leave."""
    import torch.distributed as dist

    from megatron.hpp.compat import select_backend

    backend = select_backend(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend.name)
    try:
        from megatron.hpp.profiling.collectives import DEFAULT_COLLECTIVE_SIZES, measure_collectives

        return measure_collectives(backend.device, sizes or DEFAULT_COLLECTIVE_SIZES, repeats, warmup)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    """The CLI (``hpp-profile``); bad input: ``error: ...`` on stderr, exit 2."""
    return run_main(_main, argv)
