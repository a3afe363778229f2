"""`bench.check_cost`: what the door, the loss check and the sampled verification cost a stage's step, measured on
the tiny job (one A/B pair: a run of the bench, not a timing test; no figure is asserted)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_the_check_cost_bench_measures_every_check_of_both_stages(capsys) -> None:
    from bench.check_cost import main

    rc = main(["--models", "tiny", "--pairs", "1", "--threads", "1"])
    out = capsys.readouterr().out
    rows = {line.split("|")[0].strip(): [c.strip() for c in line.split("|")[1:]] for line in out.splitlines()
            if line.strip().startswith("tiny, ")}
    assert set(rows) == {"tiny, 0", "tiny, 1"}, out
    for name, (step, door, loss, verify, recompute, bcast, share, ab) in rows.items():
        assert float(step.removesuffix("ms")) > 0 and float(door.removesuffix("ms")) > 0, out
        assert float(recompute.removesuffix("ms")) > 0 and float(bcast.removesuffix("ms")) > 0, out
        # only the last stage judges a loss; the first receives gradients, the second activations
        assert (float(loss.removesuffix("ms")) > 0) == (name == "tiny, 1"), out
    assert ("targets met: 1/1" in out) == (rc == 0) and "targets met: " in out, out


def test_the_check_cost_bench_refuses_an_unknown_job() -> None:
    from bench.check_cost import main

    with pytest.raises(SystemExit, match="unknown job 'huge'"):
        main(["--models", "huge"])
