"""Each campaign workload's recommended configuration learns: a short run of it, at small sizes and on
2 workers, gains at least half of what DDP gains in the same run (local steps: a quarter) over a
uniform guess (ln V over a vocabulary of V, or chance accuracy), and keeps the replicas identical. A
recipe that stopped training (a sign error, a lost residual, a frozen optimizer) fails here before a
campaign spends hours on it."""

import math

import pytest
from sparsecomm_lab import campaign
from sparsecomm_lab.training import train

#: per workload: what shrinks it to seconds (data and model options, the budget)
SMALL = {
    "gpt": ({"train_chars": 60_000, "test_chars": 20_000, "vocab_size": 300, "seq_len": 16, "test_size": 32},
            {"width": 32, "layers": 1, "heads": 2}, {"steps": 40, "eval_every": 40, "dense_warmup_steps": 10}),
    "gpt-local": ({"train_chars": 60_000, "test_chars": 20_000, "vocab_size": 300, "seq_len": 16, "test_size": 32},
                  {"width": 32, "layers": 1, "heads": 2}, {"steps": 80, "eval_every": 80, "local_steps": 4}),
    "word-lstm": ({"test_size": 50, "max_vocab": 500}, {}, {"steps": 40, "eval_every": 40}),
    "resnet": ({"train_size": 2000, "test_size": 300}, {"widths": (8, 16, 32, 64)}, {"steps": 40, "eval_every": 40}),
}


def _gain(wl, name, arm_name, lr, data_options, model_options, budget):
    """How far ``arm_name``'s short run ends beyond a uniform guess (loss below ln V, or accuracy points
    above 10%); its replicas must agree."""
    arm = campaign.arms_of(name, [arm_name])[0]
    config = wl.config(arm, lr, 0, workers=2, batch_size=8, data_options={**wl.data_options, **data_options},
                       model_options={**wl.model_options, **model_options}, **budget)
    record = train(config)
    assert record["consistent"], arm_name  # every replica ended with the same parameters
    last = record["history"][-1]
    if wl.metric == "loss":
        assert math.isfinite(last["test_loss"]), (arm_name, last)
        return math.log(data_options.get("vocab_size") or data_options["max_vocab"]) - last["test_loss"]
    return last["test_accuracy"] - 100 / 10  # ten classes


@pytest.mark.parametrize("name", sorted(campaign.WORKLOADS))
def test_the_recommended_configuration_learns(name):
    if name.startswith("gpt"):
        pytest.importorskip("tokenizers")
    wl = campaign.workload(name)
    data_options, model_options, budget = SMALL[name]
    recommended = campaign.arms_of(name, [wl.recommended])[0]
    lr = wl.grid(recommended)[len(wl.grid(recommended)) // 2]
    dense = _gain(wl, name, "ddp", lr, data_options, model_options, budget)
    mine = _gain(wl, name, wl.recommended, lr, data_options, model_options, budget)
    # local steps learn more slowly per step than per-step synchronization: a quarter of DDP's gain
    share = 0.25 if recommended.kind == "local" else 0.5
    assert dense > 0 and mine >= share * dense, (mine, dense)
