"""A tied GPT-2 `config.json` (`transformers.GPT2Config`, shrunk to tiny widths) as a user brings it: a coordinator
and two node processes profile it, plan it and train it, `atoll export` writes the checkpoint, and
`transformers.GPT2LMHeadModel` loads the folder with the logits of Atoll's own model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pipeline_harness import assert_losses_match, tiny_job

from atoll.job import JobSpec
from atoll.launch.cli import main
from atoll.launch.localcluster import LocalCluster
from atoll.node.checkpoint import load_layers
from atoll.node.local import train_local
from atoll.node.model import build_slice
from atoll.node.stage import StageConfig, build_optimizer

transformers = pytest.importorskip("transformers")

STEPS = 5


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_a_tied_gpt2_config_trains_on_two_nodes_and_exports_to_transformers(tmp_path: Path) -> None:
    transformers.GPT2Config(vocab_size=256, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=255,
                            eos_token_id=255).save_pretrained(tmp_path / "gpt2")
    text = tiny_job(STEPS, interval=STEPS, nodes=2).to_toml()
    assert text.count('preset = "tiny"') == 1
    job = JobSpec.from_toml(text.replace('preset = "tiny"', f'hf_config = "{tmp_path / "gpt2" / "config.json"}"'))
    assert job.model.tied_head and job.model.style == "gpt"
    path = tmp_path / "job.toml"
    path.write_text(job.to_toml())
    expected, _ = train_local(job)
    with LocalCluster(job_path=path, out=tmp_path / "run", insecure=True) as cluster:
        cluster.start_coordinator(extra=["--island-threshold", "0.001"])
        for name in ("node1", "node2"):
            cluster.start_node(name)
        planned = cluster.wait_status(lambda s: s.plan.epoch >= 1, 120, "a plan")
        got = cluster.wait_losses(STEPS, 120)
    assert len({n for p in planned.plan.pipelines for st in p.stages for n in st.node_ids}) == 2  # both nodes train
    assert_losses_match(got, expected, 1e-4, range(STEPS))

    out = tmp_path / "hf"
    assert main(["export", "--checkpoint-dir", str(cluster.checkpoints), "--step", str(STEPS), "--out", str(out)]) == 0
    hf = transformers.GPT2LMHeadModel.from_pretrained(out, dtype=torch.float32).eval()
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()  # loaded tied
    ours = build_slice(job.model, 0, job.model.n_layers + 2)
    load_layers(ours, build_optimizer(ours, StageConfig(micro_batches=1)), cluster.checkpoints, STEPS)
    assert not torch.equal(ours.layers["0"].tok.weight, build_slice(job.model, 0, 1).layers["0"].tok.weight)  # trained
    ids = torch.randint(0, job.model.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours.eval()(ids), atol=1e-5, rtol=0)
