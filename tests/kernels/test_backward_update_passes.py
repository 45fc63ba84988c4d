"""The CPU reference of the fused backward runs in passes over blocks of unique ids (sparse_update.
_backward_update_cpu): every pass size must give the bits of the unsplit reference (unique_grad_torch, then
sparse_update_torch), for every rule, mode, dtype, host-served rows, grad scaling and padding."""
import sys

import pytest
import torch

from cachedemb import kernels
from cachedemb.kernels import MODE_MEAN, MODE_SUM, UpdateRule, adam_step_size
from cachedemb.kernels.bag_backward import unique_grad_torch

su = sys.modules["cachedemb.kernels.sparse_update"]  # the module (the package exports the op by that name)

RULES = {
    "sgd": UpdateRule("sgd", lr=0.1),
    "adagrad": UpdateRule("adagrad", lr=0.1, eps=1e-10),
    "rowwise_adagrad": UpdateRule("rowwise_adagrad", lr=0.1, eps=1e-8),
    "adam": UpdateRule("adam", lr=0.1, eps=1e-8, beta1=0.9, beta2=0.999, step_size=adam_step_size(0.1, 0.9, 0.999, 3)),
}
MODES = {"sum": (MODE_SUM, False), "sum_psw": (MODE_SUM, True), "mean": (MODE_MEAN, False)}


def states_for(rule, n_rows, dim, dtype):
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    cols = {"sgd": [], "adagrad": [dim], "rowwise_adagrad": [1], "adam": [dim, dim]}[rule.kind]
    return [torch.rand(n_rows, c, dtype=acc) for c in cols]


def batch(dim, dtype, seed, *, pad_id=5, host_share=0.3, n_ids=40, lengths=None):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths if lengths is not None else torch.randint(0, 12, (30,), generator=g).tolist())
    n_lookups = int(lengths.sum())
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    ids = torch.randint(0, n_ids, (n_lookups,), generator=g)
    uniq, inverse, _, n_uniq, groups = kernels.unique_ids_torch(ids, padding_idx=pad_id, return_groups=True)
    n = int(n_uniq)
    n_rows = 64
    loc_u = torch.full((n_lookups,), -1, dtype=torch.int64)
    loc_u[:n] = torch.randperm(n_rows, generator=g)[:n]
    on_host = torch.rand(n, generator=g) < host_share
    loc_u[:n] = torch.where(on_host, kernels.host_loc(uniq[:n]), loc_u[:n])
    rows = torch.randn(n_rows, dim, generator=g).to(dtype)
    host = torch.randn(n_ids, dim, generator=g).to(dtype)
    psw = torch.rand(n_lookups, generator=g) + 0.5
    grad_out = torch.randn(len(lengths), dim, generator=g)
    if dtype == torch.float64:
        grad_out, psw = grad_out.double(), psw.double()
    gscale = 1.0 / (torch.rand(n_lookups, generator=g) * 3 + 1)
    return dict(rows=rows, host=host, loc_u=loc_u, inverse=inverse, offsets=offsets, n_uniq=n_uniq, psw=psw,
                grad_out=grad_out, groups=groups, gscale=gscale)


def unsplit(rows, states, b, mode, psw, rule, host, host_states, gscale, groups):
    grad_u = unique_grad_torch(b["grad_out"], b["inverse"], b["offsets"], mode, psw, None, gscale, groups)
    kernels.sparse_update_torch(rows, states, b["loc_u"], grad_u, b["n_uniq"], rule, host, host_states)


def bits(t):
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@pytest.mark.parametrize("pass_ids", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("mode_name", list(MODES))
@pytest.mark.parametrize("rule_name", list(RULES))
def test_passes_equal_unsplit(rule_name, mode_name, dtype, pass_ids, monkeypatch):
    rule = RULES[rule_name]
    mode, use_psw = MODES[mode_name]
    dim = 6
    for seed in range(3):
        b = batch(dim, dtype, seed)
        psw = b["psw"] if use_psw else None
        gscale = b["gscale"] if seed != 1 else None
        groups = b["groups"] if seed != 2 else None
        n_rows = b["rows"].shape[0]
        states0 = states_for(rule, n_rows, dim, dtype)
        host_states0 = states_for(rule, b["host"].shape[0], dim, dtype)
        ref = [b["rows"].clone(), [s.clone() for s in states0], b["host"].clone(), [s.clone() for s in host_states0]]
        unsplit(ref[0], ref[1], b, mode, psw, rule, ref[2], ref[3], gscale, groups)
        got = [b["rows"].clone(), [s.clone() for s in states0], b["host"].clone(), [s.clone() for s in host_states0]]
        elem = torch.empty(0, dtype=b["grad_out"].dtype).element_size()
        monkeypatch.setattr(su, "CPU_PASS_BYTES", pass_ids * dim * elem)
        kernels.backward_update_torch(got[0], got[1], b["loc_u"], b["n_uniq"], b["grad_out"], b["inverse"],
                                      b["offsets"], mode, psw, None, rule, got[2], got[3], gscale, groups)
        monkeypatch.undo()
        assert torch.equal(bits(got[0]), bits(ref[0])), "rows"
        assert torch.equal(bits(got[2]), bits(ref[2])), "host rows"
        for s, r in zip(got[1] + got[3], ref[1] + ref[3]):
            assert torch.equal(bits(s), bits(r)), "state"


@pytest.mark.parametrize("pass_ids", [1, 2, 1000])
def test_passes_keep_the_padding_tail(pass_ids, monkeypatch):
    """The whole-batch call's last bag runs over the padding lookups (scale 0, sorted last): an inf gradient in a
    bag holding a padding lookup makes the last id's row NaN (0 * inf), in passes too."""
    dim = 3
    ids = torch.tensor([1, 2, 3, 0, 4, 0, 2, 4])  # id 0 pads; bag 1 = lookups 3..5 holds two padding lookups
    offsets = torch.tensor([0, 3, 6, 8])
    uniq, inverse, _, n_uniq, groups = kernels.unique_ids_torch(ids, padding_idx=0, return_groups=True)
    n = int(n_uniq)
    loc_u = torch.full((8,), -1, dtype=torch.int64)
    loc_u[:n] = torch.arange(n)
    grad_out = torch.randn(3, dim)
    grad_out[1] = float("inf")
    rows = torch.randn(8, dim)
    rule = RULES["sgd"]
    ref = rows.clone()
    b = dict(grad_out=grad_out, inverse=inverse, offsets=offsets, loc_u=loc_u, n_uniq=n_uniq)
    unsplit(ref, [], b, MODE_SUM, None, rule, None, None, None, groups)
    assert bool(ref[n - 1].isnan().all())
    got = rows.clone()
    monkeypatch.setattr(su, "CPU_PASS_BYTES", pass_ids * dim * 4)
    kernels.backward_update_torch(got, [], loc_u, n_uniq, grad_out, inverse, offsets, MODE_SUM, None, None, rule,
                                  groups=groups)
    assert torch.equal(bits(got), bits(ref))


def test_passes_with_only_padding(monkeypatch):
    dim = 4
    ids = torch.full((6,), 5)
    uniq, inverse, _, n_uniq, groups = kernels.unique_ids_torch(ids, padding_idx=5, return_groups=True)
    rows = torch.randn(8, dim)
    got = rows.clone()
    monkeypatch.setattr(su, "CPU_PASS_BYTES", dim * 4)
    kernels.backward_update_torch(got, [], torch.full((6,), -1), n_uniq, torch.randn(2, dim), inverse,
                                  torch.tensor([0, 3, 6]), MODE_SUM, None, None, RULES["sgd"], groups=groups)
    assert torch.equal(got, rows)
