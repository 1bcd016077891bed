"""The joint refinement's leave-one-domain-out choice and the REUSE maps' held-out scoring, made cheap
(issue 58), against the straightforward arithmetic they replace: the reference below is that code
(scdviz.scd.rrr / scdviz.scd.calibrate as they were), kept here on plain statistics. Random joint
[K, V] statistics with d_kv = 64 (128 joint dimensions), several folds (one with fewer rows than
dimensions), shrinkages including the identity fallback, and the default rank / ridge grids.
Timing at Mistral-7B shapes: ``python -m research.calibrate_cost``."""

from __future__ import annotations

import dataclasses
import functools
import types

import pytest
import torch

from scdviz.scd import calibrate as cal
from scdviz.scd import rrr
from scdviz.scd.calibration import CalibConfig

# ----------------------------------------------------------------------------- the reference (the old arithmetic)


def ref_stats(st) -> types.SimpleNamespace:
    return types.SimpleNamespace(n=st.n, sx=st.sx.clone(), sy=st.sy.clone(), sxx=st.sxx.clone(), sxy=st.sxy.clone(),
                                 syy=st.syy.clone())


def ref_add(a, b):
    return types.SimpleNamespace(n=a.n + b.n, **{k: getattr(a, k) + getattr(b, k)
                                                 for k in ("sx", "sy", "sxx", "sxy", "syy")})


def ref_block(st, rows, cols):
    return types.SimpleNamespace(n=st.n, sx=st.sx[rows], sy=st.sy[cols], syy=st.syy[cols], sxx=st.sxx[rows, rows],
                                 sxy=st.sxy[rows, cols])


def ref_centred(st):
    n = max(st.n, 1)
    mu_x, mu_y = st.sx / n, st.sy / n
    gram = st.sxx - n * torch.outer(mu_x, mu_x)
    cross = st.sxy - n * torch.outer(mu_x, mu_y)
    total = (st.syy.sum() - n * (mu_y**2).sum()).clamp_min(1e-30)
    return mu_x, mu_y, gram, cross, total


def ref_full_map(st, ridge, shrink):
    mu_x, mu_y, gram, cross, _ = ref_centred(st)
    eye = torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
    if shrink == float("inf"):
        return mu_x, mu_y, eye
    scale = gram.diagonal().mean().clamp_min(1e-12)
    target = cross + shrink * scale * eye if shrink else cross
    return mu_x, mu_y, torch.linalg.solve(gram + (ridge + shrink) * scale * eye, target)


def ref_heldout_error(st, mu_x, mu_y, b):
    n = st.n
    yy = st.syy.sum() - 2 * mu_y @ st.sy + n * mu_y @ mu_y
    xx = st.sxx - torch.outer(st.sx, mu_x) - torch.outer(mu_x, st.sx) + n * torch.outer(mu_x, mu_x)
    xy = st.sxy - torch.outer(st.sx, mu_y) - torch.outer(mu_x, st.sy) + n * torch.outer(mu_x, mu_y)
    err = yy - 2 * (b * xy).sum() + (b * (xx @ b)).sum()
    return float(err / ref_centred(st)[4])


def ref_residual_of(st, mu_x, b, mu_y):
    n = st.n
    a = st.sx - n * mu_x
    aa = st.sxx - torch.outer(st.sx, mu_x) - torch.outer(mu_x, st.sx) + n * torch.outer(mu_x, mu_x)
    s_hat = a @ b + n * mu_y
    hh = b.T @ aa @ b + b.T @ torch.outer(a, mu_y) + torch.outer(mu_y, a) @ b + n * torch.outer(mu_y, mu_y)
    hy = b.T @ (st.sxy - torch.outer(mu_x, st.sy)) + torch.outer(mu_y, st.sy)
    return types.SimpleNamespace(n=n, sx=s_hat, sxx=hh, sy=st.sy - s_hat, sxy=hy - hh,
                                 syy=st.syy - 2 * hy.diagonal() + hh.diagonal())


def ref_fit(st, ridge, max_rank=None, shrink=0.0) -> rrr.LinearCode:
    _, _, gram, cross, total = ref_centred(st)
    mu_x, mu_y, b = ref_full_map(st, ridge, shrink)
    evals, evecs = torch.linalg.eigh(b.T @ gram @ b)
    s_all = evals.clamp_min(0).sqrt()
    c_all = ((b @ evecs) * (cross @ evecs)).sum(0) / s_all.clamp_min(1e-30)
    gain = 2 * s_all * c_all - s_all**2
    order = gain.argsort(descending=True)
    r = min(max_rank or order.numel(), order.numel())
    s, v = s_all[order[:r]], evecs[:, order[:r]]
    gains = torch.cumsum(gain[order[:r]], 0)
    fit_err = torch.cat([torch.ones(1, dtype=s.dtype, device=s.device), 1 - gains / total])
    return rrr.LinearCode(mu_x.float(), mu_y.float(), (b @ v).float(), v.T.float(), s.float(), fit_err.float())


def ref_refined(mu_x, mu_y, b, code):
    enc, dec = code.enc.double(), code.dec.double()
    shift = (mu_y - code.mu_in.double()) @ enc @ dec + code.mu_out.double()
    return mu_x, mu_y + shift, b + b @ enc @ dec


def ref_joint_map(st, ridge, alpha_k, alpha_v, beta, rank):
    d = st.sx.numel() // 2
    halves = (slice(0, d), slice(d, 2 * d))
    maps = [ref_full_map(ref_block(st, h, h), ridge, a) for h, a in zip(halves, (alpha_k, alpha_v))]
    mu_x, mu_y = torch.cat([m[0] for m in maps]), torch.cat([m[1] for m in maps])
    b = torch.block_diag(maps[0][2], maps[1][2])
    if beta is None:
        return mu_x, mu_y, b, None
    code = ref_fit(ref_residual_of(st, mu_x, b, mu_y), ridge + beta, rank)
    return (*ref_refined(mu_x, mu_y, b, code), code)


def ref_kv_error(st, mu_x, mu_y, b):
    d = st.sy.numel() // 2
    return sum(ref_heldout_error(ref_block(st, slice(None), h), mu_x, mu_y[h], b[:, h])
               for h in (slice(0, d), slice(d, 2 * d))) / 2


def ref_joint_lodo(stats, layer, alpha_k, alpha_v, cfg) -> dict:
    """The old ``choose_joint``'s per-layer ``lodo``."""
    ranks = [cfg.joint_rank] if cfg.joint_rank is not None else list(cfg.joint_rank_grid)
    grid = [(None, None)] + [(r, beta) for r in ranks if r for beta in cfg.joint_shrink_grid]
    errs, n_folds = dict.fromkeys(grid, 0.0), len(stats)
    for f in range(n_folds):
        train = functools.reduce(ref_add, [s[layer] for i, s in enumerate(stats) if i != f])
        mu_x, mu_y, b, _ = ref_joint_map(train, cfg.ridge, alpha_k, alpha_v, None, 0)
        errs[None, None] += ref_kv_error(stats[f][layer], mu_x, mu_y, b) / n_folds
        for beta in cfg.joint_shrink_grid if any(ranks) else ():
            code = ref_fit(ref_residual_of(train, mu_x, b, mu_y), cfg.ridge + beta, max(ranks))
            for r in filter(None, ranks):
                errs[r, beta] += ref_kv_error(stats[f][layer], *ref_refined(mu_x, mu_y, b, code.truncated(r))) / n_folds
    return errs


def ref_choose_joint(stats, shrinks, cfg) -> dict:
    n = len(stats[0])
    by_layer = [ref_joint_lodo(stats, layer, shrinks["shrink_k"][layer], shrinks["shrink_v"][layer], cfg)
                for layer in range(n)]
    per_layer = {choice: [e[choice] for e in by_layer] for choice in by_layer[0]}
    table = {choice: sum(errs) / n for choice, errs in per_layer.items()}
    best = min(table, key=table.get)
    rank, beta = best
    layers = [beta if rank is not None and per_layer[best][i] < per_layer[(None, None)][i] else None for i in range(n)]
    return {"rank": rank, "shrink": beta, "layers": layers, "table": table}


# ----------------------------------------------------------------------------- random statistics

D_KV = 64
ROWS = (400, 250, 100)  # per fold; the last has fewer rows than the 128 joint dimensions
SHRINKS = {"shrink_k": [0.0, 0.3, float("inf")], "shrink_v": [0.1, float("inf"), 1.0]}  # per layer


def random_stats(d_kv: int = D_KV, rows=ROWS, n_layers: int = 3, seed: int = 0,
                 device: str = "cpu") -> list[list[rrr.RRRStats]]:
    """(folds, layers) joint [K, V] statistics of a producer and a consumer that read one hidden state (each fold a
    domain with its own offset), so the refinement has something to find."""
    g = torch.Generator().manual_seed(seed)
    hidden = 3 * d_kv // 2
    out = [[rrr.RRRStats(2 * d_kv, 2 * d_kv, device) for _ in range(n_layers)] for _ in rows]
    for layer in range(n_layers):
        wp = torch.randn(hidden, 2 * d_kv, generator=g, dtype=torch.float64)
        wc = wp + 0.4 * torch.randn(hidden, 2 * d_kv, generator=g, dtype=torch.float64)
        for fold, n in enumerate(rows):
            h = torch.randn(n, hidden, generator=g, dtype=torch.float64) * torch.linspace(2, 0.1, hidden,
                                                                                           dtype=torch.float64)
            h = h + 0.5 * torch.randn(hidden, generator=g, dtype=torch.float64) + 0.2 * fold
            x = h @ wp + 0.05 * torch.randn(n, 2 * d_kv, generator=g, dtype=torch.float64)
            y = h @ wc + 0.1 * torch.randn(n, 2 * d_kv, generator=g, dtype=torch.float64) + 0.3
            out[fold][layer].add(x, y)
    return out


@pytest.fixture(scope="module")
def stats():
    return random_stats()


def _close(got: float, want: float) -> bool:
    return got == pytest.approx(want, rel=1e-9, abs=1e-12)


# ----------------------------------------------------------------------------- tests


def test_heldout_and_kv_errors_equal_the_reference(stats):
    train, held = stats[0][1] + stats[1][1], stats[2][1]
    ref_train = ref_add(ref_stats(stats[0][1]), ref_stats(stats[1][1]))
    for shrink in (0.0, 0.3, float("inf")):
        mu_x, mu_y, b = train.full_map(1e-3, shrink)
        torch.testing.assert_close(b, ref_full_map(ref_train, 1e-3, shrink)[2], rtol=0, atol=0)
        assert _close(held.heldout_error(mu_x, mu_y, b), ref_heldout_error(ref_stats(held), mu_x, mu_y, b))
        assert _close(cal.kv_error(held, mu_x, mu_y, b), ref_kv_error(ref_stats(held), mu_x, mu_y, b))
    # an input of another width (as research/scd_floor_check scores wider inputs)
    wide = rrr.RRRStats(3, 2 * D_KV)
    g = torch.Generator().manual_seed(5)
    wide.add(torch.randn(50, 3, generator=g), torch.randn(50, 2 * D_KV, generator=g))
    mu_x, mu_y, b = wide.full_map(1e-3, 0.0)
    assert _close(cal.kv_error(wide, mu_x, mu_y, b), ref_kv_error(ref_stats(wide), mu_x, mu_y, b))


def test_block_residual_statistics_and_fits_equal_the_reference(stats):
    st = stats[0][0] + stats[2][0]
    ref = ref_add(ref_stats(stats[0][0]), ref_stats(stats[2][0]))
    d = D_KV
    maps = [st.block(h, h).full_map(1e-3, a) for h, a in zip((slice(0, d), slice(d, 2 * d)), (0.3, float("inf")))]
    mu_x, mu_y, blocks = torch.cat([m[0] for m in maps]), torch.cat([m[1] for m in maps]), [m[2] for m in maps]
    want = ref_residual_of(ref, mu_x, torch.block_diag(*blocks), mu_y)
    for got in (st.residual_of(mu_x, blocks, mu_y), st.residual_of(mu_x, torch.block_diag(*blocks), mu_y)):
        assert got.n == want.n
        for name in ("sx", "sy", "sxx", "sxy", "syy"):
            torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-10, atol=1e-9)
    for shrink in (0.0, 0.5, float("inf")):  # the default arithmetic is the old one, bit for bit
        got, ref_code = st.fit(1e-3, None, shrink), ref_fit(ref, 1e-3, None, shrink)
        for name in ("mu_in", "mu_out", "enc", "dec", "spectrum", "fit_err"):
            assert torch.equal(getattr(got, name), getattr(ref_code, name)), (shrink, name)
    resid, ref_resid = st.residual_of(mu_x, blocks, mu_y), ref_residual_of(ref, mu_x, torch.block_diag(*blocks), mu_y)
    for beta in (0.0, 0.1, 1.0):  # the lean arithmetic: the same leading directions to rounding
        got, want = resid.fit(1e-3 + beta, 16, lean=True), ref_fit(ref_resid, 1e-3 + beta, 16)
        signs = torch.sign((got.dec.double() * want.dec.double()).sum(1))  # eigenvectors are signed arbitrarily
        torch.testing.assert_close(got.dec * signs[:, None].float(), want.dec, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got.enc * signs[None, :].float(), want.enc, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got.spectrum, want.spectrum, rtol=1e-6, atol=0)
        torch.testing.assert_close(got.fit_err, want.fit_err, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="lean"):
        st.fit(1e-3, 4, 0.3, lean=True)


def test_joint_map_equals_the_reference(stats):
    st = stats[0][2] + stats[1][2] + stats[2][2]
    ref = functools.reduce(ref_add, [ref_stats(stats[f][2]) for f in range(3)])
    held = stats[1][0]
    for beta, rank in ((None, 0), (0.0, 8), (0.3, 32)):
        got, want = cal.joint_map(st, 1e-3, 0.1, float("inf"), beta, rank), ref_joint_map(ref, 1e-3, 0.1,
                                                                                         float("inf"), beta, rank)
        torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=0)
        torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-6)  # the refinement is stored in float32
        torch.testing.assert_close(got[2], want[2], rtol=1e-6, atol=1e-6)
        assert _close(cal.kv_error(held, *got[:3]), ref_kv_error(ref_stats(held), *want[:3]))
        assert (got[3] is None) == (want[3] is None)


@pytest.mark.parametrize("layer", [0, 1, 2])
def test_each_layers_leave_one_domain_out_errors_equal_the_reference(stats, layer):
    cfg = CalibConfig()  # the default rank and ridge grids
    alphas = SHRINKS["shrink_k"][layer], SHRINKS["shrink_v"][layer]
    got = cal.joint_lodo(stats, layer, *alphas, cfg)
    want = ref_joint_lodo([[ref_stats(s) for s in fold] for fold in stats], layer, *alphas, cfg)
    assert list(got) == list(want)
    bad = {k: (got[k], want[k]) for k in want if not _close(got[k], want[k])}
    assert not bad, bad
    for fixed in (0, 24):  # a given rank (0: no refinement)
        cfg1 = dataclasses.replace(cfg, joint_rank=fixed, joint_shrink_grid=(0.1,))
        got = cal.joint_lodo(stats[:2], layer, *alphas, cfg1)
        want = ref_joint_lodo([[ref_stats(s) for s in fold] for fold in stats[:2]], layer, *alphas, cfg1)
        assert list(got) == list(want) and all(_close(got[k], want[k]) for k in want)


def test_choose_joint_equals_the_reference(stats):
    cfg = CalibConfig()
    got = cal.choose_joint(types.SimpleNamespace(kv_stats=stats), SHRINKS, cfg)
    want = ref_choose_joint([[ref_stats(s) for s in fold] for fold in stats], SHRINKS, cfg)
    assert (got["rank"], got["shrink"], got["layers"]) == (want["rank"], want["shrink"], want["layers"])
    table = {("none" if r is None else f"rank {r}, {b:g}"): v for (r, b), v in want["table"].items()}
    assert list(got["lodo_error"]) == list(table)
    assert all(got["lodo_error"][k] == pytest.approx(v, abs=1.0001e-5) for k, v in table.items())
    assert got["rank"] is not None  # the statistics have a refinement to find: the check is not on the trivial choice


def test_statistics_and_what_is_fitted_from_them_live_where_they_were_made(stats):
    """The device a calibration keeps its statistics on carries through sums, blocks, residuals and fits; what is
    stored (codes, joint_map's maps and refinement) comes back on the host."""
    meta = [[rrr.RRRStats(8, 8, "meta") for _ in range(1)] for _ in range(2)]
    assert cal.summed(meta, 0).device.type == "meta"
    assert meta[0][0].block(slice(0, 4), slice(0, 4)).device.type == "meta"
    assert meta[0][0].residual_of(torch.zeros(8, device="meta"), [torch.eye(4, device="meta", dtype=torch.float64)] * 2,
                                  torch.zeros(8, device="meta")).device.type == "meta"
    code = stats[0][0].fit(1e-3, 4)
    assert code.to("meta").enc.device.type == "meta" and code.to("cpu").enc.device.type == "cpu"
    st = cal.summed(stats, 0)
    assert all(t.device.type == "cpu" for t in cal.joint_map(st, 1e-3, 0.0, 0.0, 0.1, 4)[:3])
    if torch.cuda.is_available():  # on a GPU host: the same numbers there, fp64, returned on the host
        gpu = random_stats(device="cuda")  # the same rows, summed there
        assert gpu[0][0].device.type == "cuda"
        got = cal.joint_map(cal.summed(gpu, 0), 1e-3, 0.0, 0.0, 0.1, 4)
        want = cal.joint_map(st, 1e-3, 0.0, 0.0, 0.1, 4)
        assert all(t.device.type == "cpu" for t in got[:3]) and got[3].enc.device.type == "cpu"
        torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-5)
        cfg = CalibConfig()
        a = cal.joint_lodo(gpu, 0, 0.0, 0.3, cfg)
        b = cal.joint_lodo(stats, 0, 0.0, 0.3, cfg)
        assert all(a[k] == pytest.approx(b[k], rel=1e-7) for k in b)


def test_folds_with_fewer_rows_than_dimensions_still_equal_the_reference():
    """Every training sum below the 128 joint dimensions: the ridge alone makes the maps; same numbers."""
    few = random_stats(rows=(40, 30, 20), n_layers=1, seed=3)
    cfg = CalibConfig()
    got = cal.joint_lodo(few, 0, 0.0, 0.3, cfg)
    want = ref_joint_lodo([[ref_stats(s) for s in fold] for fold in few], 0, 0.0, 0.3, cfg)
    bad = {k: (got[k], want[k]) for k in want if not _close(got[k], want[k])}
    assert not bad, bad
