"""`loraplex bench disaggregated` on the CPU (`--smoke`: a tiny model, gloo workers): both
placements serve the same Poisson arrivals to their end, the JSON has each one's rows, goodput
and, for 1:1, the KV transfers and the prefill side's use; and the goodput rule on its own."""

import json

from loraplex.benchmarks.disaggregated_bench import Timing, goodput, main, summarize


def test_the_smoke_run_serves_both_placements(tmp_path):
    main(["--smoke", "--rates", "3", "--duration-s", "1.5", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "disaggregated-cpu.json").read_text())
    assert set(result["placements"]) == {"colocated", "1:1"}
    for placement in result["placements"].values():
        (row,) = placement["rows"]
        assert row["requests"] == 4 and row["attained"] > 0  # round(3 x 1.5)
        assert 0 < row["ttft_p50_s"] <= row["ttft_p90_s"] and row["tpot_p50_s"] > 0
        assert placement["goodput_req_per_s"] == (3.0 if row["meets_targets"] else 0.0)
    row = result["placements"]["1:1"]["rows"][0]
    assert row["kv_transfers"]["transfers"] == 4 and row["kv_transfers"]["bytes"] > 0
    assert 0 < row["prefill_side"]["busy_share"] <= 1 and row["prefill_side"]["prompt_tokens"] > 0
    assert result["summary"]["kv_transfer_gb_per_s"] > 0


def test_goodput_is_the_highest_rate_that_met_both_targets():
    def timings(ttft, tpot, count=10):
        return {str(i): Timing(arrival=0.0, first=ttft, last=ttft + tpot * 9, num_tokens=10)
                for i in range(count)}

    rows = [summarize(timings(0.5, 0.02), 2.0, 1.0, 0.05), summarize(timings(0.9, 0.04), 4.0, 1.0, 0.05),
            summarize(timings(1.5, 0.03), 6.0, 1.0, 0.05), summarize(timings(0.5, 0.06), 8.0, 1.0, 0.05)]
    assert [row["meets_targets"] for row in rows] == [True, True, False, False]
    assert goodput(rows) == 4.0
    assert goodput(rows, 1.0, 0.025) == 2.0 and goodput(rows, 2.0, 0.05) == 6.0
    assert goodput(rows, 0.1, 0.05) == 0.0
