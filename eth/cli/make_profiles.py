"""Write analytic profile databases, or import an Aceso-style CSV folder (``hpp-profiles``).

    python tools/make_profiles.py                       # profiles/<device>.json, all devices x presets
    python tools/make_profiles.py --devices A100,RTX3090 --models gpt3-13b --seq 4096 -o /tmp/p
    python tools/make_profiles.py --gemm-efficiency fitted -o /tmp/fitted   # also the unapplied GPU fits
    python tools/make_profiles.py --import-aceso runs/a100/ --device A100 --model gpt3-1.3b \
        --aceso-model gpt_1_3B -o profiles/A100-measured.json

Analytic files say "source": "analytic" and record the datasheet figures and the
efficiency factors they assume (eth/profiles/db.py).  An existing file is merged into,
not replaced: the model shapes written now replace the same shapes in it, its other
shapes stay.  Nothing is written when a requested model would get no entry (e.g.
``--tp 3`` for a model whose heads are not divisible by 3), nor when an existing file
holds another device or another kind (analytic / measured) of profile.

An Aceso import (eth/profiles/aceso.py) converts Aceso's microsecond op times to ms, reads the
CSVs of one Aceso model (``--aceso-model``, needed when the folder holds several),
refuses CSVs whose weight / activation sizes do not fit ``--model`` (hidden, vocab,
heads), imports Aceso's ``prim_*`` collective tables and ``p2p_intra_node.csv``, and marks the op times as
including the tp all-reduces.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from eth.profiles.aceso import import_aceso
from eth.cli.common import int_list, run_main
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
    ap.add_argument("--size-unit-bytes", type=float, default=2 ** 20,
                    help="unit of the CSV size columns (Aceso writes MB)")
    args = ap.parse_args(argv)
    out = Path(args.output)

    if args.aceso_model and not args.import_aceso:
        raise SpecError("--aceso-model only applies with --import-aceso DIR")
    if args.import_aceso:
        if args.gemm_efficiency != "applied":
            raise SpecError("--gemm-efficiency applies to analytic profiles, not to --import-aceso")
        if not args.device or not args.model:
            raise SpecError("--import-aceso needs --device and --model")
        data = import_aceso(args.import_aceso, args.device, model_from_args(args),
                            args.size_unit_bytes, aceso_model=args.aceso_model)
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

    if out.exists() and not out.is_dir():
        raise SpecError(f"-o {out} is a file; the generator writes one <device>.json per device "
                        f"into a folder")
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


def main(argv=None) -> int:
    """The CLI (``hpp-profiles``); bad input: ``error: ...`` on stderr, exit 2."""
    return run_main(_main, argv)
