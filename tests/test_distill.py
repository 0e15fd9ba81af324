"""Knowledge distillation (zoo/blocks/chunked_ce.py, train/features/distill.py): the loss against an
independent computation on fixed logits, chunked and not, values and gradients; a short
distillation run of an LLM and of a ResNet on digits; a teacher that does not fit is one line."""
import pytest
import torch
import torch.nn.functional as F

import zoo
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
