"""Every LLM script on tiny random models built from the configurations of seven model families, each carrying the
generation fields its Instruct release ships: a few steps train, LoRA finds its target modules, the sampler check
passes, and the log-probs are those of the model's own logits (Gemma 2 soft-caps them)."""
import importlib
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import train_rows

ROOT = Path(__file__).resolve().parents[1]
SIZE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=128)
# family: (config class, extra config fields, the generation fields of its Instruct release)
FAMILIES = {
    "llama": ("LlamaConfig", {}, {"do_sample": True, "temperature": 0.6, "top_p": 0.9}),
    "qwen2": ("Qwen2Config", {}, {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                  "repetition_penalty": 1.05}),
    "qwen3": ("Qwen3Config", {"head_dim": 8}, {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}),
    "mistral": ("MistralConfig", {}, {"do_sample": True, "temperature": 0.7}),
    "gemma2": ("Gemma2Config", {"head_dim": 8, "final_logit_softcapping": 2.0}, {"cache_implementation": "hybrid"}),
    "phi3": ("Phi3Config", {}, {"do_sample": True, "temperature": 0.7, "no_repeat_ngram_size": 3}),
    "gpt2": ("GPT2Config", {}, {"do_sample": True, "top_k": 50, "suppress_tokens": [5, 6]}),
}
TINY = {
    "grpo": dict(reward="capitalization", num_generations=4, prompts_per_step=2, micro_batch_size=4,
                 max_completion_length=6, warmup_steps=0, beta=0.04),
    "ppo": dict(reward="capitalization", prompts_per_step=4, num_mini_batches=2, max_completion_length=6,
                warmup_steps=0, beta=0.05),
    "dpo": dict(batch_size=4, micro_batch_size=2, warmup_steps=0),
    "hybrid": dict(prompts_per_step=4, sft_batch_size=4, max_completion_length=6, warmup_steps=0,
                   sft_fraction_start=0.5, sft_fraction_end=0.5),
    "reward_model": dict(batch_size=2, warmup_steps=0, log_every=1),
    "sft": dict(batch_size=8, max_new_tokens=6, warmup_steps=0, log_every=1),
}


@pytest.fixture(scope="module")
def families(tiny, tmp_path_factory):
    """family -> the folder of its tiny random model, with the task's tokenizer."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ROOT / "data/arith/tokenizer")
    root, out = tmp_path_factory.mktemp("families"), {}
    for name, (config_class, extra, generation) in FAMILIES.items():
        tokens = dict(vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                      bos_token_id=tok.eos_token_id)
        if name == "gpt2":
            config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=128, **tokens)
        else:
            config = getattr(transformers, config_class)(**SIZE, **extra, **tokens)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        model.generation_config.update(**generation)
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
        out[name] = root / name
    return out


def run(script, tiny, families, family, tmp_path, **kw):
    m = importlib.import_module(script)
    args = m.Args(model_name_or_path=str(families[family]), dataset=str(tiny / "data"), output_dir=str(tmp_path),
                  total_steps=2, eval_limit=4, eval_every=0, **TINY[script])
    return m.main(replace(args, **kw))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("script", ["grpo", "ppo", "dpo", "hybrid", "reward_model", "sft"])
def test_every_script_trains_every_family(tiny, families, tmp_path, family, script, capsys):
    out = run(script, tiny, families, family, tmp_path)
    rows = train_rows(out["run_dir"])
    assert [r["step"] for r in rows][-1] == 2 and all(torch.isfinite(torch.tensor(r["train/loss"])) for r in rows)
    gaps = [r["train/sampler_gap"] for r in rows if "train/sampler_gap" in r]
    assert all(g < 1e-4 for g in gaps) and (gaps or script not in ("grpo", "ppo", "hybrid"))
    if script != "reward_model" and FAMILIES[family][2]:  # the Instruct fields are named and not used
        assert "generation_config's" in capsys.readouterr().out
    final = Path(out["run_dir"]) / "final"
    assert json.loads((final / "config.json").read_text())["model_type"] == json.loads(
        (families[family] / "config.json").read_text())["model_type"]


# LoRA's set-up is the same call in every script (peft, target_modules="all-linear"): each family once, every script
# at least once, rather than the whole product.
LORA = list(zip(FAMILIES, ["grpo", "ppo", "dpo", "hybrid", "reward_model", "grpo", "ppo"]))


@pytest.mark.parametrize("family,script", LORA)
def test_lora_finds_its_target_modules_in_every_family(tiny, families, tmp_path, family, script):
    pytest.importorskip("peft")
    out = run(script, tiny, families, family, tmp_path, lora_r=2)
    assert train_rows(out["run_dir"])[-1]["step"] == 2
    assert (Path(out["run_dir"]) / "final" / "config.json").exists()  # merged into a plain model


def test_dpo_log_probs_are_of_gemma2s_soft_capped_logits(families):
    """dpo.py's plain and packed log-probs go through the same head as grpo.py's: against Gemma 2's own logits."""
    import dpo
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(families["gemma2"], attn_implementation="eager").eval()
    pairs = [([5, 6], [7, 8, 9, 1], [7, 8, 10, 1]), ([4], [12, 1], [13, 14, 1])]
    rows = [(p, c) for p, c, _ in pairs] + [(p, r) for p, _, r in pairs]
    with torch.no_grad():
        want = []
        for p, c in rows:
            logits = model(input_ids=torch.tensor([p + c])).logits[0].double()
            want.append(float(torch.log_softmax(logits, -1)[len(p) - 1 : -1].gather(-1, torch.tensor(c)[:, None]).sum()))
        plain = dpo.sequence_logprobs(model, *dpo.collate_completions(pairs, 0))
        packed = dpo.packed_logprobs(model, *dpo.pack_completions(pairs, pad_id=0))
    assert plain.double().tolist() == pytest.approx(want, abs=1e-5)
    assert packed.double().tolist() == pytest.approx(want, abs=1e-5)
