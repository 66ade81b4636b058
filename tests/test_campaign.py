"""The time-to-quality campaign (sparsecomm_lab.campaign): the shared grid, the seeds at the best lr,
the target, the composed time to it, the goals, the report; and the demo's pieces."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os

import pytest
from sparsecomm_lab import campaign
from sparsecomm_lab.campaign import plan, run
from sparsecomm_lab.commands import demo


def _history(losses, every=10):
    return [{"step": every * (i + 1), "epoch": 0.1 * (i + 1), "train_time": float(i + 1), "test_loss": loss,
             "test_accuracy": 0.0} for i, loss in enumerate(losses)]


def _tiny(**changes):
    wl = dataclasses.replace(campaign.WORKLOADS["gpt"], steps=40, eval_every=10, lr_grids={"adamw": (1e-3, 3e-3)})
    return dataclasses.replace(wl, **changes)


def _record(arm, lr, seed, losses, phase="convergence", net="loopback", step_times=None, warmup=0, repeat=0,
            load=None):
    return {"history": _history(losses), "epochs": [{"bytes_per_step": 10.0}],
            "steps": [{"time": t} for t in (step_times or [])], "config": {"lr": lr}, "load": {"before": load},
            "campaign": {"workload": "gpt", "arm": arm, "lr": lr, "seed": seed, "phase": phase, "net": net,
                         "warmup_steps": warmup, "repeat": repeat}}


def test_every_arm_shares_the_grid_and_the_recommended_arm_exists():
    for name, wl in campaign.WORKLOADS.items():
        arms = campaign.arms_of(name)
        assert wl.recommended in {a.name for a in arms}
        for grid in wl.lr_grids.values():
            if wl.note:  # a comparison at one tuned lr, said in its report
                continue
            assert len(grid) >= 4 and sorted(grid) == list(grid)
            ratios = [b / a for a, b in zip(grid, grid[1:], strict=False)]
            assert max(ratios) / min(ratios) < 1.5  # log-spaced
        assert {"floor", "ddp"} <= {a.name for a in arms}
        assert wl.note or any(a.kind == "powersgd" for a in arms)  # torch's PowerSGD, on its lr grid
        for arm in arms:  # a recipe that changes the optimizer names its dense twin, which exists
            if arm.options.get("freeze_adam_variance") and arm.kind == "sparse" and not wl.note:
                assert arm.dense_twin in {a.name for a in arms}
    with pytest.raises(ValueError, match="unknown arm"):
        campaign.arms_of("gpt", ["ddp", "dgc"])
    with pytest.raises(ValueError, match="unknown workload"):
        campaign.workload("bert")


def test_convergence_runs_the_grid_then_the_other_seeds_at_each_arms_best_lr_and_resumes(tmp_path):
    wl = _tiny()
    arms = campaign.arms_of("gpt", ["floor", "ddp", "topka-hook@0.01"])
    made = []

    def trainer(config):
        made.append((config.method, config.lr, config.seed))
        best = 3e-3 if config.method == "ddp" else 1e-3
        return {"history": _history([3.0, 2.0 + abs(math.log(config.lr / best))]), "epochs": [], "steps": [],
                "config": {}}

    run.run_convergence(str(tmp_path), wl, arms, trainer=trainer, echo=lambda _: None)
    assert ("nosync", 1e-3, 0) not in made  # the floor is only timed
    assert sorted(made[:4]) == sorted([("ddp", 1e-3, 0), ("ddp", 3e-3, 0), ("topka", 1e-3, 0), ("topka", 3e-3, 0)])
    assert sorted(made[4:]) == sorted([("ddp", 3e-3, 1), ("ddp", 3e-3, 2), ("topka", 1e-3, 1), ("topka", 1e-3, 2)])
    assert run.best_lr(str(tmp_path), wl, arms[1]) == 3e-3
    made.clear()
    run.run_convergence(str(tmp_path), wl, arms, trainer=trainer, echo=lambda _: None)
    assert made == []  # every record exists: resumed, nothing retrained


def test_the_target_the_steps_the_composed_time_the_limit_and_the_goals():
    wl = _tiny(recommended="topka-fva@0.01")
    records = []
    for seed in (0, 1, 2):  # DDP reaches 2.0 at step 30 (75% of 40): the target; then 1.99
        records.append(_record("ddp", 3e-3, seed, [3.0, 2.5, 2.0, 1.99]))
        records.append(_record("topka-fva@0.01", 1e-3, seed, [3.0, 2.0, 1.99, 1.995]))
        records.append(_record("powersgd-r4", 1e-3, seed, [3.0, 2.6, 2.3, 2.01]))
    records.append(_record("ddp", 1e-3, 0, [3.0, 2.9, 2.8, 2.7]))
    records.append(_record("topka-fva@0.01", 3e-3, 0, [3.0, math.nan, math.nan, math.nan]))
    records.append(_record("powersgd-r4", 3e-3, 0, [3.0, 2.8, 2.7, 2.6]))
    net = "1gbit"
    records.append(_record("floor", 1e-3, 0, [9.0], "timing", net, [1.0] * 40))
    records.append(_record("ddp", 3e-3, 0, [9.0], "timing", net, [4.0] * 40))
    records.append(_record("powersgd-r4", 1e-3, 0, [9.0], "timing", net, [3.0] * 40))
    records.append(_record("topka-fva@0.01", 1e-3, 0, [9.0], "timing", net, [3.0] * 12 + [1.1] * 28, warmup=12))
    camp = campaign.analyse(records, wl, [net])
    assert camp.target == 2.0 and camp.plateau == pytest.approx(0.005)
    fva = camp.arms["topka-fva@0.01"]
    assert fva.best_lr == 1e-3  # the diverged lr ranks last
    assert camp.arms["ddp"].steps == {0: 30, 1: 30, 2: 30} and fva.steps == {0: 20, 1: 20, 2: 20}
    assert camp.arms["powersgd-r4"].steps == {0: None, 1: None, 2: None}
    # the recipe's 50 warm-up steps cover the 20 steps to the target: all at the warm-up's step time
    assert fva.warmup == plan.FVA_WARMUP and fva.time_to_target(net, 0) == pytest.approx(20 * 3.0)
    assert camp.limit(net) == pytest.approx(30 * 1.0)
    assert camp.best_baseline(net) == ("ddp", pytest.approx(120.0))
    goals = campaign.report.goals(camp, net)
    assert goals["x limit"] == pytest.approx(2.0) and goals["within 1.25x the limit"] is False
    assert goals["speed-up vs best baseline"] == pytest.approx(2.0) and goals["2x sooner than the best baseline"]
    assert goals["within 1% of DDP"] is True  # 1.995 against 1.99
    # three full runs check the composition (20 steps x 3.0 s = 60 s): their median time to the target, a slow
    # run and a run that misses it (counted as never) do not move it; the load shown is the highest before them
    for repeat, (seconds, losses, load) in enumerate([(63.0, [3.0, 2.0], 0.9), (400.0, [3.0, 2.0], 1.4),
                                                      (0.0, [3.0, 2.5], 0.5)]):
        record = _record("topka-fva@0.01", 1e-3, 0, losses, "confirm", net, repeat=repeat, load=load)
        record["history"][1]["train_time"] = seconds
        records.append(record)
    check = campaign.analyse(records, wl, [net]).confirmations[net]
    assert check["measured"] == 400.0 and check["runs"] == 3 and check["load"] == 1.4  # median of 63, 400, never
    records.pop()  # two runs: the median of 63 and 400
    check = campaign.analyse(records, wl, [net]).confirmations[net]
    assert check["measured"] == pytest.approx(231.5) and check["ratio"] == pytest.approx(231.5 / 60)
    records.pop()
    check = campaign.analyse(records, wl, [net]).confirmations[net]
    assert check["measured"] == 63.0 and check["ratio"] == pytest.approx(1.05) and check["runs"] == 1


def test_ddp_in_half_precision_is_a_baseline_and_the_report_names_the_rows_that_rest_on_less():
    """Any form of torch's DDP competes for the best baseline; an arm run at one seed, or not timed, is
    named in the report's departures sentence."""
    wl = _tiny()
    records = [_record("ddp", 3e-3, seed, [3.0, 2.5, 2.0, 1.99]) for seed in (0, 1, 2)]
    records += [_record("ddp", 1e-3, 0, [3.0, 2.9, 2.8, 2.7]), _record("ddp-fp16", 1e-3, 0, [3.0, 2.9, 2.8, 2.7]),
                _record("ddp-fp16", 3e-3, 0, [3.0, 2.5, 2.0, 1.99]), _record("powersgd-r4", 1e-3, 0, [3.0] * 4),
                _record("powersgd-r4", 3e-3, 0, [3.0] * 4)]
    net = "1gbit"
    records += [_record("floor", 1e-3, 0, [9.0], "timing", net, [1.0] * 40),
                _record("ddp", 3e-3, 0, [9.0], "timing", net, [4.0] * 40),
                _record("ddp-fp16", 3e-3, 0, [9.0], "timing", net, [2.5] * 40)]
    camp = campaign.analyse(records, wl, [net])
    assert camp.best_baseline(net) == ("ddp-fp16", pytest.approx(75.0))
    [sentence, _] = campaign.report._departures(camp)
    assert "seed 0 alone (its row says [n/1]): ddp-fp16, powersgd-r4;" in sentence
    assert "not timed (no step time or time to the target): powersgd-r4;" in sentence
    assert sentence.endswith("step times from fewer than 3 timing runs: every arm on 1gbit (1 run).")
    records += [_record(name, lr, seed, [3.0] * 4) for name, lr in (("ddp-fp16", 3e-3), ("powersgd-r4", 1e-3))
                for seed in (1, 2)]
    records.append(_record("powersgd-r4", 1e-3, 0, [9.0], "timing", net, [3.0] * 40))
    [sentence, _] = campaign.report._departures(campaign.analyse(records, wl, [net]))
    assert "seed 0 alone" not in sentence and "not timed" not in sentence
    assert sentence.startswith("**Departures from the protocol in this run.** not trained (no row): powersgd-r2, ")
    rows = campaign.report.result_rows(campaign.analyse(records, wl, [net]), net)
    assert [r["arm"] for r in rows] == ["floor", "ddp", "ddp-fp16", "powersgd-r4"]  # the untrained: no row


def test_a_step_time_is_the_median_of_the_timing_runs_and_the_rounds_alternate_the_arms(tmp_path):
    """One slow timing run does not move an arm's step time: the median of its runs does not see it;
    the load shown is the highest before them; the runs go in rounds, every arm once per round."""
    wl, net = _tiny(), "1gbit"
    records = [_record("ddp", 3e-3, 0, [3.0, 2.5, 2.0, 1.99])]
    for repeat, (floor_s, ddp_s, load) in enumerate([(1.0, 4.0, 0.5), (1.6, 6.0, 1.4), (1.1, 4.2, 0.7)]):
        records += [_record("floor", 1e-3, 0, [9.0], "timing", net, [floor_s] * 40, repeat=repeat, load=load),
                    _record("ddp", 3e-3, 0, [9.0], "timing", net, [ddp_s] * 40, repeat=repeat, load=load)]
    camp = campaign.analyse(records, wl, [net])
    assert camp.arms["floor"].step_s[net] == (None, 1.1) and camp.arms["ddp"].step_s[net] == (None, 4.2)
    assert camp.arms["ddp"].timing_runs[net] == 3 and camp.arms["ddp"].load[net] == 1.4
    assert "timing runs" not in "".join(campaign.report._departures(camp))
    records.append(_record("ddp", 3e-3, 0, [9.0], "timing", "100mbit", [9.0] * 40, load=0.5))
    records.append(_record("floor", 1e-3, 0, [9.0], "timing", "100mbit", [2.0] * 40, load=0.5))
    records.append(_record("floor", 1e-3, 0, [9.0], "timing", "100mbit", [2.0] * 40, repeat=1, load=0.5))
    [sentence, _] = campaign.report._departures(campaign.analyse(records, wl, [net, "100mbit"]))
    assert sentence.endswith("step times from fewer than 3 timing runs: ddp on 100mbit (1 run), floor on "
                             "100mbit (2 runs).")

    made = []

    def trainer(config):
        made.append((config.method, config.net))
        return {"history": _history([3.0]), "epochs": [], "steps": [{"time": 0.1}] * config.steps, "config": {}}

    out = str(tmp_path)
    arms = campaign.arms_of("gpt", ["floor", "ddp"])
    for seed in (0, 1, 2):  # DDP's best lr, found by its convergence records
        for lr in wl.grid(arms[1]):
            os.makedirs(os.path.dirname(run.convergence_path(out, wl, arms[1], lr, seed)), exist_ok=True)
            run._save(_record("ddp", lr, seed, [2.0 + lr]), run.convergence_path(out, wl, arms[1], lr, seed), {
                "workload": "gpt", "arm": "ddp", "lr": lr, "seed": seed, "phase": "convergence", "net": "loopback"})
    run.run_timing(out, wl, ["100mbit", "1gbit"], arms, trainer=trainer, echo=lambda _: None)
    assert made == [("nosync", "100mbit"), ("ddp", "100mbit"), ("nosync", "1gbit"), ("ddp", "1gbit")] * 3
    made.clear()
    run.run_timing(out, wl, ["100mbit", "1gbit"], arms, trainer=trainer, echo=lambda _: None)
    assert made == []  # resumed: every run's record exists


def test_the_campaign_runs_end_to_end_on_a_tiny_transformer_and_writes_its_report(tmp_path):
    pytest.importorskip("tokenizers")
    wl = _tiny(steps=8, eval_every=4, data_options={"train_chars": 60_000, "test_chars": 20_000, "vocab_size": 300,
                                                     "seq_len": 16, "test_size": 16},
               model_options={"width": 16, "layers": 1, "heads": 2}, recommended="topka-fva@0.01")
    arms = campaign.arms_of("gpt", ["floor", "ddp", "topka-fva@0.01"])
    small = {"workers": 2, "batch_size": 2}
    out = str(tmp_path / "runs")
    run.run_convergence(out, wl, arms, echo=lambda _: None, **small, dense_warmup_steps=2)
    run.run_timing(out, wl, ["loopback"], arms, echo=lambda _: None, repeats=1, **small, steps=20)
    records = campaign.load_records(out, wl)
    assert len([r for r in records if r["campaign"]["phase"] == "convergence"]) == 2 * 2 + 2 * 2
    assert all(r["consistent"] for r in records if r["campaign"]["arm"] != "floor")  # replicas identical
    camp = campaign.analyse(records, wl, ["loopback"])
    assert camp.target is not None and camp.arms["floor"].step_s["loopback"][1] > 0
    path = campaign.write_report(camp, records, str(tmp_path / "report"), "sparsecomm campaign --workload gpt")
    with open(path) as handle:
        text = handle.read()
    assert "## loopback" in text and "learning-rate grid" in text and "sparsecomm campaign --workload gpt" in text
    with open(tmp_path / "report" / "summary.json") as handle:
        data = json.load(handle)
    assert set(data["arms"]) == {a.name for a in campaign.arms_of("gpt")}
    assert data["arms"]["ddp"]["best_lr"] in (1e-3, 3e-3) and data["goals"][0]["network"] == "loopback"


def test_a_dense_fallback_policy_trains_both_branches_and_takes_on_each_network_the_branch_it_decided(tmp_path):
    """The policy's decision depends on the link, so its convergence runs are its two branches with the
    decision pinned; on each network its row is the branch its timing run took, at that branch's best lr,
    and the confirmation run trains at that lr."""
    wl = dataclasses.replace(campaign.WORKLOADS["resnet"], steps=40, eval_every=10, lr_grids={"sgd": (0.03, 0.1)})
    arms = campaign.arms_of("resnet", ["floor", "ddp", "topka-hook-auto@0.01"])
    policy = arms[2]
    kept, fell = plan.branches(policy)["method"], plan.branches(policy)["dense"]
    assert policy.is_policy and not kept.is_policy and fell.kind == "dense"
    assert [a.name for a in plan.trained_arms(arms)] == ["ddp", kept.name, fell.name]
    made = []

    def trainer(config):
        decision = config.dense_fallback_decision
        timing = config.steps != wl.steps
        made.append((config.method, decision, config.lr, config.seed, config.net, timing))
        best = {"method": 0.03, "dense": 0.1, None: 0.1}[decision if config.method != "ddp" else None]
        late = abs(math.log(config.lr / best))  # each branch does best at its own lr
        accuracy = [50.0, 80.0 - late, 85.0 - late, 86.0 - late] if decision != "method" else \
            [50.0, 70.0 - late, 84.0 - late, 86.5 - late]
        measured = decision or ("dense" if config.net is None else "method")  # loopback falls back
        times = [0.1] * (config.steps or 0)
        return {"history": [{"step": 10 * (i + 1), "train_time": float(i + 1), "test_loss": 1.0,
                             "test_accuracy": a} for i, a in enumerate(accuracy)],
                "epochs": [], "steps": [{"time": t} for t in times], "config": {},
                "dense_fallback": None if config.method == "ddp" else {"decision": measured}}

    out = str(tmp_path)
    quiet = {"echo": lambda _: None, "trainer": trainer}
    run.run_convergence(out, wl, arms, **quiet)
    trained = {(m, d) for m, d, _, _, _, timing in made}
    assert trained == {("ddp", None), ("topka", "method"), ("topka", "dense")}  # never the measured policy
    assert run.best_lr(out, wl, kept) == 0.03 and run.best_lr(out, wl, fell) == 0.1
    made.clear()
    run.run_timing(out, wl, ["loopback", "1gbit"], arms, **quiet)
    assert {(d, lr) for m, d, lr, _, _, _ in made if m == "topka"} == {(None, 0.03)}  # measured, at kept's lr
    assert run.timed_decision(out, wl, policy, "loopback") == "dense"
    assert run.timed_decision(out, wl, policy, "1gbit") == "method"
    made.clear()
    run.run_confirmation(out, wl, ["loopback", "1gbit"], policy, repeats=2, **quiet)
    # in rounds: every network once, then again
    assert [(net or "loopback", lr) for _, _, lr, _, net, _ in made] == [("loopback", 0.1), ("1gbit", 0.03)] * 2
    records = campaign.load_records(out, wl)
    camp = campaign.analyse(records, wl, ["loopback", "1gbit"])
    assert camp.result(policy.name, "loopback").best_lr == 0.1 and camp.result(policy.name, "1gbit").best_lr == 0.03
    assert camp.result(policy.name, "loopback").steps[0] == 30 and camp.result(policy.name, "1gbit").steps[0] == 40
    assert camp.confirmations["loopback"]["decision"] == "dense"
    assert camp.confirmations["loopback"]["runs"] == camp.confirmations["1gbit"]["runs"] == 2
    assert "the composition checked by fewer than 3 full runs: loopback (2 runs), 1gbit (2 runs)" in \
        " ".join(campaign.report._departures(camp))
    rows = {net: {r["arm"]: r for r in campaign.report.result_rows(camp, net)} for net in ("loopback", "1gbit")}
    assert f"{policy.name} (fell back to dense)" in rows["loopback"]
    assert f"{policy.name} (kept the method)" in rows["1gbit"] and kept.name not in rows["1gbit"]
    assert {kept.name, fell.name} <= {r["arm"] for r in campaign.report.grid_rows(camp)} and policy.name not in {
        r["arm"] for r in campaign.report.grid_rows(camp)}
    summary = campaign.report.summary(camp)
    assert summary["arms"][policy.name]["by_network"]["loopback"]["best_lr"] == 0.1
    assert summary["arms"][policy.name]["final"] == {}  # no figures of its own: the accuracy table skips it


def test_quiet_policy_waits_for_the_load_and_redoes_a_run_started_on_a_busy_machine():
    loads = iter([3.0, 2.5, 2.0, 1.0])
    slept: list[float] = []
    policy = campaign.QuietPolicy(max_load_per_core=0.75, cores=2, max_wait_s=10.0, poll_s=5.0, redo=2,
                                  loadavg=lambda: next(loads), sleep=slept.append)
    calls = []

    def trainer(config):
        calls.append(config.seed)
        return {"history": [], "network": "loopback", "config": {}}

    echoed: list[str] = []
    wl = campaign.workload("gpt")
    record = campaign.quiet.train_quietly(wl.config(campaign.arms_of("gpt", ["ddp"])[0], 1e-3, 4), trainer, policy,
                                          echoed.append)
    # first attempt: 3.0, waited 2 x 5 s to 2.0 > 1.5, run and redone; the second starts at 1.0
    assert slept == [5.0, 5.0] and calls == [4, 4]
    assert echoed[0].startswith("    load average 3.00 > 1.5") and "waiting up to 10 s" in echoed[0]
    assert sum("waiting" in line for line in echoed) == 1 and "redone" in echoed[1]
    assert record["load"] == {"before": 1.0, "attempts": [2.0, 1.0], "threshold": 1.5, "quiet": True}
    with pytest.raises(ValueError, match="max_load_per_core"):
        campaign.QuietPolicy(max_load_per_core=0)


def test_the_demo_takes_the_campaigns_tuned_lrs_and_reports_measured_times(tmp_path):
    ddp_form = {"kind": "dense", "options": {"method": "ddp"}}
    summary = {"workload": {"recommended": "topka-fva@0.01"},
               "arms": {"ddp": {**ddp_form, "best_lr": 3e-3, "final": {"0": 2.0}, "steps_to_target": {"0": 30},
                                "step_s": {"1gbit": {"main": 0.4}, "100mbit": {"main": 2.0}}},
                        "ddp-fp16": {**ddp_form, "best_lr": 3e-3, "final": {"0": 2.0}, "steps_to_target": {"0": 30},
                                     "step_s": {"1gbit": {"main": 0.3}, "100mbit": {"main": 2.5}}},
                        "powersgd-r2": {"best_lr": 1e-3, "final": {"0": 2.3}},
                        "powersgd-r4": {"best_lr": 1e-3, "final": {"0": 2.2}},
                        "topka-fva@0.01": {"best_lr": 1e-3, "final": {"0": 2.01}}}}
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(summary))
    found = demo.tuned(str(path), "1gbit")
    assert found.lrs["ddp"] == 3e-3 and found.best_power == "powersgd-r4" and found.recommended == "topka-fva@0.01"
    assert found.fastest_ddp == "ddp-fp16" and demo.tuned(str(path), "100mbit").fastest_ddp == "ddp"
    assert demo.tuned(str(tmp_path / "none.json")) == ({}, "powersgd-r4", campaign.workload("gpt").recommended, "ddp")
    assert demo.reference_ddp(campaign.arms_of("gpt", ["floor", "ddp-fp16", "powersgd-r4"])) == "ddp-fp16"
    assert demo.reference_ddp(campaign.arms_of("gpt", ["ddp-fp16", "ddp"])) == "ddp"
    steps = [{"time": 0.1}] * 4
    records = {"floor": {"history": _history([5.0], 4), "steps": steps, "config": {"lr": 1e-3}},
               "ddp": {"history": _history([3.0] * 8 + [2.0] * 4, 2), "steps": [{"time": 0.4}] * 24,
                       "config": {"lr": 3e-3}},
               "ddp-fp16": {"history": _history([3.0] * 8 + [2.0], 2), "steps": [{"time": 0.3}] * 18,
                            "config": {"lr": 3e-3, "stop_at_target": True}},
               "topka-fva@0.01": {"history": _history([3.0] * 4 + [1.9] * 8, 2), "steps": [{"time": 0.12}] * 24,
                                  "config": {"lr": 1e-3}}}
    args = argparse.Namespace(steps=24, workers=4)
    assert demo.demo_target(records["ddp"], 24) == 2.0 and demo.demo_target(None, 24) is None
    report = demo.write_demo_report(records, campaign.workload("gpt"), str(tmp_path), args, "1gbit", "ddp")
    rows = {r["arm"]: r for r in report["rows"]}
    assert rows["ddp"]["steps to target"] == 18 and rows["topka-fva@0.01"]["steps to target"] == 10
    assert rows["ddp-fp16"]["final loss"] == "stopped at the target" and rows["floor"]["final loss"] == "-"
    assert rows["ddp"]["x floor"] == "4.00" and "reached the target 1.80x sooner" in report["table"]
    with open(report["path"]) as handle:
        text = handle.read()
    assert "the floor ran 4 steps" in text and "ddp-fp16 stopped at the target" in text
    assert "Target: ddp's validation loss" in text and "DDP runs as" not in text
    del records["ddp"]  # the fastest form of DDP sets the target, and the report says which it is
    records["ddp-fp16"] = {**records["ddp-fp16"], "config": {"lr": 3e-3}}
    report = demo.write_demo_report(records, campaign.workload("gpt"), str(tmp_path), args, "1gbit", "ddp-fp16")
    with open(report["path"]) as handle:
        text = handle.read()
    assert "Target: ddp-fp16's validation loss" in text and "DDP runs as ddp-fp16, torch DDP with fp16" in text


def test_the_demo_replaces_an_earlier_result_and_keeps_the_folders_readme(tmp_path):
    out, folder = tmp_path / "run", tmp_path / "benchmarks-demo"
    out.mkdir()
    (out / "report.md").write_text("new report")
    (out / "ddp.json").write_text("{}")
    folder.mkdir()
    (folder / "README.md").write_text("what the folder holds")
    (folder / "report.md").write_text("old report")
    (folder / "topka-old.json").write_text("{}")
    demo.copy_result(str(out), str(folder))
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "ddp.json", "report.md"]
    assert (folder / "README.md").read_text() == "what the folder holds"
    assert (folder / "report.md").read_text() == "new report"
