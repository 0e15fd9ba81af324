"""SmolVLM / Idefics3 (zoo/vlm.py, zoo/weights/hf_vlm.py) against transformers at random init."""
import dataclasses
import json

import pytest
import torch

import zoo
from test_vit import close, perturbed
from zoo.blocks.pixel_shuffle import pixel_shuffle
from train.data.images import image_processor, processed_image
from zoo.vit import ViT
from zoo.vlm import bucket_positions
from zoo.vlm_processor import IMAGE_TOKENS, ImageProcessor

IMAGE_ID = 100
# (encoder, decoder, scale_factor): a 4x4 patch grid folded 2x2 and full attention; a 9x9 grid folded 3x3, deeper,
# grouped-query attention (4 heads sharing 2 keys)
SHAPES = {"smolvlm-4x4-s2": (dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  image_size=32, patch_size=8),
                             dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=4), 2),
          "smolvlm-9x9-s3-gqa": (dict(hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=3,
                                      image_size=36, patch_size=4),
                                 dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                                      num_key_value_heads=2), 3)}


def hf_vlm(kind, vision, text, scale, vocab=128, image_id=IMAGE_ID):
    from transformers import (Idefics3Config, Idefics3ForConditionalGeneration, SmolVLMConfig,
                              SmolVLMForConditionalGeneration)
    config, cls = (SmolVLMConfig, SmolVLMForConditionalGeneration) if kind == "smolvlm" else \
        (Idefics3Config, Idefics3ForConditionalGeneration)
    text = dict(model_type="llama", vocab_size=vocab, rms_norm_eps=1e-5, **text)
    return cls, perturbed(cls(config(vision_config=vision, text_config=text, scale_factor=scale,
                                     image_token_id=image_id)))


def split_batch(size, tokens, g):
    """The processor's layout for two prompts: the first image split into two tiles plus its global image, the
    second one image of a smaller size padded (pixel_attention_mask) and two all-zero padding images; the prompts
    as long as each other, `tokens` placeholders per image."""
    pixels = torch.randn(2, 3, 3, size, size, generator=g)
    mask = torch.ones(2, 3, size, size, dtype=torch.long)
    pixels[1, 1:] = 0
    mask[1, 1:] = 0
    h, w = size * 3 // 4, size // 2
    pixels[1, 0, :, h:], pixels[1, 0, :, :, w:], mask[1, 0, h:], mask[1, 0, :, w:] = 0, 0, 0, 0
    text = lambda n: torch.randint(0, IMAGE_ID, (n,), generator=g).tolist()  # noqa: E731
    rows = [text(3) + [IMAGE_ID] * 3 * tokens + text(2), text(3 + 2 * tokens) + [IMAGE_ID] * tokens + text(2)]
    return torch.tensor(rows), pixels, mask


@pytest.mark.parametrize("kind,shape", [("smolvlm", "smolvlm-4x4-s2"),
                                        pytest.param("smolvlm", "smolvlm-9x9-s3-gqa", marks=pytest.mark.slow),
                                        pytest.param("idefics3", "smolvlm-4x4-s2", marks=pytest.mark.slow)])
def test_hf_vlm_in_and_out(tmp_path, kind, shape):
    """A SmolVLM (or Idefics3) folder at random init (perturbed) -> zoo.from_pretrained: on the processor's layout
    (tiles + global image, a padded smaller image, padding images) the logits within 1e-4 (fp32, eval) and the same
    12 greedy tokens on Zoo's KV cache; Zoo's export -> the class's from_pretrained: the same logits within 1e-4."""
    vision, text, scale = SHAPES[shape]
    cls, ref = hf_vlm(kind, vision, text, scale)
    ref.save_pretrained(tmp_path / "hf")
    model = zoo.from_pretrained(tmp_path / "hf")
    tokens = (vision["image_size"] // vision["patch_size"] // scale) ** 2
    ids, pixels, mask = split_batch(vision["image_size"], tokens, torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(input_ids=ids, pixel_values=pixels, pixel_attention_mask=mask).logits
        got = model(ids, pixel_values=pixels, pixel_attention_mask=mask)
        assert close(got, want)
        assert not close(model(ids, pixel_values=pixels.flip(-1), pixel_attention_mask=mask.flip(-1)), want)
    ref.generation_config.eos_token_id = None  # 12 tokens whatever they are
    greedy = ref.generate(input_ids=ids, pixel_values=pixels, pixel_attention_mask=mask, max_new_tokens=12,
                          do_sample=False)
    assert torch.equal(model.generate(ids, 12, pixel_values=pixels, pixel_attention_mask=mask), greedy)
    back = cls.from_pretrained(zoo.save_pretrained(model, tmp_path / "out")).eval()
    assert type(back.config) is type(ref.config)
    with torch.no_grad():
        assert close(back(input_ids=ids, pixel_values=pixels, pixel_attention_mask=mask).logits, want)


def test_connector_and_positions_as_transformers():
    """pixel_shuffle is Idefics3Connector.pixel_shuffle exactly; bucket_positions gives the position ids of
    SmolVLMVisionEmbeddings for images padded to other sizes."""
    from transformers import SmolVLMConfig
    from transformers.models.smolvlm.modeling_smolvlm import SmolVLMConnector, SmolVLMVisionEmbeddings
    x = torch.randn(2, 36, 5)
    for s in (2, 3):
        conn = SmolVLMConnector(SmolVLMConfig(scale_factor=s))
        assert torch.equal(pixel_shuffle(x, s), conn.pixel_shuffle(x, s))
    emb = SmolVLMVisionEmbeddings(SmolVLMConfig(vision_config=dict(image_size=28, patch_size=4, hidden_size=8)
                                                ).vision_config)
    mask = torch.zeros(3, 9, 9, dtype=torch.bool)
    for i, (h, w) in enumerate([(9, 9), (5, 7), (3, 2)]):
        mask[i, :h, :w] = True
    captured = {}
    emb.position_embedding.register_forward_hook(lambda m, a, out: captured.update(ids=a[0]))
    emb(torch.randn(3, 3, 36, 36), mask)
    assert torch.equal(bucket_positions(mask, 7), captured["ids"])


def test_vlm_bad_input_is_one_line(tmp_path):
    """A prompt whose placeholders do not match the images' tokens; an image size that is not whole patches; an
    encoder SmolVLM's cannot hold (LayerScale) on export; processor files asking for a filter Zoo does not resize
    with, or image tokens a tile does not make."""
    vision, text, scale = SHAPES["smolvlm-4x4-s2"]
    ref = hf_vlm("smolvlm", vision, text, scale)[1]
    ref.save_pretrained(tmp_path / "hf")
    model = zoo.from_pretrained(tmp_path / "hf")
    ids = torch.tensor([[1, 2] + [IMAGE_ID] * 3])
    with pytest.raises(ValueError, match="3 image tokens .* for 1 images of 4 tokens"):
        model(ids, pixel_values=torch.randn(1, 1, 3, 32, 32))
    with pytest.raises(ValueError, match=r"pixel_values \(1, 1, 3, 30, 32\)"):
        model(ids, pixel_values=torch.randn(1, 1, 3, 30, 32))
    hf = tmp_path / "hf"
    (hf / "preprocessor_config.json").write_text(json.dumps({"resample": 0}))
    with pytest.raises(ValueError, match=r"hf/preprocessor_config.json: resample=0: Zoo resizes with 1 \(lanczos\)"):
        image_processor(model, hf)
    (hf / "preprocessor_config.json").write_text(json.dumps({"max_image_size": {"longest_edge": 32}}))
    (hf / "processor_config.json").write_text(json.dumps({"image_seq_len": 16}))
    with pytest.raises(ValueError, match=r"hf/processor_config.json: image_seq_len=16, but a tile of 32 pixels is 4 "):
        image_processor(model, hf)
    model.vision = ViT(dataclasses.replace(model.vision.config, init_values=0.1))
    with pytest.raises(ValueError, match="SmolVLM's encoder cannot hold init_values=0.1 \\(needs 0.0\\)$"):
        zoo.save_pretrained(model, tmp_path / "out")


TEMPLATE = ("<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}{% if "
            "message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}{% for line in "
            "message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}{% elif line['type'] == 'image' %}"
            "{{ '<image>' }}{% endif %}{% endfor %}"
            "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")  # SmolVLM's


def test_chat_answers_about_an_image(tmp_path, capsys):
    """train/chat.py --image on a random-init tiny SmolVLM built in Zoo and saved as a transformers folder (a BPE
    tokenizer holding SmolVLM's image tokens, SmolVLM's chat template): the answer is the model's greedy
    continuation of the prompt SmolVLM's processor writes for one image without tiles; an image that is missing or
    not an image: exit code 2 and one line naming it."""
    from PIL import Image
    from train.chat import main
    from train.data.text_tokenizers import bpe_trainer, byte_level, load_tokenizer_file
    from zoo.config import LLMConfig, ViTConfig, VLMConfig
    from zoo.vlm import VLM
    specials = ["<|im_start|>", "<end_of_utterance>", "<image>", "<fake_token_around_image>", "<global-img>"]
    tok = byte_level()
    tok.train_from_iterator(["What is in this picture?"] * 4, bpe_trainer(300, specials))
    vision = ViTConfig(embed_dim=32, depth=2, num_heads=4, patch_size=8, img_size=32, class_token=False,
                       no_embed_class=True, mlp="gelu_tanh", num_classes=0)
    text = LLMConfig(vocab_size=tok.get_vocab_size(), d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                     max_seq_len=128, tie_embeddings=False)
    torch.manual_seed(0)
    model = VLM(VLMConfig(vision=vision, text=text, image_token_id=tok.token_to_id("<image>"))).eval()
    model.llm.reset_parameters(0.2)  # a decoder whose attention is sharp enough for the image to steer its answer
    with torch.no_grad():
        model.llm.lm_head.weight[:len(specials)] = 0  # no special token wins: the answer runs its full length
    folder = zoo.save_pretrained(model, tmp_path / "vlm")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    Image.fromarray(torch.randint(0, 256, (24, 40, 3), dtype=torch.uint8).numpy()).save(tmp_path / "a.png")
    question = "What is in this picture?"
    prompt = (f"<|im_start|>User:<fake_token_around_image><global-img>{'<image>' * 4}<fake_token_around_image>"
              f"{question}<end_of_utterance>\nAssistant:")
    ids = torch.tensor([tok.encode(prompt).ids])
    pixels = processed_image(ImageProcessor.for_model(model), str(tmp_path / "a.png"))[0][None]
    greedy = model.generate(ids, 6, pixel_values=pixels)[0, ids.shape[1]:]
    assert not torch.equal(model.generate(ids, 6, pixel_values=pixels.flip(-1))[0, ids.shape[1]:], greedy)
    capsys.readouterr()
    assert main([str(folder), "--image", str(tmp_path / "a.png"), "--prompt", question, "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out == load_tokenizer_file(folder / "tokenizer.json").decode(greedy.tolist()) + "\n"
    (tmp_path / "b.png").write_text("not an image")
    for name, why in (("missing.png", "no such file"), ("b.png", "cannot decode")):
        assert main([str(folder), "--image", str(tmp_path / name), "--prompt", question]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and name in err and why in err


def photos(folder) -> list:
    """Two of scikit-image's photographs of other aspect ratios as PNG files: the astronaut cut to 512 x 200 (tall)
    and the coffee cup (400 x 600, wide)."""
    from PIL import Image
    from skimage import data
    out = [folder / "astronaut.png", folder / "coffee.png"]
    for path, x in zip(out, (data.astronaut()[:, 150:350], data.coffee())):
        Image.fromarray(x).save(path)
    return out


def test_the_processor_as_transformers(tmp_path, capsys):
    """A tiny random SmolVLM saved with transformers' SmolVLMProcessor (a BPE tokenizer holding SmolVLM's special
    tokens, its chat template, tiles of 32 after the longest edge resized to 128, Lanczos): on two chat rows, each
    about one of two photographs (4 x 2 and 3 x 4 tiles), Zoo's chat SFT data (the processor read from the folder)
    gives transformers' input_ids exactly, its pixel_values within 1e-5 and its pixel_attention_mask (one image
    padded); Zoo's logits on Zoo's inputs equal transformers' on its own within 1e-4 (fp32, eval); chat.py --image
    answers with transformers' greedy tokens; the files Zoo writes give transformers' image processor the same
    pixels and read back as the same settings."""
    from PIL import Image
    from transformers import (PreTrainedTokenizerFast, SmolVLMImageProcessor, SmolVLMProcessor,
                              SmolVLMVideoProcessor)
    from transformers.models.smolvlm.processing_smolvlm import DEFAULT_CHAT_TEMPLATE
    from train.chat import main
    from train.data.conversations import ChatTemplate
    from train.data.text_tokenizers import bpe_trainer, byte_level, load_tokenizer_file
    from train.tasks.vlm import ImageChatData, VLMDataConfig
    specials = ["<|im_start|>", "<end_of_utterance>", *IMAGE_TOKENS] + [f"<row_{r}_col_{c}>" for r in range(1, 5)
                                                                         for c in range(1, 5)]
    tok = byte_level()
    tok.train_from_iterator(["What is in this picture? A cup of coffee."] * 4, bpe_trainer(300, specials))
    vision, text, scale = SHAPES["smolvlm-4x4-s2"]
    image_id = tok.token_to_id("<image>")
    ref = hf_vlm("smolvlm", vision, text, scale, tok.get_vocab_size(), image_id)[1]
    with torch.no_grad():
        ref.lm_head.weight[:len(specials)] = 0  # no special token wins: chat's answer runs its full length
    ref.generation_config.eos_token_id = None
    folder = tmp_path / "hf"
    ref.save_pretrained(folder)
    proc = SmolVLMProcessor(SmolVLMImageProcessor(max_image_size={"longest_edge": 32}, size={"longest_edge": 128}),
                            PreTrainedTokenizerFast(tokenizer_object=tok), SmolVLMVideoProcessor(), image_seq_len=4,
                            chat_template=DEFAULT_CHAT_TEMPLATE)
    proc.save_pretrained(folder)
    paths = photos(tmp_path)
    rows = [[{"role": "user", "content": [{"type": "image", "image": str(p)}, {"type": "text", "text": q}]},
             {"role": "assistant", "content": "A cup of coffee."}] for p, q in zip(paths, ("What is this?", "And?"))]
    model = zoo.from_pretrained(folder)
    data = ImageChatData([(r, ("rows", i + 1)) for i, r in enumerate(rows)], [(rows[0], ("rows", 1))],
                         load_tokenizer_file(folder / "tokenizer.json"), ChatTemplate.from_pretrained(folder),
                         VLMDataConfig(seq_len=512), 0, lambda m: None, image_processor(model, folder), image_id)
    kw = data.collate(data.train)[3]
    want = proc.image_processor([[Image.open(p)] for p in paths], return_tensors="pt", return_row_col_info=True)
    assert want["rows"] == [[4], [3]] and want["cols"] == [[2], [4]] and want["pixel_values"].shape[1] == 13
    torch.testing.assert_close(kw["pixel_values"], want["pixel_values"], atol=1e-5, rtol=0)
    assert torch.equal(kw["pixel_attention_mask"], want["pixel_attention_mask"].bool())
    for r, row in enumerate(rows):
        ids = data.encode_row(row)[0]
        theirs = proc(text=proc.apply_chat_template(row), images=[Image.open(paths[r])], return_tensors="pt")
        assert ids == theirs["input_ids"][0].tolist()
        with torch.no_grad():
            got = model(torch.tensor([ids]), pixel_values=kw["pixel_values"][r:r + 1],
                        pixel_attention_mask=kw["pixel_attention_mask"][r:r + 1])
            assert close(got, ref(**theirs).logits)
    question = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in this picture?"}]}]
    theirs = proc(text=proc.apply_chat_template(question, add_generation_prompt=True), images=[Image.open(paths[1])],
                  return_tensors="pt")
    greedy = ref.generate(**theirs, max_new_tokens=6, do_sample=False)[0, theirs["input_ids"].shape[1]:]
    capsys.readouterr()
    assert main([str(folder), "--image", str(paths[1]), "--prompt", "What is in this picture?",
                 "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out == data.tokenizer.decode(greedy.tolist()) + "\n"
    (tmp_path / "zoo").mkdir()
    data.processor.save(tmp_path / "zoo")
    assert ImageProcessor.from_folder(tmp_path / "zoo", model) == data.processor
    again = SmolVLMImageProcessor.from_pretrained(tmp_path / "zoo")([[Image.open(p)] for p in paths],
                                                                    return_tensors="pt")
    assert torch.equal(again["pixel_values"], want["pixel_values"])


@pytest.mark.slow

def test_the_generation_bench_at_a_tiny_shape(tmp_path):
    """`bench.py vlm` (one round, tiny shapes): Zoo and transformers, given one checkpoint, an image and text, decode
    the same tokens in fp32 and bf16; the result names the image's place in the prompt."""
    from train import bench
    out = tmp_path / "vlm.json"
    assert bench.main(["vlm", "--d-model", "64", "--n-layers", "1", "--n-heads", "4", "--n-kv-heads", "2",
                       "--ffn", "128", "--vocab", "512", "--vision-layers", "1", "--image-size", "64", "--rounds", "1",
                       "--new-tokens", "4", "--json", str(out)]) == 0
    tables = json.loads(out.read_text())["tables"]
    for prec in ("fp32", "bf16"):
        t = tables[f"decoding {prec}"]
        same = t["columns"].index("same tokens as the first reference")
        assert [(r[0], r[same]) for r in t["rows"]] == [("zoo-eager", "yes"), ("transformers-eager", "yes")]
        assert "an image of 64x64 in the prompt (1 of its 17 tokens), 1 encoder blocks" in t["notes"]
