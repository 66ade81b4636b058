"""The time-to-accuracy campaign (sparsecomm_lab.campaign) and the demo built on it."""

from __future__ import annotations

import json
import math
import os

import pytest
from sparsecomm_lab import campaign
from sparsecomm_lab.campaign import RunSpec
from sparsecomm_lab.data import DatasetUnavailable, load_dataset
from sparsecomm_lab.training import TrainConfig

from sparsecomm.methods import available_methods, method_class

SPARSE = [m for m in available_methods() if method_class(m).sparse]


def test_plan_puts_the_floor_and_baselines_first_then_every_sparse_method_at_its_recipe_density():
    runs = campaign.plan(["lstm"], ["1gbit", "100mbit"])
    first = [r for r in runs if r.net == "1gbit"]
    assert [r.label for r in first[:4]] == ["nosync", "ddp", "powersgd-r2", "powersgd-r4"]
    assert [r.method for r in first[4:]] == SPARSE
    # momentum correction's density on the word LSTM for the methods that can run it, else 1%
    assert {r.method: r.density for r in first[4:]} == {
        m: 0.001 if method_class(m).tracks_sent else 0.01 for m in SPARSE}
    assert len(runs) == 2 * len(first)
    assert {r.method: r.density for r in campaign.plan(["fashion"], [None], ["topka", "cltk"])} == \
        {"topka": 0.005, "cltk": 0.01}
    assert {r.density for r in campaign.plan(["lstm"], [None], ["topka"], density=0.02)} == {0.02}


def test_the_recipe_fills_density_and_lr_and_an_explicit_choice_wins():
    assert (TrainConfig(model="word-lstm", data="fortunes-words", method="topka").density,
            TrainConfig(model="word-lstm", data="fortunes-words", method="topka").lr) == (0.001, 3.0)
    hook = TrainConfig(model="word-lstm", data="fortunes-words", method="topka", sync="ddp")
    assert (hook.density, hook.lr, hook.momentum_correction) == (0.01, 1.0, False)
    assert TrainConfig(model="word-lstm", data="fortunes-words", method="topka", density=0.02).density == 0.02
    assert TrainConfig(model="word-lstm", data="fortunes-words", method="cltk").density == 0.01


def test_plan_runs_every_seed_and_powersgd_ranks_2_and_4_together():
    runs = campaign.plan(["lstm"], [None], ["powersgd", "topk"], powersgd_ranks=(2,), seeds=(0, 1, 2))
    assert [(r.label, r.seed) for r in runs if r.seed == 1] == [("powersgd-r2", 1), ("powersgd-r4", 1),
                                                                ("topk@0.001", 1)]
    assert len(runs) == 9 and campaign.SEEDS == (0, 1, 2)
    paths = {campaign.record_path("out", r) for r in runs}
    assert len(paths) == 9  # one record per seed
    with pytest.raises(ValueError, match="seeds"):
        campaign.plan(["lstm"], [None], seeds=(0, 0))


def test_the_campaign_workloads_train_three_epochs_and_the_demo_one():
    from sparsecomm_lab.commands.demo import demo_workload

    assert {w.max_epochs for w in campaign.WORKLOADS.values()} == {3}
    assert demo_workload("lstm", train_size=64, epochs=1).max_epochs == 1


def test_plan_subset_and_errors_name_the_bad_value():
    assert [r.label for r in campaign.plan(["fashion"], [None], ["ddp", "topk"])] == ["ddp", "topk@0.005"]
    with pytest.raises(ValueError, match="topkk"):
        campaign.plan(["lstm"], [None], ["topkk"])
    with pytest.raises(ValueError, match="cifar"):
        campaign.plan(["cifar"], [None])


T = campaign.WORKLOADS["lstm"].target  # the report applies the registry's target


def _ppl(*values: float) -> list[float]:
    """Perplexities given as if the target were 1000, scaled to the registry's target."""
    return [v * T / 1000 for v in values]


def _record(label: str, net: str | None, times: list[float], values: list[float], metric: str = "perplexity",
            target: float = T, density: float = 0.01, seed: int = 0, ms: float = 100.0) -> dict:
    key = "test_loss" if metric == "perplexity" else "test_accuracy"
    pairs = enumerate(zip(times, values, strict=True))
    history = [{"epoch": 0.5 * (i + 1), "train_time": t, "test_accuracy": 0.0, "test_loss": 0.0,
                key: math.log(v) if metric == "perplexity" else v} for i, (t, v) in pairs]
    return {"config": {"model": "word-lstm", "data": "fortunes-words", "net": net, "workers": 4, "density": density},
            "network": "emulated", "history": history,
            "epochs": [{"time_per_step": ms / 1e3, "bytes_per_step": 1e6}],
            "campaign": {"workload": "lstm", "metric": metric, "target": target, "label": label, "seed": seed}}


def _write(out: str, spec: RunSpec, record: dict) -> None:
    path = campaign.record_path(out, spec)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as handle:
        json.dump(record, handle)


def test_low_density_stage_takes_the_fastest_sparse_methods_of_the_first_stage(tmp_path):
    out = str(tmp_path)
    finishes = {"topk": 30.0, "spardl": 10.0, "cltk": None, "topka": 20.0}
    for method, seconds in finishes.items():
        values = _ppl(5000.0, 900.0) if seconds else _ppl(5000.0, 3000.0)
        record = _record(f"{method}@0.01", "1gbit", [5.0, seconds or 40.0], values)
        _write(out, RunSpec("lstm", "1gbit", method), record)
    runs = campaign.plan_low_density(["lstm"], ["1gbit"], out, best=2, from_density=0.01)
    assert [(r.method, r.density) for r in runs] == [("spardl", 0.001), ("topka", 0.001)]
    assert campaign.best_sparse(out, "lstm", "1gbit", 0.01)[-1] == "cltk"  # never reached: last
    # without a density, each method's first-stage run is looked up at its recipe density:
    # topk and topka (0.001 on the word LSTM) have none there
    assert campaign.best_sparse(out, "lstm", "1gbit") == ["spardl", "cltk"]


def test_run_campaign_skips_finished_runs_so_an_interrupted_campaign_resumes(tmp_path):
    calls = []

    def trainer(config):
        calls.append(config.method)
        return {"history": [{"epoch": 1.0, "train_time": 1.0, "test_accuracy": 0.0, "test_loss": math.log(50.0)}],
                "network": "loopback", "config": {}}

    specs = campaign.plan(["lstm"], [None], ["ddp", "topk"])
    _write(str(tmp_path), specs[0], _record("ddp", None, [1.0], _ppl(50.0)))
    paths = campaign.run_campaign(specs, str(tmp_path), trainer=trainer, echo=lambda _: None)
    assert calls == ["topk"] and all(os.path.exists(p) for p in paths)
    campaign.run_campaign(specs, str(tmp_path), trainer=trainer, echo=lambda _: None)
    assert calls == ["topk"]
    assert "?" not in paths[1] and "(" not in paths[1]


def test_rows_and_speedups_compare_against_ddp_at_the_same_network():
    records = [_record("ddp", "1gbit", [10.0, 20.0, 30.0], _ppl(3000.0, 1500.0, 900.0)),
               _record("powersgd-r2", "1gbit", [8.0, 16.0, 24.0], _ppl(4000.0, 950.0, 800.0)),
               _record("topka@0.01", "1gbit", [3.0, 6.0, 9.0], _ppl(3500.0, 1600.0, 930.0)),
               _record("cltk@0.01", "1gbit", [2.0, 4.0, 6.0], _ppl(6000.0, 4000.0, 2000.0))]
    rows = {r["method"]: r for r in campaign.campaign_rows(records)}
    assert rows["ddp"]["time to target s"] == 30.0 and rows["topka@0.01"]["speed-up vs DDP"] == pytest.approx(30 / 9)
    assert rows["cltk@0.01"]["time to target s"] == "not reached"
    assert rows["topka@0.01"]["vs DDP, same epochs"] == "+3.3%"
    (summary,) = campaign.speedups(list(rows.values()))
    assert summary["fastest sparse"] == "topka@0.01"
    assert summary["speed-up vs PowerSGD"] == pytest.approx(16 / 9)


def test_every_row_reports_its_step_over_the_floor_of_its_seed():
    records = [_record("nosync", "1gbit", [1.0, 2.0], _ppl(5000.0, 4000.0), ms=50.0),
               _record("ddp", "1gbit", [10.0, 20.0], _ppl(3000.0, 900.0), ms=400.0),
               _record("topka@0.01", "1gbit", [3.0, 6.0], _ppl(3500.0, 930.0), ms=120.0),
               _record("nosync", "1gbit", [1.0, 2.0], _ppl(5000.0, 4000.0), ms=60.0, seed=1),
               _record("topka@0.01", "1gbit", [3.0, 6.0], _ppl(3500.0, 930.0), ms=120.0, seed=1)]
    rows = campaign.campaign_rows(records)
    by = {(r["method"], r["seed"]): r for r in rows}
    assert by[("nosync", 0)]["x floor"] == pytest.approx(1.0)
    assert by[("nosync", 0)]["time to target s"] == "floor: no exchange"
    assert by[("ddp", 0)]["x floor"] == pytest.approx(8.0)
    assert by[("topka@0.01", 0)]["x floor"] == pytest.approx(2.4)
    assert by[("topka@0.01", 1)]["x floor"] == pytest.approx(2.0)  # against seed 1's floor
    (summary,) = campaign.speedups(rows)
    assert summary["fastest sparse"] == "topka@0.01" and summary["x floor"] == "2.2 (2-2.4)"


def test_headline_figures_are_the_median_over_seeds_with_the_least_and_the_most():
    records = []
    for seed, (ddp_t, power_t, topka_t) in enumerate([(30.0, 16.0, 8.0), (30.0, 18.0, 9.0), (33.0, 12.0, 12.0)]):
        records += [_record("ddp", "1gbit", [ddp_t], _ppl(900.0), seed=seed),
                    _record("powersgd-r2", "1gbit", [power_t], _ppl(900.0), seed=seed),
                    _record("powersgd-r4", "1gbit", [power_t + 1], _ppl(900.0), seed=seed),
                    _record("topka@0.01", "1gbit", [topka_t], _ppl(900.0), seed=seed),
                    _record("cltk@0.01", "1gbit", [2.0 if seed == 0 else 40.0],
                            _ppl(900.0 if seed == 0 else 2000.0), seed=seed)]
    rows = campaign.campaign_rows(records)
    (summary,) = campaign.speedups(rows)
    # cltk is fastest in one seed but never reaches the target in the other two: not the fastest in the median
    assert summary["fastest sparse"] == "topka@0.01" and summary["seeds"] == 3
    assert summary["its time s"] == 9.0 and summary["DDP s"] == 30.0
    assert summary["speed-up vs PowerSGD"] == pytest.approx(2.0)  # per seed 2.0, 2.0, 1.0
    assert summary["vs PowerSGD min-max"] == "2 (1-2)"
    aggregated = {r["method"]: r for r in campaign.aggregate_rows(rows)}
    assert aggregated["topka@0.01"]["time to target s"] == "9 (8-12)"
    assert aggregated["cltk@0.01"]["time to target s"] == "not reached (1/3 reached)"


def test_quiet_policy_waits_for_the_load_and_redoes_a_run_started_on_a_busy_machine():
    loads = iter([3.0, 2.5, 2.0, 1.0])
    slept = []
    policy = campaign.QuietPolicy(max_load_per_core=0.75, cores=2, max_wait_s=10.0, poll_s=5.0, redo=2,
                                  loadavg=lambda: next(loads), sleep=slept.append)
    calls = []

    def trainer(config):
        calls.append(config.seed)
        return {"history": [{"epoch": 1.0, "train_time": 1.0, "test_accuracy": 0.0, "test_loss": math.log(50.0)}],
                "network": "loopback", "config": {}}

    echoed = []
    record = campaign._train_quietly(campaign.WORKLOADS["lstm"].config(seed=4), trainer, policy, echoed.append)
    # first attempt: 3.0, waited 2 x 5 s to 2.0 > 1.5, run and redone; the second starts at 1.0
    assert slept == [5.0, 5.0] and calls == [4, 4]
    assert echoed[0].startswith("    load average 3.00 > 1.5") and "waiting up to 10 s" in echoed[0]  # said, not silent
    assert sum("waiting" in line for line in echoed) == 1 and "redone" in echoed[1]
    assert record["load"] == {"before": 1.0, "attempts": [2.0, 1.0], "threshold": 1.5, "quiet": True}
    with pytest.raises(ValueError, match="max_load_per_core"):
        campaign.QuietPolicy(max_load_per_core=0)


def test_report_writes_the_table_and_one_plot_per_workload_and_network(tmp_path):
    pytest.importorskip("matplotlib")
    records = [_record("ddp", "1gbit", [1.0, 2.0], _ppl(3000.0, 900.0)),
               _record("topk@0.01", "1gbit", [0.5, 1.0], _ppl(3100.0, 950.0)),
               _record("ddp", "100mbit", [5.0, 9.0], _ppl(3000.0, 900.0))]
    paths = campaign.write_campaign_report(records, str(tmp_path), command="sparsecomm bench time_to_accuracy")
    names = sorted(os.path.basename(p) for p in paths["plots"])
    assert names == ["campaign-lstm-100mbit.png", "campaign-lstm-1gbit.png"]
    with open(paths["markdown"]) as handle:
        text = handle.read()
    assert text.index(".png") < text.index("Speed-up") < text.index("sparsecomm bench time_to_accuracy")
    fast = next(row for row in paths["summary"] if row["network"] == "1gbit")
    assert fast["speed-up vs DDP"] == pytest.approx(2.0)


def test_demo_pieces_train_and_report_on_a_tiny_config(tmp_path):
    pytest.importorskip("matplotlib")
    from sparsecomm_lab.commands.demo import demo_workload, run_demo

    try:
        load_dataset("fortunes-words", max_vocab=2, test_size=1)
    except DatasetUnavailable as exc:
        pytest.skip(str(exc))
    workload = demo_workload("lstm", train_size=64, epochs=1, embed_dim=8, hidden=8)
    workload = campaign.Workload(**{**workload.__dict__, "evals_per_epoch": 2,
                                    "data_options": {**workload.data_options, "max_vocab": 300, "test_size": 8}})
    quiet = campaign.QuietPolicy(cores=2, loadavg=lambda: 0.25, sleep=lambda _: None)
    report = run_demo(workload, ["nosync", "ddp", "topka"], None, str(tmp_path), workers=2, quiet=quiet)
    assert [r["method"] for r in report["rows"]] == ["nosync", "ddp", "topka@0.001"]  # the recipe's density
    assert [r["load before"] for r in report["rows"]] == [0.25] * 3  # recorded as in the campaign
    assert [r["x floor"] for r in report["rows"]][0] == pytest.approx(1.0)
    assert all(isinstance(r["x floor"], float) for r in report["rows"])
    with open(report["markdown"]) as handle:
        assert handle.read().startswith("# sparsecomm demo")
    assert all(os.path.exists(p) for p in report["plots"])


def test_sparse_runs_take_the_recommended_recipe():
    """docs/training.md (the recipe): on the word LSTM, a method that reports the indices it sent (topka) runs DGC
    momentum correction through the synchronizer at lr 3.0; cltk (no last_sent) and models without a
    measured lr keep the DDP hook at the model's lr; an explicit hook or momentum choice wins."""
    lstm = campaign.WORKLOADS["lstm"]

    def recipe(config: TrainConfig) -> tuple:
        return config.sync, config.momentum_correction, config.lr

    assert recipe(lstm.config(method="topka")) == ("synchronizer", True, 3.0)
    assert recipe(lstm.config(method="cltk")) == ("ddp", False, 1.0)
    assert recipe(lstm.config(method="topka", sync="ddp")) == ("ddp", False, 1.0)
    assert recipe(lstm.config(method="topka", momentum_correction=False)) == ("ddp", False, 1.0)
    assert recipe(lstm.config(method="topka", lr=2.0)) == ("synchronizer", True, 2.0)
    assert recipe(lstm.config(method="ddp")) == ("ddp", False, 1.0)
    assert recipe(TrainConfig(model="cnn", method="topka")) == ("ddp", False, 0.05)
    for method in ("topka", "cltk", "ddp", "powersgd"):
        lstm.config(method=method).validate()


def test_campaign_runs_take_the_recommended_recipe_unless_one_is_named(tmp_path):
    configs = []

    def trainer(config):
        configs.append(config)
        return {"history": [{"epoch": 1.0, "train_time": 1.0, "test_accuracy": 0.0, "test_loss": math.log(50.0)}],
                "network": "loopback", "config": {}}

    specs = [RunSpec("lstm", None, "topka"), RunSpec("lstm", None, "topka", recipe="hook")]
    campaign.run_campaign(specs, str(tmp_path), trainer=trainer, echo=lambda _: None)
    assert [(c.sync, c.momentum_correction, c.lr) for c in configs] == [("synchronizer", True, 3.0),
                                                                        ("ddp", False, 1.0)]
    assert [s.recipe for s in campaign.plan_recipes(["lstm"], [None], "topka")] == list(campaign.RECIPES)


def test_the_demo_records_the_load_without_waiting_and_the_campaign_keeps_its_protocol():
    """The demo keeps to its 10 minutes (it records the load but neither waits nor redoes a run); the
    campaign waits up to 300 s and redoes a run started above the threshold twice."""
    import argparse

    from sparsecomm_lab.bench import time_to_accuracy
    from sparsecomm_lab.commands import demo

    defaults = {}
    for name, module in (("demo", demo), ("campaign", time_to_accuracy)):
        parser = argparse.ArgumentParser()
        module.add_arguments(parser)
        policy = campaign.quiet_policy(parser.parse_args([]))
        defaults[name] = (policy.threshold / policy.cores, policy.max_wait_s, policy.redo)
    assert defaults == {"demo": (0.75, 0.0, 0), "campaign": (0.75, 300.0, 2)}
