"""Talk to a trained LLM in its chat format.

    python train/chat.py DIR                         # interactive: one message per line, answers streamed
    python train/chat.py DIR --prompt "Hi there"     # one answer, then exit
    python train/chat.py DIR --temperature 0.8 --top-k 50 --system "Answer briefly."
    python train/chat.py VLM_DIR --image cat.jpg --prompt "What is in this image?"

DIR: a run folder, a Hugging Face folder or a GGUF file. Turns stay in the KV cache;
`/reset` starts a new conversation, `/exit` quits; temperature 0 is greedy. A vision-language model's
--image joins the first message: processed as the folder's preprocessor_config.json says (SmolVLM's tiles),
else resized to the encoder's square; its tokens where the model's chat template puts `<image>`.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable, Optional

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from zoo.llm import decode_step, sample_next
from zoo.vlm_processor import pad_images

from train.data.conversations import IMAGE, expand_images
from train.data.images import image_processor, processed_image
from train.step import eval_mode


class ChatSession:
    """A conversation with an LLM that keeps its keys and values between turns.

        chat = ChatSession(model, tokenizer, template, system="Answer briefly.")
        chat.reply("Hi, my name is Ada.", on_text=print)    # streams, returns the answer"""

    def __init__(self, model, tokenizer, template, system: Optional[str] = None, max_new_tokens: int = 256,
                 temperature: float = 0.0, top_k: Optional[int] = None, top_p: Optional[float] = None,
                 seed: Optional[int] = None, images: Optional[tuple] = None):
        from train.data.conversations import token_offsets
        self.vlm = model if getattr(model, "family", None) == "vlm" else None
        self.model, self.tokenizer, self.template = model.llm if self.vlm else model, tokenizer, template
        self.images = images  # (the tiles of the images (n, C, S, S), the text of each image), as processed_image's
        self.system, self.max_new_tokens = system, max_new_tokens
        self.sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p)
        self.device = next(model.parameters()).device
        self.generator = torch.Generator(self.device).manual_seed(seed) if seed is not None else None
        self.end_of_turn = template.end_of_turn
        self._encode = lambda text: token_offsets(tokenizer, text)[0]
        eos = template.special_tokens.get("eos_token")
        eos_ids = self._encode(eos) if eos else []
        self.eos_id = eos_ids[0] if len(eos_ids) == 1 else getattr(tokenizer, "eos_id", None)
        self.reset()
        if images is not None and self._encode(IMAGE) != [model.config.image_token_id]:
            raise ValueError(f"the tokenizer does not encode <image> as the model's image token "
                             f"{model.config.image_token_id}")

    def _content(self, text: str, images: int = 0):
        """A message's content: the text, or for a VLM the list of parts its chat templates read."""
        return [{"type": "image"}] * images + [{"type": "text", "text": text}] if self.vlm else text

    def reset(self):
        self.messages = [{"role": "system", "content": self._content(self.system)}] if self.system else []
        self.caches, self.cached = None, []  # the KV caches and the token ids whose keys and values they hold

    def reply(self, text: str, on_text: Optional[Callable[[str], None]] = None) -> str:
        """Add the user's message, generate the answer (streamed to on_text piece by piece), keep both."""
        first = self.images is not None and not any(m["role"] == "user" for m in self.messages)
        user = {"role": "user", "content": self._content(text, len(self.images[1]) if first else 0)}
        answer = self.respond(self.messages + [user], on_text)
        self.messages += [user, {"role": "assistant", "content": self._content(answer)}]
        return answer

    @torch.inference_mode()
    def respond(self, messages: list[dict], on_text: Optional[Callable[[str], None]] = None) -> str:
        """The assistant's answer to `messages`, reusing the cached tokens they start with."""
        model, cap = self.model, self.model.config.max_seq_len
        text = self.template.render(messages, add_generation_prompt=True)  # each <image> as the processor writes it
        ids = self._encode(text if self.images is None else expand_images(text, self.images[1])[0])
        if len(ids) >= cap:
            raise ValueError(f"the conversation is {len(ids)} tokens, the model's context {cap}: /reset to start over")
        with eval_mode(model):
            if self.caches is None:
                dev = self.device.type
                dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
                self.caches = model.new_caches(1, cap, self.device, dtype)
            keep = min(len(os.path.commonprefix([self.cached, ids])), len(ids) - 1)  # a new token at least: the logits
            new = torch.tensor([ids[keep:]], device=self.device)
            new_image = self.images is not None and self.vlm.config.image_token_id in ids[keep:]
            embeds = self.vlm.embed(torch.tensor([ids], device=self.device), *pad_images([self.images[0]])) \
                if new_image else None
            logits = model(new, caches=self.caches, start_pos=keep,
                           inputs_embeds=None if embeds is None else embeds[:, keep:])[:, -1]
            self.cached = list(ids)
            out, shown, text = [], 0, ""
            for _ in range(min(self.max_new_tokens, cap - len(ids))):
                nxt = int(sample_next(logits.float(), generator=self.generator, **self.sampling))
                if nxt == self.eos_id:
                    break
                out.append(nxt)
                text = self.tokenizer.decode(out)
                if self.end_of_turn and self.end_of_turn in text:
                    text = text[:text.index(self.end_of_turn)]
                    break
                safe = len(text) - _held_back(text, self.end_of_turn)
                if on_text is not None and safe > shown:
                    on_text(text[shown:safe])
                    shown = safe
                if len(self.cached) >= cap:
                    break
                logits = decode_step(model, torch.tensor([[nxt]], device=self.device), self.caches, len(self.cached))
                self.cached.append(nxt)
            if on_text is not None and len(text) > shown:
                on_text(text[shown:])
        return text


def _held_back(text: str, stop: str) -> int:
    """How many characters at the end of text must wait (a possible stop-text start, or U+FFFD)."""
    n = len(text) - len(text.rstrip("\ufffd"))
    for k in range(min(len(stop) - 1, len(text)), 0, -1):
        if stop.startswith(text[-k:]):
            return max(n, k)
    return n


def load(path: str, device: str = "auto", dtype: str = "float32", tokenizer: Optional[str] = None,
         template_name: Optional[str] = None):
    """(model, tokenizer, template) of anything zoo.from_pretrained loads (a run, adapter or Hugging Face
    folder, a GGUF file); the template `template_name` names (a built-in name or a path), else the model's own or
    its base's, else ChatML."""
    import zoo
    from train.data import DataError
    from train.data.conversations import ChatTemplate, choose_template, tokenizer_and_template
    from train.step import resolve_device
    if template_name == "none":
        raise DataError("--template none: a chat needs a template (chatml, a template file or folder)")
    tok, template = tokenizer_and_template(path, tokenizer)
    template = choose_template(template_name, template)
    model = zoo.from_pretrained(path, dtype=getattr(torch, dtype), device=resolve_device(device))
    if getattr(model, "family", None) not in ("llm", "vlm"):
        raise DataError(f"{path}: not an LLM or a vision-language model")
    vocab = (model.llm if model.family == "vlm" else model).config.vocab_size
    if tok.vocab_size > vocab:
        raise DataError(f"{tokenizer or path}: the tokenizer's {tok.vocab_size} ids exceed the model's vocab_size={vocab}")
    return model.eval(), tok, template or ChatTemplate.builtin("chatml")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python train/chat.py", description=__doc__.split("\n\n")[0])
    p.add_argument("dir", help="a run folder, a Hugging Face folder, or anything zoo.from_pretrained loads")
    p.add_argument("--prompt", help="answer this one message and exit")
    p.add_argument("--system", help="a system message opening the conversation")
    p.add_argument("--max-new-tokens", type=int, default=256, help="the longest answer, in tokens")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="sample among the smallest set reaching probability p")
    p.add_argument("--seed", type=int, default=None, help="seed of the sampling")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="the weights' dtype")
    p.add_argument("--tokenizer", help="a tokenizer file or 'bytes' (default: the model's own, else its base's)")
    p.add_argument("--image", help="an image file the first message is about (a vision-language model)")
    p.add_argument("--template", help="chatml, a template file or folder (default: the model's own, else chatml)")
    args = p.parse_args(argv)
    from zoo.config import ConfigError
    from train.data import DataError
    try:
        model, tokenizer, template = load(args.dir, args.device, args.dtype, args.tokenizer, args.template)
        images = None
        if args.image is not None:
            if getattr(model, "family", None) != "vlm":
                raise DataError(f"--image: {args.dir} is not a vision-language model")
            pixels, text = processed_image(image_processor(model, args.dir), args.image)
            images = (pixels.to(next(model.parameters()).device), [text])
        chat = ChatSession(model, tokenizer, template, args.system, args.max_new_tokens, args.temperature,
                           args.top_k, args.top_p, args.seed, images)
    except (ConfigError, DataError, ValueError, FileNotFoundError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    show = lambda piece: print(piece, end="", flush=True)
    if args.prompt is not None:
        try:
            chat.reply(args.prompt, show)
        except ValueError as e:  # longer than the model's context
            print(f"error: {e}", file=sys.stderr)
            return 2
        print()
        return 0
    tty = sys.stdin.isatty()
    print(f"chat with {args.dir} (template: {template.name}); /reset starts over, /exit quits", file=sys.stderr)
    while True:
        if tty:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() == "/exit":
            return 0
        if line.strip() == "/reset":
            chat.reset()
        elif line.strip():
            try:
                chat.reply(line.rstrip("\n"), show)
            except ValueError as e:
                print(f"\n{e}", file=sys.stderr)
            print(flush=True)


if __name__ == "__main__":
    sys.exit(main())
