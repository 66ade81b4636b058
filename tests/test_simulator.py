"""The simulator: calibration fits, predictions against the cost formulas, the simulate/calibrate/advise CLI."""

import json
import math
from pathlib import Path

import pytest

from sparsecomm import available_methods
from sparsecomm.cli import main
from sparsecomm.launch.launcher import run_workers
from sparsecomm.methods import cost, method_class
from sparsecomm.methods.base import selection_count
from sparsecomm.simulator.calibration import SAMPLED_THRESHOLD, fit_links, profile_from_records, time_method_in_worker
from sparsecomm.simulator.model import Profile, UnknownMethodError, check_methods, crossover, fit_work, predict

ALPHA, BETA = 150e-6, 2.5e-9


def _link_record(rank, P, kind="intra", noise=0.0):
    samples = []
    for n in (1_000, 250_000, 2_000_000):
        for algorithm in ("ring", "rabenseifner"):
            c = cost(algorithm, P=P, n=n, rank=rank)
            seconds = c.rounds * ALPHA + c.bytes_sent * BETA
            samples.append({"kind": kind, "algorithm": algorithm, "P": P, "n": n, "rounds": c.rounds,
                            "bytes": c.bytes_sent, "seconds": seconds * (1 + noise)})
    return samples


@pytest.mark.parametrize("P", [2, 4, 6])
def test_calibration_recovers_known_alpha_and_beta_from_synthetic_timings(P):
    records = [{"links": _link_record(rank, P)} for rank in range(P)]
    link = fit_links(records)["intra"]
    assert link["alpha"] == pytest.approx(ALPHA, rel=1e-6)
    assert link["beta"] == pytest.approx(BETA, rel=1e-6)


def test_calibration_separates_link_kinds():
    records = [{"links": _link_record(0, 4, "intra") + [
        {**s, "kind": "inter", "seconds": 3 * s["seconds"]} for s in _link_record(0, 4, "intra")]}]
    links = fit_links(records)
    assert links["inter"]["alpha"] == pytest.approx(3 * ALPHA, rel=1e-6)
    assert links["inter"]["beta"] == pytest.approx(3 * BETA, rel=1e-6)


def _synthetic_profile(P=2, density=0.01, work_per_element=2e-9):
    """A profile built by the real code path from synthetic worker records."""
    n = 100_000
    runs = []
    for name in available_methods():
        k = selection_count(density, n) if method_class(name).sparse else 0
        sent = max(cost(name, P=P, n=n, k=k, rank=r, density=density).bytes_sent for r in range(P))
        runs.append({"method": name, "n": n, "times": [0.01 + work_per_element * n] * 3, "time_comm": [0.01] * 3,
                     "bytes_sent": sent})
    dense = [{"n": m, "rounds": cost("dense", P=P, n=m, rank=0).rounds,
              "bytes": cost("dense", P=P, n=m, rank=0).bytes_sent,
              "seconds": 2 * ALPHA + 4 * m * BETA} for m in (1_000, 1_000_000)]
    records = [{"P": P, "links": _link_record(r, P), "dense": dense, "runs": runs} for r in range(P)]
    return profile_from_records(records, density=density, net="loopback", device="cpu", cores=2, colocated=True,
                                selectors={"exact_topk": 1e-9}, recv_element_s=5e-9, meta={})


def test_profile_round_trips_through_json(tmp_path):
    profile = _synthetic_profile()
    path = tmp_path / "p.json"
    profile.save(path)
    again = Profile.load(path)
    assert again == profile
    assert again.alpha == pytest.approx(ALPHA) and again.beta == pytest.approx(BETA)
    assert again.methods["topka"]["w1"] == pytest.approx(2e-9)


def test_profile_load_rejects_other_json(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"hello": 1}))
    with pytest.raises(ValueError, match="not a version-1 sparsecomm profile"):
        Profile.load(path)


@pytest.mark.parametrize("name", available_methods())
@pytest.mark.parametrize("P", [2, 7, 64])
def test_prediction_equals_cost_formula_when_work_is_zero(name, P):
    n, density = 1_000_003, 0.01
    k = selection_count(density, n) if method_class(name).sparse else 0
    worst = max(cost(name, P=P, n=n, k=k, rank=r, density=density).time(ALPHA, BETA) for r in range(P))
    p = predict(name, P, n, density, alpha=ALPHA, beta=BETA)
    assert p.work_s == 0.0
    assert p.total_s == pytest.approx(worst, rel=1e-12) or P > 4  # sampled ranks at large P
    assert p.total_s <= worst * (1 + 1e-12)
    assert p.total_s >= cost(name, P=P, n=n, k=k, rank=0, density=density).time(ALPHA, BETA) * (1 - 1e-12)


def test_prediction_with_profile_adds_contended_work_and_overlap():
    profile = _synthetic_profile(P=2, work_per_element=2e-9)
    n = 1_000_000
    alone = predict("topka", 2, n, 0.01, profile=profile)
    assert alone.work_s == pytest.approx(2e-9 * n, rel=1e-6)
    factor = profile.methods["topka"]["comm_factor"]
    formula = predict("topka", 2, n, 0.01, alpha=ALPHA, beta=BETA).comm_s
    assert factor == pytest.approx(0.01 / predict("topka", 2, 100_000, 0.01, alpha=ALPHA, beta=BETA).comm_s)
    # the calibration measured 10 ms at n = 100K, more than the formula: the rest is a cost per round
    at_cal = predict("topka", 2, 100_000, 0.01, alpha=ALPHA, beta=BETA)
    assert at_cal.comm_s < 0.01
    per_round = (0.01 - at_cal.comm_s) / at_cal.rounds
    assert alone.comm_s == pytest.approx(formula + alone.rounds * per_round, rel=1e-6)
    assert predict("topka", 2, 100_000, 0.01, profile=profile).comm_s == pytest.approx(0.01)
    assert predict("topka", 2, n, 0.01, profile=profile, use_comm_factor=False).comm_s == pytest.approx(formula)
    crowded = predict("topka", 8, n, 0.01, profile=profile)  # 8 workers on 2 cores: 4x the work time
    received = (cost("topka", P=8, n=n, k=10_000, rank=0).bytes_recv - cost("topka", P=2, n=n, k=10_000,
                                                                               rank=0).bytes_recv) / 8
    assert crowded.work_s == pytest.approx(4 * 2e-9 * n + 5e-9 * received, rel=1e-6)
    cluster = predict("topka", 8, n, 0.01, profile=profile, colocated=False, compute_scale=10)
    assert cluster.work_s == pytest.approx((2e-9 * n + 5e-9 * received) / 10, rel=1e-6)
    assert "ASSUMED" in cluster.rests_on
    hidden = predict("topka", 8, n, 0.01, profile=profile, overlap=0.5, backward_s=1.0)
    assert hidden.total_s == pytest.approx(crowded.total_s - 0.5 * crowded.comm_s)


def test_fit_work_recovers_slope_and_intercept():
    w1, w0 = fit_work([(1_000_000, 0.003 + 2e-9 * 1_000_000), (25_000_000, 0.003 + 2e-9 * 25_000_000)])
    assert w1 == pytest.approx(2e-9) and w0 == pytest.approx(0.003)


def test_crossover_is_first_P_where_dense_wins():
    rows = [{"method": "x", "P": P, "speedup": s} for P, s in [(8, 3.0), (16, 1.2), (32, 1.0), (64, 0.5)]]
    assert crossover(rows, "x") == 32
    assert crossover([{"method": "x", "P": 8, "speedup": 2.0}], "x") is None


def test_check_methods_names_the_valid_ones():
    with pytest.raises(UnknownMethodError, match=r"unknown method 'topkk'; valid names: .*topka"):
        check_methods(["topka", "topkk"])


def test_simulate_rejects_unknown_names_with_one_line_and_exit_2(capsys):
    assert main(["simulate", "--methods", "topka,nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "unknown method 'nope'" in err and "spardl" in err


@pytest.mark.parametrize("name", ["hitopk", "redsync"])
def test_simulate_with_density_no_longer_crashes(name, capsys):
    assert main(["simulate", "--methods", name, "--density", "0.001", "--workers", "8,64"]) == 0
    out = capsys.readouterr().out
    assert f"| {name}" in out


def test_simulate_runs_for_every_available_method(capsys, tmp_path):
    rows_file = tmp_path / "rows.json"
    assert main(["simulate", "--methods", "all", "--workers", "2,8,1024", "--size", "340M",
                 "--json", str(rows_file)]) == 0
    rows = json.loads(rows_file.read_text())
    assert {r["method"] for r in rows} == set(available_methods())
    assert all(math.isfinite(r["time_s"]) and r["time_s"] > 0 for r in rows)


def test_simulate_with_profile_and_plot(tmp_path, capsys):
    path = tmp_path / "p.json"
    _synthetic_profile().save(path)
    png = tmp_path / "out.png"
    assert main(["simulate", "--methods", "dense,topka,spardl", "--profile", str(path), "--workers", "8,64",
                 "--plot", str(png), "--compute-scale", "5"]) == 0
    out = capsys.readouterr().out
    assert "ASSUMPTION: compute 5x" in out
    assert png.stat().st_size > 1000


@pytest.mark.parametrize("argv, message", [
    (["--density", "0"], "--density=0.0 must lie in (0, 1]"),
    (["--workers", "8,x"], "--workers='8,x' must be comma-separated integers"),
    (["--bandwidth", "1gbps"], "must be a rate in bits per second"),
    (["--overlap", "2"], "--overlap=2.0 must lie in [0, 1]"),
])
def test_simulate_rejects_bad_options(argv, message, capsys):
    assert main(["simulate", *argv]) == 2
    assert message in capsys.readouterr().err


def test_advise_recommends_with_predicted_time_against_ddp(capsys):
    assert main(["advise", "--params", "25M", "-P", "64", "--bandwidth", "10gbit", "--latency", "50us"]) == 0
    out = capsys.readouterr().out
    assert "recommended: " in out and "vs DDP" in out and "rests on: cost formula only" in out


def test_advise_counts_a_saved_model(tmp_path, capsys):
    import torch

    path = tmp_path / "m.pt"
    torch.save(torch.nn.Linear(1000, 100).state_dict(), path)
    assert main(["advise", "--model-file", str(path), "-P", "8"]) == 0
    assert "model: 100,100 parameters" in capsys.readouterr().out


def test_advise_rests_on_the_profile(tmp_path, capsys):
    path = tmp_path / "p.json"
    _synthetic_profile().save(path)
    assert main(["advise", "--params", "1M", "-P", "4", "--profile", str(path), "--colocated"]) == 0
    out = capsys.readouterr().out
    rests_on = out.split("rests on: ")[1].splitlines()[0]
    assert "fitted" in rests_on and "work measured at P=2" in rests_on


@pytest.mark.parametrize("argv, message", [
    ([], "give the model size"),
    (["--params", "1M", "--methods", "spardll"], "unknown method 'spardll'"),
    (["--params", "1M", "--densities", "0.5,2"], "must be fractions in (0, 1]"),
    (["--model", "resnet"], "unrecognized arguments: --model resnet"),
])
def test_advise_rejects_bad_input_in_one_line(argv, message, capsys):
    assert main(["advise", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_refit_from_kept_records_reproduces_the_profile():
    from sparsecomm.simulator.calibration import refit

    profile = _synthetic_profile()
    profile.meta = {"density": 0.01}
    assert profile.records, "the raw timings are kept in the profile"
    assert refit(profile).methods == profile.methods
    with pytest.raises(ValueError, match="keeps no raw timings"):
        refit(Profile())


def test_work_is_the_critical_ranks_own_time_and_the_least_over_calls():
    """Rank 1 waits 50 ms for rank 0 inside its comm; rank 0's second call is disturbed by 1 s."""
    P, n = 2, 100_000
    sent = cost("topka", P=P, n=n, k=1_000, rank=0).bytes_sent
    rank0 = {"method": "topka", "n": n, "times": [0.080, 1.080, 0.080], "time_comm": [0.020] * 3, "bytes_sent": sent}
    rank1 = {"method": "topka", "n": n, "times": [0.080, 1.080, 0.080], "time_comm": [0.070] * 3, "bytes_sent": sent}
    dense = [{"n": m, "rounds": 2, "bytes": 4 * m, "seconds": 2 * ALPHA + 4 * m * BETA} for m in (1_000, 1_000_000)]
    records = [{"P": P, "links": _link_record(r, P), "dense": dense, "runs": [run]}
               for r, run in enumerate((rank0, rank1))]
    profile = profile_from_records(records, density=0.01, net="1gbit", device="cpu", cores=2, colocated=True,
                                   selectors={}, recv_element_s=0.0, meta={})
    fit = profile.methods["topka"]
    assert fit["work_s"][str(n)] == pytest.approx(0.060)      # rank 0's own 80 - 20 ms, not rank 1's 10 ms
    assert fit["comm_s"][str(n)] == pytest.approx(0.020)      # the best call's 80 ms less that work


def test_colocated_workers_share_the_cpu_cost_of_rounds_and_of_loopback_bytes():
    """8 workers on 2 cores: each round's CPU cost (alpha, the per-message overhead) is shared by
    the processes on any network (4x at P = 8 against the calibration's P = 2); the bytes are a CPU
    copy only on loopback (4x there, the rate under a tc limit). A cluster changes nothing."""
    profile = _synthetic_profile()
    n = 1_000_000
    formula = {P: predict("ring", P, n, 0.01, alpha=ALPHA, beta=BETA) for P in (2, 8)}
    loop = {P: predict("ring", P, n, 0.01, profile=profile, use_comm_factor=False) for P in (2, 8)}
    profile.net = "1gbit"
    tc = {P: predict("ring", P, n, 0.01, profile=profile, use_comm_factor=False) for P in (2, 8)}
    assert loop[2].comm_s == pytest.approx(tc[2].comm_s) == pytest.approx(formula[2].comm_s)
    rounds, sent = formula[8].rounds, formula[8].bytes_sent
    assert tc[8].comm_s == pytest.approx(4 * rounds * ALPHA + sent * BETA)
    assert loop[8].comm_s == pytest.approx(4 * rounds * ALPHA + 4 * sent * BETA)
    assert "loopback links slowed 4x" in loop[8].rests_on and "rounds' CPU cost 4x" in tc[8].rests_on
    cluster = predict("ring", 8, n, 0.01, profile=profile, colocated=False, alpha=ALPHA, beta=BETA)
    assert cluster.comm_s == pytest.approx(formula[8].comm_s)


def test_best_of_runs_keeps_the_least_and_reports_the_spread():
    from sparsecomm_lab.bench.simvalidate import best_of_runs

    rows = [{"net": "loopback", "n": 1, "P": 2, "method": "dense", "measured_s": s, "run": i}
            for i, s in enumerate((0.03, 0.02, 0.05))]
    (best,) = best_of_runs(rows)
    assert best["measured_s"] == 0.02 and best["runs"] == 3 and best["spread"] == pytest.approx(1.5)


def test_merged_calibrations_take_the_least_over_all_calls():
    from sparsecomm.simulator.calibration import merge_records

    P, n = 2, 100_000
    quiet = [{"P": P, "links": _link_record(r, P), "dense": [{"n": n, "rounds": 2, "bytes": 4 * n, "seconds": 0.01}],
              "runs": [{"method": "dense", "n": n, "times": [0.02, 0.03], "time_comm": [0.015, 0.02],
                        "bytes_sent": 4 * n}]} for r in range(P)]
    busy = [{**r, "links": _link_record(i, P, noise=1.0),
             "dense": [{"n": n, "rounds": 2, "bytes": 4 * n, "seconds": 0.05}],
             "runs": [{**r["runs"][0], "times": [0.09, 0.08], "time_comm": [0.05, 0.05]}]} for i, r in enumerate(quiet)]
    merged = merge_records(busy, quiet)
    assert merged[0]["runs"][0]["times"] == [0.09, 0.08, 0.02, 0.03]
    assert merged[0]["dense"][0]["seconds"] == 0.01
    assert fit_links(merged)["intra"]["alpha"] == pytest.approx(ALPHA, rel=1e-6)
    with pytest.raises(ValueError, match="cannot merge calibrations at P=2 and P=4"):
        merge_records(quiet, [{**quiet[0], "P": 4}] * 2)


def test_faster_range_names_where_a_method_beats_dense():
    from sparsecomm.simulator.model import faster_range

    def rows(speedups):
        return [{"method": "x", "P": P, "speedup": s} for P, s in zip((8, 16, 32, 64), speedups, strict=True)]

    assert faster_range(rows([2, 2, 2, 2]), "x") == "all P"
    assert faster_range(rows([1, 0.5, 1, 0.9]), "x") == "never"
    assert faster_range(rows([2, 1.5, 1.0, 0.5]), "x") == "P <= 16"
    assert faster_range(rows([0.5, 1.0, 1.2, 3]), "x") == "P >= 32"
    assert faster_range(rows([0.5, 1.2, 1.3, 0.9]), "x") == "16 <= P <= 32"
    assert faster_range(rows([1.5, 0.9, 1.2, 0.9]), "x") == "P <= 8, P = 32"


def _split_records(P, sizes, density, select_per_element, decompress_per_byte, methods=("topka", "spardl", "dense"),
                   agreement_round=0.0):
    """Worker records whose work is ``select_per_element`` per gradient element plus
    ``decompress_per_byte`` per byte of the decompression's sweep (of the entries the rank touches:
    its k and what it receives), the latter in the method's ``time_decompress``, plus
    ``agreement_round`` per agreement round (folded into the selection's scan): the calibration must
    recover them."""
    from sparsecomm.simulator.model import agreement_rounds, decompress_bytes, layout_options

    runs = []
    for n in sizes:
        for name in methods:
            k = selection_count(density, n) if method_class(name).sparse else 0
            decompress = decompress_per_byte * decompress_bytes(name, P, n, k, density,
                                                                layout_options(name, P, "loopback", True))
            agree = agreement_round * agreement_rounds(P)
            work = select_per_element * n + decompress + agree
            sent = max(cost(name, P=P, n=n, k=k, rank=r, density=density).bytes_sent for r in range(P))
            runs.append({"method": name, "n": n, "times": [0.01 + work] * 3, "time_comm": [0.01] * 3,
                         "time_select": [select_per_element * n] * 3, "time_decompress": [decompress] * 3,
                         "time_agreement": [agree] * 3, "agreement_folded": name != "dense",
                         "bytes_sent": sent})
    dense = [{"n": m, "rounds": cost("dense", P=P, n=m, rank=0).rounds,
              "bytes": cost("dense", P=P, n=m, rank=0).bytes_sent,
              "seconds": 2 * ALPHA + 4 * m * BETA} for m in (1_000, 1_000_000)]
    return [{"P": P, "links": _link_record(r, P), "dense": dense, "runs": runs} for r in range(P)]


def test_work_is_modelled_by_what_it_touches_selection_by_n_decompression_by_its_sweep():
    """Calibrated at P = 2, n = 1M (the held-out point of issue 25: P = 6, n = 5M): selection grows
    with n; the decompression with the pairs received and the output's lines written (the blocked
    sweep), at most about one write of the output however many pairs arrive."""
    from sparsecomm.simulator.model import decompress_bytes, layout_options, touched_entries
    from sparsecomm.transport.merge import IN_PLACE_SHARE

    density, select, per_byte = 0.01, 2e-9, 0.1e-9
    records = _split_records(2, [1_000_000], density, select, per_byte)
    profile = profile_from_records(records, density=density, net="1gbit", device="cpu", cores=2, colocated=True,
                                   selectors={}, recv_element_s=5e-9, meta={})
    fit = profile.methods["topka"]
    assert fit["s1"] == pytest.approx(select) and fit["d1"] == pytest.approx(per_byte)
    assert fit["decompress_per"] == "byte"
    P, n = 6, 5_000_000
    k = selection_count(density, n)
    for name in ("topka", "spardl"):
        swept = decompress_bytes(name, P, n, k, density, layout_options(name, P, "1gbit", True))
        truth = (select * n + per_byte * swept) * 3  # 6 workers on 2 cores
        assert predict(name, P, n, density, profile=profile).work_s == pytest.approx(truth, rel=1e-6)
    # topka touches P x k entries: 6% of the elements at P = 6, so about 62% of the output's lines,
    # more than the sweep's in-place share (1/6): every block streamed, one write of the output (4n
    # bytes) plus the pairs
    assert abs(IN_PLACE_SHARE - 1 / 6) < 1e-12
    assert touched_entries("topka", 6, n, k, density, {}) == pytest.approx(6 * k)
    assert decompress_bytes("topka", 6, n, k, density, {}) == pytest.approx(4 * n + 8 * 6 * k)
    # at P = 2, n = 1M (2%: 27% of the lines) streamed too; at 0.1% (3% of the lines) a block is swept
    # in place: its touched lines, each costing six streamed ones
    assert decompress_bytes("topka", 2, 1_000_000, 10_000, density, {}) == pytest.approx(8 * 20_000 + 4e6)
    share = 1 - math.exp(-16 * 2 * 1_000 / 1_000_000)
    assert decompress_bytes("topka", 2, 1_000_000, 1_000, 0.001, {}) == pytest.approx(8 * 2_000 + 4e6 * 6 * share)
    # per entry it would grow 15x from the calibration to P = 6, n = 5M; the sweep grows 5.4x
    growth = decompress_bytes("topka", 6, n, k, density, {}) / decompress_bytes("topka", 2, 1_000_000, 10_000,
                                                                                   density, {})
    assert 5 < growth < 6
    # however many pairs arrive, the output is written about once
    many = decompress_bytes("topka", 1024, n, k, density, {})
    assert many == pytest.approx(4 * n + 8 * 1024 * k)


def test_agreement_is_costed_per_round_and_the_messages_cpu_shares_the_cores():
    """The agreement (ceil(log2 P) small messages) is its own term: 1 round at P = 2, 3 at P = 6, not
    a cost per gradient element. On a rate-limited network the communication's CPU time (the link's
    CPU per message and per byte, fitted on the calibration's all-reduces, by the method's cost
    formula at P) is shared by the colocated workers: the messages' part (P / cores - 1) x more, the
    bytes' part where the shared CPU outlasts the wire."""
    from sparsecomm.simulator.model import agreement_rounds, comm_cpu_seconds, layout_options, shared_cpu

    assert [agreement_rounds(P) for P in (1, 2, 3, 4, 6, 8, 9)] == [0, 1, 2, 2, 3, 3, 4]
    density, select, per_byte, round_s = 0.01, 2e-9, 0.1e-9, 0.4e-3
    records = _split_records(2, [1_000_000], density, select, per_byte, agreement_round=round_s)
    for r, record in enumerate(records):  # CPU of the links: 300 us per message, 0.5 ns per byte moved
        for sample in record["links"]:
            sample["bytes_recv"] = cost(sample["algorithm"], P=2, n=sample["n"], rank=r).bytes_recv
            sample["cpu"] = 300e-6 * sample["rounds"] + 0.5e-9 * (sample["bytes"] + sample["bytes_recv"])
    profile = profile_from_records(records, density=density, net="1gbit", device="cpu", cores=2, colocated=True,
                                   selectors={}, recv_element_s=0.0, meta={})
    link = profile.links["intra"]
    assert link["cpu_round_s"] == pytest.approx(300e-6) and link["cpu_byte_s"] == pytest.approx(0.5e-9)
    fit = profile.methods["topka"]
    assert fit["agreement_round_s"] == pytest.approx(round_s)
    assert fit["s1"] == pytest.approx(select)  # the agreement is not in the per-element work
    at_cal = comm_cpu_seconds("topka", 2, 1_000_000, density, link, {})
    assert at_cal == pytest.approx((300e-6, 0.5e-9 * 2 * 80_000))  # 1 message, 80 KB each way
    P, n = 6, 5_000_000
    layout = layout_options("topka", P, "1gbit", True)
    p6 = predict("topka", P, n, density, profile=profile)
    no_agreement = dict(fit)
    del no_agreement["agreement_round_s"]
    legacy = predict("topka", P, n, density, profile=Profile(**{**profile.__dict__,
                                                                 "methods": {"topka": no_agreement}}))
    assert p6.work_s - legacy.work_s == pytest.approx(3 * round_s * 3)  # 3 rounds, 6 workers on 2 cores
    cpu6 = comm_cpu_seconds("topka", P, n, density, link, layout)
    assert cpu6[0] == pytest.approx(3 * 300e-6)  # 3 messages (Bruck)
    assert cpu6[1] == pytest.approx(25 * 0.5e-9 * 2 * 80_000)  # 25x the bytes
    # the rounds' fixed cost no longer scales by itself: the measured CPU carries the contention
    formula = predict("topka", P, n, density, alpha=ALPHA, beta=BETA, options=layout).comm_s
    without_cpu = {kind: {key: v for key, v in fit_.items() if not key.startswith("cpu_")}
                   for kind, fit_ in profile.links.items()}
    legacy_formula = predict("topka", P, n, density, profile=Profile(**{**profile.__dict__, "links": without_cpu}),
                             use_comm_factor=False)
    assert legacy_formula.comm_s == pytest.approx(formula + 2 * p6.rounds * ALPHA)
    wire = formula - p6.rounds * ALPHA
    assert predict("topka", P, n, density, profile=profile, use_comm_factor=False).comm_s == pytest.approx(
        formula + shared_cpu(cpu6, wire, 3.0))
    assert shared_cpu(cpu6, wire, 3.0) > 2 * cpu6[0]
    # a cluster (a device per worker) shares nothing: no CPU term, no agreement contention
    cluster = predict("topka", P, n, density, profile=profile, colocated=False, use_comm_factor=False)
    assert cluster.comm_s == pytest.approx(formula)


def test_the_comm_excess_over_the_formula_is_per_call_where_the_messages_cpu_is_its_own_term():
    """The calibration's comm beyond the formula at P_cal: on a rate-limited network, whose per-message
    CPU is fitted and costed by messages on its own, what is left is per call (added once at any P);
    on loopback (no such term) it is per message (x rounds at P / rounds at P_cal, as CPU shared)."""
    density, n, P = 0.01, 1_000_000, 6
    records = _split_records(2, [n], density, 2e-9, 0.1e-9, methods=("topka",))
    for r, record in enumerate(records):
        for sample in record["links"]:
            sample["bytes_recv"] = cost(sample["algorithm"], P=2, n=sample["n"], rank=r).bytes_recv
            sample["cpu"] = 300e-6 * sample["rounds"] + 0.5e-9 * (sample["bytes"] + sample["bytes_recv"])
    kept = {"density": density, "device": "cpu", "cores": 2, "colocated": True, "selectors": {},
            "recv_element_s": 0.0, "meta": {}}
    for net, per_call in (("1gbit", True), ("loopback", False)):
        profile = profile_from_records(records, net=net, **kept)
        measured = profile.methods["topka"]["comm_s"][str(n)]
        excess = measured - predict("topka", 2, n, density, profile=profile, use_comm_factor=False).comm_s
        assert excess > 0.005  # 10 ms measured against a formula of about 1
        at_cal = predict("topka", 2, n, density, profile=profile)
        assert at_cal.comm_s == pytest.approx(measured, rel=1e-9)
        p6 = predict("topka", P, n, density, profile=profile)
        plain = predict("topka", P, n, density, profile=profile, use_comm_factor=False)
        assert p6.rounds == 3 and at_cal.rounds == 1
        expected = excess if per_call else excess * 3 * 3  # 3 rounds against 1, 6 workers on 2 cores
        assert p6.comm_s - plain.comm_s == pytest.approx(expected, rel=1e-6)


def test_split_work_fits_two_sizes_and_merged_calibrations_keep_the_timers():
    from sparsecomm.simulator.calibration import merge_records, split_work

    fit = split_work([(1_000_000, 0.003), (4_000_000, 0.009)], {1_000_000: (20_000.0, 0.001),
                                                                4_000_000: (80_000.0, 0.003)})
    assert fit["d1"] == pytest.approx(2 / 60_000 * 1e-3) and fit["s1"] == pytest.approx(1.333e-9, rel=1e-3)
    dense = split_work([(1_000_000, 0.002)], {1_000_000: (0.0, 0.001)})
    assert dense["decompress_per"] == "element" and dense["d1"] == pytest.approx(1e-9)
    records = _split_records(2, [100_000], 0.01, 1e-9, 1e-10, methods=("topka",))
    merged = merge_records(records, records)
    for key in ("time_decompress", "time_agreement"):
        assert len(merged[0]["runs"][0][key]) == 6


def test_simvalidate_report_says_when_under_what_load_and_which_held_out_points_miss():
    from sparsecomm_lab.bench.simvalidate import report_header, validation_table

    base = {"net": "1gbit", "n": 5_000_000, "P": 6, "density": 0.01, "calibrated_P": 2,
            "calibrated_sizes": [1_000_000], "comm_s": 0.01, "work_s": 0.02}
    rows = [{**base, "method": "topka", "measured_s": 0.060, "predicted_s": 0.050, "when": "2026-11-26 04:08 UTC",
             "load": 1.2},
            {**base, "method": "spardl", "measured_s": 0.060, "predicted_s": 0.030, "when": "2026-11-26 04:20 UTC",
             "load": 0.9}]
    header = report_header(rows, "sparsecomm bench simvalidate -P 6")
    assert "2026-11-26 04:08 UTC .. 2026-11-26 04:20 UTC" in header and "0.9 .. 1.2" in header
    assert header.endswith("    sparsecomm bench simvalidate -P 6")
    table = validation_table(rows)
    assert "| within 25% |" in table and "| -17% | yes | yes |" in table and "| -50% | yes | no |" in table
    assert "within 25%: 1/2; outside: spardl (P=6, n=5000000, 1gbit)" in table


def test_shared_cpu_puts_the_messages_cpu_on_the_path_and_hides_the_bytes_cpu_behind_the_wire():
    from sparsecomm.simulator.model import shared_cpu

    assert shared_cpu((0.002, 0.004), 0.010, 1.0) == 0.0  # the calibration's contention: nothing added
    # 3 processes a core: the messages' CPU twice more; the bytes' 12 ms of CPU outlast the 10 ms wire by 2
    assert shared_cpu((0.002, 0.004), 0.010, 3.0) == pytest.approx(2 * 0.002 + 0.002)
    # a bandwidth-bound call (dense at 1 Gbit/s): its bytes' CPU, shared, still fits behind the wire
    assert shared_cpu((0.001, 0.030), 0.270, 3.0) == pytest.approx(2 * 0.001)
    # CPU-bound bytes (the wire faster than their copies): the calibrated time held the CPU once
    assert shared_cpu((0.0, 0.004), 0.001, 3.0) == pytest.approx(0.008)


def test_a_gpu_calibration_fits_decompression_per_entry_touched():
    """On a GPU the decompression is an ``index_add_`` per chunk, not the CPU's blocked sweep."""
    records = _split_records(2, [1_000_000], 0.01, 2e-9, 0.1e-9, methods=("topka",))
    gpu = profile_from_records(records, density=0.01, net="loopback", device="cuda (a GPU)", cores=1,
                               colocated=False, selectors={}, recv_element_s=0.0, meta={})
    assert gpu.methods["topka"]["decompress_per"] == "entry"
    cpu = profile_from_records(records, density=0.01, net="loopback", device="cpu", cores=2, colocated=True,
                               selectors={}, recv_element_s=0.0, meta={})
    assert cpu.methods["topka"]["decompress_per"] == "byte"


def test_a_one_size_calibration_keeps_the_selectors_fixed_part_out_of_the_per_element_work():
    """exact_topk's sampled floor (about 256 / density elements and their top-k) costs the same at
    any n: calibrated at n = 1M alone, it must not be scaled 5x at n = 5M."""
    from sparsecomm.simulator.calibration import measure_selector_fixed

    density, select, fixed = 0.01, 2e-9, 0.5e-3
    records = _split_records(2, [1_000_000], density, select, 0.0, methods=("topka",))
    for record in records:
        record["runs"][0]["selector"] = "exact_topk"
    profile = profile_from_records(records, density=density, net="1gbit", device="cpu", cores=2, colocated=True,
                                   selectors={}, recv_element_s=0.0, meta={},
                                   selector_fixed_s={"exact_topk": fixed})
    fit = profile.methods["topka"]
    assert fit["s0"] == pytest.approx(fixed) and fit["s1"] == pytest.approx((select * 1e6 - fixed) / 1e6)
    at_5m = predict("topka", 2, 5_000_000, density, profile=profile).work_s
    assert at_5m == pytest.approx(5 * select * 1e6 - 4 * fixed, rel=1e-6)
    # the one-process measurement: a fixed part between 0 and the call's time, for every selector
    measured = measure_selector_fixed(200_000, density, repeat=2)
    assert "exact_topk" in measured and all(seconds >= 0 for seconds in measured.values())
    assert SAMPLED_THRESHOLD in measured  # ExDyna's and the adaptive threshold's sampled estimate


@pytest.mark.parametrize("name, options, recorded", [
    ("exdyna", {}, SAMPLED_THRESHOLD), ("exdyna", {"controller": "paper"}, ""),
    ("threshold", {}, SAMPLED_THRESHOLD), ("threshold", {"threshold": 0.5}, "fixed_threshold"),
    ("topka", {}, "exact_topk")])
def test_the_calibration_records_what_fixed_part_a_methods_selection_has(name, options, recorded):
    """A method that estimates its threshold from a sample every call (about 1024 / density elements,
    the same at any n) is calibrated with that estimate's one-process fixed part as its ``s0``."""
    out = run_workers(1, time_method_in_worker, name, {"density": 0.01, **options}, 20_000, 1, 0, timeout=60)
    assert out[0]["selector"] == recorded


def test_the_agreement_is_the_last_arriving_ranks_not_the_wait_of_the_others():
    """Rank 0 finishes its selection 5 ms early and waits in the agreement for rank 1: that wait is
    imbalance of the selection, not the agreement's messages (0.3 ms, rank 1's)."""
    records = _split_records(2, [1_000_000], 0.01, 2e-9, 0.0, methods=("topka",), agreement_round=0.3e-3)
    run0 = records[0]["runs"][0]
    records[0] = {**records[0], "runs": [{**run0, "time_agreement": [t + 0.005 for t in run0["time_agreement"]],
                             "time_select": [t - 0.005 for t in run0["time_select"]]}]}
    fit = profile_from_records(records, density=0.01, net="1gbit", device="cpu", cores=2, colocated=True,
                               selectors={}, recv_element_s=0.0, meta={}).methods["topka"]
    assert fit["agreement_round_s"] == pytest.approx(0.3e-3)
    assert fit["s1"] == pytest.approx(2e-9)  # the critical rank's work: its selection and its agreement


def test_on_an_emulated_rate_a_formula_over_estimate_is_the_buckets_burst_a_fixed_credit_per_call():
    """topka's 80 KB at P = 2 pass in the token bucket's burst, faster than the rate: the formula
    over-estimates by a fixed amount per call (the burst), which must not shrink the 2 MB at P = 6
    by the same fraction. On loopback the over-estimate stays a factor."""
    density, measured = 0.01, 0.1e-3
    records = _split_records(2, [1_000_000], density, 2e-9, 0.0, methods=("topka",))
    run = records[0]["runs"][0]  # shared by the ranks' records
    run["times"] = [t - 0.01 + measured for t in run["times"]]
    run["time_comm"] = [measured] * len(run["time_comm"])
    profile = profile_from_records(records, density=density, net="1gbit", device="cpu", cores=2, colocated=True,
                                   selectors={}, recv_element_s=0.0, meta={})
    formula = {P: predict("topka", P, n, density, alpha=ALPHA, beta=BETA)
               for P, n in ((2, 1_000_000), (6, 5_000_000))}
    assert formula[2].comm_s > measured
    assert predict("topka", 2, 1_000_000, density, profile=profile).comm_s == pytest.approx(measured)
    credit = formula[2].comm_s - measured
    p6 = predict("topka", 6, 5_000_000, density, profile=profile)
    assert p6.comm_s == pytest.approx(3 * p6.rounds * ALPHA + formula[6].bytes_sent * BETA - credit)
    profile.net = "loopback"
    factor = measured / formula[2].comm_s
    assert predict("topka", 2, 1_000_000, density, profile=profile).comm_s == pytest.approx(measured)
    assert predict("topka", 6, 5_000_000, density, profile=profile).comm_s == pytest.approx(
        factor * 3 * (p6.rounds * ALPHA + formula[6].bytes_sent * BETA))


def test_simvalidate_merges_a_new_calibration_into_the_last_one(tmp_path, monkeypatch):
    """Each validation run adds one calibration to the profile the earlier runs made (the least over all
    their calls), so calibration and measurement sample the same period: a profile of the current
    calibration is kept, not calibrated afresh."""
    import argparse

    from sparsecomm_lab.bench import simvalidate

    from sparsecomm.simulator import calibration

    made = []

    def fake_calibrate(P, methods, sizes, density, **_):
        made.append(P)
        return profile_from_records(_split_records(P, sizes, density, 1e-9, 1e-10, methods=tuple(methods)),
                                    density=density, net="1gbit", device="cpu", cores=2, colocated=True,
                                    selectors={}, recv_element_s=0.0,
                                    meta={"P": P, "sizes": list(sizes), "when": f"call {len(made)}"})

    monkeypatch.setattr(calibration, "calibrate", fake_calibrate)
    args = argparse.Namespace(calibrate_repeat=None, repeat=5, calibrate_workers=2, density=0.01, timeout=60.0,
                              profile_dir=str(tmp_path))
    first, _ = simvalidate._profile_for("1gbit", args, ["topka"], [1_000_000], rounds=1)
    second, _ = simvalidate._profile_for("1gbit", args, ["topka"], [1_000_000], rounds=2)
    assert len(made) == 2 and first.meta["calibrations"] == 1 and second.meta["calibrations"] == 2
    assert second.meta["when"] == "call 1 .. call 2"
    assert len(second.records[0]["runs"][0]["times"]) == 2 * len(first.records[0]["runs"][0]["times"])


def test_rests_on_names_each_methods_decompression_unit():
    """The GPU profile fits the dense methods' decompression per gradient element and the sparse
    ones' per entry touched: each prediction says which (not "byte swept" for both)."""
    profile = Profile.load(Path(__file__).resolve().parents[1] / "docs/simulator/profile-h100-P2.json")
    dense = predict("dense", 8, 25_000_000, 0.01, profile=profile, alpha=50e-6, beta=0.8e-9)
    sparse = predict("topka", 8, 25_000_000, 0.01, profile=profile, alpha=50e-6, beta=0.8e-9)
    assert "decompression per gradient element" in dense.rests_on
    assert "decompression per entry touched" in sparse.rests_on


def test_spardls_messages_riding_on_the_agreement_leave_it_the_rounds_it_agrees_apart():
    """Where SparDL's Spar-Reduce-Scatter rides on the agreement's steps (P a power of two, gloo) its
    calibration times no agreement of its own (``agreement_ride`` "ride"): it is costed at the
    folded methods' rate per round, for the rounds it still sends apart at P (none where P is a power
    of two, the whole agreement elsewhere: two at P = 3, three at P = 6)."""
    from sparsecomm.simulator.model import agreement_rounds, layout_options, work_seconds

    assert [agreement_rounds(P, "ride") for P in (1, 2, 3, 4, 6, 8)] == [0, 0, 2, 0, 3, 0]
    assert [agreement_rounds(P, "gather") for P in (2, 3, 8)] == [0, 0, 0]
    density, select, per_byte, round_s = 0.01, 2e-9, 0.1e-9, 0.4e-3
    records = _split_records(2, [1_000_000], density, select, per_byte, agreement_round=round_s)
    for run in records[0]["runs"]:  # the ranks' records share one list of runs
        if run["method"] == "spardl":  # its agreement was its comm: no time of its own, not in its work
            run["times"] = [t - round_s for t in run["times"]]
            run["time_agreement"] = [0.0] * 3
            run["agreement_ride"] = "ride"
    profile = profile_from_records(records, density=density, net="1gbit", device="cpu", cores=2, colocated=True,
                                   selectors={}, recv_element_s=5e-9, meta={})
    fit = profile.methods["spardl"]
    assert fit["agreement_ride"] == "ride" and fit["agreement_round_s"] == pytest.approx(round_s)
    assert fit["s1"] == pytest.approx(select)  # the rounds were not taken out of its work
    n = 5_000_000

    def agreement_part(P):
        options = layout_options("spardl", P, "1gbit", True)
        alone = dict(fit, agreement_round_s=0.0)
        return (work_seconds(fit, "spardl", P, n, density, options, {}, 0.0)[0]
                - work_seconds(alone, "spardl", P, n, density, options, {}, 0.0)[0])

    assert [agreement_part(P) for P in (2, 3, 4, 6)] == pytest.approx([0.0, 2 * round_s, 0.0, 3 * round_s])


def _oktopk_runs():
    from sparsecomm.simulator.calibration import method_runs

    return method_runs(["oktopk"], [40_000], 0.01, repeat=2)


def test_calibration_times_a_dense_warmup_method_after_its_warmup():
    """Ok-Topk's first 512 calls are dense all-reduces by default (its paper's warm-up); the
    calibration and the validation time the calls after them, as the model predicts: not a dense
    all-reduce's bytes (its first sparse calls, thresholds not yet settled, send about a third of
    them here)."""
    from sparsecomm.methods import dense_warmup

    assert dense_warmup("oktopk") > 3  # the default would make every timed call here dense
    n, P = 40_000, 2
    dense_bytes = cost("dense", P=P, n=n, rank=0).bytes_sent
    for rank_runs in run_workers(P, _oktopk_runs, timeout=120):
        (run,) = rank_runs
        assert 0 < run["bytes_sent"] < dense_bytes / 2


def test_spardls_top_k_blocks_follow_its_reduce_scatter_schedule():
    """Spar-Reduce-Scatter selects every block it sends after the first step, and its own, by a top-k
    of that block: 2^(ceil(log2 m) - 1) blocks of n / m (the first step's bag in the scan), all m
    without the scan. The other methods select in one pass at any P."""
    spardl, n = method_class("spardl"), 6_000_000
    assert [len(spardl.topk_blocks(P, n)) for P in range(1, 9)] == [0, 1, 2, 2, 4, 4, 4, 4]
    assert [len(spardl.topk_blocks(P, n, scan=False)) for P in range(2, 9)] == list(range(2, 9))
    assert spardl.topk_blocks(6, n) == [1_000_000] * 4 and spardl.topk_blocks(2, n) == [3_000_000]
    assert spardl.topk_blocks(8, n, teams=2) == [1_500_000] * 2  # teams of four ranks
    assert all(method_class(name).topk_blocks(6, n) == [] for name in available_methods() if name != "spardl")


def test_spardls_selection_grows_with_the_blocks_it_takes_at_P():
    """Calibrated at P = 2 (one block of n / 2 by top-k), SparDL at P = 6 takes four blocks of n / 6:
    its selection grows by their one-process cost (per element and per block), the other methods'
    not at all."""
    from sparsecomm.simulator.calibration import measure_block_topk

    density, n = 0.01, 6_000_000
    records = _split_records(2, [1_000_000], density, 2e-9, 0.0)
    block = {"per_element": 1e-9, "per_block": 1e-3}
    kept = {"density": density, "net": "1gbit", "device": "cpu", "cores": 2, "colocated": True, "selectors": {},
            "recv_element_s": 0.0, "meta": {}}
    with_blocks = profile_from_records(records, block_topk_s=block, **kept)
    without = profile_from_records(records, **kept)
    grows = {name: predict(name, 6, n, density, profile=with_blocks, colocated=False).work_s
             - predict(name, 6, n, density, profile=without, colocated=False).work_s for name in ("spardl", "topka")}
    assert grows["spardl"] == pytest.approx(4 * (1e-9 * 1_000_000 + 1e-3) - (1e-9 * 3_000_000 + 1e-3))
    assert grows["topka"] == 0.0
    at_cal = predict("spardl", 2, n, density, profile=with_blocks, colocated=False).work_s
    assert at_cal == pytest.approx(predict("spardl", 2, n, density, profile=without, colocated=False).work_s)
    measured = measure_block_topk(400_000, density, repeat=2)
    assert measured["per_element"] >= 0 and measured["per_block"] >= 0
    assert measured["per_element"] * 200_000 + measured["per_block"] > 0  # a block's top-k costs something


def _cpu_profile(cpu_per_element, sizes=(1_000_000, 4_000_000), colocated=True):
    """topka calibrated at P = 2 on an emulated 1 Gbit/s with 2 cores: 2 ns of work per element, the
    links' CPU 300 us per message and 0.5 ns per byte, and each call's process CPU
    ``cpu_per_element`` per element."""
    density = 0.01
    records = _split_records(2, list(sizes), density, 2e-9, 0.0, methods=("topka",))
    for r, record in enumerate(records):
        for sample in record["links"]:
            sample["bytes_recv"] = cost(sample["algorithm"], P=2, n=sample["n"], rank=r).bytes_recv
            sample["cpu"] = 300e-6 * sample["rounds"] + 0.5e-9 * (sample["bytes"] + sample["bytes_recv"])
    for run in records[0]["runs"]:  # shared by the ranks' records
        run["cpu"] = [cpu_per_element * run["n"]] * 3
    return profile_from_records(records, density=density, net="1gbit", device="cpu", cores=2, colocated=colocated,
                                selectors={}, recv_element_s=0.0, meta={})


def test_the_cores_estimate_is_every_ranks_cpu_on_the_cores_plus_the_wire():
    """P colocated workers on fewer cores: the cores do P ranks' CPU (the calibrated process CPU per
    call plus what P adds) and the wire passes on top, the bytes' copies overlapping it. The larger of
    that and the critical path is the prediction; at P <= cores, on a cluster, or where the CPU was
    not recorded, it is not used."""
    from sparsecomm.simulator.model import comm_cpu_seconds, cores_seconds, mean_comm_cpu_seconds

    # the formula: c (cpu - bytes' cpu) + max(wire, c bytes' cpu); cpu = the calibrated one plus P's growth
    link = {"cpu_round_s": 300e-6, "cpu_byte_s": 0.5e-9}
    calib = {"P": 2, "cpu1": 4e-9, "cpu0": 1e-3, "s1": 0.0, "s0": 0.0, "d1": 0.0, "d0": 0.0}
    n, density = 5_000_000, 0.01
    at_6, at_2 = (mean_comm_cpu_seconds("topka", P, n, density, link, {"local_size": 1}) for P in (6, 2))
    cpu = 4e-9 * n + 1e-3 + sum(at_6) - sum(at_2)
    assert cores_seconds(calib, "topka", 6, n, density, {"local_size": 1}, {"local_size": 1}, link, 0.010, 3.0) \
        == pytest.approx(3 * (cpu - at_6[1]) + max(0.010, 3 * at_6[1]))
    assert cores_seconds(calib, "topka", 6, n, density, {"local_size": 1}, {"local_size": 1}, link, 1.0, 3.0) \
        == pytest.approx(3 * (cpu - at_6[1]) + 1.0)  # a long wire hides the copies
    assert cores_seconds({k: v for k, v in calib.items() if k != "cpu1"},
                         "topka", 6, n, density, {}, {}, link, 0.01, 3.0) is None
    # the mean rank's messages: CLT-k's leader (rank 0) sends more than the other five
    slowest, mean = (f("cltk", 6, n, density, link, {"local_size": 1}) for f in (comm_cpu_seconds,
                                                                                 mean_comm_cpu_seconds))
    assert sum(mean) < sum(slowest)
    assert mean == pytest.approx(tuple(sum(link["cpu_round_s" if i == 0 else "cpu_byte_s"] * v for v in values) / 6
                                       for i, values in enumerate(zip(*[
                                           (c.rounds, c.bytes_sent + c.bytes_recv)
                                           for c in (cost("cltk", P=6, n=n, k=50_000, rank=r, density=density,
                                                          local_size=1) for r in range(6))], strict=True))))
    # in the prediction: the CPU of 6 ranks on 2 cores outlasts the critical path, a little CPU does not
    busy, idle = _cpu_profile(20e-9), _cpu_profile(1e-9)
    assert busy.methods["topka"]["cpu1"] == pytest.approx(20e-9)
    plain = {P: predict("topka", P, n, density, profile=_cpu_profile(0.0)) for P in (2, 6)}
    p6 = predict("topka", 6, n, density, profile=busy)
    assert "the cores' estimate" in p6.rests_on and p6.total_s > 2 * plain[6].total_s
    assert p6.total_s > 3 * 20e-9 * n  # three ranks a core, 100 ms of CPU each
    assert predict("topka", 6, n, density, profile=idle).total_s == pytest.approx(plain[6].total_s)
    assert predict("topka", 2, n, density, profile=busy).total_s == pytest.approx(plain[2].total_s)
    cluster = predict("topka", 6, n, density, profile=busy, colocated=False)
    assert "the cores' estimate" not in cluster.rests_on


def test_the_calibration_records_each_calls_cpu_and_bytes_and_takes_the_median_calls_traffic():
    """A data-dependent method's bytes vary from call to call (ExDyna's threshold controller): the
    traffic factor is the median call's (each call's largest over ranks), not the most any call sent,
    which the least call the estimators take is not."""
    from sparsecomm_lab.bench.simvalidate import _validate_worker

    (record,) = run_workers(1, _validate_worker, ["topka"], [20_000], 0.01, 3, timeout=60)
    (run,) = record["runs"]
    assert len(run["cpu"]) == 3 and all(seconds > 0 for seconds in run["cpu"])
    assert run["bytes_per_call"] == [0] * 3  # one worker sends nothing
    density, n = 0.01, 1_000_000
    records = _split_records(2, [n], density, 2e-9, 0.0, methods=("topka",))
    formula = records[0]["runs"][0]["bytes_sent"]
    per_rank = ([0.8, 1.5, 1.1], [1.0, 0.7, 1.2])  # per call: largest over ranks 1.0, 1.5, 1.2; median 1.2
    records = [{**record, "runs": [{**record["runs"][0], "bytes_per_call": [f * formula for f in factors],
                                    "bytes_sent": max(factors) * formula}]}
               for record, factors in zip(records, per_rank, strict=True)]
    kept = {"density": density, "net": "1gbit", "device": "cpu", "cores": 2, "colocated": True, "selectors": {},
            "recv_element_s": 0.0, "meta": {}}
    assert profile_from_records(records, **kept).methods["topka"]["traffic_factor"] == pytest.approx(1.2)
    older = [{**record, "runs": [{k: v for k, v in record["runs"][0].items() if k != "bytes_per_call"}]}
             for record in records]
    assert profile_from_records(older, **kept).methods["topka"]["traffic_factor"] == pytest.approx(1.5)
