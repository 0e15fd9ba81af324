"""Chat fine-tuning of a vision-language model (`family: vlm`, train/tasks/vlm.py): chat rows with image parts, their
bad rows, and the embedded digits config (configs/vlm/digits-vqa.yaml) run through the loop and chat.py --image."""
import json

import pytest
import torch

from conftest import ROOT, TEST_DEVICE
from zoo.config import ConfigError
from train.config import load_run_config
from train.data.conversations import IMAGE_TOKENS, ChatTemplate, read_conversations
from train.data.images import digits_dataset
from train.loop import train
from train.tasks.vlm import WORDS, ImageChatData, VLMDataConfig, VLMTask
from zoo.vlm_processor import ImageProcessor

CONFIG = ROOT / "configs" / "vlm" / "digits-vqa.yaml"


def digit_png(path, split="val", k=0):
    """Digit k of the split as an 8x8 PNG; returns its word."""
    from PIL import Image
    x, y = digits_dataset(split, size=8)
    Image.fromarray((x[k, 0].numpy() * 255).round().astype("uint8")).save(path)
    return WORDS[int(y[k])]


def row(*parts, answer="seven"):
    content = [{"type": "image", "image": str(p)} if not isinstance(p, str) else {"type": "text", "text": p}
               for p in parts]
    return {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]}


def test_image_rows_batches_and_bad_rows(tmp_path):
    """Rows with image parts -> each image its 4 image tokens where the template puts it (no loss on them), the
    batch's pixel_values (B, images, 3, 32, 32) padded with all-zero images for a row with fewer; a missing file, a
    file that is not an image, a row whose text holds one more image place than it has images and one whose image
    tokens lie past data.seq_len: skipped and counted in one log line naming the first; a template that does not
    place a row's images (it writes only the last part of a message): the row refused, naming the count."""
    from train.data.text_tokenizers import bpe_trainer, byte_level, load_tokenizer_file
    tok = byte_level()
    tok.train_from_iterator(["What digit is this? seven"] * 4, bpe_trainer(300, ["<|im_start|>", "<|im_end|>",
                                                                                *IMAGE_TOKENS]))
    tok.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer_file(tmp_path / "tokenizer.json")
    a, b = tmp_path / "a.png", tmp_path / "b.png"
    digit_png(a), digit_png(b, k=1)
    (tmp_path / "bad.png").write_text("not an image")
    rows = [row(a, "What digit is this?"), row(tmp_path / "missing.png", "Which?"), row(tmp_path / "bad.png", "Hi"),
            row(a, "Two <image> here"), row("no image"), row(a, b, "Both?"), row("many words " * 40, a)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    logs = []
    convs = read_conversations(str(tmp_path / "rows.jsonl"), "messages", parts=True)
    image_id = tok.encode(IMAGE_TOKENS[0])[0]
    data = ImageChatData(convs, convs[:1], tok, ChatTemplate.builtin("chatml"), VLMDataConfig(seq_len=64), 0,
                         logs.append, ImageProcessor(32, 4), image_id)
    skipped = [m for m in logs if "skipped" in m]
    assert len(skipped) == 1 and "4 conversations" in skipped[0] and "lines 2, 3, 4, 7" in skipped[0]
    assert "missing.png: no such file" in skipped[0]
    assert len(data.train) == 3
    x, y, n, kw = data.collate(data.train)
    assert kw["pixel_values"].shape == (3, 2, 3, 32, 32)
    assert [int((r == image_id).sum()) for r in x] == [4, 0, 8]
    assert not (y == image_id).any() and (y != -100).any()
    assert kw["pixel_values"][1].eq(0).all() and kw["pixel_values"][0, 1].eq(0).all()
    assert not kw["pixel_values"][2, 1].eq(0).all()
    assert kw["pixel_attention_mask"].flatten(2).all(2).tolist() == [[True, False], [False, False], [True, True]]
    for (messages, _), why in zip(convs[2:4] + convs[6:], ("bad.png: cannot decode", "2 <image> places for 1 images",
                                                          "image tokens run past data.seq_len=64")):
        with pytest.raises(ValueError, match=why):
            data.encode_row(messages)
    data.template = ChatTemplate("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content if m.content is "
                                 "string else m.content[-1].text }}<|im_end|>\n{% endfor %}")
    with pytest.raises(ValueError, match="^0 <image> places for 2 images \\(images the template does not"):
        data.encode_row(convs[5][0])


def test_config_keys_split_the_images(tmp_path):
    """data.image_splitting=true and data.longest_edge=64 on the embedded config's model (tiles of 32): each digit
    resized to 64 x 64, a 2 x 2 grid of tiles and its global image (5 images of 4 image tokens, the tokenizer trained
    here keeping the tiles' names whole), written beside the weights as SmolVLM's processor files that read back the
    same; data.longest_edge=40: a one-line error naming it."""
    from train.data.images import image_processor
    over = [f"data.cache_dir={tmp_path}", "data.synthetic_rows=20", "data.eval_generate=0", "data.image_splitting=true",
            "data.seq_len=64"]  # five images of 4 tokens and their tile names: the config's 48 would cut the answers
    task = VLMTask(load_run_config(str(CONFIG), over + ["data.longest_edge=64"]), TEST_DEVICE, lambda m: None)
    task.setup()
    assert task.processor == ImageProcessor(32, 4, splitting=True, longest_edge=64)
    x, _, _, kw = task.data.collate(task.data.train[:2])
    assert kw["pixel_values"].shape == (2, 5, 3, 32, 32) and kw["pixel_attention_mask"].all()
    assert [int((r == 3).sum()) for r in x] == [20, 20]
    assert len(task.data.tokenizer.encode("<row_2_col_1>")) == 1
    task.save_files(tmp_path)
    assert image_processor(task.build_model(), tmp_path) == task.processor
    with pytest.raises(ConfigError, match="data.longest_edge=40 must be a multiple of the tile size 32"):
        VLMTask(load_run_config(str(CONFIG), over + ["data.longest_edge=40"]), TEST_DEVICE, lambda m: None).setup()


def test_config_refuses_packing():
    with pytest.raises(ConfigError, match="data.pack"):
        load_run_config(str(CONFIG), ["data.pack=true"])


@pytest.mark.slow
def test_three_steps_of_the_config(tmp_path):
    """The embedded config for 3 steps: a run folder that loads back as the VLM it trained (zoo.from_pretrained)."""
    import zoo
    cfg = load_run_config(str(CONFIG), [f"train.out_dir={tmp_path}", "train.max_steps=3", "train.eval_every=3",
                                        "data.eval_generate=2", "train.progress=false", "train.plot=false"])
    train(cfg, log=lambda m: None)
    model = zoo.from_pretrained(tmp_path)
    assert model.family == "vlm" and (tmp_path / "tokenizer.model").is_file()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any("val_exact_match" in r for r in rows)


@pytest.mark.slow
def test_the_trained_config_names_held_out_digits(tmp_path, capsys):
    """configs/vlm/digits-vqa.yaml as it is (300 steps), then `chat.py RUN --image` on five held-out digit images:
    at least four named by their word (docs/vit.md gives the run's held-out exact match and the text-only
    baseline's)."""
    from train.chat import main
    cfg = load_run_config(str(CONFIG), [f"train.out_dir={tmp_path / 'run'}", "train.progress=false",
                                        "train.plot=false", "train.checkpoint_every=0", "train.eval_every=0"])
    train(cfg, log=lambda m: None)
    hits = 0
    for k in range(5):
        word = digit_png(tmp_path / f"{k}.png", k=k)
        capsys.readouterr()
        assert main([str(tmp_path / "run"), "--image", str(tmp_path / f"{k}.png"), "--prompt",
                     "What digit is this?", "--max-new-tokens", "8"]) == 0
        hits += capsys.readouterr().out.strip() == word
    assert hits >= 4
