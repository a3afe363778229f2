"""`atoll export`: a checkpoint written by two stages, gathered into a Hugging Face folder that
`transformers.AutoModelForCausalLM.from_pretrained` loads; its logits equal Atoll's forward (fp32, within
1e-5 absolute) and greedy `generate` gives the tokens Atoll's own greedy decoding gives."""

from __future__ import annotations

import json
import logging
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from atoll.hf import config_from_hf
from atoll.launch.cli import main
from atoll.models import preset
from atoll.modelspec import ModelConfig
from atoll.node.checkpoint import read_checkpoint, save_layers
from atoll.node.model import StageModule, build_slice, lm_loss
from atoll.node.stage import StageConfig, build_optimizer

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parent.parent
QWEN = {"model_type": "qwen2", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False}
GPT2 = {"model_type": "gpt2", "vocab_size": 300, "n_embd": 64, "n_layer": 3, "n_head": 4, "n_positions": 64,
        "activation_function": "gelu_new", "tie_word_embeddings": True}


def _trained_checkpoint(config, cuts: list[int], root: Path, step: int) -> list[StageModule]:
    """The stages of `cuts`, trained two AdamW steps on random tokens (so norms and biases leave their
    initial values), each saved as a node saves it."""
    stages = [build_slice(config, a, b, seed=7) for a, b in zip(cuts, cuts[1:])]
    opts = [build_optimizer(s, StageConfig(micro_batches=1, lr=1e-2)) for s in stages]
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        ids = torch.randint(0, config.vocab_size, (2, 17), generator=g)
        x = ids[:, :-1]
        for s in stages:
            x = s(x)
        lm_loss(x, ids[:, 1:]).backward()
        for o in opts:
            o.step()
            o.zero_grad()
    for s, o in zip(stages, opts):
        save_layers(s, o, root, step, data_position=123)
    return [s.eval() for s in stages]


class _TransformersWarnings(logging.Handler):
    """Every warning `transformers` logs or raises while it is entered (its loggers do not reach pytest's)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        self._caught = warnings.catch_warnings(record=True)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def __enter__(self) -> None:
        logging.getLogger("transformers").addHandler(self)
        self._seen = self._caught.__enter__()
        warnings.simplefilter("always")

    def __exit__(self, *exc) -> None:
        self._caught.__exit__(*exc)
        logging.getLogger("transformers").removeHandler(self)
        self.messages += [str(w.message) for w in self._seen]


def _greedy(stages: list[StageModule], ids: torch.Tensor, n: int) -> torch.Tensor:
    with torch.no_grad():
        for _ in range(n):
            x = ids
            for s in stages:
                x = s(x)
            ids = torch.cat([ids, x[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


LLAMA3 = {"model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 1, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
          "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
          "tie_word_embeddings": True}
# heads wider than hidden_size / heads with q/k norms (Qwen3); Gemma's narrower heads, (1 + weight) norms, scaled
# embedding, tanh-GELU gate and tied head
QWEN3 = {"model_type": "qwen3", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 64,
         "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False}
GEMMA = {"model_type": "gemma", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 8, "max_position_embeddings": 64,
         "rms_norm_eps": 1e-6, "hidden_act": "gelu_pytorch_tanh", "tie_word_embeddings": True}
# Atoll's own presets export too: the demo's tiny model (gpt style, exact GELU, untied) and a llama-style one
TINY = replace(preset("tiny"), vocab_size=300)
TINY_LLAMA = replace(preset("tiny"), style="llama", vocab_size=300, n_kv_heads=2, ffn_hidden=96)


@pytest.mark.parametrize("shape,cuts", [(QWEN, [0, 2, 5]), (GPT2, [0, 5]), (LLAMA3, [0, 4]), (TINY, [0, 3, 6]),
                                        (TINY_LLAMA, [0, 2, 6]), (QWEN3, [0, 2, 4]), (GEMMA, [0, 5])],
                         ids=["qwen2-two-stages", "gpt2-tied", "llama3-rope-tied", "atoll-tiny", "atoll-tiny-llama",
                              "qwen3-wide-heads", "gemma-tied"])
def test_export_loads_in_transformers_with_the_same_logits(shape, cuts, tmp_path: Path, capsys) -> None:
    from atoll.node.tokenizer import train_bpe

    config = shape if isinstance(shape, ModelConfig) else config_from_hf(shape, name="exported")
    stages = _trained_checkpoint(config, cuts, tmp_path / "ckpt", step=4)
    tok = train_bpe([REPO / "atoll" / "data" / "genesis-exodus.txt"], vocab_size=300, out=tmp_path / "tok.json")
    out = tmp_path / "hf"
    assert main(["export", "--checkpoint-dir", str(tmp_path / "ckpt"), "--step", "4", "--out", str(out),
                 "--tokenizer", str(tmp_path / "tok.json"), "--shard-size", str(40e3 / 1024**3)]) == 0
    assert "from_pretrained" in capsys.readouterr().out
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == (shape["model_type"] if isinstance(shape, dict) else
                                 {"llama": "llama", "gpt": "gpt2"}[config.style])
    assert cfg["atoll"]["step"] == 4
    assert cfg["eos_token_id"] == tok.eos_id

    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert hf.config.tie_word_embeddings == config.tied_head
    text = "In the beginning God created the heaven and the earth."
    ids = transformers.AutoTokenizer.from_pretrained(out)(text, return_tensors="pt").input_ids
    assert ids.tolist()[0] == tok.encode(text).tolist()
    with torch.no_grad():
        x = ids
        for s in stages:
            x = s(x)
        torch.testing.assert_close(hf(ids).logits, x, atol=1e-5, rtol=0)
    # the context length is the config's; a max_length beside the caller's max_new_tokens would be warned about
    assert "max_length" not in json.loads((out / "generation_config.json").read_text())
    assert hf.config.max_position_embeddings == config.seq_len
    warned = _TransformersWarnings()
    with warned:
        generated = hf.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.eos_id)
    assert warned.messages == []
    assert generated.shape[1] == ids.shape[1] + 6
    assert torch.equal(generated, _greedy(stages, ids, 6))
    # exported again into the same folder, whole and without --tokenizer: nothing of the first export's weights is
    # left to load with it (its shards and index), and the tokenizer it wrote stays, its ids in the configs
    assert main(["export", "--checkpoint-dir", str(tmp_path / "ckpt"), "--step", "4", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                     "tokenizer.json", "tokenizer_config.json"]
    assert "no tokenizer in" not in capsys.readouterr().err
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == tok.eos_id
    assert transformers.AutoTokenizer.from_pretrained(out)(text).input_ids == tok.encode(text).tolist()
    # into a new folder without --tokenizer: none there, said with what to do
    assert main(["export", "--checkpoint-dir", str(tmp_path / "ckpt"), "--step", "4", "--out", str(tmp_path / "bare")]) == 0
    assert sorted(p.name for p in (tmp_path / "bare").iterdir()) == ["config.json", "generation_config.json",
                                                                    "model.safetensors"]
    err = capsys.readouterr().err
    assert "no tokenizer in" in err and "--tokenizer" in err


def test_export_refuses_an_incomplete_checkpoint(tmp_path: Path, capsys) -> None:
    config = config_from_hf(QWEN)
    first = build_slice(config, 0, 2)
    save_layers(first, build_optimizer(first, StageConfig(micro_batches=1)), tmp_path, 3, data_position=0)
    assert main(["export", "--checkpoint-dir", str(tmp_path), "--step", "3", "--out", str(tmp_path / "hf")]) == 2
    assert "does not hold all 5 layers" in capsys.readouterr().err
    assert main(["export", "--checkpoint-dir", str(tmp_path), "--step", "9", "--out", str(tmp_path / "hf")]) == 2
    assert "steps there: [3]" in capsys.readouterr().err
    assert main(["export", "--checkpoint-dir", str(tmp_path), "--step", "2", "--out", str(tmp_path / "hf")]) == 2
    assert "the one after step 2, as the logs and `atoll status` number steps, is 3" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


def test_read_checkpoint_gathers_every_layer_once(tmp_path: Path) -> None:
    config = config_from_hf(QWEN)
    stages = _trained_checkpoint(config, [0, 2, 4, 5], tmp_path, step=1)
    got, tensors, extra = read_checkpoint(tmp_path, 1)
    assert got == config and extra["data_position"] == 123
    want = {k: v for s in stages for k, v in s.state_dict().items()}
    assert tensors.keys() == want.keys()
    assert all(torch.equal(tensors[k], want[k]) for k in want)
