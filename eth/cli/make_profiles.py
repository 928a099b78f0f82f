"""Write analytic profile databases, or import an Aceso-style CSV folder (``hpp-profiles``).

    python tools/make_profiles.py                       # profiles/<device>.json, all devices x presets
    python tools/make_profiles.py --devices A100,RTX3090 --models gpt3-13b --seq 4096 -o my_profiles
    python tools/make_profiles.py --gemm-efficiency fitted -o fitted_profiles   # also the unapplied GPU fits
    python tools/make_profiles.py --import-aceso runs/a100/ --device A100 --model gpt3-1.3b \
        --aceso-model gpt_1_3B -o profiles/A100-measured.json
    python tools/make_profiles.py --import-sailor profiles_tmp.json --sailor-model OPT-350 \
        --sailor-gpu GH-96 --device GH200 --model opt-350m.yaml -o profiles/GH200-sailor.json

Analytic files say "source": "analytic" and record the datasheet figures and the
efficiency factors they assume (eth/profiles/db.py).  An existing file is merged into,
not replaced: the model shapes written now replace the same shapes in it, its other
shapes stay.  Nothing is written when a requested model would get no entry (e.g.
``--tp 3`` for a model whose heads are not divisible by 3), nor when an existing file
holds another device or another kind (analytic / measured) of profile.

An Aceso import (eth/profiles/aceso.py) converts Aceso's microsecond op times to ms, reads the
CSVs of one Aceso model (``--aceso-model``, needed when the folder holds several),
refuses CSVs whose weight sizes do not fit ``--model`` (hidden, ffn, seq_len; the vocabulary
is scaled to the model's), takes every byte from the model's shapes, imports Aceso's
``prim_*`` collective tables and ``p2p_intra_node.csv``, and marks the op times as including
the tp all-reduces.  A Sailor import (eth/profiles/sailor.py) reads the layer times Sailor
measured in Megatron-DeepSpeed and spreads them over the ops.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from eth.profiles.aceso import DEFAULT_PATTERN, import_aceso
from eth.profiles.sailor import import_sailor
from eth.cli.common import check_output_dir, check_output_file, int_list, run_main
from eth.spec.cluster import catalog
from eth.errors import SpecError
from eth.spec.model import PRESETS
from eth.spec.model_source import add_model_args, apply_overrides, load_model, model_from_args, overrides_of
from eth.profiles.db import DEFAULT_MBS, DEFAULT_TP, analytic_profile, entry_shape, load_profile, save_profile


def _names(text: str, known, what: str) -> list[str]:
    if text == "all":
        return list(known)
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if known is not None and n not in known]
    if bad:
        raise SpecError(f"unknown {what} {bad}; known: {', '.join(known)}")
    if not names:
        raise SpecError(f"no {what} given")
    return names


def _shape(model_entry: dict) -> tuple:
    return entry_shape(model_entry["shape"])   # files written before a shape field existed: its GPT value


def merge_profile(old: dict, new: dict, where: str) -> dict:
    """``new``'s model shapes replace the same shapes in ``old``; ``old``'s other shapes
    are kept.  Both must be of one device and one source (else SpecError)."""
    if old["device"] != new["device"]:
        raise SpecError(f"{where} holds device {old['device']!r}, not {new['device']!r}; "
                        f"write to another file")
    if old["source"] != new["source"]:
        raise SpecError(f"{where} holds {old['source']!r} profiles, not {new['source']!r} ones; "
                        f"write to another file")
    shapes = {_shape(m) for m in new["models"]}
    kept = [m for m in old["models"] if _shape(m) not in shapes]
    merged = dict(old, provenance=new.get("provenance", old.get("provenance")),
                  models=kept + list(new["models"]))
    if new.get("collectives"):
        merged["collectives"] = new["collectives"]
    return merged


def _check_entries(models, tps: list[int]) -> None:
    """Every requested model gets at least one (mbs, tp) entry (else SpecError)."""
    for model in models:
        if not any(model.splits(t) for t in tps):
            raise SpecError(f"--tp {','.join(map(str, tps))} leaves model {model.name} without an entry: "
                            f"no tp in it divides heads {model.heads}, kv_heads {model.kv_heads}, "
                            f"ffn {model.ffn} and vocab {model.vocab}; nothing written")


def _round(data: dict) -> dict:
    for m in data["models"]:
        for e in m["entries"]:
            e["ops"] = {op: [round(v, 6) if isinstance(v, float) else v for v in vals]
                        for op, vals in e["ops"].items()}
    return data


def _merged(data: dict, path: Path) -> tuple[dict, bool]:
    """``data`` merged into the profile at ``path`` when one exists."""
    if not path.exists():
        return data, False
    if path.is_dir():
        raise SpecError(f"{path} is a directory, expected a profile JSON file")
    return merge_profile(load_profile(path).data, data, str(path)), True


def _main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("-o", "--output", default="profiles", help="folder (generate) or file (import)")
    ap.add_argument("--devices", default="all", help="comma-separated catalog device types")
    ap.add_argument("--models", default="all",
                    help="comma-separated models: presets, model YAML files or HuggingFace config.json files")
    ap.add_argument("--mbs", type=int_list, default=list(DEFAULT_MBS))
    ap.add_argument("--tp", type=int_list, default=list(DEFAULT_TP))
    ap.add_argument("--gemm-efficiency", choices=("applied", "fitted"), default="applied",
                    help="GEMM efficiency curves of the analytic profiles: the applied entries of "
                         "eth/data/gemm_efficiency.yaml (default), or every fitted one, also those "
                         "marked applied: false (the GPU fits)")
    ap.add_argument("--import-aceso", metavar="DIR", help="Aceso CSV folder to import")
    ap.add_argument("--device", help="device type of the imported profile")
    add_model_args(ap, required=False, model_help="the model the imported CSVs profile (a preset, a model "
                                                  "YAML file or a HuggingFace config.json); the overrides "
                                                  "below apply to it and to --models")
    ap.add_argument("--aceso-model", metavar="NAME",
                    help="Aceso's {model}_{size} of the CSVs to import (e.g. gpt_1_3B) when the "
                         "folder holds several models' CSVs")
    ap.add_argument("--size-unit-bytes", type=float, default=None,
                    help="unit of the CSV size columns (default 1048576: Aceso writes MB)")
    ap.add_argument("--aceso-pattern", metavar="PATTERN", default=None,
                    help="names of the op CSVs, with {model}, {mbs}, {tp} and optionally {algo} "
                         "(default: {model}_mbs{mbs}_tp{tp}_algo{algo}.csv, Aceso's and Sailor's)")
    ap.add_argument("--aceso-absent", metavar="OPS", default="",
                    help="comma-separated ops the CSVs time that the model does not have (e.g. "
                         "head+loss for a pipeline that ends at its final layernorm): no time, no bytes")
    ap.add_argument("--import-sailor", metavar="FILE",
                    help="Sailor's layer profiles (profiles_tmp.json) to import, with --sailor-model, "
                         "--sailor-gpu, --device and --model")
    ap.add_argument("--sailor-model", metavar="NAME", help="the model's name in the Sailor file (e.g. OPT-350)")
    ap.add_argument("--sailor-gpu", metavar="NAME", help="the GPU's name in the Sailor file (e.g. GH-96)")
    args = ap.parse_args(argv)
    out = Path(args.output)

    for flag, value in (("--aceso-model", args.aceso_model), ("--aceso-pattern", args.aceso_pattern),
                        ("--aceso-absent", args.aceso_absent), ("--size-unit-bytes", args.size_unit_bytes)):
        if value is not None and value != "" and not args.import_aceso:
            raise SpecError(f"{flag} only applies with --import-aceso DIR")
    if args.size_unit_bytes is None:
        args.size_unit_bytes = float(2 ** 20)
    elif not 0 < args.size_unit_bytes < float("inf"):
        raise SpecError(f"--size-unit-bytes must be a positive number of bytes, got {args.size_unit_bytes}")
    if args.import_aceso or args.import_sailor:
        check_output_file(out)
    elif out.exists() and not out.is_dir():
        raise SpecError(f"-o {out} is a file; the generator writes one <device>.json per device "
                        f"into a folder")
    else:
        check_output_dir(out, "-o")
    if args.import_sailor:
        return _import_sailor(args, out)
    if args.import_aceso:
        if args.gemm_efficiency != "applied":
            raise SpecError("--gemm-efficiency applies to analytic profiles, not to --import-aceso")
        if not args.device or not args.model:
            raise SpecError("--import-aceso needs --device and --model")
        absent = tuple(op.strip() for op in args.aceso_absent.split(",") if op.strip())
        data = import_aceso(args.import_aceso, args.device, model_from_args(args),
                            args.size_unit_bytes, aceso_model=args.aceso_model,
                            pattern=args.aceso_pattern or DEFAULT_PATTERN, absent=absent)
        n = sum(len(m["entries"]) for m in data["models"])
        if n == 0:
            raise SpecError(f"{args.import_aceso} holds no (mbs, tp) entry for {args.model}; nothing written")
        for line in data["provenance"]["warnings"]:
            print(f"warning: {line}", file=sys.stderr)
        data, merged = _merged(data, out)
        save_profile(data, out)
        tables = sum(len(by_n) for by_n in data.get("collectives", {}).values())
        print(f"imported {n} (mbs, tp) entries of {data['provenance']['aceso_model']} for {args.device} "
              f"into {out}" + (f", {tables} collective tables" if tables else "")
              + (" (merged into the existing file)" if merged else ""))
        return 0

    devices = catalog()
    names = _names(args.devices, list(devices), "device")
    overrides = overrides_of(args)
    models = [apply_overrides(load_model(n, overrides.get("seq_length")), overrides)
              for n in (list(PRESETS) if args.models == "all" else _names(args.models, None, "model"))]
    _check_entries(models, args.tp)
    # build and validate every file before the first write
    fitted = args.gemm_efficiency == "fitted"
    files = [(out / f"{name}.json",
              _round(analytic_profile(devices[name], models, args.mbs, args.tp, include_unapplied=fitted)))
             for name in names]
    files = [(path, *_merged(data, path)) for path, data in files]
    for path, data, _ in files:
        save_profile(data, path)
    merged = sum(m for _, _, m in files)
    print(f"wrote analytic profiles for {len(names)} device types x {len(models)} models to {out}/"
          + (f" (merged into {merged} existing files)" if merged else ""))
    return 0


def _import_sailor(args, out: Path) -> int:
    """``--import-sailor FILE``: Sailor's layer profiles of one model and GPU (eth/profiles/sailor.py)."""
    missing = [f for f, v in (("--sailor-model", args.sailor_model), ("--sailor-gpu", args.sailor_gpu),
                              ("--device", args.device), ("--model", args.model)) if not v]
    if missing:
        raise SpecError(f"--import-sailor needs {', '.join(missing)}")
    types = catalog()
    if args.device not in types:
        raise SpecError(f"--device {args.device!r} is not in the device catalog ({', '.join(types)}); the "
                        f"layer times are spread over the ops by that type's analytic profile")
    data = import_sailor(args.import_sailor, args.sailor_model, args.sailor_gpu, types[args.device],
                         model_from_args(args))
    data, merged = _merged(data, out)
    save_profile(data, out)
    n = sum(len(m["entries"]) for m in data["models"])
    print(f"imported {n} (mbs, tp) entries of {args.sailor_model} on {args.sailor_gpu} for {args.device} into "
          f"{out}" + (" (merged into the existing file)" if merged else ""))
    return 0


def main(argv=None) -> int:
    """The CLI (``hpp-profiles``); bad input: ``error: ...`` on stderr, exit 2."""
    return run_main(_main, argv)
