"""Write analytic profile databases, or import an Aceso-style CSV folder.

    python tools/make_profiles.py                       # profiles/<device>.json, all devices x presets
    python tools/make_profiles.py --devices A100,RTX3090 --models gpt3-13b --seq 4096 -o /tmp/p
    python tools/make_profiles.py --import-aceso runs/a100/ --device A100 --model gpt3-1.3b \
        -o profiles/A100-measured.json

Analytic files say "source": "analytic" and record the datasheet figures and the
efficiency factors they assume (eth/profiles.py).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eth.cli import int_list, run_main  # noqa: E402
from eth.cluster import catalog  # noqa: E402
from eth.errors import SpecError  # noqa: E402
from eth.model import PRESETS, get_model  # noqa: E402
from eth.profiles import DEFAULT_MBS, DEFAULT_TP, analytic_profile, import_aceso, save_profile  # noqa: E402


def _names(text: str, known, what: str) -> list[str]:
    if text == "all":
        return list(known)
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in known]
    if bad:
        raise SpecError(f"unknown {what} {bad}; known: {', '.join(known)}")
    return names


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-o", "--output", default="profiles", help="folder (generate) or file (import)")
    ap.add_argument("--devices", default="all", help="comma-separated catalog device types")
    ap.add_argument("--models", default="all", help="comma-separated model presets")
    ap.add_argument("--seq", type=int, default=None, help="sequence length override")
    ap.add_argument("--mbs", type=int_list, default=list(DEFAULT_MBS))
    ap.add_argument("--tp", type=int_list, default=list(DEFAULT_TP))
    ap.add_argument("--import-aceso", metavar="DIR", help="Aceso CSV folder to import")
    ap.add_argument("--device", help="device type of the imported profile")
    ap.add_argument("--model", help="model preset the imported CSVs profile")
    ap.add_argument("--size-unit-bytes", type=float, default=2 ** 20,
                    help="unit of the CSV size columns (Aceso writes MB)")
    args = ap.parse_args(argv)
    if args.seq is not None and args.seq <= 0:
        raise SpecError(f"--seq must be positive, got {args.seq}")

    if args.import_aceso:
        if not args.device or not args.model:
            raise SpecError("--import-aceso needs --device and --model")
        data = import_aceso(args.import_aceso, args.device, get_model(args.model, seq_len=args.seq),
                            args.size_unit_bytes)
        save_profile(data, args.output)
        n = sum(len(m["entries"]) for m in data["models"])
        print(f"imported {n} (mbs, tp) entries for {args.device} into {args.output}")
        return 0

    devices = catalog()
    out = Path(args.output)
    models = [get_model(n, seq_len=args.seq) for n in _names(args.models, list(PRESETS), "model")]
    for name in _names(args.devices, list(devices), "device"):
        data = analytic_profile(devices[name], models, args.mbs, args.tp)
        for m in data["models"]:
            for e in m["entries"]:
                e["ops"] = {op: [round(v, 6) if isinstance(v, float) else v for v in vals]
                            for op, vals in e["ops"].items()}
        save_profile(data, out / f"{name}.json")
    print(f"wrote analytic profiles for {len(_names(args.devices, list(devices), 'device'))} "
          f"device types x {len(models)} models to {out}/")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
