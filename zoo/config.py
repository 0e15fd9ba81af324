"""Typed configs: one dataclass per model family, YAML files, `key=value` overrides, validation.

Every config error is a one-line `ConfigError` naming the file and the key. The dataclasses are the
single source of defaults; a field's range is declared on it (`bounded(8, gt=0)`) and checked by
`check_bounds`; `validate()` holds the rules across fields. A field's trailing `# comment` is its
documentation (train/docs.py renders the key tables of docs/).
"""
from __future__ import annotations

import dataclasses
import math
import operator
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Optional, Union

import yaml


class ConfigError(ValueError):
    """A bad config: the message is one line naming the source and the key."""


def fail(source: str, key: str, msg: str) -> ConfigError:
    """ConfigError "<source>: <key> <msg>" (no space before a msg that starts with '=')."""
    return ConfigError(f"{source}: {key}{'' if msg.startswith('=') else ' '}{msg}")


# ---------- generic machinery: dict -> dataclass with type checks, YAML loading, overrides

_SCI_NUMBER = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin in (list, tuple):
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp, key: str, source: str):
    """Check `value` against the annotation `tp`; return it (ints widened to float)."""
    origin = typing.get_origin(tp)
    bad = fail(source, key, f"must be {_type_name(tp)}, got {value!r}")
    if tp is Any:
        return value
    if origin is Literal:
        if any(value == a and type(value) is type(a) for a in typing.get_args(tp)):
            return value
        raise bad
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in [a for a in args if a is not type(None)]:
            try:
                return _coerce(value, a, key, source)
            except ConfigError as e:
                errors.append(e)
        if len(errors) == 1:
            raise errors[0]
        raise bad
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise bad
        return from_dict(tp, value, source, prefix=key + ".")
    if tp in (bool, str):
        if isinstance(value, tp):
            return value
        raise bad
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if not -2**63 <= value < 2**63:
                raise fail(source, key, f"must fit in 64 bits, got {value}")
            return value
        if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
            return int(value)
        raise bad
    if tp is float:
        if isinstance(value, str) and _SCI_NUMBER.match(value.strip()):
            value = float(value)  # YAML 1.1 reads 3e-4 (no dot) as a string
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(float(value)):
                raise fail(source, key, f"must be a finite number, got {value!r}")
            return float(value)
        raise bad
    if origin in (list, tuple) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise bad
        args = typing.get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:  # tuple[float, float]: a fixed length
            if len(value) != len(args):
                raise fail(source, key, f"must be a list of {len(args)} values, got {value!r}")
            return tuple(_coerce(v, a, f"{key}[{i}]", source) for i, (v, a) in enumerate(zip(value, args)))
        inner = args[0] if args else Any
        out = [_coerce(v, inner, f"{key}[{i}]", source) for i, v in enumerate(value)]
        return tuple(out) if (origin is tuple or tp is tuple) else out
    if (origin is dict or tp is dict) and isinstance(value, dict):
        return value
    raise bad


def from_dict(cls, data: dict, source: str = "<config>", prefix: str = ""):
    """Build dataclass `cls` from a mapping: unknown keys and wrong types are one-line errors."""
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: {prefix.rstrip('.') or 'config'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    kwargs = {}
    moved = getattr(cls, "moved", {})
    for k, v in data.items():
        if k in moved:
            raise ConfigError(f"{source}: {prefix + str(k)} moved to {moved[k]}")
        if k not in names:
            raise ConfigError(f"{source}: unknown key {prefix + str(k)!r}{did_you_mean(str(k), names, prefix)} "
                              f"(known: {', '.join(names)})")
        kwargs[k] = _coerce(v, hints[k], prefix + k, source)
    obj = cls(**kwargs)
    check(obj, source, prefix)
    return obj


def without_moved(cls, data: dict) -> dict:
    """`data` less the keys that moved out of dataclass `cls` and its nested configs (what older folders hold)."""
    sub = {k: next((a for a in (tp, *typing.get_args(tp)) if dataclasses.is_dataclass(a)), None)
           for k, tp in typing.get_type_hints(cls).items()}
    return {k: without_moved(sub[k], v) if isinstance(v, dict) and sub.get(k) else v
            for k, v in data.items() if k not in getattr(cls, "moved", {})}


def did_you_mean(key: str, names, prefix: str = "") -> str:
    """'; did you mean X?' naming the closest of `names` to a misspelled `key`, or ''."""
    import difflib
    close = difflib.get_close_matches(key, list(names), n=1, cutoff=0.6)
    return f"; did you mean {prefix + close[0]!r}?" if close else ""


def bounded(default=dataclasses.MISSING, *, gt=None, ge=None, lt=None, le=None,
            default_factory=dataclasses.MISSING):
    """A dataclass field whose numeric value must satisfy the bounds given (gt: >, ge: >=, lt: <,
    le: <=); `check` tests them for every config, a null value passes. E.g. `n_layers: int = bounded(8, gt=0)`."""
    bounds = {k: v for k, v in (("gt", gt), ("ge", ge), ("lt", lt), ("le", le)) if v is not None}
    return field(default=default, default_factory=default_factory, metadata={"bounds": bounds})


def _num(x) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def describe_bounds(bounds: dict) -> str:
    """{'ge': 0, 'lt': 1} -> 'in [0, 1)'; {'gt': 0} -> '> 0'; {} -> ''."""
    lo = ("[", ">=", bounds["ge"]) if "ge" in bounds else ("(", ">", bounds["gt"]) if "gt" in bounds else None
    hi = ("]", "<=", bounds["le"]) if "le" in bounds else (")", "<", bounds["lt"]) if "lt" in bounds else None
    if lo and hi:
        return f"in {lo[0]}{_num(lo[2])}, {_num(hi[2])}{hi[0]}"
    end = lo or hi
    return f"{end[1]} {_num(end[2])}" if end else ""


_BOUNDS = {"gt": operator.gt, "ge": operator.ge, "lt": operator.lt, "le": operator.le}


def check_bounds(obj, source: str = "<config>", prefix: str = ""):
    """The declared bounds (`bounded`) of every field of dataclass `obj`, nested configs included:
    the first value outside them is a one-line ConfigError, e.g. "<source>: model.n_layers must be > 0, got 0"."""
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            check_bounds(v, source, f"{prefix}{f.name}.")
            continue
        bounds = f.metadata.get("bounds")
        if not bounds or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue  # null, or a non-number a Union allows ('auto')
        if not all(_BOUNDS[k](v, b) for k, b in bounds.items()):
            null = " or null" if type(None) in typing.get_args(typing.get_type_hints(type(obj))[f.name]) else ""
            raise fail(source, prefix + f.name, f"must be {describe_bounds(bounds)}{null}, got {v}")


def first_broken(source: str, prefix: str, rules):
    """Raise the first broken rule of `rules`, (broken, key, message) triples, as fail(source, prefix + key, message);
    a generator of them reads each rule once the rules before it hold (validate() writes its rules so)."""
    for broken, key, msg in rules:
        if broken:
            raise fail(source, prefix + key, msg)


def check(obj, source: str = "<config>", prefix: str = ""):
    """Check a config dataclass: its declared field bounds, then its validate() (the rules across
    fields that bounds cannot declare). from_dict calls it; so do the models on their config."""
    check_bounds(obj, source, prefix)
    if hasattr(obj, "validate"):
        obj.validate(source, prefix)


def to_dict(obj):
    """Dataclass -> plain nested dict (tuples become lists, so it round-trips through YAML/JSON)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(x) for x in obj]
    if isinstance(obj, dict):
        return {k: to_dict(x) for k, x in obj.items()}
    return obj


class ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's numbers: a plain scalar with a colon (`2:4`, an N:M
    pruning pattern) stays a string instead of YAML 1.1's base-60 number (124)."""

    def resolve(self, kind, value, implicit):
        tag = super().resolve(kind, value, implicit)
        if kind is yaml.ScalarNode and implicit[0] and ":" in value and tag.endswith((":int", ":float")):
            return "tag:yaml.org,2002:str"
        return tag


def load_yaml(path) -> dict:
    """Read a YAML mapping; a missing file, bad YAML or a non-mapping is a one-line error."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        data = yaml.load(p.read_text(), Loader=ConfigLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}: invalid YAML{where}: {getattr(e, 'problem', e)}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a UTF-8 text file") from None
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys, got {type(data).__name__}")
    return data


def parse_overrides(items, source: str = "command line") -> dict:
    """['train.lr=3e-4', 'model.n_layers=2'] -> nested dict. Values are parsed as YAML scalars."""
    out: dict = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"{source}: override '{item}' must look like key=value (e.g. train.max_steps=100)")
        key, _, raw = item.partition("=")
        key = key.strip()
        if not key or any(not part for part in key.split(".")):
            raise ConfigError(f"{source}: override '{item}' has an empty key")
        try:
            value = yaml.load(raw, Loader=ConfigLoader) if raw.strip() != "" else None
        except yaml.YAMLError:
            value = raw
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"{source}: override '{item}' conflicts with '{part}={nxt!r}'")
            node = nxt
        node[parts[-1]] = value
    return out


def deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


# the keys of how a model runs that moved from a model config to the run config's train: section
CHECKPOINTING_MOVED = {"activation_checkpointing": "train.activation_checkpointing",
                       "checkpoint_every": "train.activation_checkpointing_every"}


# ----------------------------------------------------------------------------- LLM family

@dataclass
class RopeScaling:
    """RoPE frequency scaling: 'linear' (position interpolation), 'llama3' (Llama 3.1), 'yarn' (YaRN), 'longrope'
    (Phi-3) or 'proportional' (Gemma 4); zoo/blocks/rope.py."""
    type: Literal["linear", "llama3", "yarn", "longrope", "proportional"] = "linear"
    factor: float = bounded(1.0, gt=0)
    low_freq_factor: float = 1.0            # llama3 only
    high_freq_factor: float = 4.0           # llama3 only
    original_max_position_embeddings: int = bounded(8192, gt=0)  # llama3, yarn, longrope: the pretraining context
    beta_fast: float = bounded(32.0, gt=0)  # yarn: channels turning more often than this keep their frequency
    beta_slow: float = bounded(1.0, gt=0)   # yarn: channels turning less often than this are interpolated
    truncate: bool = True                   # yarn: round the ramp's ends to whole channels
    attention_factor: Optional[float] = bounded(None, gt=0)  # yarn, longrope: cos/sin scale; null = from `factor`
    mscale_all_dim: float = bounded(0.0, ge=0)  # yarn with multi-head latent attention (DeepSeek): scores times
                                            # (0.1 mscale_all_dim ln(factor) + 1)^2; 0 = off
    short_factor: list[float] = field(default_factory=list)  # longrope: per-channel divisors (head_dim / 2 values)
    long_factor: list[float] = field(default_factory=list)  # longrope: the same past `original_max_position_embeddings`
    rotated: float = bounded(1.0, gt=0, le=1)  # proportional: the share of a head's angles that turn, channel i paired
                                            # with i + head_dim / 2 at theta^(-2i / head_dim); the rest stay still
    query_beta: float = bounded(0.0, ge=0)  # queries times 1 + beta ln(1 + floor(position /
                                            # original_max_position_embeddings)) (Llama 4, Mistral 4: `llama_4_scaling_beta`;
                                            # multi-head latent attention only); 0 = off

    def validate(self, source, prefix=""):
        first_broken(source, prefix, [
            (self.type == "longrope" and (not self.short_factor or len(self.short_factor) != len(self.long_factor)),
             "short_factor", "and long_factor must be lists of head_dim / 2 numbers"),
            (self.type == "llama3" and not 0 < self.low_freq_factor < self.high_freq_factor, "high_freq_factor",
             f"must be > low_freq_factor > 0, got {self.high_freq_factor} and {self.low_freq_factor}")])


@dataclass
class MoEConfig:
    """Mixture-of-Experts feed-forward layers (zoo/blocks/moe.py). Sparse layers replace the
    MLP of a block by `n_experts` experts of width `expert_hidden` (gated by `mlp_act`), `top_k` per token."""
    n_experts: int = bounded(8, gt=0)       # experts per sparse layer
    top_k: int = bounded(2, gt=0)           # experts per token (<= `n_experts`)
    expert_hidden: Optional[int] = bounded(None, gt=0)  # each expert's SwiGLU width; null = `ffn_hidden`
    n_shared: int = bounded(0, ge=0)        # always-on shared experts, run as one SwiGLU of `n_shared * shared_hidden`
    shared_hidden: Optional[int] = bounded(None, gt=0)  # width of each shared expert; null = `expert_hidden`
    shared_gate: bool = False               # multiply the shared experts' output by sigmoid(x W), W of shape (1,
                                            # d_model) (Qwen2-MoE); needs `n_shared` > 0
    sparse_every: int = bounded(1, gt=0)    # layer i (from 0) is sparse when (i + 1) % sparse_every == 0 (Qwen's
                                            # `decoder_sparse_step`)
    dense_layers: list[int] = field(default_factory=list)  # layers kept dense, a SwiGLU of `ffn_hidden` (Qwen's
                                            # `mlp_only_layers`)
    scoring: Literal["softmax", "sigmoid"] = "softmax"  # router: `softmax` (Mixtral, Qwen) or `sigmoid` (DeepSeek-V3)
    norm_topk_prob: bool = True             # renormalise the chosen experts' weights to sum to 1
    balance: Literal["aux_loss", "bias", "none"] = "aux_loss"  # `aux_loss` (Switch Transformer loss, weight
                                            # `train.moe_aux_loss_coef`), `bias` (DeepSeek-V3's loss-free bias), `none`
    bias: bool = False                      # biases on the router and the experts (GPT-OSS)
    swiglu_limit: Optional[float] = bounded(None, gt=0)  # clamped SwiGLU experts (GPT-OSS): gate <= L, up in [-L,
                                            # L], gate * sigmoid(1.702 gate) * (up + 1); null = plain SwiGLU
    n_groups: int = bounded(1, gt=0)        # expert groups for group-limited routing (DeepSeek-V3); 1 = off
    topk_groups: int = bounded(1, gt=0)     # groups a token's experts may come from (<= `n_groups`)
    routed_scale: float = bounded(1.0, gt=0)  # the routed experts' weights are multiplied by it (DeepSeek-V3)
    router_norm: bool = False               # the router reads RMSNorm(x) times a learned gain and d_model^-1/2; the
                                            # chosen weights times a learned per-expert scale (Gemma 4)
    branch_norms: bool = False              # the shared experts and the routed ones each between norms of their own,
                                            # the router reading the block's input (Gemma 4); needs `n_shared` > 0
    moved: ClassVar[dict] = {k: f"train.moe_{k}" for k in ("aux_loss_coef", "z_loss_coef", "bias_update_rate",
                                                           "capacity_factor", "router_jitter", "dispatch")}

    def validate(self, source="<config>", prefix=""):
        p = prefix
        first_broken(source, p, [
            (self.top_k > self.n_experts, "top_k", f"={self.top_k} must be <= {p}n_experts={self.n_experts}"),
            (self.n_experts % self.n_groups or self.topk_groups > self.n_groups, "n_groups",
             f"={self.n_groups} must divide {p}n_experts={self.n_experts} and be >= {p}topk_groups={self.topk_groups}"),
            *((getattr(self, k) and not self.n_shared, k, f"needs {p}n_shared > 0") for k in ("shared_gate", "branch_norms"))])


@dataclass
class MLAConfig:
    """Multi-head latent attention (zoo/blocks/mla.py, DeepSeek-V2/V3) in place of grouped-query attention."""
    kv_rank: int = bounded(512, gt=0)       # width of the compressed key/value latent (what the KV cache holds)
    q_rank: Optional[int] = bounded(None, gt=0)  # width of the query bottleneck; null = a full-rank query projection
    rope_dim: int = bounded(64, gt=0)       # per-head channels with RoPE (the key part shared by all heads)
    nope_dim: int = bounded(128, gt=0)      # per-head query/key channels without RoPE
    v_dim: int = bounded(128, gt=0)         # per-head value width
    absorb: bool = False                    # decoding on the cache: kv_b folded into the query and the output, the
                                            # attention over the latents (same numbers; less work for a small kv_rank)
    index_heads: int = bounded(0, ge=0)     # DeepSeek-V3.2's lightning indexer: its heads (each query attends to the
                                            # `index_topk` keys it scores highest); 0 = every key (needs `q_rank`)
    index_dim: int = bounded(128, gt=0)     # the indexer's head width (its first `rope_dim` channels rotated)
    index_topk: int = bounded(2048, gt=0)   # the keys each query keeps
    index_shared: list[int] = field(default_factory=list)  # layers with no indexer that keep the keys the previous
                                            # indexer layer chose (GLM-5's "shared" indexer_types)


@dataclass
class RecurrentConfig:
    """The sizes of the recurrent layers `layer_types` names: Gated DeltaNet (`linear_attention`,
    zoo/blocks/gated_deltanet.py), Mamba-2 (`mamba`, mamba2.py), gated short convolutions (`conv`, short_conv.py)."""
    n_heads: int = bounded(16, gt=0)        # linear_attention: query/key heads; mamba: heads
    head_dim: int = bounded(128, gt=0)      # linear_attention: query/key head width; mamba: head width
    n_v_heads: Optional[int] = bounded(None, gt=0)  # linear_attention: value heads (a multiple of `n_heads`); null =
                                            # `n_heads`
    v_head_dim: Optional[int] = bounded(None, gt=0)  # linear_attention: value head width; null = `head_dim`
    state_size: int = bounded(128, gt=0)    # mamba: the state's width per group (B and C)
    n_groups: int = bounded(1, gt=0)        # mamba: groups of heads sharing B and C (divides `n_heads`)
    conv_kernel: int = bounded(4, gt=1)     # width of the causal depthwise convolution
    conv_bias: bool = False                 # mamba: a bias on the convolution; conv: on it and both projections
    bias: bool = False                      # mamba: biases on in_proj and out_proj
    chunk: int = bounded(64, gt=0)          # tokens per chunk of the chunked scan (training, prefill)
    dt_min: float = bounded(0.0, ge=0)      # mamba: the least step size, clamped after its softplus (Granite's
                                            # time_step_limit[0])
    dt_max: Optional[float] = bounded(None, gt=0)  # mamba: the largest step size; null: no limit (time_step_limit[1])


DEPTH_ASPECT_RATIO, DEPTH_HEAD_DIM = 64, 128  # model.depth: d_model per layer, and the head size it is rounded to


def depth_shape(depth: int, head_dim: Optional[int] = None) -> dict:
    """model.depth's shape (nanochat's rule): n_layers = depth, d_model = depth x DEPTH_ASPECT_RATIO rounded up to a
    multiple of the head size (head_dim, else DEPTH_HEAD_DIM), n_heads = d_model / head size."""
    head = head_dim or DEPTH_HEAD_DIM
    d_model = -(-depth * DEPTH_ASPECT_RATIO // head) * head
    return dict(n_layers=depth, d_model=d_model, n_heads=d_model // head)


LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention", "conv", "mamba")
RECURRENT_TYPES = frozenset(LAYER_TYPES[2:])


@dataclass
class LLMConfig:
    """Decoder-only transformer (Llama-style: pre-norm RMSNorm, RoPE, GQA attention, SwiGLU).
    Null fields are derived; the `resolved_*` properties give the values in use."""
    vocab_size: int = bounded(32000, gt=0)  # embedding rows / output classes; must be >= the tokenizer's vocabulary
    depth: Optional[int] = bounded(None, gt=0)  # one dial for the shape (nanochat's rule, `depth_shape`): `n_layers`,
                                            # `d_model` (depth x a fixed aspect ratio, rounded up to the head size) and
                                            # `n_heads`; the three keys below null, or equal to the dial's values
    d_model: Optional[int] = bounded(None, gt=0)  # width of the residual stream; null: 512, or from `depth`
    n_layers: Optional[int] = bounded(None, gt=0)  # transformer blocks; null: 8, or `depth`
    n_heads: Optional[int] = bounded(None, gt=0)  # query heads; must divide `d_model` unless `head_dim` is set; null:
                                            # 8, or from `depth`
    n_kv_heads: Optional[int] = bounded(None, gt=0)  # null = `n_heads` (MHA), 1 = MQA, else GQA; divides `n_heads`
    head_dim: Optional[int] = bounded(None, gt=0)  # per-head width; null = `d_model / n_heads`; must be even (RoPE)
    ffn_hidden: Optional[int] = bounded(None, gt=0)  # SwiGLU width; null = 8/3 `d_model` rounded up (`ffn_multiple_of`)
    ffn_multiple_of: int = bounded(64, gt=0)  # rounding of the default `ffn_hidden`
    max_seq_len: int = bounded(2048, gt=0)  # context the RoPE tables are built for; they grow for a longer sequence
    norm_eps: float = bounded(1e-5, gt=0)   # RMSNorm epsilon
    rope_theta: float = bounded(10000.0, gt=0)  # RoPE base
    rope_scaling: Optional[RopeScaling] = None  # RoPE scaling: the `rope_scaling:` keys below; null = none
    tie_embeddings: bool = True             # the LM head shares the embedding matrix (one tensor)
    qkv_bias: bool = False                  # bias on the q/k/v projection (Qwen2)
    sliding_window: Optional[int] = bounded(None, gt=0)  # attend only to the last N positions (Mistral)
    qk_norm: Union[bool, Literal["head", "proj"]] = False  # RMSNorm of queries and keys before RoPE: `true` /
                                            # `head` per head (Qwen3, Gemma 3), `proj` over the projection (OLMo 2)
    attn_out_bias: bool = False             # bias on the attention output (with `qkv_bias`: Llama's attention_bias)
    attn_pattern: list[Literal["local", "global"]] = field(default_factory=list)  # per layer, repeated: `local` uses
                                            # `sliding_window`, `global` not (Gemma, GPT-OSS); empty: every layer local
    rope_theta_local: Optional[float] = bounded(None, gt=0)  # RoPE base of the `local` layers, unscaled (Gemma 3);
                                            # null = `rope_theta`
    nope_layers: list[int] = field(default_factory=list)  # layers without RoPE (SmolLM3)
    rotary_fraction: float = bounded(1.0, gt=0, le=1)  # share of each head's channels RoPE rotates (Phi-4-mini)
    norm_placement: Literal["pre", "post", "sandwich"] = "pre"  # RMSNorm before each branch (`pre`), after it
                                            # (`post`, OLMo 2) or both (`sandwich`, Gemma)
    mlp_act: Literal["silu", "gelu_tanh"] = "silu"  # SwiGLU, or GeGLU with tanh-approximated GELU (Gemma)
    mlp: Literal["swiglu", "relu2"] = "swiglu"  # the MLP: gated (`mlp_act`), or `relu2`: W_down relu(W_up x)^2, ungated
                                            # (modded-nanogpt); its null `ffn_hidden` = 4 `d_model`
    value_embeds: int = bounded(0, ge=0)    # extra token-embedding tables added, each times a learned scalar, to the
                                            # attention values: table i in layers i and n_layers - value_embeds + i
                                            # (modded-nanogpt); 0 = off
    unet_skips: bool = False                # U-net: block i's output, times a learned weight (starting at one), joins
                                            # the input of block n_layers - 1 - i, for the first half (modded-nanogpt)
    zero_init_out: bool = False             # attention output and MLP down projections start at zero: every block the
                                            # identity at init (modded-nanogpt)
    embed_scale: bool = False               # multiply the embeddings by sqrt(`d_model`) (Gemma)
    embed_multiplier: float = bounded(1.0, gt=0)  # the embeddings times it (Granite's `embedding_multiplier`)
    residual_multiplier: float = bounded(1.0, gt=0)  # each block's attention (or mixer) and MLP outputs times it
                                            # before they join the residual stream (Granite)
    norm_type: Literal["rms", "layer"] = "rms"  # RMSNorm, or LayerNorm without a bias (Cohere)
    parallel_block: bool = False            # attention and MLP side by side from one norm: x + attn(n(x)) + mlp(n(x))
                                            # (Cohere; `norm_placement: pre` only)
    logit_scale: float = bounded(1.0, gt=0)  # the output logits times it (Cohere; Granite: 1 / `logits_scaling`)
    query_pre_attn_scalar: Optional[float] = bounded(None, gt=0)  # attention scores scaled by its -1/2 power
                                            # instead of `head_dim`'s (Gemma; Granite: `attention_multiplier`^-2)
    attn_softcap: Optional[float] = bounded(None, gt=0)  # attention scores c * tanh(s / c) (Gemma 2)
    final_softcap: Optional[float] = bounded(None, gt=0)  # output logits c * tanh(z / c) (Gemma 2)
    attn_sinks: bool = False                # a learned logit per head joins every attention softmax (GPT-OSS)
    attn_gate: bool = False                 # attention output times sigmoid of a gate projected with q (Qwen3.5,
                                            # Qwen3-Next: q_proj twice as wide, each head's q then its gate)
    global_head_dim: Optional[int] = bounded(None, gt=0)  # head width of the global (not sliding) attention layers;
                                            # null = `head_dim` (Gemma 4)
    global_n_kv_heads: Optional[int] = bounded(None, gt=0)  # kv heads of the global layers; null = `n_kv_heads`
    global_kv_same: bool = False            # the global layers' values are their keys' projection (before the key's
                                            # norm and RoPE): no v rows (Gemma 4's `attention_k_eq_v`)
    v_norm: bool = False                    # values RMS-normalised per head, without a gain (Gemma 4)
    kv_shared_layers: int = bounded(0, ge=0)  # the last N layers project no keys and values: each attends to those of
                                            # the last earlier layer of its kind, local or global (Gemma 4)
    kv_shared_ffn_hidden: Optional[int] = bounded(None, gt=0)  # MLP width of those layers; null = `ffn_hidden`
    per_layer_dim: int = bounded(0, ge=0)   # per-layer input embeddings: each layer adds a gated input of this width
                                            # from a token table and a projection of the embeddings (Gemma 4); 0 = off
    per_layer_vocab: Optional[int] = bounded(None, gt=0)  # rows of that token table; null = `vocab_size`
    layer_scalar: bool = False              # each layer's output times a stored scalar (Gemma 4)
    layer_types: list[Literal[LAYER_TYPES]] = field(default_factory=list)  # per layer, repeated: `full_attention`,
                                            # `sliding_attention` (within `sliding_window`), or a recurrent layer:
                                            # `linear_attention` (Gated DeltaNet), `conv` (short convolution), `mamba`
                                            # (Mamba-2), sized by `recurrent`; empty: attention as `attn_pattern` says
    recurrent: Optional[RecurrentConfig] = None  # the recurrent layers' sizes: the keys below; null = their defaults
    mla: Optional[MLAConfig] = None         # multi-head latent attention (DeepSeek-V3): its keys; null = GQA
    moe: Optional[MoEConfig] = None         # Mixture-of-Experts layers: the keys below; null = a dense model
    # Mixture-of-Depths (zoo/blocks/mod.py): a router sends capacity * T tokens per sequence through
    # every mod_every-th block and the rest around it
    mod_capacity: float = bounded(0.0, ge=0, le=1)  # the share of each sequence's tokens a MoD block processes
                                            # (k = int(capacity · T), at least 1); 0 = off; not with `sliding_window`
    mod_every: int = bounded(2, gt=0)       # layer i (from 0) is a MoD block when (i + 1) % mod_every == 0 (2: layers
                                            # 1, 3, 5, ...); at most `n_layers`
    mod_router: Literal["aux_loss", "predictor"] = "aux_loss"  # the causal decision decoding uses: `aux_loss` (a
                                            # cross-entropy on the router logit) or `predictor` (a small MLP)
    mup_base_width: Optional[int] = bounded(None, gt=0)  # muP (Tensor Programs V) against a model of this
                                            # `d_model`: logits x base / d_model, attention scores / head_dim (not its
                                            # square root), hidden matrices' init std x sqrt(base / d_model), their
                                            # Adam-type LR x base / d_model and weight decay x d_model / base (LR x
                                            # decay as at the base width); null = the standard parametrization
    # how a model trains and runs is not part of its architecture: these keys live in the run config's train:
    moved: ClassVar[dict] = {**CHECKPOINTING_MOVED, **{k: f"train.{k}" for k in (
        "attn_backend", "chunked_loss", "loss_chunk_size", "mod_aux_loss_coef", "mod_threshold_rate", "init_std")}}

    SHAPE: ClassVar[dict] = dict(n_layers=8, d_model=512, n_heads=8)  # the shape keys' values when null, no depth

    def __post_init__(self):
        shape = depth_shape(self.depth, self.head_dim) if self.depth else self.SHAPE
        for k, v in shape.items():  # the keys left null; validate() refuses those given otherwise beside depth
            if getattr(self, k) is None:
                setattr(self, k, v)

    def validate(self, source="<config>", prefix=""):
        p = prefix
        if self.depth and (bad := {k: v for k, v in depth_shape(self.depth, self.head_dim).items()
                                   if getattr(self, k) != v}):
            k, v = next(iter(bad.items()))
            raise fail(source, p + k, f"={getattr(self, k)} conflicts with {p}depth={self.depth}, which sets {k}={v} "
                                      f"(set one, the other null)")
        first_broken(source, p, self._rules(p))

    def _rules(self, p: str):
        """validate()'s rules after the depth dial's, in order: (broken, key, message)."""
        mod, mla, r = self.mod_capacity > 0, self.mla or MLAConfig(), self.resolved_recurrent
        recurrent = RECURRENT_TYPES & set(self.layer_types)
        yield (self.mup_base_width and (self.mla or self.moe or self.query_pre_attn_scalar or recurrent), "mup_base_width",
               f"covers dense attention layers with their own scale: not {p}mla, moe, query_pre_attn_scalar or "
               f"recurrent layer_types")
        yield (self.head_dim is None and self.d_model % self.n_heads, "n_heads",
               f"={self.n_heads} must divide {p}d_model={self.d_model} (or set {p}head_dim)")
        yield (self.n_heads % self.resolved_n_kv_heads, "n_kv_heads",
               f"={self.resolved_n_kv_heads} must divide {p}n_heads={self.n_heads}")
        yield (self.n_heads % (self.global_n_kv_heads or 1), "global_n_kv_heads",
               f"={self.global_n_kv_heads} must divide {p}n_heads={self.n_heads}")
        yield (self.global_head_dim or 0) % 2, "global_head_dim", f"={self.global_head_dim} must be even for RoPE"
        yield self.resolved_head_dim % 2, "head_dim", f"={self.resolved_head_dim} must be even for RoPE"
        yield (mod and self.sliding_window is not None, "mod_capacity",
               f"does not combine with {p}sliding_window (a MoD block's tokens are not contiguous)")
        for key in ("attn_sinks", "attn_softcap", "mla"):
            yield (mod and getattr(self, key), "mod_capacity",
                   f"does not combine with {p}{key} (a MoD block attends through a key mask)")
        yield (self.parallel_block and self.norm_placement != "pre", "parallel_block",
               f"needs {p}norm_placement=pre, got {self.norm_placement}")
        yield (mla.index_heads and not mla.q_rank, "mla.index_heads",
               f"={mla.index_heads}: the lightning indexer reads the query bottleneck; set {p}mla.q_rank")
        yield (mla.index_shared and (not mla.index_heads or 0 in mla.index_shared or mod), "mla.index_shared",
               f"={mla.index_shared} needs {p}mla.index_heads > 0, layer 0 an indexer layer, no MoD")
        yield (self.rope_scaling is not None and self.rope_scaling.query_beta and self.mla is None,
               "rope_scaling.query_beta", f"needs {p}mla (multi-head latent attention)")
        yield (self.layer_types and self.attn_pattern, "layer_types",
               f"and {p}attn_pattern both set: sliding_attention in layer_types says which layers are local")
        yield (("local" in self.attn_pattern or "sliding_attention" in self.layer_types) and self.sliding_window is None,
               "layer_types" if self.layer_types else "attn_pattern", f"has local layers but {p}sliding_window is null")
        yield (mod and recurrent, "mod_capacity",
               f"does not combine with recurrent {p}layer_types (a recurrence runs over every token)")
        yield ("linear_attention" in self.layer_types and (r.n_v_heads or r.n_heads) % r.n_heads, "recurrent.n_v_heads",
               f"={r.n_v_heads} must be a multiple of {p}recurrent.n_heads={r.n_heads}")
        yield ("mamba" in self.layer_types and r.n_heads % r.n_groups, "recurrent.n_groups",
               f"={r.n_groups} must divide {p}recurrent.n_heads={r.n_heads}")
        yield (self.rotary_dim % 2, "rotary_fraction",
               f"={self.rotary_fraction} gives {self.rotary_dim} rotated channels; RoPE needs an even number")
        yield (mod and self.mod_every > self.n_layers, "mod_every",
               f"={self.mod_every} exceeds {p}n_layers={self.n_layers}: no layer would be a MoD block")
        yield (self.value_embeds and (2 * self.value_embeds > self.n_layers or self.mla or mod or
                                      any(self.layer_type(i) in RECURRENT_TYPES for i in self.value_embed_layers())),
               "value_embeds", f"={self.value_embeds} needs 2 x {p}value_embeds <= {p}n_layers={self.n_layers}, "
                               f"grouped-query attention in those layers, no MoD")
        shared, kinds = range(self.n_layers - self.kv_shared_layers, self.n_layers), self.layer_type
        yield (self.kv_shared_layers and (self.mla or mod or self.value_embeds or RECURRENT_TYPES & set(map(kinds, shared))
                                          or set(map(kinds, shared)) - set(map(kinds, range(shared.start)))),
               "kv_shared_layers", f"={self.kv_shared_layers} needs an earlier attention layer of each shared layer's "
                                   f"kind, no {p}mla, MoD or value_embeds")
        yield (self.per_layer_dim and mod, "per_layer_dim",
               f"does not combine with {p}mod_capacity (a MoD block skips tokens)")
        for key, layers in (("nope_layers", self.nope_layers), ("moe.dense_layers", self.moe.dense_layers if self.moe
                                                                 else []), ("mla.index_shared", mla.index_shared)):
            bad = [i for i in layers if not 0 <= i < self.n_layers]
            yield bad, key, f"has {bad}, not layers of {p}n_layers={self.n_layers}"

    @property
    def mup_ratio(self) -> Optional[float]:
        """muP's base width over d_model: the logits' and the hidden matrices' LR multiplier; None when off."""
        return None if self.mup_base_width is None else self.mup_base_width / self.d_model

    @property
    def resolved_n_kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    def attn_shape(self, layer: int) -> tuple[int, int]:
        """(kv heads, head width) of attention layer `layer`: the global layers' own where set."""
        kv, d = self.resolved_n_kv_heads, self.resolved_head_dim
        return (kv, d) if self.is_local(layer) else (self.global_n_kv_heads or kv, self.global_head_dim or d)

    def indexer_at(self, layer: int) -> bool:
        """Whether `layer` runs a lightning indexer of its own (not one of `mla.index_shared`)."""
        return bool(self.mla and self.mla.index_heads) and layer not in self.mla.index_shared

    def kv_shared(self, layer: int) -> bool:
        """Whether `layer` attends to an earlier layer's keys and values (`kv_shared_layers`)."""
        return layer >= self.n_layers - self.kv_shared_layers

    def ffn_width(self, layer: int) -> int:
        """The dense MLP width of `layer` (a KV-sharing layer's own where set)."""
        return self.kv_shared_ffn_hidden if self.kv_shared(layer) and self.kv_shared_ffn_hidden else self.resolved_ffn_hidden

    @property
    def resolved_ffn_hidden(self) -> int:
        m = self.ffn_multiple_of  # 8/3 d_model rounded up to a multiple of m
        if self.mlp == "relu2":
            return self.ffn_hidden or 4 * self.d_model
        return self.ffn_hidden or m * ((int(8 * self.d_model / 3) + m - 1) // m)

    @property
    def resolved_expert_hidden(self) -> Optional[int]:
        """The width of each MoE expert (None for a dense model)."""
        return None if self.moe is None else self.moe.expert_hidden or self.resolved_ffn_hidden

    @property
    def rotary_dim(self) -> int:
        """The channels of each head that RoPE rotates."""
        return self.mla.rope_dim if self.mla else int(self.resolved_head_dim * self.rotary_fraction)

    @property
    def resolved_recurrent(self) -> RecurrentConfig:
        return self.recurrent or RecurrentConfig()

    def layer_type(self, layer: int) -> str:
        """The kind of block `layer` (from 0): one of LAYER_TYPES."""
        if self.layer_types:
            return self.layer_types[layer % len(self.layer_types)]
        return "sliding_attention" if self.is_local(layer) else "full_attention"

    def is_local(self, layer: int) -> bool:
        """Whether block `layer` (from 0) attends within `sliding_window` (layer_types, attn_pattern)."""
        if self.sliding_window is None:
            return False
        if self.layer_types:
            return self.layer_types[layer % len(self.layer_types)] == "sliding_attention"
        return not self.attn_pattern or self.attn_pattern[layer % len(self.attn_pattern)] == "local"

    def value_embed_layers(self) -> list[int]:
        """The layers value embedding tables 0, 1, ... feed: the first `value_embeds`, then the last as many."""
        k = self.value_embeds
        return [*range(k), *range(self.n_layers - k, self.n_layers)] if k else []

    def is_mod(self, layer: int) -> bool:
        """Whether block `layer` (from 0) is wrapped in Mixture-of-Depths routing."""
        return self.mod_capacity > 0 and (layer + 1) % self.mod_every == 0

    def is_sparse(self, layer: int) -> bool:
        """Whether block `layer` (from 0) has a Mixture-of-Experts feed-forward."""
        m = self.moe
        return m is not None and layer not in m.dense_layers and (layer + 1) % m.sparse_every == 0


# ------------- ConvNet family (zoo/convnet/: resnet, convnext, efficientnet, mobilenetv3)

# ResNet presets: name -> (block, blocks per stage, groups, width_per_group), as timm/torchvision.
RESNET_ARCHS: dict[str, tuple] = {
    "resnet18": ("basic", [2, 2, 2, 2], 1, 64),
    "resnet34": ("basic", [3, 4, 6, 3], 1, 64),
    "resnet50": ("bottleneck", [3, 4, 6, 3], 1, 64),
    "resnet101": ("bottleneck", [3, 4, 23, 3], 1, 64),
    "resnet152": ("bottleneck", [3, 8, 36, 3], 1, 64),
    "resnext50_32x4d": ("bottleneck", [3, 4, 6, 3], 32, 4),
    "resnext101_32x8d": ("bottleneck", [3, 4, 23, 3], 32, 8),
    "wide_resnet50_2": ("bottleneck", [3, 4, 6, 3], 1, 128),
    "wide_resnet101_2": ("bottleneck", [3, 4, 23, 3], 1, 128),
}
# ConvNeXt presets, timm's: name -> (version 1 or 2 (GRN, no layer scale), blocks per stage, stage-1 channels,
# whether timm holds the MLP as 1x1 convs: its atto to nano sizes).
_CONVNEXT_SIZES = {"atto": ([2, 2, 6, 2], 40, True), "femto": ([2, 2, 6, 2], 48, True),
                   "pico": ([2, 2, 6, 2], 64, True), "nano": ([2, 2, 8, 2], 80, True),
                   "tiny": ([3, 3, 9, 3], 96, False), "small": ([3, 3, 27, 3], 96, False),
                   "base": ([3, 3, 27, 3], 128, False), "large": ([3, 3, 27, 3], 192, False),
                   "xlarge": ([3, 3, 27, 3], 256, False), "xxlarge": ([3, 4, 30, 3], 384, False),
                   "huge": ([3, 3, 27, 3], 352, False)}
CONVNEXT_ARCHS: dict[str, tuple] = {
    f"convnext{'v2' if v == 2 else ''}_{size}": (v, *_CONVNEXT_SIZES[size])
    for v, sizes in ((1, "atto femto pico nano tiny small base large xlarge xxlarge"),
                     (2, "atto femto pico nano tiny small base large huge")) for size in sizes.split()}
# EfficientNet compound scaling: name -> (width multiplier, depth multiplier, the paper's image size).
EFFICIENTNET_ARCHS: dict[str, tuple] = {f"efficientnet_b{i}": scaling for i, scaling in enumerate([
    (1.0, 1.0, 224), (1.0, 1.1, 240), (1.1, 1.2, 260), (1.2, 1.4, 300), (1.4, 1.8, 380), (1.6, 2.2, 456),
    (1.8, 2.6, 528), (2.0, 3.1, 600)])}
# MobileNetV3 presets: name -> (size "large" or "small", width multiplier), as timm.
MOBILENETV3_ARCHS: dict[str, tuple] = {f"mobilenetv3_{size}_{round(mult * 100):03d}": (size, mult) for size, mult in (
    ("large", 1.0), ("large", 0.75), ("small", 0.5), ("small", 0.75), ("small", 1.0))}
CONVNET_KINDS: dict[str, dict] = {"resnet": RESNET_ARCHS, "convnext": CONVNEXT_ARCHS,
                                  "efficientnet": EFFICIENTNET_ARCHS, "mobilenetv3": MOBILENETV3_ARCHS}
DEEP_STEMS = ("deep", "deep_tiered")  # ResNet's three-conv stems (timm's stem_type)
# the keys that shape only some kinds (the rest apply to all): key -> kinds
_CONVNET_KEY_KINDS = {"block": ("resnet",), "groups": ("resnet",), "width_per_group": ("resnet",),
                      "layers": ("resnet", "convnext"), "width": ("resnet", "convnext"),
                      "width_mult": ("efficientnet", "mobilenetv3"), "depth_mult": ("efficientnet", "mobilenetv3")}


@dataclass
class ConvNetConfig:
    """A ConvNet: a preset `arch` (ResNet, ConvNeXt, EfficientNet or MobileNetV3, timm's names),
    optionally reshaped by the keys of its kind. The `resolved_*` properties give the values in use
    (the override, else the preset's)."""
    arch: str = "resnet50"                  # the preset, timm's name (resnet50, convnextv2_tiny, efficientnet_b0,
                                            # mobilenetv3_large_100, ...; docs/convnet.md lists them)
    block: Optional[Literal["basic", "bottleneck"]] = None  # ResNet: `basic` or `bottleneck`; null: the preset's
    layers: Optional[list[int]] = None      # ResNet, ConvNeXt: blocks per stage, e.g. `[1, 1, 1, 1]` (a ResNet-10);
                                            # any number of stages; null: the preset's
    groups: Optional[int] = bounded(None, gt=0)  # ResNeXt cardinality; null: from arch
    width_per_group: Optional[int] = bounded(None, gt=0)  # ResNet bottleneck width per group; null: from arch
    width: Optional[int] = bounded(None, gt=0)  # ResNet: stem channels, `width * 2**i` planes in stage i (null:
                                            # 64); ConvNeXt: stage-1 channels, doubled per stage (null: the preset's)
    width_mult: Optional[float] = bounded(None, gt=0)  # EfficientNet, MobileNetV3: channel multiplier (rounded to
                                            # multiples of 8); null: the preset's
    depth_mult: Optional[float] = bounded(None, gt=0)  # EfficientNet, MobileNetV3: blocks-per-stage multiplier
                                            # (rounded up); null: the preset's (1.0 for MobileNetV3)
    stem: Literal["imagenet", "small", "deep", "deep_tiered"] = "imagenet"  # `imagenet` (the architecture's own
                                            # downsampling stem) or `small` (for 32x32 inputs: a stem that keeps the
                                            # resolution); ResNet only: `deep` (timm's resnet*c/d: three 3x3 convs,
                                            # width/2, width/2, width) or `deep_tiered` (resnet*t: 3*(width/8), width/2,
                                            # width), each before the max-pool
    avg_down: bool = False                  # ResNet: a strided shortcut average-pools (2x2) before its 1x1 conv
                                            # (timm's resnet*d/t) instead of striding the conv
    channel_attn: Literal["none", "se", "eca"] = "none"  # ResNet: channel attention after each block's last BN,
                                            # timm's attn_layer: `se` (seresnet*, seresnext*) or `eca` (ecaresnet*)
    in_chans: int = bounded(3, gt=0)        # input channels (1 for grey images)
    num_classes: int = bounded(1000, gt=0)  # must equal the number of classes in the data
    drop_rate: float = bounded(0.0, ge=0, lt=1)  # dropout before the classifier
    drop_path_rate: float = bounded(0.0, ge=0, lt=1)  # stochastic depth at the last block (linear from 0)
    drop_path_mode: Literal["mask", "skip", "batch"] = "mask"  # ResNet: `mask` (dropped samples computed, then
                                            # zeroed), `skip` (kept samples only), `batch` (whole batch)
    zero_init_last: bool = True             # each residual branch's last BN gamma starts at 0 (not in ConvNeXt)
    bn_eps: float = bounded(1e-5, gt=0)     # BatchNorm epsilon (ConvNeXt's LayerNorms use 1e-6)
    moved: ClassVar[dict] = CHECKPOINTING_MOVED

    def validate(self, source="<config>", prefix=""):
        p = prefix
        if self.arch not in self.all_archs():
            raise fail(source, p + "arch", f"must be one of {', '.join(self.all_archs())}, got {self.arch!r}")
        kind = self.kind
        first_broken(source, p, [
            *((getattr(self, key) is not None and kind not in kinds, key,
               f"applies to {' and '.join(kinds)} archs, not {self.arch} (set it to null)")
              for key, kinds in _CONVNET_KEY_KINDS.items()),
            (self.layers is not None and (not self.layers or any(n <= 0 for n in self.layers)), "layers",
             f"must be a non-empty list of positive block counts, got {self.layers}"),
            (kind != "resnet" and self.drop_path_mode != "mask", "drop_path_mode",
             f"applies to resnet archs, not {self.arch} (they use mask)"),
            (kind != "resnet" and self.stem in DEEP_STEMS, "stem",
             f"={self.stem!r} applies to resnet archs, not {self.arch} (use imagenet or small)"),
            (kind != "resnet" and self.avg_down, "avg_down", f"applies to resnet archs, not {self.arch}"),
            (kind != "resnet" and self.channel_attn != "none", "channel_attn",
             f"applies to resnet archs, not {self.arch} (their blocks have their own)"),
            (kind == "resnet" and self.stem in DEEP_STEMS and self.resolved_width % 8, "stem",
             f"={self.stem!r} needs a width divisible by 8 (its convs are width/2 and 3*width/8), "
             f"got {self.width}"),  # (the preset's 64 is)
            (kind == "resnet" and self.resolved_block == "basic" and (self.resolved_groups,
                                                                      self.resolved_width_per_group) != (1, 64),
             "block", "='basic' needs groups=1 and width_per_group=64")])

    @staticmethod
    def all_archs() -> list:
        return [a for archs in CONVNET_KINDS.values() for a in archs]

    @property
    def kind(self) -> str:
        """resnet, convnext, efficientnet or mobilenetv3: which model class `arch` builds."""
        return next(k for k, archs in CONVNET_KINDS.items() if self.arch in archs)

    @property
    def resolved_block(self) -> str:
        return self.block or RESNET_ARCHS[self.arch][0]

    @property
    def resolved_layers(self) -> list:
        return list(self.layers or (RESNET_ARCHS if self.kind == "resnet" else CONVNEXT_ARCHS)[self.arch][1])

    @property
    def resolved_width(self) -> int:
        return self.width or (64 if self.kind == "resnet" else CONVNEXT_ARCHS[self.arch][2])

    @property
    def resolved_width_mult(self) -> float:
        return self.width_mult or (EFFICIENTNET_ARCHS[self.arch][0] if self.kind == "efficientnet"
                                   else MOBILENETV3_ARCHS[self.arch][1])

    @property
    def resolved_depth_mult(self) -> float:
        return self.depth_mult or (EFFICIENTNET_ARCHS[self.arch][1] if self.kind == "efficientnet" else 1.0)

    @property
    def resolved_groups(self) -> int:
        return self.groups or RESNET_ARCHS[self.arch][2]

    @property
    def resolved_width_per_group(self) -> int:
        return self.width_per_group or RESNET_ARCHS[self.arch][3]


# ------------- Vision transformer family (zoo/vit.py)

_VIT_SIZES = {"tiny": (192, 12, 3), "small": (384, 12, 6), "base": (768, 12, 12), "large": (1024, 24, 16),
              "huge": (1280, 32, 16)}  # size -> (embed_dim, depth, num_heads)


def _vit(size: str, patch: int, img: int = 224, **flags) -> dict:
    return dict(zip(("embed_dim", "depth", "num_heads"), _VIT_SIZES[size]), patch_size=patch, img_size=img, **flags)


_EVA02 = dict(mlp_ratio=4 * 2 / 3, mlp="swiglu", global_pool="avg", k_bias=False, rope_theta=10000.0, rope_ref_grid=16)

# ViT presets, timm's names: name -> the keys that differ from ViTConfig's defaults
VIT_ARCHS: dict[str, dict] = {
    **{f"vit_{s}_patch{p}_{i}": _vit(s, p, i) for s, p, i in (
        ("tiny", 16, 224), ("small", 16, 224), ("base", 16, 224), ("large", 16, 224), ("small", 32, 224),
        ("base", 32, 224), ("large", 32, 224), ("small", 8, 224), ("base", 8, 224), ("huge", 14, 224),
        ("tiny", 16, 384), ("small", 16, 384), ("base", 16, 384), ("large", 16, 384))},
    **{f"deit_{s}_patch16_224": _vit(s, 16) for s in ("tiny", "small", "base")},
    **{f"deit_{s}_distilled_patch16_224": _vit(s, 16, distilled=True) for s in ("tiny", "small", "base")},
    **{f"vit_{s}_patch14_dinov2": _vit(s, 14, 518, init_values=1e-5) for s in ("small", "base", "large")},
    **{f"vit_{s}_patch14_reg4_dinov2": _vit(s, 14, 518, init_values=1e-5, reg_tokens=4, no_embed_class=True)
       for s in ("small", "base", "large")},
    "vit_base_patch16_reg4_gap_256": _vit("base", 16, 256, class_token=False, no_embed_class=True,
                                          global_pool="avg", reg_tokens=4),
    # CLIP's image towers: a norm before the blocks, the patch conv unbiased (OpenAI's *_quickgelu_*: mlp=quick_gelu)
    **{f"vit_{s}_patch{p}_clip_224": _vit(s, p, pre_norm=True, norm_eps=1e-5)
       for s, p in (("base", 16), ("base", 32), ("large", 14))},
    # EVA-02 (timm's non-CLIP image models): the table and RoPE on the patch indices, SwiGLU (sub-LN from base on)
    **{f"eva02_{s}_patch14_{i}": _vit(s, 14, i, **_EVA02) for s, i in (("tiny", 224), ("tiny", 336), ("small", 224),
                                                                          ("small", 336))},
    **{f"eva02_{s}_patch14_{i}": _vit(s, 14, i, **_EVA02, mlp_norm=True)
       for s, i in (("base", 224), ("base", 448), ("large", 224), ("large", 448))},
}
ROPE_AUGMENT_KEYS = ("pos_embed_shift", "pos_embed_jitter", "pos_embed_rescale")  # DINOv3's, in training
VIT_SHAPE_KEYS = ("embed_dim", "depth", "num_heads", "patch_size", "img_size", "mlp_ratio", "class_token", "distilled",
                  "reg_tokens", "no_embed_class", "global_pool", "fc_norm", "pre_norm", "init_values", "mlp", "norm_eps", "rope_theta",
                  "pos_interp", "rope_ref_grid", "k_bias", "mlp_norm")


@dataclass
class ViTConfig:
    """A vision transformer: a preset `arch` (timm's name), optionally reshaped by the keys below; a null key takes
    the preset's value, else the default named in its comment (`resolved` gives the values in use)."""
    arch: str = "vit_small_patch16_224"      # the preset, timm's name (vit_base_patch16_224,
                                            # deit_tiny_distilled_patch16_224, vit_small_patch14_reg4_dinov2, ...)
    embed_dim: Optional[int] = bounded(None, gt=0)  # token width
    depth: Optional[int] = bounded(None, gt=0)  # encoder blocks
    num_heads: Optional[int] = bounded(None, gt=0)  # attention heads (must divide embed_dim)
    patch_size: Optional[int] = bounded(None, gt=0)  # square patch side in pixels
    img_size: Optional[int] = bounded(None, gt=0)  # the image side the position table is laid out for (other
                                            # sizes resample it bicubically); must be a multiple of patch_size
    mlp_ratio: Optional[float] = bounded(None, gt=0, le=64)  # MLP hidden width over embed_dim (default 4)
    class_token: Optional[bool] = None      # a learned class token in front (default true)
    distilled: Optional[bool] = None        # DeiT's distillation token and second head, logits averaged (default false)
    reg_tokens: Optional[int] = bounded(None, ge=0)  # register tokens after the class token (default 0)
    no_embed_class: Optional[bool] = None   # position table for the patches only, not the prefix tokens (default false)
    global_pool: Optional[Literal["token", "avg", "map"]] = None  # `token` (the class token, final norm), `avg`
                                            # (mean of the patch tokens, then fc_norm) or `map` (attention pooling,
                                            # SigLIP's); default token
    fc_norm: Optional[bool] = None          # the pooled features normed (fc_norm), not the tokens before pooling
                                            # (the final norm); default: with global_pool avg (timm's vit_*_gap_*:
                                            # false)
    pre_norm: Optional[bool] = None         # a LayerNorm on the tokens before the blocks, the patch conv unbiased
                                            # (CLIP's: timm's vit_*_clip_*); default false
    init_values: Optional[float] = bounded(None, ge=0)  # LayerScale's initial value; 0: no LayerScale (default 0)
    mlp: Optional[Literal["gelu", "gelu_tanh", "quick_gelu", "swiglu"]] = None  # the blocks' MLP: GELU exact,
                                            # tanh-approximated (SigLIP) or quick (OpenAI CLIP), or SwiGLU (DINOv3's
                                            # gated one); default gelu
    norm_eps: Optional[float] = bounded(None, gt=0)  # the LayerNorms' epsilon (default 1e-6)
    rope_theta: Optional[float] = bounded(None, ge=0)  # >0: DINOv3's 2-D RoPE on the patch tokens with this base,
                                            # no position table (EVA-02's, rope_ref_grid, keeps it); 0: the learned
                                            # table alone (default 0)
    pos_interp: Optional[Literal["bicubic", "bilinear"]] = None  # how the table is resized to another grid,
                                            # antialiased: bicubic (timm) or bilinear (SigLIP 2); default bicubic
    rope_ref_grid: Optional[int] = bounded(None, ge=0)  # >0, with rope_theta: EVA-02's RoPE instead, beside the
                                            # table: patch indices scaled to a grid of this side (timm's
                                            # ref_feat_shape), channels turned in adjacent pairs; default 0
    k_bias: Optional[bool] = None           # false: qkv_bias biases q and v only (EVA-02's); default true
    mlp_norm: Optional[bool] = None         # a LayerNorm on SwiGLU's hidden features before its down projection
                                            # (EVA-02 base and large: timm's scale_mlp); default false
    qkv_bias: bool = True                   # biases on the attention's qkv projection
    in_chans: int = bounded(3, gt=0)        # input channels (1 for grey images)
    num_classes: int = bounded(1000, ge=0)  # classifier outputs; 0: no head (the pooled features)
    drop_rate: float = bounded(0.0, ge=0, lt=1)  # dropout before the classifier
    drop_path_rate: float = bounded(0.0, ge=0, lt=1)  # stochastic depth at the last block (linear from 0)
    patch_drop_rate: float = bounded(0.0, ge=0, lt=1)  # in training, each image drops this fraction of its patch
                                            # tokens at random after the position embedding (PatchDropout, FLIP)
    pos_embed_shift: Optional[float] = bounded(None, ge=0)  # RoPE only, in training: the patch centres in [-1, 1]
                                            # shifted by U(-shift, shift) per axis, one draw per batch (DINOv3's
                                            # transformers key); null or 0: off
    pos_embed_jitter: Optional[float] = bounded(None, ge=0)  # RoPE only, in training: each axis of the centres
                                            # scaled by a log-uniform factor in [1/jitter, jitter]; null or 0: off,
                                            # else >= 1
    pos_embed_rescale: Optional[float] = bounded(None, ge=0)  # RoPE only, in training: both axes scaled by one
                                            # log-uniform factor in [1/rescale, rescale] (DINOv3 trains with 2); null
                                            # or 0: off, else >= 1

    DEFAULTS: ClassVar[dict] = dict(mlp_ratio=4.0, class_token=True, distilled=False, reg_tokens=0,
                                    no_embed_class=False, global_pool="token", fc_norm=None, pre_norm=False,
                                    init_values=0.0,
                                    mlp="gelu",
                                    norm_eps=1e-6, rope_theta=0.0, pos_interp="bicubic", rope_ref_grid=0,
                                    k_bias=True, mlp_norm=False)

    def validate(self, source="<config>", prefix=""):
        if self.arch not in VIT_ARCHS:
            raise fail(source, prefix + "arch", f"must be one of {', '.join(VIT_ARCHS)}, got {self.arch!r}")
        r = self.resolved
        head = r["embed_dim"] // r["num_heads"]
        first_broken(source, prefix, [
            (r["embed_dim"] % r["num_heads"], "num_heads", f"={r['num_heads']} must divide embed_dim={r['embed_dim']}"),
            (r["img_size"] % r["patch_size"], "img_size",
             f"={r['img_size']} must be a multiple of patch_size={r['patch_size']}"),
            (r["distilled"] and not r["class_token"], "distilled", "needs class_token"),
            (r["global_pool"] == "token" and not r["class_token"] and self.num_classes, "global_pool",
             "=token needs class_token (without one: avg or map)"),
            (r["rope_theta"] and head % 4, "rope_theta",
             f"needs a head width embed_dim / num_heads divisible by 4, got {head}"),
            (r["rope_ref_grid"] and not r["rope_theta"], "rope_ref_grid", "needs rope_theta > 0 (EVA-02's RoPE turns by it)"),
            (r["mlp_norm"] and r["mlp"] != "swiglu", "mlp_norm", f"needs mlp=swiglu, got {r['mlp']}"),
            # pos_embed_jitter / _rescale below 1 (but for 0, off) have no log-uniform range (that they need RoPE, the
            # ViT checks when built: a run from pretrained weights takes rope_theta from the weights)
            *((0 < (getattr(self, k) or 0) < 1, k, f"={getattr(self, k)} must be 0 or null (off) or >= 1")
              for k in ROPE_AUGMENT_KEYS[1:])])

    @property
    def resolved(self) -> dict:
        """Every shape key's value in use: the key, else the preset's, else DEFAULTS'."""
        preset = {**self.DEFAULTS, **VIT_ARCHS[self.arch]}
        r = {k: preset[k] if getattr(self, k) is None else getattr(self, k) for k in VIT_SHAPE_KEYS}
        return {**r, "fc_norm": r["global_pool"] == "avg" if r["fc_norm"] is None else r["fc_norm"]}


@dataclass
class VLMConfig:
    """A vision-language model as SmolVLM / Idefics3 build it: a ViT encoder of image tiles, the pixel-shuffle
    connector, an LLM decoder reading the image tokens where the prompt holds `image_token_id`."""
    vision: ViTConfig = field(default_factory=lambda: ViTConfig(
        class_token=False, no_embed_class=True, mlp="gelu_tanh", num_classes=0))  # the encoder (default: SigLIP's)
    text: LLMConfig = field(default_factory=LLMConfig)  # the decoder
    scale_factor: int = bounded(2, gt=0)    # the connector folds each scale_factor^2 patch tokens into one
    image_token_id: int = bounded(0, ge=0)  # the placeholder id whose embeddings the image tokens replace

    def validate(self, source="<config>", prefix=""):
        grid, vocab = self.vision.resolved["img_size"] // self.vision.resolved["patch_size"], self.text.vocab_size
        first_broken(source, prefix, [
            (grid % self.scale_factor, "scale_factor", f"={self.scale_factor} must divide the patch grid's side {grid}"),
            (self.image_token_id >= vocab, "image_token_id", f"={self.image_token_id} must be < text.vocab_size={vocab}")])


# ---------------------------------------------------------------- Latent diffusion family

@dataclass
class AutoencoderConfig:
    """The frozen TAESD autoencoder between images and latents (zoo/diffusion/taesd.py)."""
    weights: Optional[str] = None           # TAESD weights (`*_encoder.pth`, diffusers folder); null: the task trains it
    latent_channels: Optional[int] = bounded(None, gt=0)  # 4 / 16 / 32; null: the weights' (4 when trained)
    midblock_gn: Optional[bool] = None      # FLUX.2 branch; null: the weights' (false when trained)
    channels: Optional[int] = bounded(None, gt=0)  # width; null: the weights' (64 when trained)


# DiT presets (Peebles & Xie 2023, Table 1): name -> (depth, width, heads); the patch size is its own key
DIT_PRESETS: dict[str, tuple[int, int, int]] = {
    "tiny": (4, 128, 4), "S": (12, 384, 6), "B": (12, 768, 12), "L": (24, 1024, 16), "XL": (28, 1152, 16),
}


@dataclass
class DiTConfig:
    """The DiT denoiser (zoo/diffusion/dit.py), used when `model.denoiser: dit`: a preset shape,
    optionally overridden by depth / width / heads. The `resolved_*` properties give the values in use."""
    preset: str = "tiny"                    # `tiny` (4 x 128, 4 heads), `S`, `B`, `L`, `XL` (DiT-S/B/L/XL)
    depth: Optional[int] = bounded(None, gt=0)  # blocks; null: the preset's
    width: Optional[int] = bounded(None, gt=0)  # hidden size; null: the preset's
    heads: Optional[int] = bounded(None, gt=0)  # attention heads; null: the preset's
    patch_size: int = bounded(2, gt=0)      # latent patch size (DiT-XL/2: 2); must divide the latent size
    mlp_ratio: float = bounded(4.0, gt=0, le=64)   # MLP hidden = mlp_ratio * width
    learn_sigma: bool = False               # also predict the variance (2x output channels, trained with the VLB term)
    qk_norm: bool = False                   # RMS-normalise query and key heads
    rope: bool = False                      # 2D axial RoPE in attention instead of the sin-cos position embedding
    qkv_bias: bool = True                   # biases on the query, key and value projections
    norm_eps: float = bounded(1e-6, gt=0)   # eps of the LayerNorm before each MLP (diffusers' `norm_eps`; 1e-6 elsewhere)
    freq_shift: float = bounded(1.0, ge=0, lt=2)  # timestep sinusoids f_i = 10000^(-i/(128 - shift)): 1 = diffusers, 0 = original DiT
    block_conditioning: bool = False        # a timestep + class embedder per block (diffusers' layout), else one shared

    def validate(self, source="<config>", prefix=""):
        if self.preset not in DIT_PRESETS:
            raise fail(source, prefix + "preset", f"must be one of {', '.join(DIT_PRESETS)}, got {self.preset!r}")
        width, heads = self.resolved_width, self.resolved_heads
        first_broken(source, prefix, [
            (width % heads, "heads", f"={heads} must divide width={width}"),
            (self.rope and (width // heads) % 4, "rope", f"needs a head size divisible by 4, got {width // heads}"),
            (not self.rope and width % 4, "width", f"must be divisible by 4 (2D sin-cos embedding), got {width}")])

    @property
    def resolved_depth(self) -> int:
        return self.depth or DIT_PRESETS[self.preset][0]

    @property
    def resolved_width(self) -> int:
        return self.width or DIT_PRESETS[self.preset][1]

    @property
    def resolved_heads(self) -> int:
        return self.heads or DIT_PRESETS[self.preset][2]


@dataclass
class Flux2Config:
    """The FLUX.2 transformer (zoo/diffusion/flux2.py): MMDiT double-stream then single-stream blocks, 4-axis RoPE.
    The defaults are a small shape; FLUX.2 [klein]'s own come with its diffusers folder."""
    double_depth: int = bounded(2, ge=0)    # double-stream blocks (diffusers' num_layers)
    single_depth: int = bounded(4, ge=0)    # single-stream blocks (num_single_layers)
    heads: int = bounded(4, gt=0)           # attention heads; width = heads * head_dim
    head_dim: int = bounded(32, gt=0)       # size of one head; must equal the sum of rope_axes
    mlp_ratio: float = bounded(3.0, gt=0, le=64)   # SwiGLU hidden = mlp_ratio * width
    in_channels: int = bounded(128, gt=0)   # channels of a latent token (FLUX.2: 32 latent channels x a 2x2 patch)
    out_channels: Optional[int] = bounded(None, gt=0)  # null: in_channels
    text_dim: int = bounded(64, gt=0)       # width of the text encoder's embeddings (joint_attention_dim)
    rope_axes: tuple[int, ...] = (8, 8, 8, 8)  # head channels rotated per position axis (time, height, width, text index)
    rope_theta: float = bounded(2000.0, gt=0)  # RoPE base
    guidance: bool = False                  # a guidance-scale embedder (guidance-distilled models)
    timestep_dim: int = bounded(256, gt=0)  # sinusoids fed to the timestep / guidance MLPs
    eps: float = bounded(1e-6, gt=0)        # eps of the LayerNorms and QK RMSNorms

    def validate(self, source="<config>", prefix=""):
        if sum(self.rope_axes) != self.head_dim or any(d % 2 for d in self.rope_axes):
            raise fail(source, prefix + "rope_axes", f"={list(self.rope_axes)} must be even and sum to "
                       f"head_dim={self.head_dim}")


@dataclass
class DiffusionConfig:
    """Latent diffusion: TAESD autoencoder + class-conditional denoiser (U-Net or DiT) or text-conditioned FLUX.2
    transformer + noise schedule."""
    image_size: int = bounded(32, gt=0)     # training and sampled image size, divisible by 8
    num_classes: int = bounded(10, gt=0)    # classes (+1 "no label" for guidance)
    autoencoder: AutoencoderConfig = field(default_factory=AutoencoderConfig)
    latent_channels: Optional[int] = bounded(None, gt=0)  # the denoiser's; must match the autoencoder's
    denoiser: Literal["unet", "dit", "flux2"] = "unet"  # `unet` (the keys below), `dit` (the `dit:` section) or
                                            # `flux2` (the `flux2:` section; text-conditioned, prediction: flow)
    dit: DiTConfig = field(default_factory=DiTConfig)
    flux2: Flux2Config = field(default_factory=Flux2Config)
    text_encoder: Optional[str] = None      # flux2: the Zoo LLM embedding the prompts, a model folder (pretrained) or
                                            # an LLM config file (random init, frozen; vocab_size 256: bytes)
    text_layers: list[int] = field(default_factory=lambda: [9, 18, 27])  # flux2: the text encoder's hidden states
                                            # stacked per token (0 the embeddings); text_dim = layers x d_model
    text_length: int = bounded(512, gt=0)   # flux2: prompt tokens, padded (and truncated) to it
    channels: list[int] = field(default_factory=lambda: [64, 128])  # U-Net width per level (each halves the latents)
    blocks_per_level: int = bounded(2, gt=0)  # U-Net residual blocks per level going down (one more going up)
    attention: bool = True                  # self-attention at the lowest resolution
    heads: int = bounded(4, gt=0)           # U-Net attention heads; must divide every `channels` width
    class_dropout: float = bounded(0.1, ge=0, lt=1)  # label dropout for classifier-free guidance
    prediction: Literal["eps", "v", "x0", "flow"] = "eps"  # eps, v or x0 (on the noise schedule), or flow (rectified
                                            # flow: velocity eps - x0 on x_s = (1 - s) x0 + s eps)
    flow_timesteps: Literal["logit_normal", "uniform"] = "logit_normal"  # flow: how s is drawn in training
    flow_logit_mean: float = 0.0            # flow: s = sigmoid(N(mean, std)) (SD3: 0 and 1)
    flow_logit_std: float = bounded(1.0, gt=0)  # flow: s = sigmoid(N(mean, std))
    schedule: Literal["linear", "scaled_linear", "cosine"] = "linear"  # noise schedule
    num_timesteps: int = bounded(1000, gt=0)  # noise schedule
    beta_start: float = bounded(1e-4, gt=0, lt=1)  # noise schedule
    beta_end: float = bounded(0.02, gt=0, lt=1)  # noise schedule
    min_snr_gamma: Optional[float] = bounded(5.0, gt=0)  # Min-SNR-gamma; null = uniform
    sampler: Literal["ddim", "ddpm", "flow_euler", "dpmpp_2m", "euler", "euler_a", "unipc"] = "ddim"  # Zoo's own
                                            # (ddim, ddpm, flow_euler) or diffusers' scheduler (the others)
    sample_steps: int = bounded(50, gt=0)   # sampling defaults
    guidance: float = bounded(3.0, ge=0)    # classifier-free guidance scale (1 = off)
    sample_shift: Optional[Union[float, Literal["auto"]]] = bounded("auto", gt=0)  # flow_euler's noise levels
                                            # s -> k s / (1 + (k - 1) s): `auto` FLUX.2's k for the image size (flux2;
                                            # none for the others), a number that k, null none
    eta: float = bounded(0.0, ge=0)         # DDIM noise (0 = deterministic)
    moved: ClassVar[dict] = CHECKPOINTING_MOVED

    def validate(self, source="<config>", prefix=""):
        p = prefix
        from .diffusion.samplers import check_sampler
        latent, factor, ae = self.image_size // 8, self.latent_multiple, self.autoencoder.latent_channels
        flow, sampler_problem = self.prediction == "flow", check_sampler(self.sampler, self.prediction)
        first_broken(source, p, [
            (self.image_size % 8, "image_size",
             f"must be divisible by 8 (the autoencoder's downscale), got {self.image_size}"),
            (not self.channels or any(c <= 0 or c % self.heads for c in self.channels), "channels",
             f"must be positive widths divisible by heads={self.heads}, got {self.channels}"),
            (latent % factor and self.denoiser == "dit", "dit.patch_size",
             f"={factor}: the latent side {latent} ({p}image_size {self.image_size} / 8) must be divisible by it"),
            (latent % factor and self.denoiser == "flux2", "image_size",
             f"={self.image_size}: the latent side {latent} (/ 8) must be divisible by the patch {factor}"),
            (latent % factor, "channels",
             f"has {len(self.channels)} levels: the latent size {latent} must be divisible by {factor}"),
            (self.latent_channels is not None and ae is not None and self.latent_channels != ae, "latent_channels",
             f"does not match {p}autoencoder.latent_channels: {self.latent_channels} != {ae}"),
            (not 0.0 < self.beta_start < self.beta_end < 1.0, "beta_end",
             f"must satisfy 0 < beta_start < beta_end < 1, got {self.beta_start} and {self.beta_end}"),
            (sampler_problem, "sampler", f"={self.sampler}: {sampler_problem}"),
            (self.denoiser == "flux2" and (not flow or not self.text_encoder), "text_encoder" if flow else "prediction",
             "denoiser=flux2 is a text-conditioned rectified flow: set prediction: flow and a text_encoder"),
            (self.denoiser == "dit" and self.dit.learn_sigma and flow, "dit.learn_sigma",
             "needs a noise-schedule prediction (eps, v, x0): the variance is trained with DDPM's bound, which flow "
             "has not"),
            (self.sample_steps > self.num_timesteps, "sample_steps",
             f"must be <= {p}num_timesteps={self.num_timesteps}, got {self.sample_steps}"),
            (isinstance(self.sample_shift, float) and not flow, "sample_shift",
             f"={self.sample_shift} shifts flow matching's noise levels: set prediction: flow, or sample_shift: null")])

    @property
    def latent_multiple(self) -> int:
        """What the latent sides must be multiples of: the U-Net's downsampling, the DiT's or FLUX.2's patch."""
        return {"unet": 2 ** (len(self.channels) - 1), "dit": self.dit.patch_size, "flux2": 2}[self.denoiser]


@dataclass(frozen=True)
class Family:
    """A model family: its config dataclass and its model class ("module:Class", imported when used).
    The task that trains a family is the trainer's to register (train/tasks/__init__.py)."""
    config: type
    model: str


# the registry of model families: a new family registers its config and model here
FAMILIES: dict[str, Family] = {
    "llm": Family(LLMConfig, "zoo.llm:LLM"),
    "convnet": Family(ConvNetConfig, "zoo.convnet:build"),
    "diffusion": Family(DiffusionConfig, "zoo.diffusion.latent:LatentDiffusion"),
    "vit": Family(ViTConfig, "zoo.vit:ViT"),
    "vlm": Family(VLMConfig, "zoo.vlm:VLM"),
}


def family(name: str, source: str = "<config>") -> Family:
    """The registry's entry, or a one-line ConfigError naming the known families."""
    if name not in FAMILIES:
        raise ConfigError(f"{source}: unknown family {name!r} (known: {', '.join(FAMILIES)})")
    return FAMILIES[name]


def load_class(spec: str):
    """"module:Class" -> the class."""
    import importlib
    mod, _, name = spec.partition(":")
    return getattr(importlib.import_module(mod), name)


def model_config_from(data: dict, family_name: str, source: str, prefix: str = "model."):
    return from_dict(family(family_name, source).config, data, source, prefix)
