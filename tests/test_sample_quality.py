"""The Frechet distance against an independent computation (scipy's sqrtm), and the classifier judge."""
import numpy as np
import pytest
import torch

from train.sample_quality import Classifier, frechet_distance, judge, sample_accuracy


def reference_fd(a: np.ndarray, b: np.ndarray) -> float:
    """The textbook formula, written out separately: |mu_a - mu_b|^2 + tr(S_a + S_b - 2 sqrtm(S_a S_b))."""
    from scipy import linalg
    mu_a, mu_b = a.mean(axis=0), b.mean(axis=0)
    s_a, s_b = np.cov(a.T), np.cov(b.T)
    root = linalg.sqrtm(s_a.dot(s_b))
    return float(np.sum((mu_a - mu_b) ** 2) + np.trace(s_a) + np.trace(s_b) - 2 * np.trace(np.real(root)))


@pytest.mark.parametrize("n_a,n_b,dim", [(300, 200, 16), (90, 120, 48)])
def test_frechet_distance_equals_scipy_sqrtm(n_a, n_b, dim):
    rng = np.random.default_rng(dim)
    mix = rng.normal(size=(dim, dim)) / dim ** 0.5          # correlated features, unequal scales
    a = rng.normal(size=(n_a, dim)) @ mix + 0.3
    b = (rng.normal(size=(n_b, dim)) * rng.uniform(0.5, 2.0, dim)) @ mix.T
    ref = reference_fd(a, b)
    ours = frechet_distance(torch.from_numpy(a).float(), b)   # torch or numpy in
    ours64 = frechet_distance(a, b)
    assert abs(ours64 - ref) <= 1e-6 * abs(ref), (ours64, ref)
    assert abs(ours - reference_fd(a.astype(np.float32).astype(np.float64), b)) <= 1e-6 * abs(ref)
    assert abs(frechet_distance(b, a) - ref) <= 1e-6 * abs(ref)  # symmetric


def test_frechet_distance_zero_on_itself_and_growing_with_a_shift():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 32)) @ rng.normal(size=(32, 32))
    scale = np.trace(np.cov(x.T))
    assert abs(frechet_distance(x, x)) <= 1e-9 * scale
    # a shift of every feature by c adds exactly 32 c^2 (the covariances are the same)
    for c in (0.1, 1.0):
        assert frechet_distance(x, x + c) == pytest.approx(32 * c * c, rel=1e-6, abs=1e-8 * scale)
    y = rng.normal(size=(200, 32)) @ rng.normal(size=(32, 32))
    assert frechet_distance(x, y) < frechet_distance(x, y + 1.0) < frechet_distance(x, y + 3.0)


def test_frechet_distance_bad_input():
    with pytest.raises(ValueError, match="different sizes"):
        frechet_distance(np.zeros((5, 3)), np.zeros((5, 4)))
    with pytest.raises(ValueError, match=r"\(N >= 2, D\)"):
        frechet_distance(np.zeros((1, 3)), np.zeros((5, 3)))
    with pytest.raises(ValueError, match="non-finite"):
        frechet_distance(np.full((4, 3), np.nan), np.zeros((5, 3)))


def test_classifier_features_are_the_head_input():
    import zoo
    from zoo.config import ConvNetConfig
    torch.manual_seed(0)
    model = zoo.build(ConvNetConfig(arch="resnet18", layers=[1, 1, 1, 1], width=4, stem="small", in_chans=1,
                                    num_classes=10))
    judge_ = Classifier(model, (0.5,), (0.5,), batch_size=3)
    rgb = torch.rand(7, 3, 16, 16)
    feats, logits = judge_(rgb)
    with torch.no_grad():
        expected = model((rgb.mean(1, keepdim=True) - 0.5) / 0.5)
        assert torch.allclose(logits, expected, atol=1e-5)
        assert torch.allclose(model.fc(feats), expected, atol=1e-5)     # the penultimate layer
    assert feats.shape == (7, model.num_features)
    labels = logits.argmax(-1)
    assert sample_accuracy(logits, labels) == 1.0
    assert sample_accuracy(logits, (labels + 1) % 10) == 0.0
    out = judge(judge_, rgb, labels, feats)
    assert out["sample_accuracy"] == 1.0 and abs(out["classifier_fd"]) < 1e-6


@pytest.mark.parametrize("ema_better", [True, False])
def test_classifier_from_a_run_folder(tmp_path, ema_better):
    """A convnet run folder (config.yaml, weights, metrics.jsonl): the weights with the lower final
    validation loss judge, normalised as the run trained (digits: 0.5 / 0.5)."""
    import json

    import yaml
    from safetensors.torch import save_model

    import zoo
    from train.config import load_run_config
    cfg = load_run_config("configs/convnet/resnet-digits.yaml", ["model.width=4", f"train.out_dir={tmp_path}"])
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    torch.manual_seed(0)
    raw, ema = zoo.build(cfg.model).eval(), zoo.build(cfg.model).eval()
    save_model(raw, str(tmp_path / "model.safetensors"))
    save_model(ema, str(tmp_path / "model_ema.safetensors"))
    row = {"step": 10, "val_loss": 1.0, "ema_val_loss": 0.5 if ema_better else 2.0}
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 10, "loss": 1.0}) + "\n" + json.dumps(row) + "\n")
    images = torch.rand(4, 3, 32, 32)
    _, logits = Classifier.from_run(tmp_path)(images)
    with torch.no_grad():
        expected = (ema if ema_better else raw)((images.mean(1, keepdim=True) - 0.5) / 0.5)
    assert torch.allclose(logits, expected, atol=1e-5)
    with pytest.raises(FileNotFoundError, match="no config.yaml"):
        Classifier.from_run(tmp_path / "nothing")


def test_docs_tables_are_rendered_from_the_benchmarks_json():
    """docs/diffusion.md's quality tables equal what `bench.py diffusion-quality` renders from its
    committed JSON: three seeds or more, each with every run judged."""
    import json

    from train.benches.diffusion import RUNS
    from train.docs import RESULTS, ROOT, render_result
    data = json.loads((RESULTS / "diffusion-quality.json").read_text())["data"]
    assert len(data["per_seed"]) >= 3
    assert all(set(runs) == set(RUNS) for runs in data["per_seed"].values())
    page = (ROOT / "docs" / "diffusion.md").read_text()
    for key in ("flow", "dit"):
        assert f"<!-- table:diffusion-quality/{key} -->\n" + render_result("diffusion-quality", key) in page
