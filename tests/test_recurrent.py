"""The recurrent blocks (Gated DeltaNet, Mamba-2, LFM2's short convolution): the chunked form equals the recurrent
form token by token, packed documents equal the documents run alone, and each equals transformers' module with the
same weights. Tolerance: 1e-5 in fp32 throughout."""
import pytest
import torch

from zoo.blocks import gated_deltanet as gdn
from zoo.blocks.gated_deltanet import GatedDeltaNet
from zoo.blocks.mamba2 import Mamba2
from zoo.blocks.short_conv import ShortConv

TOL = 1e-5


def make(kind: str, seed: int = 0) -> torch.nn.Module:
    """A small block with random weights (the norms' gains too), chunks of 8 tokens."""
    torch.manual_seed(seed)
    m = {"gdn": lambda: GatedDeltaNet(16, 2, 8, n_v_heads=4, v_head_dim=6, chunk=8),
         "mamba2": lambda: Mamba2(16, 4, 8, state_size=6, n_groups=2, chunk=8),
         "short_conv": lambda: ShortConv(16, 3, bias=True)}[kind]()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.startswith(("norm", "D", "conv")):
                p.normal_(0, 0.5)
    return m


def flat(state) -> torch.Tensor:
    """A block's state as one (B, n) tensor."""
    return torch.cat([s.flatten(1) for s in (state if isinstance(state, tuple) else (state,))], 1)


# two rows of 21 tokens (chunks of 8): boundaries inside chunks, a document shorter than the conv window
DOCS = torch.tensor([[0] * 5 + [1] * 9 + [2] * 7, [0] * 10 + [1] * 2 + [2] * 9])
KINDS = ["gdn", "mamba2", "short_conv"]


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_equals_recurrent_token_by_token(kind):
    """The packed rows in one chunked call = each row stepped token by token from a fresh state at every document
    start (outputs and final states); and the same call cut in two, the state passed across the cut."""
    m, x = make(kind), torch.randn(2, 21, 16)
    with torch.no_grad():
        y, state = m(x, doc_ids=DOCS)
        for b in range(2):
            step = None
            for t in range(21):
                if t and DOCS[b, t] != DOCS[b, t - 1]:
                    step = None
                yt, step = m(x[b:b + 1, t:t + 1], step)
                assert (yt[0, 0] - y[b, t]).abs().max() < TOL, (b, t)
            assert (flat(step) - flat(state)[b:b + 1]).abs().max() < TOL
        y1, s1 = m(x[:, :11], doc_ids=DOCS[:, :11])
        y2, s2 = m(x[:, 11:], s1, DOCS[:, 11:])
    assert (torch.cat([y1, y2], 1) - y).abs().max() < TOL and (flat(s2) - flat(state)).abs().max() < TOL


@pytest.mark.parametrize("kind", KINDS)
def test_packed_documents_equal_documents_alone(kind):
    m, x = make(kind), torch.randn(1, 25, 16)
    lengths = [8, 11, 6]  # one document starts a chunk, one starts inside one
    doc_ids = torch.repeat_interleave(torch.tensor([4, 9, 2]), torch.tensor(lengths))[None]
    with torch.no_grad():
        y, state = m(x, doc_ids=doc_ids)
        for part, yp in zip(x.split(lengths, 1), y.split(lengths, 1)):
            alone, last = m(part)
            assert (alone - yp).abs().max() < TOL
    assert (flat(last) - flat(state)).abs().max() < TOL


def _hf(kind: str):
    """transformers' module for `kind` from a small config, and the keyword arguments of ours with the same shapes."""
    if kind in ("qwen3_5", "qwen3_next"):
        from transformers import Qwen3_5TextConfig, Qwen3NextConfig
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet
        kw = dict(hidden_size=24, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                  linear_value_head_dim=6, linear_conv_kernel_dim=3, num_hidden_layers=1, rms_norm_eps=1e-5,
                  layer_types=["linear_attention"])
        cls, cfg = ((Qwen3_5GatedDeltaNet, Qwen3_5TextConfig) if kind == "qwen3_5"
                    else (Qwen3NextGatedDeltaNet, Qwen3NextConfig))
        return cls(cfg(**kw), 0), GatedDeltaNet(24, 2, 8, n_v_heads=4, v_head_dim=6, conv_kernel=3, eps=1e-5, chunk=16)
    if kind in ("mamba2", "granite"):
        from transformers import GraniteMoeHybridConfig, Mamba2Config
        from transformers.models.granitemoehybrid.modeling_granitemoehybrid import GraniteMoeHybridMambaLayer
        from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer
        if kind == "mamba2":
            cfg = Mamba2Config(hidden_size=24, num_heads=6, head_dim=8, expand=2, state_size=6, n_groups=3,
                               conv_kernel=3, chunk_size=16, num_hidden_layers=1, use_bias=True)
            hf = Mamba2Mixer(cfg, 0)
        else:
            cfg = GraniteMoeHybridConfig(hidden_size=24, mamba_n_heads=6, mamba_d_head=8, mamba_expand=2,
                                         mamba_d_state=6, mamba_n_groups=3, mamba_d_conv=3, mamba_chunk_size=16,
                                         num_hidden_layers=1, layer_types=["mamba"], rms_norm_eps=1e-5)
            hf = GraniteMoeHybridMambaLayer(cfg, 0)
        return hf, Mamba2(24, 6, 8, state_size=6, n_groups=3, conv_kernel=3, chunk=16, bias=kind == "mamba2",
                          eps=1e-5)
    from transformers import Lfm2Config
    from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv
    cfg = Lfm2Config(hidden_size=24, conv_L_cache=4, conv_bias=True, num_hidden_layers=1, layer_types=["conv"])
    return Lfm2ShortConv(cfg, 0), ShortConv(24, 4, bias=True)


def qwen3_next_to_qwen3_5(sd: dict) -> dict:
    """Qwen3-Next's in_proj_qkvz / in_proj_ba (rows grouped per key head) as Qwen3.5's four projections, by the
    rows its record gives (Qwen3Next.split_rows, what loading a Qwen3-Next folder uses)."""
    from zoo.archs import RECORDS
    from zoo.config import LLMConfig, RecurrentConfig
    cfg = LLMConfig(recurrent=RecurrentConfig(n_heads=2, head_dim=8, n_v_heads=4, v_head_dim=6))
    splits = {own.split(".", 1)[1]: (file.split(".", 1)[1], rows) for own, (file, rows) in
              RECORDS["Qwen3NextForCausalLM"].split_rows(cfg).items()}
    return {**{n: t for n, t in sd.items() if not n.startswith(("in_proj_qkvz", "in_proj_ba"))},
            **{own: sd[file][rows] for own, (file, rows) in splits.items()}}


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next", "mamba2", "granite", "lfm2"])
def test_matches_transformers(kind):
    """transformers' module at random init (its gains and D drawn at random too), its weights copied into ours:
    the same outputs over 45 tokens (three chunks of ours, the last one partial)."""
    torch.manual_seed(0)
    hf, ours = _hf(kind)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.startswith(("norm", "D", "conv1d.bias")):
                p.normal_(0, 0.5)
    sd = hf.state_dict()
    if kind == "qwen3_next":
        sd = qwen3_next_to_qwen3_5(sd)
    ours.load_state_dict(sd)  # strict: every key maps one to one
    x = torch.randn(2, 45, 24)
    with torch.no_grad():
        assert (ours(x)[0] - hf(x)).abs().max() < TOL


def test_flash_linear_attention_packing():
    """The packing around flash-linear-attention's kernel (one flat row cut at cu_seqlens, the incoming state given to
    each row's first document, each row's last state returned), with the kernel stood in for by the recurrent form run
    over each cu_seqlens segment: it equals the chunked torch form."""
    def kernel(q, k, v, g, beta, initial_state=None, output_final_state=True, use_qk_l2norm_in_kernel=True,
               cu_seqlens=None):
        assert use_qk_l2norm_in_kernel and output_final_state and q.shape[0] == 1
        outs, finals = [], []
        for i, (a, b) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
            init = None if initial_state is None else initial_state[i:i + 1]
            o, s = gdn.recurrent_gated_delta_rule(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], init)
            outs.append(o)
            finals.append(s)
        return torch.cat(outs, 1), torch.cat(finals)

    torch.manual_seed(0)
    q, k = torch.randn(2, 21, 2, 8), torch.randn(2, 21, 2, 8)
    v, g, beta = torch.randn(2, 21, 4, 6), -torch.rand(2, 21, 4), torch.rand(2, 21, 4)
    state = torch.randn(2, 4, 8, 6)
    ref, ref_state = gdn.chunk_gated_delta_rule(q, k, v, g, beta, state, DOCS, 8)
    saved, gdn.fla_chunk = gdn.fla_chunk, lambda: kernel
    try:
        o, s = gdn.fla_gated_delta_rule(q, k, v, g, beta, state, DOCS)
    finally:
        gdn.fla_chunk = saved
    assert (o - ref).abs().max() < TOL and (s - ref_state).abs().max() < TOL
