"""Knowledge distillation (zoo/blocks/chunked_ce.py, train/features/distill.py): the loss against an
independent computation on fixed logits, chunked and not, values and gradients; a short
distillation run of an LLM and of a ResNet on digits; a teacher that does not fit is one line."""
import pytest
import torch
import torch.nn.functional as F

import zoo
from conftest import CPU
from zoo.blocks.chunked_ce import chunked_distillation_loss, distillation_loss
from zoo.config import ConfigError

from train.config import load_run_config
from train.loop import train


def reference(s, t, y, alpha, T, ignore=-100):
    """Hinton et al.'s loss written with torch.nn.functional: KL(p_t || p_s) at T, times T^2, and
    the cross-entropy, each averaged over the rows with a target."""
    keep = y != ignore
    kl = F.kl_div(F.log_softmax(s[keep] / T, -1), F.log_softmax(t[keep] / T, -1), log_target=True,
                  reduction="batchmean")
    return alpha * T * T * kl + (1 - alpha) * F.cross_entropy(s[keep], y[keep])


@pytest.mark.parametrize("chunk", [5, 64])
def test_kd_loss_equals_an_independent_computation(chunk):
    """fp32, 37 rows (chunks of 5 leave a partial one), vocab 50; values and the gradients of the
    student's hidden states and head within 1e-5."""
    g = torch.Generator().manual_seed(0)
    N, D, Dt, V = 37, 16, 24, 50
    h = torch.randn(N, D, generator=g, requires_grad=True)
    w = (torch.randn(V, D, generator=g) / 4).requires_grad_()
    th, tw = torch.randn(N, Dt, generator=g), torch.randn(V, Dt, generator=g) / 4
    y = torch.randint(0, V, (N,), generator=g)
    y[[3, 11]] = -100
    alpha, T = 0.7, 2.5
    want = reference(h @ w.t(), th @ tw.t(), y, alpha, T)
    gh, gw = torch.autograd.grad(want, (h, w))
    for loss in (chunked_distillation_loss(h, w, y, th, tw, alpha, T, chunk),
                 distillation_loss(h @ w.t(), th @ tw.t(), y, alpha, T)):
        assert abs(loss.item() - want.item()) <= 1e-5
        a, b = torch.autograd.grad(loss, (h, w))
        assert (a - gh).abs().max() <= 1e-5 and (b - gw).abs().max() <= 1e-5
    with torch.no_grad():  # the evaluation path (no autograd function)
        assert abs(chunked_distillation_loss(h, w, y, th, tw, alpha, T, chunk).item() - want.item()) <= 1e-5
    # alpha 0 is the cross-entropy alone; a teacher equal to the student leaves only it too
    assert abs(chunked_distillation_loss(h, w, y, th, tw, 0.0, T, chunk).item()
               - F.cross_entropy(h @ w.t(), y).item()) <= 1e-5


def test_llm_forward_distills_the_same_chunked_and_not():
    torch.manual_seed(0)
    tiny = dict(vocab_size=64, d_model=32, n_layers=1, n_heads=2, max_seq_len=32)
    student, teacher = zoo.build({"model": tiny}), zoo.build({"model": dict(tiny, d_model=48, n_layers=2)}).eval()
    x = torch.randint(0, 64, (2, 16))
    from zoo.llm import Distill
    d = Distill(teacher.features(x).detach(), teacher.lm_head.weight.detach(), 0.5, 2.0)
    chunked = student(x, x, distill=d)[1]
    student.chunked_loss = False
    plain = student(x, x, distill=d)[1]
    want = reference(student(x).flatten(0, 1), teacher(x).flatten(0, 1), x.flatten(), 0.5, 2.0)
    assert abs(chunked.item() - want.item()) <= 1e-5 and abs(plain.item() - want.item()) <= 1e-5


LLM = {
    "family": "llm", "model": {"vocab_size": 256, "d_model": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 32},
    "data": {"tokenizer": "bytes", "seq_len": 32},
    "train": {"max_steps": 2, "batch_size": 4, "log_every": 1, "eval_every": 0, "eval_batches": 1,
              "checkpoint_every": 0, "progress": False, "samples": False, "plot": False, "export": False},
    "optim": {"lr": 3e-3, "warmup_steps": 1},
}


def test_llm_distillation_run(tmp_path, text_corpus, one_thread):
    torch.manual_seed(1)
    teacher = zoo.build({"model": dict(LLM["model"], d_model=48)})
    zoo.save_pretrained(teacher, tmp_path / "teacher")  # a Hugging Face Llama folder
    logs = []
    over = [f"data.path={text_corpus}", f"train.teacher={tmp_path / 'teacher'}", "train.kd_alpha=0.5"]
    final = train(load_run_config(None, [f"train.out_dir={tmp_path / 'kd'}"] + over, base=LLM), log=logs.append)
    assert final["val_loss"] > 0 and any(m.startswith("teacher: ") for m in logs)
    bad = zoo.build({"model": dict(LLM["model"], vocab_size=300)})
    zoo.save_pretrained(bad, tmp_path / "bad")
    with pytest.raises(ConfigError, match="vocab_size=300 is not the student's 256") as e:
        train(load_run_config(None, [f"train.out_dir={tmp_path / 'bad-run'}", f"data.path={text_corpus}",
                                     f"train.teacher={tmp_path / 'bad'}"], base=LLM), log=lambda m: None)
    assert "\n" not in str(e.value)


def test_resnet_digits_distillation_run(tmp_path, one_thread):
    from test_classify import TINY
    torch.manual_seed(2)
    teacher = zoo.build({"family": "convnet", "model": dict(TINY["model"], width=16)})
    path = zoo.save_pretrained(teacher, tmp_path / "teacher.safetensors")
    cfg = load_run_config(None, [f"train.out_dir={tmp_path / 'kd'}", f"train.teacher={path}", "train.max_steps=2",
                                 "train.batch_size=8", "data.eval_images=16", "optim.warmup_steps=1"], base=TINY)
    final = train(cfg, log=lambda m: None)
    assert final["val_loss"] > 0
    with pytest.raises(ConfigError, match="num_classes=5 is not the student's 10"):
        five = zoo.save_pretrained(zoo.build({"family": "convnet", "model": dict(TINY["model"], num_classes=5)}),
                                   tmp_path / "five.safetensors")
        train(load_run_config(None, [f"train.out_dir={tmp_path / 'five'}", f"train.teacher={five}",
                                     "train.max_steps=2", "optim.warmup_steps=1"], base=TINY),
              log=lambda m: None)


# ---------------------------------------------------------------- DeiT: the class head on the labels, the
# distillation head on the teacher (train.kd_kind)
VIT = {
    "family": "vit",
    "model": {"arch": "deit_tiny_distilled_patch16_224", "embed_dim": 32, "depth": 1, "num_heads": 2,
              "patch_size": 8, "img_size": 16, "in_chans": 1, "num_classes": 10},
    "data": {"path": "digits", "image_size": 16, "val_fraction": 0.2, "shift": 1},
    "train": {"max_steps": 3, "batch_size": 8, "log_every": 1, "eval_every": 0, "checkpoint_every": 0,
              "progress": False, "samples": False, "plot": False, "export": False},
    "optim": {"lr": 0.01, "warmup_steps": 1, "weight_decay": 0.0},
}


def resnet_teacher(path, **kw):
    from test_classify import TINY
    return zoo.save_pretrained(zoo.build({"family": "convnet", "model": dict(TINY["model"], **kw)}), path)


def ce(logits, target, smoothing=0.0):
    """Cross-entropy written out: labels (B,) with label smoothing, or soft targets (B, C)."""
    logp = logits.log_softmax(-1)
    if target.dim() == 2:
        return -(target * logp).sum(-1).mean()
    return (-(1 - smoothing) * logp.gather(1, target[:, None])[:, 0] - smoothing * logp.mean(-1)).mean()


CASES = [("deit", "hard", False), ("deit", "soft", False), ("deit", "hard", True), ("vit", "hard", False),
         ("vit", "soft", False), ("vit", "soft", True)]


@pytest.mark.parametrize("student,kind,mix", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_each_head_learns_its_target(tmp_path, student, kind, mix, one_thread):
    """The task's loss on one digits batch equals the loss written out (fp32, limit 1e-6): a distilled ViT's class
    head on the labels (smoothed; Mixup's targets with data.mixup_alpha), its distillation head on the teacher, the
    ResNet's top class (hard) or T^2 KL at T (soft); a one-head ViT both on the same logits, its soft loss on labels
    Hinton's (reference above). Hard: the distillation head's gradient does not depend on the labels."""
    from train.features.distill import load_teacher
    from train.tasks.classify import ClassifyTask
    torch.manual_seed(0)
    teacher = resnet_teacher(tmp_path / "teacher.safetensors")
    over = [f"train.out_dir={tmp_path / 'r'}", f"train.teacher={teacher}", f"train.kd_kind={kind}",
            "train.kd_alpha=0.3", "train.kd_temperature=1.5", "data.label_smoothing=0.1"]
    over += ["model.distilled=false"] if student == "vit" else []
    over += ["data.mixup_alpha=0.8"] if mix else []
    cfg = load_run_config(None, over, base=VIT)
    task = ClassifyTask(cfg, CPU, log=lambda m: None)
    task.setup()
    model = task.build_model()
    task.teacher = load_teacher(cfg, task, model, CPU, lambda m: None)
    batch = task.train_batch(0, 0)
    x, y = task.recipe(task.normalize(batch[0]), batch[1], batch[2])
    assert y.dim() == (2 if mix else 1)
    out, z = model(x), task.teacher(x).detach()
    cls, dist = out if student == "deit" else (out, out)
    assert isinstance(out, tuple) == (student == "deit")
    kd = ce(dist, z.argmax(1)) if kind == "hard" else 2.25 * (z / 1.5).softmax(-1).mul(
        (z / 1.5).log_softmax(-1) - (dist / 1.5).log_softmax(-1)).sum(-1).mean()
    want = 0.7 * ce(cls, y, 0.1) + 0.3 * kd
    if student == "vit" and kind == "soft" and not mix:
        want = reference(out, z, y, 0.3, 1.5)
    got = task.loss(model, batch)[0]
    assert abs(got.item() - want.item()) <= 1e-6
    if student == "deit" and kind == "hard" and not mix:
        grads = [torch.autograd.grad(task.loss(model, b)[0], (model.head.weight, model.head_dist.weight))
                 for b in (batch, (batch[0], (batch[1] + 1) % 10, batch[2]))]
        assert torch.equal(grads[0][1], grads[1][1]) and not torch.equal(grads[0][0], grads[1][0])


@pytest.mark.parametrize("alpha", [0.5, 1.0])
def test_deit_taught_by_a_resnet_trains_both_heads(tmp_path, alpha, one_thread):
    """A distilled ViT (train.init_from: its file) taught by a ResNet run folder with kd_kind=hard, three AdamW steps
    without weight decay: both heads move; at kd_alpha=1 the labels weigh nothing, so the class head stays
    bit-identical while the distillation head moves. The run's weights load back as a distilled ViT whose output is
    one (averaged) logits tensor."""
    torch.manual_seed(3)
    student = zoo.save_pretrained(zoo.build({"family": "vit", "model": VIT["model"]}), tmp_path / "deit.safetensors")
    logs = []
    cfg = load_run_config(None, [f"train.out_dir={tmp_path / 'r'}", f"train.init_from={student}", "train.kd_kind=hard",
                                 f"train.teacher={resnet_teacher(tmp_path / 'resnet')}", f"train.kd_alpha={alpha}"],
                          base=VIT)
    final = train(cfg, log=logs.append)
    assert 0 <= final["val_acc1"] <= 1 and any(m.startswith("teacher: ") and "kd_kind hard" in m for m in logs)
    before, after = zoo.from_pretrained(student), zoo.from_pretrained(tmp_path / "r" / "model.safetensors")
    assert not torch.equal(before.head_dist.weight, after.head_dist.weight)
    assert torch.equal(before.head.weight, after.head.weight) == (alpha == 1.0)
    assert after(torch.zeros(2, 1, 16, 16)).shape == (2, 10)


def test_distillation_keys_refuse_in_one_line(tmp_path, text_corpus):
    """kd_kind=hard without a teacher; a ResNet teacher of 5 classes or 3 channels for the ViT; hard for an LLM."""
    with pytest.raises(ConfigError, match=r"train.kd_kind=hard distils from a teacher: needs train.teacher$"):
        load_run_config(None, [f"train.out_dir={tmp_path / 'r'}", "train.kd_kind=hard"], base=VIT)
    for kw, why in ((dict(num_classes=5), "its num_classes=5 is not the student's 10"),
                    (dict(in_chans=3), "its in_chans=3 is not the student's 1")):
        bad = resnet_teacher(tmp_path / f"{next(iter(kw))}.safetensors", **kw)
        with pytest.raises(ConfigError, match=f"train.teacher={bad}: {why}$") as e:
            train(load_run_config(None, [f"train.out_dir={tmp_path / 'r'}", f"train.teacher={bad}"], base=VIT),
                  log=lambda m: None)
        assert "\n" not in str(e.value)
    torch.manual_seed(1)
    llm = zoo.save_pretrained(zoo.build({"model": LLM["model"]}), tmp_path / "llm")
    with pytest.raises(ConfigError, match="train.kd_kind=hard: an LLM distils the teacher's soft targets only$"):
        train(load_run_config(None, [f"train.out_dir={tmp_path / 'l'}", f"data.path={text_corpus}",
                                     f"train.teacher={llm}", "train.kd_kind=hard"], base=LLM), log=lambda m: None)
