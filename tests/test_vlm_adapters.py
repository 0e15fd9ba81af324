"""LoRA on a vision-language model (zoo/adapters.py: the decoder by default, the encoder's and the connector's
projections with adapter.vision_targets) against PEFT on transformers' SmolVLM, through an adapter run of the
embedded digits model; image questions in train/eval.py against the model's own greedy decoding."""
import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file
from test_lora import randomize_adapters
from test_vit import close
from test_vlm import SHAPES, hf_vlm, split_batch

import zoo
from conftest import CPU, ROOT
from train.config import load_run_config
from train.data.conversations import IMAGE, token_offsets, tokenizer_and_template
from train.data.images import digits_dataset, processed_image
from zoo.vlm_processor import ImageProcessor, image_text
from train.loop import train
from train.tasks.vlm import QUESTIONS, WORDS
from zoo.adapters import AdapterConfig, apply_adapters, merged_model
from zoo.blocks.lora import LoRALinear
from zoo.config import ConfigError
from zoo.weights.peft_lora import save_adapter

import peft

CONFIG = ROOT / "configs" / "vlm" / "digits-vqa.yaml"
VISION = ["fc1", "fc2", "k_proj", "out_proj", "proj", "q_proj", "v_proj"]  # SmolVLM's encoder, its connector (proj)
pytestmark = pytest.mark.cpu_only("the models load where zoo.from_pretrained puts them, the CPU, as transformers' do")
QUIET = ["train.progress=false", "train.plot=false", "train.checkpoint_every=0", "train.eval_every=0",
         "train.eval_batches=1", "data.eval_generate=0"]


def vision_modules(model) -> list:
    return [m for n, m in model.named_modules() if isinstance(m, LoRALinear) and not n.startswith("llm.")]


@pytest.mark.parametrize("vision", [[], VISION], ids=["decoder", "decoder+encoder"])
def test_peft_loads_the_adapter_onto_transformers_smolvlm(tmp_path, vision, one_thread):
    """A SmolVLM at random init (perturbed) -> Zoo -> LoRA on the decoder's default targets (with vision_targets also
    the encoder's and the connector's), the adapters randomised -> save_adapter: PEFT on
    SmolVLMForConditionalGeneration wraps exactly the modules the file holds (a decoder-only adapter none of the
    encoder's, whose q/k/v_proj share the decoder's short names) and gives Zoo's logits on the processor's layout
    (fp32, 1e-4); zoo.from_pretrained(adapter) the same; merged_model the adapted logits (1e-5)."""
    vcfg, text, scale = SHAPES["smolvlm-4x4-s2"]
    _, ref = hf_vlm("smolvlm", vcfg, text, scale)
    ref.save_pretrained(tmp_path / "hf")
    model = apply_adapters(zoo.from_pretrained(tmp_path / "hf"),
                           AdapterConfig(method="lora", r=4, alpha=8, vision_targets=vision))
    assert len(vision_modules(model)) == (2 * 4 + 1 if vision else 0)  # qkv, out_proj, fc1, fc2 per block; connector
    randomize_adapters(model)
    out = save_adapter(model, tmp_path / "adapter", base=tmp_path / "hf")
    pm = peft.PeftModel.from_pretrained(ref, out).eval()
    held = {k.removeprefix("base_model.model.").rsplit(".lora_", 1)[0]
            for k in load_file(out / "adapter_model.safetensors")}
    wrapped = {n.removeprefix("base_model.model.") for n, m in pm.named_modules()
               if isinstance(m, peft.tuners.lora.LoraLayer)}
    assert wrapped == held and any("vision_model" in n for n in held) == bool(vision)
    assert ("model.connector.modality_projection.proj" in held) == bool(vision)
    ids, pixels, mask = split_batch(vcfg["image_size"], (vcfg["image_size"] // vcfg["patch_size"] // scale) ** 2,
                                    torch.Generator().manual_seed(1))
    kw = dict(pixel_values=pixels, pixel_attention_mask=mask)
    with torch.no_grad():
        want, got = pm(input_ids=ids, **kw).logits, model(ids, **kw)
        assert close(got, want), (got - want).abs().max()
        assert close(zoo.from_pretrained(out)(ids, **kw), got)
        for m in vision_modules(model):  # the encoder's adapters show
            m.enabled = False
        assert not vision or not close(model(ids, **kw), got, 1e-2)
        for m in vision_modules(model):
            m.enabled = True
        assert close(merged_model(model)(ids, **kw), got, 1e-5)


def test_vision_targets_name_the_encoders_projections():
    """adapter.vision_targets: a name the encoder lacks, or any on an LLM: one error listing what there is; with a
    method other than LoRA / DoRA: a config error."""
    vlm = zoo.build(load_run_config(str(CONFIG)).model)
    with pytest.raises(ConfigError, match=r"adapter.vision_targets: gate_proj not in this model \(known: fc1, fc2, "
                                          r"k_proj, out_proj, proj, q_proj, v_proj\)"):
        apply_adapters(vlm, AdapterConfig(method="lora", vision_targets=["gate_proj"]))
    llm = zoo.build({"vocab_size": 64, "d_model": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 16})
    with pytest.raises(ConfigError, match=r"adapter.vision_targets: q_proj not in this model \(known: none\)"):
        apply_adapters(llm, AdapterConfig(method="lora", vision_targets=["q_proj"]))
    with pytest.raises(ConfigError, match="adapter.vision_targets needs adapter.method lora or dora"):
        load_run_config(str(CONFIG), ["adapter.method=prefix", "adapter.vision_targets=[q_proj]"])


# ----------------------------------------------------------------------------- the digits model
@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    """configs/vlm/digits-vqa.yaml for 120 of its 300 steps: a run folder that answers some held-out digits."""
    out = tmp_path_factory.mktemp("digits") / "run"
    train(load_run_config(str(CONFIG), [f"train.out_dir={out}", "train.max_steps=120", *QUIET]), log=lambda m: None)
    return out


def digit_task(folder, n=24):
    """n questions about held-out digits (PNGs beside the file, named relative to it); the answers' case and
    punctuation varied."""
    from PIL import Image
    x, y = digits_dataset("val", size=8)
    rows = []
    for k in range(n):
        Image.fromarray((x[k, 0].numpy() * 255).round().astype("uint8")).save(folder / f"{k}.png")
        word = WORDS[int(y[k])]
        rows.append({"image": f"{k}.png", "question": QUESTIONS[k % len(QUESTIONS)],
                     "answer": [word, word.capitalize() + ".", f" {word.upper()}!"][k % 3]})
    (folder / "digits.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder / "digits.jsonl", rows


def prompt_ids(model, tokenizer, template, question: str) -> torch.Tensor:
    """(1, T): a user message of the image, then the question, rendered for the answer; the image's tokens written
    as SmolVLM's processor writes one untiled image."""
    text = template.render([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}],
                           add_generation_prompt=True)
    return torch.tensor([token_offsets(tokenizer, text.replace(IMAGE, image_text(model.image_tokens)))[0]])


def image_pixels(path, model) -> torch.Tensor:
    """(1, 3, S, S): one image at the encoder's size, untiled (the model's default processor)."""
    return processed_image(ImageProcessor.for_model(model), str(path))[0]


def greedy_answers(model, tokenizer, template, folder, rows) -> list:
    """Each row's answer by the VLM's own generate (not chat.py's session), cut at EOS and the end of turn."""
    out = []
    for r in rows:
        ids = prompt_ids(model, tokenizer, template, r["question"])
        pixels = image_pixels(folder / r["image"], model)
        new = model.generate(ids, 16, pixel_values=pixels)[0, ids.shape[1]:].tolist()
        new = new[:new.index(tokenizer.eos_id)] if tokenizer.eos_id in new else new
        out.append(tokenizer.decode(new).split(template.end_of_turn)[0])
    return out


def test_image_questions_score_chat_answers(tmp_path, one_thread):
    """evaluate_files on image questions, a VLM at random init with a small tokenizer keeping <image> whole: the rows
    answered by chat.py's ChatSession in a loop here, half given that answer back (cased and punctuated
    otherwise), half another: exact match and per-answer counts as that loop says."""
    from PIL import Image

    from train.chat import ChatSession
    from train.data.conversations import IMAGE_TOKENS, ChatTemplate
    from train.data.text_tokenizers import bpe_trainer, byte_level, load_tokenizer_file
    from train.eval import evaluate_files
    tok = byte_level()
    tok.train_from_iterator(["What digit is this? seven"] * 4, bpe_trainer(300, ["<|im_start|>", "<|im_end|>",
                                                                                *IMAGE_TOKENS]))
    tok.save(str(tmp_path / "tokenizer.json"))
    tok, template = load_tokenizer_file(tmp_path / "tokenizer.json"), ChatTemplate.builtin("chatml")
    cfg = load_run_config(str(CONFIG), [f"model.image_token_id={tok.encode(IMAGE)[0]}"]).model
    torch.manual_seed(0)
    model = zoo.build(cfg).eval()
    g, rows, answers = torch.Generator().manual_seed(0), [], []
    for k in range(6):
        Image.fromarray((torch.rand(32, 32, 3, generator=g) * 255).byte().numpy()).save(tmp_path / f"{k}.png")
        chat = ChatSession(model, tok, template, max_new_tokens=6,
                           images=(image_pixels(tmp_path / f"{k}.png", model), [image_text(model.image_tokens)]))
        answers.append(chat.reply("What?"))
        rows.append({"image": f"{k}.png", "question": "What?", "answer": answers[-1].upper() + "?" if k % 2 else
                     "not this"})
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = evaluate_files(model, tok, [tmp_path / "t.jsonl"], CPU, template, max_new_tokens=6,
                         log=lambda m: None)["t"]
    norm = lambda s: " ".join(re.sub(r"[^\w\s]", "", s.lower()).split())  # noqa: E731
    hits = [norm(a) == norm(r["answer"]) for a, r in zip(answers, rows)]
    assert [d["output"] for d in got["details"]] == answers and got["exact_match"] == sum(hits) / 6 > 0
    assert got["per_answer"]["not this"] == [3, sum(hits[::2]) / 3]


@pytest.mark.slow
def test_eval_image_questions_equal_the_models_greedy_answers(digits_run, tmp_path, capsys):
    """`eval.py RUN --task FILE` on held-out digit questions: exact match and per-answer counts equal those of the
    model's own greedy decoding compared by hand (lowercase, letters only); the run's Hugging Face export (SmolVLM,
    its tokenizer and template beside it) scores the same."""
    from train.eval import main
    task, rows = digit_task(tmp_path)
    model = zoo.from_pretrained(digits_run).eval()
    tokenizer, template = tokenizer_and_template(digits_run)
    answers = greedy_answers(model, tokenizer, template, tmp_path, rows)
    norm = lambda s: re.sub(r"[^a-z ]", "", s.lower()).strip()  # noqa: E731  (the answers are words)
    hits = [norm(a) == norm(r["answer"]) for a, r in zip(answers, rows)]
    assert 0 < sum(hits) < len(rows)  # partly trained: both kinds of row
    hf = zoo.save_pretrained(model, tmp_path / "hf")
    for name in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(digits_run / name, hf / name)
    for folder in (digits_run, hf):
        assert main([str(folder), "--task", str(task), "--json", str(tmp_path / "eval.json"), "--max-new-tokens",
                     "16"]) == 0
        got = json.loads((tmp_path / "eval.json").read_text())["tasks"]["digits"]
        assert got["exact_match"] == sum(hits) / len(rows) and got["n"] == len(rows)
        per = {norm(r["answer"]): [0, 0] for r in rows}
        for h, r in zip(hits, rows):
            per[norm(r["answer"])][0] += 1
            per[norm(r["answer"])][1] += h
        assert got["per_answer"] == {a: [n, k / n] for a, (n, k) in sorted(per.items())}
        assert "digits, per answer:" in capsys.readouterr().out


@pytest.mark.slow
def test_adapter_run_trains_the_encoders_lora(digits_run, tmp_path):
    """An adapter run from the digits run with LoRA on the encoder and connector too: every vision adapter's B
    leaves zero in the PEFT folder it writes; the merged export's weights are the base's plus s B A (the base
    unchanged by the run: exactly, where nothing is adapted) and its logits those of the adapter folder loaded on
    its base (1e-5); eval.py scores the adapter folder."""
    out = tmp_path / "lora"
    cfg = load_run_config(str(CONFIG), [f"train.out_dir={out}", f"train.init_from={digits_run}", "train.max_steps=6",
                                        "adapter.method=lora", f"adapter.vision_targets=[{','.join(VISION)}]",
                                        "adapter.export_merged=true", "optim.lr=1e-2", *QUIET])
    train(cfg, log=lambda m: None)
    state = load_file(out / "adapter" / "adapter_model.safetensors")
    vision_b = [k for k in state if ("vision_model" in k or "connector" in k) and ".lora_B." in k]
    assert len(vision_b) == 2 * 6 + 1 and all(state[k].abs().max() > 0 for k in vision_b)
    base, merged = zoo.from_pretrained(digits_run).eval(), zoo.from_pretrained(out / "hf").eval()
    adapted = zoo.from_pretrained(out / "adapter").eval()
    b, m = base.state_dict(), merged.state_dict()
    lora = {n: mod for n, mod in adapted.named_modules() if isinstance(mod, LoRALinear)}
    assert any(n.startswith("vision.") for n in lora) and "connector.proj" in lora
    for k in b:
        site = k.removesuffix(".weight")
        if site in lora and k.endswith(".weight"):
            assert torch.allclose(m[k], lora[site].merged_weight(), atol=1e-6), k  # the base's W + s B A
        else:
            assert torch.equal(m[k], b[k]), k
    task, rows = digit_task(tmp_path, n=6)
    tokenizer, template = tokenizer_and_template(out / "adapter")
    ids = prompt_ids(base, tokenizer, template, QUESTIONS[0])
    pixels = image_pixels(tmp_path / "0.png", base)
    with torch.no_grad():
        assert close(merged(ids, pixel_values=pixels), adapted(ids, pixel_values=pixels), 1e-5)
        assert not close(base(ids, pixel_values=pixels), adapted(ids, pixel_values=pixels), 1e-3)
    from train.eval import main
    assert main([str(out / "adapter"), "--task", str(task), "--json", str(tmp_path / "a.json")]) == 0
    assert json.loads((tmp_path / "a.json").read_text())["tasks"]["digits"]["n"] == len(rows)
