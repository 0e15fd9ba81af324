"""train.init_from for every family goes through one checked path: a truncated file, a flipped
byte, a pickle payload and the weights of another architecture each end the run before training
with exit 2 and one line naming the file; the intact file fine-tunes."""
import pickle
import shutil
from pathlib import Path

import pytest
import torch

import zoo
from train.run import main as run_main
from zoo.config import ConvNetConfig, LLMConfig
from zoo.convnet import ResNet
from zoo.llm import LLM
from zoo.weights.files import read_safetensors_header

ROOT = Path(__file__).resolve().parents[1]
MARKER = "pickle_payload_ran"

LLM_RUN = ["train.max_steps=2", "optim.warmup_steps=1", "train.batch_size=2", "data.tokenizer=bytes", "data.seq_len=16",
           "train.eval_batches=1", "train.eval_every=0", "train.checkpoint_every=0", "train.progress=false",
           "train.samples=false", "train.plot=false", "train.export=false"]
CONVNET_RUN = ["train.max_steps=2", "optim.warmup_steps=1", "train.batch_size=8", "train.eval_every=0",
               "train.progress=false", "train.samples=false", "train.plot=false", "train.export=false",
               "data.eval_images=16", "data.ema_bn_batches=1"]
DIFFUSION_RUN = ["train.max_steps=2", "optim.warmup_steps=1", "train.batch_size=8", "train.eval_every=0",
                 "train.eval_batches=1", "train.progress=false", "train.samples=false", "train.plot=false",
                 "data.ae_steps=2", "model.channels=[16,32]", "model.blocks_per_level=1", "model.autoencoder.channels=8"]


class Payload:
    """Unpickling this runs code (it creates a marker file): what a malicious .pth does."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def write_pickle_payload(path: Path, marker: Path):
    with open(path, "wb") as f:  # a plain pickle...
        pickle.dump({"conv1.weight": Payload(marker)}, f)
    torch.save({"state_dict": Payload(marker)}, path.with_name("zip_" + path.name))  # ...and a torch zip archive


def flip_a_data_byte(path: Path):
    """Flip one byte of a tensor's data (not its header)."""
    raw = bytearray(path.read_bytes())
    if path.suffix == ".safetensors":
        _, _, start = read_safetensors_header(path)
        at = start + (len(raw) - start) // 2
    else:  # a torch zip: a byte inside the largest record's data
        import zipfile
        with zipfile.ZipFile(path) as z:
            info = max(z.infolist(), key=lambda i: i.file_size)
        at = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra) + info.file_size // 2
    raw[at] ^= 0x10
    path.write_bytes(bytes(raw))


def truncate(path: Path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size * 2 // 3])


def run(capsys, *args):
    code = run_main([str(a) for a in args])
    err = capsys.readouterr().err.strip()
    return code, err


def assert_refused(capsys, bad_file: Path, *args):
    code, err = run(capsys, *args)
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and "train.init_from" in err, err
    assert str(bad_file) in err, err


# ------------------------------------------------------------------------------ one family at a time
def llm_weights(folder: Path) -> Path:
    torch.manual_seed(0)
    model = LLM(LLMConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=2, max_seq_len=64))
    zoo.save_pretrained(model, folder)
    return folder / "model.safetensors"


def resnet_weights(path: Path) -> Path:
    torch.manual_seed(0)
    model = ResNet(ConvNetConfig(arch="resnet18", layers=[1, 1, 1, 1], width=8, stem="small", in_chans=1,
                                 num_classes=10))
    zoo.save_pretrained(model, path)  # the timm/torchvision layout, torch.save zip
    return path


def diffusion_weights(tmp_path: Path, capsys) -> Path:
    out = tmp_path / "diffusion-run"
    code, err = run(capsys, ROOT / "configs/diffusion/digits.yaml", f"train.out_dir={out}", *DIFFUSION_RUN)
    assert code == 0, err
    return out / "model.safetensors"


def family_case(family, tmp_path, capsys):
    """(the intact weights, the path train.init_from takes, the run's arguments, another family's file)"""
    other_resnet = resnet_weights(tmp_path / "other" / "resnet.pth")
    if family == "llm":
        f = llm_weights(tmp_path / "hf")
        return f, f.parent, ["configs/llm/tiny.yaml", f"train.out_dir={tmp_path / 'out'}", *LLM_RUN], other_resnet
    if family == "convnet":
        f = resnet_weights(tmp_path / "w" / "resnet.pth")
        return f, f, ["configs/convnet/resnet-digits.yaml", f"train.out_dir={tmp_path / 'out'}", *CONVNET_RUN], \
            llm_weights(tmp_path / "other" / "hf")
    f = diffusion_weights(tmp_path, capsys)
    return f, f, ["configs/diffusion/digits.yaml", f"train.out_dir={tmp_path / 'out'}", *DIFFUSION_RUN], other_resnet


@pytest.mark.parametrize("family", ["llm", "convnet", "diffusion"])
def test_bad_init_from_is_one_line_and_exit_2(family, tmp_path, capsys, monkeypatch, one_thread):
    monkeypatch.chdir(ROOT)
    good, init, args, other = family_case(family, tmp_path, capsys)
    pristine = good.read_bytes()

    def restore():
        good.write_bytes(pristine)

    # the intact file trains
    code, err = run(capsys, *args, f"train.init_from={init}")
    assert code == 0, err
    if family == "llm":  # the run folder describes the loaded architecture (d_model 32), not the config's (256)
        assert zoo.from_pretrained(tmp_path / "out").config.d_model == 32
    shutil.rmtree(tmp_path / "out")

    for damage in (truncate, flip_a_data_byte):
        damage(good)
        assert_refused(capsys, good, *args, f"train.init_from={init}", "train.resume=false")
        restore()

    # a pickle payload in place of the weights: refused without running it
    marker = tmp_path / MARKER
    if family == "llm":  # a Hub folder with only a pickled pytorch_model.bin
        bad = tmp_path / "pickled_hf"
        shutil.copytree(init, bad)
        (bad / "model.safetensors").unlink()
        write_pickle_payload(bad / "pytorch_model.bin", marker)
        (bad / "zip_pytorch_model.bin").unlink()
        assert_refused(capsys, bad, *args, f"train.init_from={bad}", "train.resume=false")
    else:
        name = "weights.pth" if family == "convnet" else "model.pth"
        bad = tmp_path / "pickled" / name
        bad.parent.mkdir()
        write_pickle_payload(bad, marker)
        for f in (bad, bad.with_name("zip_" + name)):
            assert_refused(capsys, f, *args, f"train.init_from={f}", "train.resume=false")
    assert not marker.exists(), "the pickle payload ran"

    # the weights of another architecture
    other_init = other.parent if family == "convnet" else other  # an HF folder, or a ResNet file
    assert_refused(capsys, other_init, *args, f"train.init_from={other_init}", "train.resume=false")
