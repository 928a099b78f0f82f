"""--model as a preset, a model YAML file or a HuggingFace config.json, Megatron's model
flags on top (eth.spec.model_source), and the flags the plan decides (eth.spec.plan_flags)."""
import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from eth.errors import SpecError
from eth.spec.model import PRESETS
from eth.spec.model_source import apply_overrides, from_hf_config, load_model
from eth.spec.plan import load_plan
from eth.spec.plan_flags import check_plan_flags

ROOT = Path(__file__).resolve().parents[2]
LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 32, "vocab_size": 256, "hidden_act": "silu", "rms_norm_eps": 1e-6,
         "rope_theta": 500000.0, "tie_word_embeddings": False}


def test_presets_yaml_and_hf_files():
    assert load_model("gpt3-13b") is PRESETS["gpt3-13b"]
    assert load_model(str(ROOT / "examples/models/tiny-gpt.yaml")) == replace(PRESETS["tiny"], name="tiny-gpt")
    # the shipped LLaMA-shaped config is tiny-llama's shape (tiny-llama uses fused attention)
    llama = load_model(str(ROOT / "examples/models/llama-tiny/config.json"))
    assert replace(llama, name="tiny-llama", attention="fused") == PRESETS["tiny-llama"]
    mistral = load_model(str(ROOT / "examples/models/mistral-tiny/config.json"))
    assert (mistral.name, mistral.kv_heads, mistral.ffn, mistral.rope_theta, mistral.norm_eps) == \
        ("mistral-tiny", 2, 128, 1e6, 1e-6)


def test_hf_llama_fields():
    m = from_hf_config(LLAMA, name="x")
    assert (m.num_layers, m.hidden, m.heads, m.kv_heads, m.ffn, m.seq_len, m.vocab) == (4, 64, 4, 2, 96, 32, 256)
    assert (m.norm, m.position, m.swiglu, m.bias, m.norm_eps, m.rope_theta) == \
        ("rmsnorm", "rope", True, False, 1e-6, 500000.0)
    assert from_hf_config({**LLAMA, "num_key_value_heads": None}).kv_heads == 4   # absent: multi-head


def test_hf_gpt_neox_and_gpt2():
    neox = {"architectures": ["GPTNeoXForCausalLM"], "hidden_size": 64, "intermediate_size": 256,
            "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 512, "max_position_embeddings": 64,
            "rotary_pct": 1.0, "use_parallel_residual": False, "hidden_act": "gelu", "tie_word_embeddings": False}
    m = from_hf_config(neox)
    assert (m.norm, m.position, m.bias, m.swiglu, m.ffn) == ("layernorm", "rope", True, False, 256)
    gpt2 = {"architectures": ["GPT2LMHeadModel"], "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 32,
            "vocab_size": 256, "activation_function": "gelu", "tie_word_embeddings": False,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    m = from_hf_config(gpt2)
    assert (m.position, m.ffn, m.dropout, m.seq_len) == ("learned", 256, 0.0, 32)


@pytest.mark.parametrize("cfg, words", [
    ({**LLAMA, "architectures": ["Qwen2ForCausalLM"]}, ["Qwen2ForCausalLM is not supported", "q, k and v"]),
    ({**LLAMA, "architectures": ["FalconForCausalLM"]}, ["FalconForCausalLM is not supported"]),
    ({**LLAMA, "tie_word_embeddings": True}, ["tie_word_embeddings true"]),
    ({**LLAMA, "rope_scaling": {"type": "linear", "factor": 2.0}}, ["rope_scaling"]),
    ({**LLAMA, "hidden_act": "gelu"}, ["hidden_act 'gelu'"]),
    ({**LLAMA, "attention_bias": True}, ["attention_bias true"]),
    ({**LLAMA, "architectures": ["MistralForCausalLM"], "sliding_window": 16}, ["sliding_window 16 shorter"]),
    ({**LLAMA, "head_dim": 32}, ["head_dim 32"]),
    ({k: v for k, v in LLAMA.items() if k != "intermediate_size"}, ["missing 'intermediate_size'"]),
    ({"architectures": ["GPT2LMHeadModel"], "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 32,
      "vocab_size": 256, "tie_word_embeddings": False}, ["activation_function 'gelu_new'"]),
    ({"architectures": ["GPTNeoXForCausalLM"], "hidden_size": 64, "intermediate_size": 256,
      "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 512, "max_position_embeddings": 64},
     ["use_parallel_residual true"]),
])
def test_unsupported_configs_are_refused_by_name(cfg, words):
    with pytest.raises(SpecError) as err:
        from_hf_config(cfg)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_a_sliding_window_as_long_as_the_sequence_is_plain_attention(tmp_path):
    assert from_hf_config({**LLAMA, "architectures": ["MistralForCausalLM"], "sliding_window": 32}).seq_len == 32
    # Mistral-7B: 32768 positions, window 4096: usable at --seq-length 4096 (checked after the flag)
    mistral = {**LLAMA, "architectures": ["MistralForCausalLM"], "max_position_embeddings": 32768}
    (tmp_path / "config.json").write_text(json.dumps({**mistral, "sliding_window": 4096}))
    with pytest.raises(SpecError, match="sliding_window 4096 shorter than the sequence"):
        load_model(str(tmp_path / "config.json"))
    assert load_model(str(tmp_path / "config.json"), seq_len=4096).seq_len == 4096
    # absent keys take MistralConfig's defaults (8 kv heads, window 4096), not LLaMA's
    absent = {k: v for k, v in mistral.items() if k != "num_key_value_heads"}
    with pytest.raises(SpecError, match="sliding_window 4096 shorter"):
        from_hf_config({**absent, "num_attention_heads": 32, "hidden_size": 4096})
    assert from_hf_config({**absent, "num_attention_heads": 32, "hidden_size": 4096}, seq_len=4096).kv_heads == 8


def test_newer_rope_parameters_and_bad_values_are_one_line_errors(tmp_path):
    assert from_hf_config({**LLAMA, "rope_theta": None, "rope_parameters": {"rope_type": "default",
                                                                            "rope_theta": 1e6}}).rope_theta == 1e6
    with pytest.raises(SpecError, match="rope_parameters .*llama3"):
        from_hf_config({**LLAMA, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8}})
    for bad, words in [({"max_position_embeddings": None}, "'max_position_embeddings' as a positive integer"),
                       ({"head_dim": {}}, "head_dim {}"), ({"rms_norm_eps": "x"}, "'rms_norm_eps' as a number"),
                       ({"attention_dropout": 0.1}, "attention_dropout 0.1")]:
        with pytest.raises(SpecError, match=re.escape(words)):
            from_hf_config({**LLAMA, **bad})
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(SpecError, match="a HuggingFace config is a JSON object, got list"):
        load_model(str(tmp_path / "list.json"))
    (tmp_path / "m.yaml").write_text("num_layers: 2\nhidden: null\nheads: 4\n")
    with pytest.raises(SpecError, match="model.hidden must be a positive integer, got None"):
        load_model(str(tmp_path / "m.yaml"))
    (tmp_path / "e.yaml").write_text("num_layers: 2\nhidden: 64\nheads: 4\nnorm_eps: 1e-6\n")
    assert load_model(str(tmp_path / "e.yaml")).norm_eps == 1e-6           # YAML 1.1 reads 1e-6 as text


def test_megatron_overrides():
    m70 = PRESETS["llama2-70b"]
    assert apply_overrides(m70, {"num_attention_heads": 32}).kv_heads == 32        # alone: multi-head
    assert apply_overrides(m70, {"num_attention_heads": 32, "num_query_groups": 4}).kv_heads == 4
    assert apply_overrides(m70, {"hidden_size": 4096}).ffn == m70.ffn             # an explicit ffn stays
    assert apply_overrides(m70, {"num_attention_heads": 64}) == m70                # heads unchanged: GQA kept
    assert apply_overrides(PRESETS["gpt3-1.3b"], {"swiglu": True}).ffn == 5440     # Megatron's SwiGLU default
    with pytest.raises(SpecError, match=r"--normalization must be one of \['LayerNorm', 'RMSNorm'\]"):
        apply_overrides(m70, {"normalization": "rmsnorm"})
    gpt = apply_overrides(PRESETS["gpt3-13b"], {"hidden_size": 4096, "num_attention_heads": 32})
    assert (gpt.ffn, gpt.kv_heads) == (4 * 4096, 32)                               # Megatron's default ffn
    m = apply_overrides(PRESETS["tiny"], {"normalization": "RMSNorm", "position_embedding_type": "rope",
                                          "swiglu": True, "seq_length": 64, "vocab_size": 512, "num_layers": 2})
    assert (m.norm, m.position, m.swiglu, m.seq_len, m.vocab, m.num_layers) == ("rmsnorm", "rope", True, 64, 512, 2)
    with pytest.raises(SpecError, match="--num-attention-heads 7 does not divide --hidden-size 64"):
        apply_overrides(PRESETS["tiny"], {"num_attention_heads": 7})
    with pytest.raises(SpecError, match="--num-query-groups 3 does not divide --num-attention-heads 4"):
        apply_overrides(PRESETS["tiny"], {"num_query_groups": 3})
    with pytest.raises(SpecError, match="--num-layers must be a positive integer, got 0"):
        apply_overrides(PRESETS["tiny"], {"num_layers": 0})


def test_bad_model_sources(tmp_path):
    with pytest.raises(SpecError, match="unknown model 'gpt5'"):
        load_model("gpt5")
    with pytest.raises(SpecError, match="no such file"):
        load_model(str(tmp_path / "none.json"))
    (tmp_path / "m.yaml").write_text("num_layers: 2\nhidden: 64\nheads: 4\nwidth: 3\n")
    with pytest.raises(SpecError, match=r"unknown field\(s\) \['width'\]"):
        load_model(str(tmp_path / "m.yaml"))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(SpecError, match="not a readable JSON file"):
        load_model(str(tmp_path / "bad.json"))


def test_plan_flags_must_match_the_plan():
    plan = load_plan(ROOT / "examples/plans/cpu-demo.json")
    mbs = sorted({p.mbs for p in plan.pipelines})
    tps = sorted({s.tp for p in plan.pipelines for s in p.stages})   # the shipped plan's, whatever they are
    check_plan_flags(plan, {"global_batch_size": plan.gbs, "seq_length": plan.model.seq_len,
                            "hidden_size": plan.model.hidden, "normalization": "LayerNorm", "micro_batch_size": None,
                            **({"tensor_model_parallel_size": tps[0]} if len(tps) == 1 else {})})
    if len(tps) > 1:
        with pytest.raises(SpecError, match=r"--tensor-model-parallel-size .* \(per stage\)"):
            check_plan_flags(plan, {"tensor_model_parallel_size": tps[0]})
    with pytest.raises(SpecError, match=f"--global-batch-size {2 * plan.gbs} but the plan has {plan.gbs};"):
        check_plan_flags(plan, {"global_batch_size": 2 * plan.gbs})
    if len(mbs) > 1:
        with pytest.raises(SpecError, match=r"--micro-batch-size .* \(per pipeline\)"):
            check_plan_flags(plan, {"micro_batch_size": mbs[0]})
    with pytest.raises(SpecError, match=r"--num-attention-heads 8 does not match the plan's model tiny "
                                        r"\(heads 4, kv_heads 4\)"):
        check_plan_flags(plan, {"num_attention_heads": 8})


def _cli(*args):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_search_hpp_takes_a_config_json_and_megatron_flags(tmp_path):
    out = tmp_path / "plan.json"
    proc = _cli("tools/search_hpp.py", "--model", "examples/models/llama-tiny/config.json", "--attention", "fused",
                "--num-layers", "6", "--cluster", "examples/clusters/cpu-demo.yaml", "--global-batch-size", "16",
                "--seq-length", "32", "--profiles", "profiles/measured/cpu.json", "--precision", "fp32",
                "--no-progress", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    model = load_plan(out).model
    assert (model.name, model.num_layers, model.kv_heads, model.attention) == ("llama-tiny", 6, 2, "fused")
    # a shape the explicit profiles lack is an error naming it, unless analytic ones are asked for
    args = ["tools/search_hpp.py", "--model", "examples/models/mistral-tiny/config.json", "--cluster",
            "examples/clusters/cpu-demo.yaml", "--gbs", "16", "--profiles", "profiles/measured/cpu.json",
            "--no-progress"]
    proc = _cli(*args)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "has no entry for model mistral-tiny (hidden 64, heads 4, kv_heads 2" in proc.stderr
    assert "--profiles-fallback analytic" in proc.stderr
    assert _cli(*args, "--profiles-fallback", "analytic").returncode == 0
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({**LLAMA, "architectures": ["Qwen2ForCausalLM"]}))
    proc = _cli("tools/search_hpp.py", "--model", str(bad), "--cluster", "examples/clusters/cpu-demo.yaml",
                "--gbs", "16")
    assert proc.returncode == 2 and "architecture Qwen2ForCausalLM is not supported" in proc.stderr


def test_pretrain_gpt_checks_megatron_flags_against_the_plan():
    plan = load_plan(ROOT / "examples/plans/cpu-demo.json")
    tp = 2 * max(s.tp for p in plan.pipelines for s in p.stages)   # a degree no stage has
    for flags, words in [(["--micro-batch-size", "5"], "--micro-batch-size 5 but the plan has"),
                         (["--tensor-model-parallel-size", str(tp)], f"--tensor-model-parallel-size {tp} but the "
                                                                     f"plan has"),
                         (["--seq-length", "64"], "--seq-length 64 does not match the plan's model tiny (seq_len 32)"),
                         (["--lr-decay-style", "constant", "--min-lr", "0.1"], "--lr-decay-style constant with")]:
        proc = _cli("pretrain_gpt.py", "--hpp-plan", "examples/plans/cpu-demo.json", "--train-iters", "2", *flags)
        assert proc.returncode == 2 and words in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


def test_hf_opt_and_gpt_neo():
    """OPT with relu (its default) or gelu, learned positions, its own attention dropout;
    what our layers lack is refused by name, GPT-Neo always (local attention, unbiased q/k/v)."""
    opt = {"architectures": ["OPTForCausalLM"], "hidden_size": 64, "ffn_dim": 256, "num_hidden_layers": 2,
           "num_attention_heads": 4, "vocab_size": 256, "max_position_embeddings": 32,
           "word_embed_proj_dim": 64, "do_layer_norm_before": True, "dropout": 0.1, "attention_dropout": 0.0,
           "tie_word_embeddings": False}
    m = from_hf_config(opt)
    assert (m.activation, m.position, m.ffn, m.dropout, m.attn_dropout, m.seq_len) == ("relu", "learned", 256, 0.1,
                                                                                       0.0, 32)
    assert from_hf_config(dict(opt, activation_function="gelu")).activation == "gelu"
    for bad, words in (({"tie_word_embeddings": True}, "tie_word_embeddings true"),
                       ({"do_layer_norm_before": False}, "do_layer_norm_before false"),
                       ({"word_embed_proj_dim": 32}, "word_embed_proj_dim 32 != hidden_size 64"),
                       ({"activation_function": "silu"}, "activation_function 'silu'")):
        with pytest.raises(SpecError, match=re.escape(words)):
            from_hf_config(dict(opt, **bad))
    untied = {k: v for k, v in opt.items() if k != "tie_word_embeddings"}
    with pytest.raises(SpecError, match="tie_word_embeddings true"):      # transformers' OPT default
        from_hf_config(untied)
    neo = {"architectures": ["GPTNeoForCausalLM"], "hidden_size": 64, "num_layers": 2, "num_heads": 4,
           "vocab_size": 256, "max_position_embeddings": 32, "attention_types": [[["global", "local"], 1]],
           "window_size": 8}
    with pytest.raises(SpecError, match=r"GPTNeoForCausalLM with local attention layers \(a window of 8 tokens\); "
                                        r"q, k and v projections without biases .* 'gelu_new'"):
        from_hf_config(neo)
