"""Shared test data: a tiny model and a hand-made profile with round numbers."""

from eth.spec.model import ModelSpec, op_shapes
from eth.profiles.db import OP_FIELDS, PROFILE_VERSION, SHAPE_FIELDS

TINY = ModelSpec("t", num_layers=4, hidden=8, heads=2, ffn=32, seq_len=4, vocab=16, dropout=0.0)
RESERVED = 1000.0


def flat_profile(device="cpu", model=TINY, mbs=(1, 2), tp=(1, 2)):
    """Every op takes fwd = mbs ms and bwd = 2*mbs ms; bytes from the model formulas."""
    entries = []
    for t in tp:
        for m in mbs:
            ops = {}
            for name, s in op_shapes(model, m, t).items():
                ops[name] = [float(m), 2.0 * m, s.weight_bytes, s.act_bytes, s.input_bytes, s.output_bytes]
            entries.append({"mbs": m, "tp": t, "reserved_bytes": RESERVED, "ops": ops})
    return {"version": PROFILE_VERSION, "device": device, "source": "test", "provenance": {},
            "op_fields": list(OP_FIELDS),
            "models": [{"name": model.name, "shape": {f: getattr(model, f) for f in SHAPE_FIELDS},
                        "entries": entries}]}


# Aceso's op names, in its order (flex_gpt): ours -> theirs
ACESO_NAMES = {"embedding": "encoder-embedding", "1st-layernorm": "enc-1st-layernorm", "qkv": "enc-attention-qkv",
               "score": "enc-attention-score", "softmax": "enc-attention-softmax",
               "attn-dropout": "enc-attention-dropout", "context": "enc-attention-context",
               "attn-dense": "enc-attention-dense", "post-attn-dropout": "enc-post-attention-dropout",
               "2nd-layernorm": "enc-2nd-layernorm", "mlp-gemm-1": "enc-MLP-GEMM-1", "gelu": "enc-MLP-gelu",
               "mlp-gemm-2": "enc-MLP-GEMM-2", "post-mlp-dropout": "enc-post-MLP-dropout",
               "final-layernorm": "final-layernorm", "head+loss": "gpt-post-process"}
