"""What an architecture record holds, and the names of the ideas records speak of.

A record (one per Hugging Face decoder class, zoo/archs/*.py) says what makes the class what it is: its config.json
keys and transformers' defaults for them, its tensor names where they are not the common ones, the tensors stored in
another layout than Zoo's (RoPE pairs interleaved, Gemma's 1 + w norms, GPT-OSS's experts), which Zoo ideas
(`features`) a model needs and may have to be held by it, and its GGUF name. The base class is what most classes
share; a record overrides the rest. zoo/weights/hf_llm.py and gguf_llm.py read records, docs/pretrained.md's table is
made from them, tests/test_hf_arch.py tests them.
"""
from __future__ import annotations

from typing import Optional

from ..config import RECURRENT_TYPES, LLMConfig

ROPES = frozenset({"rope_linear", "rope_llama3", "rope_yarn"})
FEATURES = {  # the ideas records speak of -> the model keys that give them (docs/pretrained.md; refusals)
    "attn_bias": "qkv_bias and attn_out_bias", "qkv_bias": "qkv_bias", "out_bias": "attn_out_bias",
    "window": "sliding_window on every layer", "pattern": "sliding_window with attn_pattern (local and global layers)",
    "qk_norm": "qk_norm: head", "qk_norm_proj": "qk_norm: proj", "post_norm": "norm_placement: post",
    "sandwich_norm": "norm_placement: sandwich", "layer_norm": "norm_type: layer", "parallel": "parallel_block",
    "gelu_tanh": "mlp_act: gelu_tanh", "embed_scale": "embed_scale", "query_scalar": "query_pre_attn_scalar",
    "attn_softcap": "attn_softcap", "final_softcap": "final_softcap", "logit_scale": "logit_scale",
    "rope_local": "rope_theta_local", "nope": "nope_layers", "partial_rotary": "rotary_fraction < 1",
    "rope_linear": "rope_scaling.type: linear", "rope_llama3": "rope_scaling.type: llama3",
    "rope_yarn": "rope_scaling.type: yarn", "rope_longrope": "rope_scaling.type: longrope",
    "query_temperature": "rope_scaling.query_beta", "sinks": "attn_sinks", "mla": "mla", "mod": "mod_capacity",
    "moe": "moe", "moe_shared": "moe.n_shared", "moe_shared_gate": "moe.shared_gate",
    "moe_dense_layers": "moe.dense_layers or moe.sparse_every", "moe_topk_raw": "moe.norm_topk_prob: false",
    "moe_bias": "moe.bias", "clamped_swiglu": "moe.swiglu_limit", "sigmoid": "moe.scoring: sigmoid",
    "moe_groups": "moe.n_groups or moe.routed_scale", "router_norm": "moe.router_norm",
    "branch_norms": "moe.branch_norms", "attn_gate": "attn_gate",
    "linear_attention": "layer_types: linear_attention", "conv": "layer_types: conv", "mamba": "layer_types: mamba",
    "embed_multiplier": "embed_multiplier", "residual_multiplier": "residual_multiplier",
    "rope_proportional": "rope_scaling.type: proportional", "v_norm": "v_norm", "layer_scalar": "layer_scalar",
    "global_heads": "global_head_dim or global_n_kv_heads", "kv_same": "global_kv_same",
    "kv_shared": "kv_shared_layers", "kv_shared_wide": "kv_shared_ffn_hidden", "per_layer": "per_layer_dim",
    "sparse_attention": "mla.index_heads", "shared_index": "mla.index_shared"}
PRE = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}  # Zoo norm -> HF norm of a layer


def features(cfg: LLMConfig) -> set:
    """The Zoo ideas `cfg` uses, by their names in `FEATURES` (what a record `needs` and `may` have)."""
    m = cfg.moe
    bias = {(True, True): "attn_bias", (True, False): "qkv_bias", (False, True): "out_bias"}.get(
        (cfg.qkv_bias, cfg.attn_out_bias))
    window = None if cfg.sliding_window is None else "pattern" if "global" in cfg.attn_pattern else "window"
    named = {bias, window, cfg.rope_scaling and "rope_" + cfg.rope_scaling.type,
             {"head": "qk_norm", True: "qk_norm", "proj": "qk_norm_proj"}.get(cfg.qk_norm),
             {"post": "post_norm", "sandwich": "sandwich_norm"}.get(cfg.norm_placement),
             {"gelu_tanh": "gelu_tanh"}.get(cfg.mlp_act), {"layer": "layer_norm"}.get(cfg.norm_type)}
    flags = {"embed_scale": cfg.embed_scale, "query_scalar": cfg.query_pre_attn_scalar,
             "attn_softcap": cfg.attn_softcap, "final_softcap": cfg.final_softcap, "rope_local": cfg.rope_theta_local,
             "nope": cfg.nope_layers, "partial_rotary": cfg.rotary_fraction < 1, "sinks": cfg.attn_sinks,
             "mod": cfg.mod_capacity > 0, "mla": cfg.mla, "parallel": cfg.parallel_block,
             "logit_scale": cfg.logit_scale != 1.0, "query_temperature": cfg.rope_scaling and cfg.rope_scaling.query_beta,
             "moe": m, "moe_shared": m and m.n_shared, "moe_shared_gate": m and m.shared_gate,
             "moe_dense_layers": m and (m.dense_layers or m.sparse_every > 1), "moe_topk_raw": m and not m.norm_topk_prob,
             "moe_bias": m and m.bias, "clamped_swiglu": m and m.swiglu_limit, "sigmoid": m and m.scoring == "sigmoid",
             "moe_groups": m and (m.n_groups > 1 or m.routed_scale != 1), "router_norm": m and m.router_norm,
             "branch_norms": m and m.branch_norms, "attn_gate": cfg.attn_gate,
             "embed_multiplier": cfg.embed_multiplier != 1, "residual_multiplier": cfg.residual_multiplier != 1,
             "v_norm": cfg.v_norm, "layer_scalar": cfg.layer_scalar, "global_heads": cfg.global_head_dim or
             cfg.global_n_kv_heads, "kv_same": cfg.global_kv_same, "kv_shared": cfg.kv_shared_layers,
             "kv_shared_wide": cfg.kv_shared_ffn_hidden, "per_layer": cfg.per_layer_dim,
             "sparse_attention": cfg.mla and cfg.mla.index_heads, "shared_index": cfg.mla and cfg.mla.index_shared}
    recurrent = {cfg.layer_type(i) for i in range(cfg.n_layers)} & RECURRENT_TYPES
    return (named | recurrent | {k for k, v in flags.items() if v}) - {None}


def no_attention(cfg: LLMConfig) -> str:
    """`Record.refuses` of the hybrid classes whose transformers cache reads the sequence length from an attention
    layer: a model of recurrent layers only runs there in no forward that keeps a cache (generate included)."""
    if all(cfg.layer_type(i) in RECURRENT_TYPES for i in range(cfg.n_layers)):
        return "no attention layer (transformers' cache of this class takes its length from one)"
    return ""


def attention_bias(get) -> dict:
    """qkv_bias and attn_out_bias from config.json's one `attention_bias` (on q, k, v and o)."""
    return dict.fromkeys(("qkv_bias", "attn_out_bias"), bool(get("attention_bias")))


def stacked(cfg: LLMConfig, gate_up: str, down: str) -> tuple:
    """`Record.experts`' 'stacked' entry of a file that stacks the experts as Zoo does: gate_up (E, 2F, d), gate rows
    first, and down (E, d, F)."""
    E, d, F = cfg.moe.n_experts, cfg.d_model, cfg.resolved_expert_hidden
    return (gate_up, (E, 2 * F, d)), (down, (E, d, F))


def interleaved(heads: int, head_dim: int, start: int, width: int) -> list:
    """The row order that turns a checkpoint's RoPE channels in interleaved pairs (x0, x1), (x2, x3), ...
    into Zoo's halves (x0, x2, ...), (x1, x3, ...): rows [start, start + width) of each of `heads` heads of
    `head_dim` rows; zoo_rows = file_rows[order]."""
    rope = list(range(start, start + width, 2)) + list(range(start + 1, start + width, 2))
    one = list(range(start)) + rope + list(range(start + width, head_dim))
    return [h * head_dim + r for h in range(heads) for r in one]


class Record:
    hf_class = ""                          # "LlamaForCausalLM"
    model_type = ""                        # config.json's model_type
    needs: frozenset = frozenset()         # the `features` a model must have to be held by this class
    may: frozenset = ROPES                 # those it may have besides
    defaults: dict = {}                    # transformers' values of config.json keys a file may leave out
    window = None                          # which layers a sliding_window applies to: "every" (all), "qwen"
                                           # (use_sliding_window, max_window_layers, layer_types), "types"
                                           # (layer_types, else every `period`-th layer global), None (none)
    period = 0
    act = "silu"                           # hidden_act when config.json has none
    tie = False                            # tie_word_embeddings when config.json has none
    norms = PRE                            # Zoo norm -> the layer's norm in the file, by norm_placement's need
    fused = ()                             # projections the file keeps fused: "qkv_proj", "gate_up_proj"
    norm_offset = 0.0                      # what Zoo's norm gains hold beyond the file's (Gemma's 1 + w: 1)
    renames: dict = {}                     # the common tensor names' parts -> this class's ("self_attn.o_proj": ...)
    mixers: dict = {}                      # recurrent layer type -> its module in a file's layer ("conv": "conv");
                                           # a class with mixers reads and writes config.json's layer_types
    types: dict = {}                       # its layer_types' names that are not Zoo's -> Zoo's ("attention": ...)
    wrapper: Optional[tuple] = None        # (model_type, tensor prefix) of a multimodal class's folder holding this
                                           # class's model as its text_config
    old_rope = True                        # config.json also gets 4.x's rope_theta and rope_scaling (a class
                                           # transformers 4 lacks: False)
    gguf: Optional[str] = None             # llama.cpp's architecture name, when Zoo reads GGUF files of it
    gguf_writes = False                    # and writes them
    gguf_interleaved = False               # llama.cpp interleaves the RoPE pairs of its q/k rows (Llama)
    gguf_renames: dict = {}                # tensor names' parts llama.cpp's converter renames before mapping them
    gguf_fused: Optional[tuple] = None     # the projections GGUF files keep fused (None: `fused`)

    def renamed(self, name: str, renames: Optional[dict] = None) -> str:
        """A tensor's or module's common name with the parts this class names otherwise replaced (`renames`, or
        those given)."""
        for old, new in (self.renames if renames is None else renames).items():
            name = name.replace(old, new)
        return name

    def config(self, hf: dict, get, n_layers: int) -> dict:
        """The LLMConfig fields of this class's own config.json keys (get(key): the file's or the default)."""
        return {}

    def default_local(self, hf: dict, get, n_layers: int) -> list:
        """Which layers are local when a window applies and the file names no layer_types ("qwen", "types"):
        all but every `sliding_window_pattern`-th (default `period`; 0: all)."""
        period = get("sliding_window_pattern") or self.period
        return [bool((i + 1) % period) for i in range(n_layers)] if period else [True] * n_layers

    def to_hf(self, cfg: LLMConfig) -> dict:
        """This class's own config.json keys for `cfg`."""
        return {}

    def refuses(self, cfg: LLMConfig) -> str:
        """Why this class cannot hold `cfg` although it has the features ('' when it can)."""
        return ""

    def rope_rows(self, cfg: LLMConfig, hf: Optional[dict] = None) -> dict:
        """File tensor suffix ('self_attn.q_proj') -> its row order (`interleaved`) where the file keeps RoPE
        channels in interleaved pairs; {} when it keeps halves, as Zoo does. hf: the config.json read (None: writing)."""
        return {}

    def experts(self, cfg: LLMConfig, h: str) -> dict:
        """A sparse layer's names in the file (h: 'model.layers.i.'): 'router'; the experts either 'per_expert'
        (a prefix with {e}, the gate, up and down names) or 'stacked' ((name, shape) of the gate/up and down
        tensors; their biases: name + '_bias'); 'shared' (the shared experts' prefix), 'shared_gate',
        'score_bias' (a routing bias); 'router_scale', 'expert_scale' (router_norm); 'norms' (branch_norms: the norms
        before and after the shared experts, then the routed ones)."""
        return {"router": h + "mlp.gate", "per_expert": (h + "mlp.experts.{e}.", "gate_proj", "up_proj", "down_proj"),
                "shared": h + "mlp.shared_expert.", "shared_gate": h + "mlp.shared_expert_gate"}

    def split_rows(self, cfg: LLMConfig) -> dict:
        """A layer's tensor in the common naming ('linear_attn.in_proj_z.weight') -> (the file tensor holding it,
        its rows there in Zoo's order), for file tensors split across Zoo tensors on load and joined on save."""
        return {}

    def layout(self, state: dict, cfg: LLMConfig, to_file: bool) -> dict:
        """Tensors the file stores in another layout than Zoo's (Zoo names), turned either way."""
        return state

    def gguf_config(self, get, tensors: dict) -> dict:
        """config.json keys from this class's GGUF metadata beyond the common ones (get(key): '{arch}.key'; a key given
        None: the class's default)."""
        return {}

    def gguf_metadata(self, cfg: LLMConfig) -> dict:
        """This class's GGUF metadata beyond (or instead of) the common keys: GGUFWriter.add_<key> -> value (None: the
        key not written)."""
        return {}

    def gguf_layout(self, cfg: LLMConfig) -> dict:
        """A layer tensor's name in the common naming ('mamba.D') -> (its shape in a GGUF file or None, its rows'
        order or None, its columns' order or None; zoo = file[order]) where llama.cpp's converter reshapes or reorders
        it beyond what every architecture gets (a Conv1d weight squeezed to 2-D, A_log stored as -exp(A_log))."""
        return {}

    def gguf_split_rows(self, cfg: LLMConfig, found=()) -> dict:
        """`split_rows` for the tensors llama.cpp's converter keeps fused (found: the names of a file being read)."""
        return self.split_rows(cfg)

    def gguf_refuses(self, cfg: LLMConfig) -> str:
        """What of `cfg` llama.cpp's architecture would not read back ('' when nothing)."""
        return "q/k/v/o biases" if cfg.attn_out_bias else ""
