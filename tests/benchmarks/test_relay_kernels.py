"""The relay-kernels benchmark's crossover rule, on made-up timings (the benchmark needs a GPU)."""

from loraplex.benchmarks.relay_kernels import crossover


def _case(batch, n, s, speedup):
    return {"batch": batch, "group_size": n, "prefix_len": s, "speedup": speedup}


def test_crossover_is_the_smallest_group_size_from_which_relay_stays_faster():
    results = [_case(64, n, 512, x) for n, x in ((1, 0.8), (2, 1.1), (4, 0.99), (8, 1.5))]
    results += [_case(128, n, 512, x) for n, x in ((1, 0.9), (2, 1.2), (4, 1.4), (8, 2.0))]
    results += [_case(64, n, 128, x) for n, x in ((1, 0.5), (2, 0.7), (4, 0.9), (8, 0.95))]
    results += [_case(128, n, 128, x) for n, x in ((1, 0.5), (2, 0.7), (4, 0.9), (8, 1.05))]
    out = crossover(results)
    assert out["min_group_size_by_prefix_and_batch"] == {"128": {"64": None, "128": 8},
                                                         "512": {"64": 8, "128": 2}}
    assert out["min_group_size_by_prefix"] == {"128": None, "512": 8}
    assert "prefix 512: group size >= 8" in out["rule"]


def test_inputs_give_relay_equal_to_plain_decode():
    import torch

    from loraplex.benchmarks.relay_kernels import SCALE, make_inputs
    from loraplex.kernels import reference as ref

    torch.manual_seed(0)
    q, kv, tables, lens, prefix_lens, members, starts = make_inputs(6, 3, 32, 5, device="cpu")
    q, kv = q.float(), kv.float()
    assert starts.tolist() == [0, 3, 6] and tables.shape == (6, 3)
    assert torch.equal(tables[0, :2], tables[2, :2]) and not torch.equal(tables[0, :2], tables[3, :2])
    relay = ref.relay_decode_attention(q, kv, tables, lens, prefix_lens, members, starts, SCALE)
    plain = ref.paged_decode_attention(q, kv, tables, lens, SCALE)
    torch.testing.assert_close(relay, plain, atol=1e-5, rtol=1e-5)
