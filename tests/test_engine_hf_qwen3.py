"""A real-format Qwen3 directory end to end on CPU: a randomly initialised dense Qwen3 saved by transformers
(save_pretrained, safetensors, tied embeddings, rope_parameters as transformers 5 writes them), a tokenizer this test
builds with the `tokenizers` library (tokenizer.json + tokenizer_config.json with a chat template; no downloads),
and a dapo-math style JSONL task, trained for a few GRPO steps by `policyc run --model DIR`.

The tokenizer's word vocabulary holds whole `\\boxed{N}` answers as single tokens, so an untrained model samples a
correct boxed answer often enough for GRPO to get non-zero advantages: the steps really update the weights.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import StrictCliRunner

SPECIALS = ["<pad>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ["user", "assistant", "add", "one", "two", "and", "\\boxed{2}", "\\boxed{3}", "\\boxed{4}", "so", "[UNK]"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")


def build_qwen3_dir(path, tie: bool = True):
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import Qwen3Config, Qwen3ForCausalLM

    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "pad_token": "<pad>", "chat_template": TEMPLATE}))
    cfg = Qwen3Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, tie_word_embeddings=tie, max_position_embeddings=128,
                      eos_token_id=vocab["<|im_end|>"], pad_token_id=0, bos_token_id=None)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    return vocab


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3") / "model"
    build_qwen3_dir(d)
    return d


def test_forward_matches_transformers(qwen3_dir):
    from transformers import Qwen3ForCausalLM

    from precision_dsl.engine.model import load_model

    ours = load_model(qwen3_dir)
    ref = Qwen3ForCausalLM.from_pretrained(qwen3_dir).eval()
    ids = torch.randint(0, 15, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(ours(ids), ref(ids).logits, atol=1e-5, rtol=1e-4)


def test_tokenizer_uses_chat_template_and_special_tokens(qwen3_dir):
    from precision_dsl.engine.task import HFTokenizer, load_tokenizer

    tok = load_tokenizer(qwen3_dir)
    assert isinstance(tok, HFTokenizer)
    assert tok.eos_id == SPECIALS.index("<|im_end|>") and tok.pad_id == 0
    ids = tok.encode_prompt("add one and two")
    names = [(SPECIALS + WORDS)[i] for i in ids]
    assert names == ["<|im_start|>", "user", "add", "one", "and", "two", "<|im_end|>", "<|im_start|>", "assistant"]
    assert tok.decode([ids[2], ids[3], tok.eos_id, ids[4]]) == "add one"  # stops at EOS


def test_policyc_run_trains_a_real_qwen3_dir_end_to_end(qwen3_dir, tmp_path):
    from precision_dsl.cli import app

    data = tmp_path / "dapo.jsonl"
    rows = [{"prompt": [{"role": "user", "content": "add one and one"}], "label": "2"},
            {"prompt": "add one and two", "label": "3"},
            {"prompt": "add two and two", "label": "4"}]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    policy = tmp_path / "q3-mxfp8.policy"
    policy.write_text('policy "q3-mxfp8" {\n    target blackwell\n    default bf16\n'
                      '    attn: mxfp8 backward=dequantized\n    mlp: mxfp8 backward=dequantized\n}\n')
    out = tmp_path / "run"
    r = StrictCliRunner().invoke(app, ["run", str(policy), "--model", str(qwen3_dir), "--task", str(data), "--steps", "2",
                                 "--prompts", "4", "--samples", "4", "--lr", "1e-2", "--max-new-tokens", "6",
                                 "--out", str(out)])
    assert r.exit_code == 0, r.output
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2
    assert all(s["quantized_weights_identical"] for s in steps)
    assert any(s["reward_mean"] > 0 for s in steps) and any(s["grad_norm"] > 0 for s in steps)
    assert all(s["mismatch_abs_logp"] < 1.0 for s in steps)
    summary = json.loads((out / "summary.json").read_text())
    assert "emulated" in summary["note"]


def test_bf16_run_is_not_labelled_emulated(qwen3_dir, tmp_path):
    from precision_dsl.cli import app

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "add one and one", "label": "2"}) + "\n")
    out = tmp_path / "run"
    r = StrictCliRunner().invoke(app, ["run", "bf16", "--model", str(qwen3_dir), "--task", str(data), "--steps", "1",
                                 "--prompts", "2", "--samples", "2", "--max-new-tokens", "4",
                                 "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "emulated" not in r.output.lower()
    assert "emulated" not in json.loads((out / "summary.json").read_text())["note"]


def test_run_on_a_dense_model_picks_the_dense_default(qwen3_dir, tmp_path):
    """The MoE default (nvfp4-pertoken-dequant-backward) names routed_experts, which a dense Qwen3 lacks: without a
    policy `policyc run` takes nvfp4-dense, and an MoE-only policy is refused naming the shipped ones that fit."""
    from precision_dsl.cli import app

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "add one and one", "label": "2"}) + "\n")
    out = tmp_path / "run"
    r = StrictCliRunner().invoke(app, ["run", "--model", str(qwen3_dir), "--task", str(data), "--steps", "1",
                                       "--prompts", "2", "--samples", "2", "--max-new-tokens", "4", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "default policy nvfp4-dense" in r.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["quantized_weights_identical_every_step"] is True
    bad = StrictCliRunner().invoke(app, ["run", "mxfp8-e2e", "--model", str(qwen3_dir), "--task", str(data),
                                         "--steps", "1", "--out", str(tmp_path / "bad")])
    assert bad.exit_code != 0
    assert "routed_experts" in bad.output and "fit" in bad.output and "mxfp8-dense" in bad.output, bad.output
