"""Chat templates and conversation rows (train/data/conversations.py).

Reference: transformers' `apply_chat_template` on tokenizers built here (a byte-level BPE trained
on a few sentences, with each model family's special tokens added) and the real templates of
Llama 3 Instruct, Qwen2.5 Instruct, SmolLM2 Instruct and Zephyr (the Jinja strings below are
copied from their tokenizer_config.json files: test data). Parity is exact: the same text, the
same token ids, the same assistant masks where the template has {% generation %} markers.
"""
import json

import pytest

from train.data import DataError, HFTokenizer
from train.data.conversations import (ChatTemplate, find_template, read_conversations, row_messages,
                                      token_offsets)

import transformers

LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' "
          "+ message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 "
          "== 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if "
          "add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
SMOLLM2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
           "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
           "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
           "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
ZEPHYR = ("{% for message in messages %}\n{% if message['role'] == 'user' %}\n{{ '<|user|>\n' + message['content'] + "
          "eos_token }}\n{% elif message['role'] == 'system' %}\n{{ '<|system|>\n' + message['content'] + eos_token }}\n"
          "{% elif message['role'] == 'assistant' %}\n{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n"
          "{% endif %}\n{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n{% endfor %}")
# Llama 3's template with its assistant content and end of turn marked (the form TRL documents)
LLAMA3_MARKED = ("{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
                 "'<|end_header_id|>\n\n' }}{% if message['role'] == 'assistant' %}{% generation %}"
                 "{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}{% else %}"
                 "{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
                 "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

STYLES = {  # template, its special tokens, the end-of-turn text of an assistant message
    "llama3": (LLAMA3, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}, "<|eot_id|>"),
    "qwen2.5": (QWEN25, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, "<|im_end|>"),
    "smollm2": (SMOLLM2, {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}, "<|im_end|>"),
    "zephyr": (ZEPHYR, {"eos_token": "</s>", "unk_token": "<unk>"}, "</s>"),
    "llama3-marked": (LLAMA3_MARKED, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}, "<|eot_id|>"),
}
SPECIAL = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|im_start|>",
           "<|im_end|>", "<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>", "</s>", "<unk>"]
CONVERSATIONS = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi, my name is Ada."},
     {"role": "assistant", "content": "Nice to meet you, Ada!"}, {"role": "user", "content": "What is my name?"},
     {"role": "assistant", "content": "Your name is Ada."}],
    [{"role": "user", "content": "Is 417 even or odd?"}, {"role": "assistant", "content": "417 is odd."},
     {"role": "user", "content": "And 12 ?"}, {"role": "assistant", "content": "12 is even. Ünïcode: 日本"}],
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """One Hugging Face tokenizer folder per style: tokenizer.json (a byte-level BPE trained here)
    and tokenizer_config.json with the template and special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [m["content"] for c in CONVERSATIONS for m in c] * 20 + ["You are a helpful AI assistant named SmolLM."]
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    out = {}
    for name, (template, special, _) in STYLES.items():
        folder = tmp_path_factory.mktemp(name)
        tok.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template, **special}))
        out[name] = folder
    return out


def zoo_side(folder):
    return ChatTemplate.from_pretrained(folder), HFTokenizer(folder / "tokenizer.json")


@pytest.mark.parametrize("style", list(STYLES))
def test_text_and_ids_equal_transformers(folders, style):
    hf = transformers.AutoTokenizer.from_pretrained(folders[style])
    template, tok = zoo_side(folders[style])
    for conv in CONVERSATIONS + [c[1:] for c in CONVERSATIONS[:1]]:  # with and without a system message
        for messages, gen in ((conv, False), (conv[:-1], True)):
            assert template.render(messages, gen) == hf.apply_chat_template(messages, tokenize=False,
                                                                           add_generation_prompt=gen)
            ids = (token_offsets(tok, template.render(messages, True))[0] if gen
                   else template.encode(tok, messages)[0])
            assert ids == hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen,
                                                 return_dict=True)["input_ids"]


@pytest.mark.parametrize("style", list(STYLES))
def test_trained_tokens_are_the_assistant_messages_and_their_end_of_turn(folders, style):
    template, tok = zoo_side(folders[style])
    eot = STYLES[style][2]
    assert template.end_of_turn == eot
    for conv in CONVERSATIONS:
        ids, labels = template.encode(tok, conv)
        runs, current = [], []
        for t, lab in zip(ids, labels):
            if lab != -100:
                assert lab == t
                current.append(t)
            elif current:
                runs.append(current)
                current = []
        runs += [current] if current else []
        want = [m["content"].strip() + eot for m in conv if m["role"] == "assistant"]
        assert [tok.decode(r) for r in runs] == want
        assert template.encode(tok, conv, train_on_prompt=True)[1] == ids


@pytest.mark.parametrize("style", ["llama3-marked", "chatml"])
def test_generation_markers_give_transformers_masks_and_agree_with_prefix_rendering(folders, style, tmp_path):
    folder = folders["llama3-marked"]
    if style == "chatml":  # the built-in template, with markers, on the Qwen-style tokenizer
        folder = tmp_path
        (folder / "tokenizer.json").write_bytes((folders["qwen2.5"] / "tokenizer.json").read_bytes())
        (folder / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", **ChatTemplate.builtin("chatml").to_config(),
            "eos_token": "<|im_end|>"}))
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    template, tok = zoo_side(folder)
    assert template.has_generation_marks
    for conv in CONVERSATIONS:
        ids, labels = template.encode(tok, conv)
        want = hf.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert ids == want["input_ids"]
        assert [int(lab != -100) for lab in labels] == want["assistant_masks"]
        assert 0 < sum(want["assistant_masks"]) < len(ids)
        marked = template.assistant_spans(conv)
        template.has_generation_marks = False  # the same conversation found prefix by prefix
        try:
            assert template.assistant_spans(conv) == marked
        finally:
            template.has_generation_marks = True


def test_a_template_that_rewrites_earlier_turns_cannot_mark_the_assistant(folders):
    # the last assistant message is rendered apart from the others: no prefix holds the earlier ones
    t = ChatTemplate("{% for m in messages %}{{ m['role'] }}{{ '*' if loop.last else '' }}: {{ m['content'] }}\n"
                     "{% endfor %}", name="odd")
    _, tok = zoo_side(folders["llama3"])
    with pytest.raises(DataError, match=r"^odd: cannot mark the assistant's part") as e:
        t.encode(tok, CONVERSATIONS[0])
    assert "\n" not in str(e.value)


def test_template_sources(folders, tmp_path):
    assert find_template(tmp_path) is None
    (tmp_path / "chat_template.jinja").write_text(SMOLLM2)
    assert find_template(tmp_path).render(CONVERSATIONS[0]) == ChatTemplate(SMOLLM2).render(CONVERSATIONS[0])
    with pytest.raises(DataError, match="not a valid Jinja chat template"):
        ChatTemplate("{% for m in messages %}", name="broken")
    with pytest.raises(DataError, match="TemplateError: only user"):
        ChatTemplate("{{ raise_exception('only user') }}").render([])
    import gguf
    path = tmp_path / "model.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_chat_template(ZEPHYR)
    w.add_token_list(["<unk>", "<s>", "</s>", "a"])
    w.add_eos_token_id(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    t = ChatTemplate.from_pretrained(path)
    assert t.special_tokens["eos_token"] == "</s>" and t.end_of_turn == "</s>"


def test_rows_of_each_format_and_malformed_rows(tmp_path):
    want = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Add 2 and 3"},
            {"role": "assistant", "content": "5"}]
    assert row_messages({"messages": want}, "messages") == want
    assert row_messages({"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Add 2 "
                         "and 3"}, {"from": "gpt", "value": "5"}]}, "messages") == want
    assert row_messages({"system": "Be brief.", "prompt": "Add 2 and 3", "completion": "5"}, "prompt_completion") == want
    assert row_messages({"prompt": want[:2], "completion": want[2:]}, "prompt_completion") == want
    assert row_messages({"system": "Be brief.", "instruction": "Add", "input": "2 and 3", "output": "5"},
                        "alpaca")[1:] == [{"role": "user", "content": "Add\n\n2 and 3"}, want[2]]
    f = tmp_path / "rows.jsonl"
    f.write_text("\n".join([json.dumps({"messages": want}), "{not json", json.dumps({"messages": want[:2]}), "",
                            json.dumps({"messages": [{"role": "robot", "content": "x"}]}), json.dumps({"messages": want})]))
    logged = []
    rows = read_conversations(str(f), "messages", logged.append)
    assert [r[1][1] for r in rows] == [1, 6] and rows[0][0] == want
    assert len(logged) == 1 and f"{f}: 3 malformed rows skipped" in logged[0] and "lines 2, 3, 5;" in logged[0]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(DataError, match=rf"^{bad}: no usable conversation for data.format=prompt_completion; "
                                        rf"{bad}: line 1: 'completion' is not a string$"):
        read_conversations(str(bad), "prompt_completion", logged.append)


def test_offsets_of_every_tokenizer_cover_the_text():
    from train.data import ByteTokenizer
    text = "<|im_start|>user\nÜber 日本<|im_end|>\n"
    ids, offsets = token_offsets(ByteTokenizer(), text)
    assert ids == list(text.encode()) and offsets[0] == (0, 1) and offsets[-1] == (len(text) - 1, len(text))
    assert {o for o in offsets if o[0] == text.index("日")} == {(text.index("日"), text.index("日") + 1)}
