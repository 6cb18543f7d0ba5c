"""Scale: parallel loading equals serial, column-major site matrices read block by block, later stages never
decode NIfTI again, and a reduction that cannot fit (or noise above the signal) never fails after a release."""

import json
import shutil
import threading
import time
from dataclasses import replace
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from dpneuro._utils.parallel import ordered_map
from dpneuro.config import ConfigError, RunConfig
from dpneuro.data.images import load_space
from dpneuro.data.load import load_site
from dpneuro.data.matrix import ColumnWriter, NpyColumns, column_blocks
from dpneuro.datasets.synth import make_consortium
from dpneuro.run import pipeline
from dpneuro.run.factory import STREAMED_PCA_ITERATIONS, STREAMED_PCA_TOL, check_reduction_fits, pca_mode
from dpneuro.run.roles import site_whiten
from dpneuro.run.stages import reduce_inprocess

R = 4


@pytest.fixture(scope="module")
def consortium(tmp_path_factory):
    root = tmp_path_factory.mktemp("scale")
    man = make_consortium(root / "data", n_sites=3, subjects_per_site=4, n_components=R, n_timepoints=60,
                          space="grid30", random_state=5)
    return root, man


def _config(root: Path, man: dict, out: str, **kw) -> RunConfig:
    d = dict(sites=[{"name": s["site"], "path": s["path"]} for s in man["sites"]], out=str(root / out),
             mask=man["mask"], n_components=R, parcels=0, truth=str(root / "data"), seed=2)
    d.update(kw)
    return RunConfig.from_dict(d).validate()


# -- loading --------------------------------------------------------------------------------------

def test_parallel_load_equals_serial_and_is_column_major(consortium, tmp_path):
    _, man = consortium
    site = man["sites"][0]
    serial = load_site(site["path"], man["mask"], workers=1)
    for w in (2, 3):
        par = load_site(site["path"], man["mask"], workers=w, memmap_path=tmp_path / f"X{w}.npy")
        np.testing.assert_array_equal(np.asarray(par.X), serial.X)
        assert par.boundaries == serial.boundaries and par.subject_ids == serial.subject_ids
        assert par.X.flags.f_contiguous  # a subject's columns are one contiguous read
    reader = NpyColumns(tmp_path / "X2.npy")
    assert reader.shape == serial.X.shape and reader.fortran_order
    for a, b in serial.boundaries:
        blk = reader.columns(a, b)
        assert blk.flags.owndata is False and blk.base.flags.owndata  # a fresh array, not a map of the file
        np.testing.assert_array_equal(blk, serial.X[:, a:b])
    got = np.hstack([blk for _, _, blk in column_blocks(tmp_path / "X2.npy", block_bytes=4 * 900 * 7)])
    np.testing.assert_array_equal(got, serial.X)


def test_row_major_files_are_still_read(tmp_path):
    X = np.random.default_rng(0).standard_normal((5, 12)).astype(np.float32)
    np.save(tmp_path / "c.npy", X)  # C order, as earlier versions wrote
    r = NpyColumns(tmp_path / "c.npy")
    assert not r.fortran_order
    np.testing.assert_array_equal(r.columns(3, 9), X[:, 3:9])
    with pytest.raises(IndexError):
        r.columns(4, 13)


def test_column_writer_checks_the_count_and_removes_partial_files(tmp_path):
    X = np.arange(24, dtype=np.float32).reshape(4, 6)
    with ColumnWriter(tmp_path / "ok.npy", X.shape) as w:
        w.write(X[:, :2])
        w.write(X[:, 2:])
    np.testing.assert_array_equal(np.load(tmp_path / "ok.npy"), X)
    with pytest.raises(RuntimeError, match="4 of 6 columns"):
        with ColumnWriter(tmp_path / "short.npy", X.shape) as w:
            w.write(X[:, :4])
    assert not (tmp_path / "short.npy").exists()
    with pytest.raises(ValueError, match="more than the 6 columns"):
        with ColumnWriter(tmp_path / "long.npy", X.shape) as w:
            w.write(X)
            w.write(X[:, :1])
    assert not (tmp_path / "long.npy").exists()
    with open(tmp_path / "trunc.npy", "wb") as f:
        f.write((tmp_path / "ok.npy").read_bytes()[:-8])
    with pytest.raises(ValueError, match="truncated"):
        NpyColumns(tmp_path / "trunc.npy").columns(0, 6)


def test_ordered_map_keeps_order_bounds_lookahead_and_raises():
    started, lock = [], threading.Lock()

    def slow(i):
        with lock:
            started.append(i)
        time.sleep(0.02 if i % 2 else 0.0)  # odd items finish later than the next even one
        return i * i

    gen = ordered_map(slow, range(20), workers=3)
    assert next(gen) == 0
    time.sleep(0.2)
    assert len(started) <= 1 + 2 * 3  # never more than 2 x workers ahead of the consumer
    assert list(gen) == [i * i for i in range(1, 20)]

    def boom(i):
        if i == 5:
            raise ValueError("subject 5 is broken")
        return i

    with pytest.raises(ValueError, match="subject 5"):
        list(ordered_map(boom, range(10), workers=2))


def test_later_stages_never_decode_nifti_again(consortium, tmp_path):
    """The decoded float32 site matrices are the cache: with the NIfTI files gone the run still completes."""
    root, man = consortium
    data = tmp_path / "data"
    shutil.copytree(root / "data", data)
    sites = [{"name": s["site"], "path": str(data / s["site"])} for s in man["sites"]]
    cfg, _ = pipeline.prepare(_config(root, man, "nocache", sites=sites, mask=str(data / "mask.nii.gz"),
                                      truth=str(data)))
    pipeline.run_stages(cfg, until="load")
    for f in data.glob("site-*/*.nii*"):
        f.unlink()
    out = pipeline.run_stages(cfg)
    assert Path(out["report"]).exists()


def test_pydra_concurrent_worker_equals_the_stages(consortium):
    """dpneuro run's default (Pydra's concurrent worker, sites loaded in parallel) gives the serial numbers."""
    from dpneuro.workflows import run_workflow

    root, man = consortium
    res = run_workflow(_config(root, man, "cf"), plugin="cf")
    ref_cfg, _ = pipeline.prepare(_config(root, man, "stages"))
    ref = pipeline.run_stages(ref_cfg)
    for a, b in zip(res["load"], ref["load"]):
        np.testing.assert_array_equal(np.load(json.loads(Path(a).read_text())["X"]),
                                      np.load(json.loads(Path(b).read_text())["X"]))
    got, want = (json.loads(Path(r["maps"]).read_text())["components"] for r in (res, ref))
    np.testing.assert_array_equal(nib.load(got).get_fdata(), nib.load(want).get_fdata())


# -- the reduction at large D ------------------------------------------------------------------------

def test_covariance_mode_refused_before_any_data_are_read(consortium, monkeypatch):
    root, man = consortium
    cfg = _config(root, man, "big", max_memory_gb=0.01)  # 900 voxels need 9 * 8 * 900^2 B = 0.054 GB
    read = []
    monkeypatch.setattr("dpneuro.data.load._read_subject", lambda *a, **k: read.append(a) or None)
    with pytest.raises(ConfigError, match="capepca-power.*Nothing was released"):
        pipeline.prepare(cfg)
    assert read == []
    assert pca_mode(replace(cfg, reduction="capepca-power"), 900) == "power"
    assert pca_mode(replace(cfg, reduction="none"), 900) == "power"  # no noise: streams instead
    assert pca_mode(replace(cfg, max_memory_gb=0.06), 900) == "covariance"
    with pytest.raises(ConfigError, match="max_memory_gb"):
        RunConfig.from_dict({**cfg.to_json(), "max_memory_gb": 0}).validate()


def test_covariance_release_larger_than_a_message_is_refused_before_any_data_are_read(consortium, monkeypatch):
    """Memory alone is not enough: the D x D release must also fit one message of the exchange."""
    from dpneuro.algorithms.pca import covariance_release_bytes

    root, man = consortium
    cfg = _config(root, man, "msg")  # 900 voxels: fits max_memory_gb, the release is 8 * 900^2 B
    limit = covariance_release_bytes(900) - 1
    read = []
    monkeypatch.setattr("dpneuro.data.load._read_subject", lambda *a, **k: read.append(a) or None)
    with pytest.raises(ConfigError, match="message of 6 MB, more than the exchange carries.*Nothing was released"):
        check_reduction_fits(cfg, message_limit=limit)
    assert read == []
    assert pca_mode(cfg, 900, limit + 1) == "covariance"
    assert pca_mode(replace(cfg, reduction="none"), 900, limit) == "power"  # no noise: streams instead


def test_covariance_release_bytes_is_what_a_site_sends():
    """The size the refusal models is the array bytes of the release a site actually makes."""
    from dpneuro.algorithms.pca import covariance_release_bytes
    from dpneuro.protocol.exchange.base import Payload
    from dpneuro.protocol.exchange.inprocess import InProcessExchange

    rng = np.random.default_rng(0)
    D, sizes = 40, []
    X = [rng.standard_normal((D, 30)) for _ in range(3)]
    cfg = RunConfig.from_dict({"sites": [{"name": f"s{i}", "path": "."} for i in range(3)], "out": ".",
                               "parcels": 0, "n_components": 4, "seed": 0, "pca_epsilon": 4.0})
    orig = InProcessExchange.send

    def send(self, sender, round, topic, payload: Payload):
        if sender >= 0 and topic == "release":
            sizes.append(payload.nbytes())
        return orig(self, sender, round, topic, payload)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(InProcessExchange, "send", send)
        reduce_inprocess(cfg, X, [[10, 10, 10]] * 3)
    assert sizes and max(sizes) <= covariance_release_bytes(D) + 64
    assert max(sizes) >= covariance_release_bytes(D)


def test_streamed_pca_without_noise_equals_the_covariance_mode(consortium):
    root, man = consortium
    cfg = _config(root, man, "none", reduction="none")
    X = [load_site(s["path"], man["mask"]) for s in man["sites"]]
    lengths = [sd.lengths for sd in X]
    full = reduce_inprocess(cfg, [sd.X for sd in X], lengths)
    streamed = reduce_inprocess(replace(cfg, max_memory_gb=0.01), [sd.X for sd in X], lengths)
    assert not any(led.releases for led in streamed.ledgers)  # no noise, nothing released privately
    # stopped on convergence (residual <= STREAMED_PCA_TOL * lambda_1), well before the cap
    assert 2 <= streamed.rounds < STREAMED_PCA_ITERATIONS
    cosines = np.linalg.svd(full.basis.T @ streamed.basis, compute_uv=False)
    assert cosines.min() > 1 - 1e-8
    np.testing.assert_allclose(streamed.eigenvalues, full.eigenvalues, rtol=1e-6)


def test_readme_states_the_streamed_pca_stopping_rule():
    """The README's numbers come from the constants the run uses."""
    text = " ".join((Path(__file__).resolve().parents[2] / "README.md").read_text().split())
    tol = f"{STREAMED_PCA_TOL:.0e}".replace("e-0", "e-")  # 1e-4
    assert (f"residual below {tol} of the largest eigenvalue; at most {STREAMED_PCA_ITERATIONS} "
            "passes over the data") in text


def test_eigenvalues_at_or_below_zero_are_floored_not_fatal(consortium):
    """Noise above the signal can make a released eigenvalue <= 0: whitening and spatial ICA go on."""
    from dpneuro.algorithms.djica import EIGENVALUE_FLOOR, usable_eigenvalues
    from dpneuro.algorithms.spatial_ica import spatial_ica

    lam = np.array([0.5, 0.2, 0.0, -0.1])
    np.testing.assert_array_equal(usable_eigenvalues(lam), [0.5, 0.2, 0.5 * EIGENVALUE_FLOOR, 0.5 * EIGENVALUE_FLOOR])
    np.testing.assert_array_equal(usable_eigenvalues(-lam[:2]), [1.0, 1.0])  # none positive: unit scale
    with pytest.raises(ValueError, match="NaN"):
        site_whiten(np.ones((3, 4), np.float32), np.eye(3)[:, :2], [1.0, np.nan])
    _, man = consortium
    sd = load_site(man["sites"][0]["path"], man["mask"])
    V = np.linalg.qr(np.random.default_rng(0).standard_normal((sd.n_features, R)))[0]
    Z = site_whiten(sd.X, V, lam)
    assert np.isfinite(Z).all() and Z.shape == (R, sd.n_samples)
    res = spatial_ica(V, lam)
    assert np.isfinite(res.W).all()


def test_mni3mm_grid():
    mask, affine = load_space("mni3mm")
    assert mask.shape == (67, 79, 64) and abs(int(mask.sum()) - 69_765) <= 0.02 * 69_765
    np.testing.assert_allclose(np.diag(affine)[:3], 3.0)
