"""The torchrun cases that run against one process in a shared pair of launches (the `parity` fixture: every
case one after another in one torchrun launch, and in one process): adapters, chat SFT (of a recurrent + attention
hybrid too), DPO, distillation, QAT, pruning, every optimizer, lr_find, the diffusion denoiser, MoE,
Mixture-of-Depths, float8, GRPO, the ResNet with SyncBatchNorm, the ViT, the VLM's chat SFT, fp16 and whole-batch
stochastic depth; and (a launch of their own) DDP's gradient compression against plain DDP, and ZeRO-2. A file of
its own so that pytest-xdist runs it beside test_distributed.py. Tolerances: tests/test_distributed.py's docstring,
and each test's own."""
import json
import random
import re

import pytest
import torch
from safetensors.torch import load_file

import zoo
from parallel_runs import configs  # noqa: F401 (a fixture)
from parallel_runs import (ATOL, DEEPSEEK, HYBRID_SFT, LLM, MOE, NEWER, RTOL, SFT, TEXT, assert_bitwise,
                           assert_close_weights, assert_same_losses, case, checkpoint_weights, copy_step, curve,
                           last_stderr, launch, run)
from train.metrics import read_rows

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.cpu_only("two processes over gloo share the CPU; NCCL needs a GPU per process")]


# ------------------------------------------------------------------------------ parity, case by case
ADAPTERS = {"lora": ["adapter.method=lora"], "dora": ["adapter.method=dora"],
            "prefix": ["adapter.method=prefix", "adapter.prefix_len=4"],
            "prompt": ["adapter.method=prompt", "adapter.prefix_len=4"], "bottleneck": ["adapter.method=bottleneck"],
            # NF4 stores blocks of 64 weights, their scales in blocks of 256: a wider model
            "qlora": ["adapter.method=lora", "adapter.quantize_base=nf4", "model.d_model=256", "model.n_kv_heads=4",
                      "model.ffn_hidden=512"]}
# optim.name -> (losses' rel, weights' abs tolerance) against one process: where an optimizer rounds what it
# is given (Muon orthogonalises in bf16, 8-bit AdamW quantises its states to 256 levels per block, GaLore
# projects on a few singular vectors), the round-off of 2 ranks' gradient sums grows to its own size
# (measured, 8-bit AdamW: losses 2e-7, weights 2e-4, a state rounded to the next level)
OPTIM_TOL = {"adamw_offload": (RTOL, ATOL), "muon": (1e-4, 1e-2), "adamw8bit": (RTOL, 2e-3), "galore": (1e-5, 1e-3),
             "adagrad": (RTOL, ATOL), "rmsprop": (RTOL, ATOL)}
# torchao's 8-bit AdamW keeps a tensor of under 4096 entries in fp32, counted on each rank's shard under FSDP2:
# at d_model 128 every matrix's shard is quantised as its whole tensor is in one process, block for block
OPTIM_OVER = {"adamw8bit": ["model.d_model=128"]}
RL = ["data.format=prompts", "data.path=synthetic", "data.synthetic_rows=40", "data.template=none", "data.seq_len=24",
      "data.eval_prompts=2", "rl.prompts_per_step=4", "rl.group_size=2", "rl.max_new_tokens=6", "rl.kl_beta=0.1",
      "rl.updates_per_batch=2", "train.max_steps=4",
      "optim.name=sgd", "optim.lr=0.5"]  # not Adam: it would scale the round-off of near-zero gradients up to the LR
BOTH = ("ddp", "fsdp")
FP16_SCALE = 3e6
PARITY = {  # case -> (config, overrides, strategies, the parallel runs' own overrides)
    **{m: ("llm", ["train.average_last=2", *over], BOTH, []) for m, over in ADAPTERS.items()},
    "sft": ("llm", SFT, BOTH, []),
    "hybrid": ("llm", HYBRID_SFT, BOTH, []),
    "dpo": ("llm", ["data.format=preference", "data.path={pairs}", "data.seq_len=24", "data.val_fraction=0.2",
                    "adapter.method=lora"], BOTH, []),
    "compress": ("llm", ["train.teacher={teacher}", "train.kd_alpha=0.5", "train.qat=int8", "train.prune=2:4",
                         "optim.name=adafactor", "optim.lr=1e-2"], BOTH, []),
    **{f"optim-{n}": ("llm", [f"optim.name={n}", *OPTIM_OVER.get(n, [])], BOTH, []) for n in OPTIM_TOL},
    "diffusion": ("diffusion", [], ("fsdp",), []),
    "t2i": ("diffusion", TEXT, BOTH, []),
    "moe": ("llm", DEEPSEEK + ["train.grad_accum=1"], ("fsdp",), []),
    "newer": ("llm", NEWER, BOTH, []),
    # a checkpoint every step: the thresholds of step 1
    "mod": ("llm", MOE + ["train.grad_accum=1", "model.mod_capacity=0.25", "train.checkpoint_every=1",
                          "train.keep_checkpoints=6"], BOTH, []),
    "float8": ("llm", ["train.float8=true", "train.float8_keep=[]"], ("fsdp",), []),
    "rl": ("llm", RL, BOTH, []),
    "lr_find": ("llm", ["train.lr_find=true", "train.lr_find_steps=10", "optim.name=lion"], ("fsdp",), []),
    # without sync_bn each rank normalises its own half: on this config the loss of step 4 is then 3e-3
    # away, relative, so parity fails
    "resnet": ("resnet", [], ("ddp",), ["train.sync_bn=true"]),
    "vit": ("vit", [], BOTH, []),  # with layer-wise LR decay
    "vlm": ("vlm", [], BOTH, []),  # chat SFT on digit images
    # a loss scale that overflows the fp16 gradients of the first steps, which are skipped, then trains
    "fp16": ("llm", ["train.precision=fp16", f"train.loss_scale={FP16_SCALE}", "optim.eps=1e-5"], BOTH, []),
    # train.seed=1: the second block is dropped in some steps and kept in others
    "drop_path": ("resnet", ["model.drop_path_rate=0.5", "model.drop_path_mode=batch", "train.seed=1"], BOTH,
                  ["train.sync_bn=true"]),
}


@pytest.fixture(scope="module")
def parity(configs, tmp_path_factory):
    """Every case of PARITY run in one process with batch_size 8 (one after another in one process),
    and under each of its strategies on 2 processes with batch_size 4, the same global batch (one after
    another in one torchrun launch: tests/torchrun_cases.py); the FSDP2 GRPO run's step-3 checkpoint then
    resumes to step 6 (rl/resumed). Returns the folder: CASE/one, CASE/ddp, CASE/fsdp."""
    d = tmp_path_factory.mktemp("parity")
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghij") for _ in range(rng.randint(3, 6))) for _ in range(100)]
    (d / "pairs.jsonl").write_text("".join(json.dumps({"prompt": w + "=", "chosen": w.upper(), "rejected": w}) + "\n"
                                           for w in words))
    zoo.save_pretrained(zoo.build({"model": dict(LLM["model"], d_model=48)}), d / "teacher")
    fill = lambda over: [o.format(pairs=d / "pairs.jsonl", teacher=d / "teacher") for o in over]  # noqa: E731
    ones, pars = [], []
    for name, (cfg, over, strategies, par_over) in PARITY.items():
        ones.append(case(configs[cfg], d / name / "one", "train.batch_size=8", *fill(over)))
        pars += [case(configs[cfg], d / name / s, f"train.parallel={s}", *fill(over), *par_over) for s in strategies]
    pars += [copy_step(d / "rl" / "fsdp", d / "rl" / "resumed"),
             case(configs["llm"], d / "rl" / "resumed", "train.parallel=fsdp", *RL, "train.max_steps=6")]
    one, par = launch(None, d / "one-process", cases=ones, nproc=0), launch(None, d / "torchrun", cases=pars)
    assert par.wait(1500) == 0, last_stderr(d / "torchrun")[-3000:]
    assert one.wait(600) == 0, last_stderr(d / "one-process")[-3000:]
    return d


@pytest.mark.parametrize("method", list(ADAPTERS))
def test_adapters_under_two_processes_match_one(parity, configs, tmp_path, method):
    """LoRA, DoRA, prefix and prompt tuning, bottleneck adapters and QLoRA under DDP and FSDP2 (the frozen base, NF4 included, sharded with
    its adapters): the losses, the trained adapter and the final and averaged evaluations of one process
    with the same global batch; the checkpoints (DCP) hold what trains, not the base. The FSDP2 LoRA
    checkpoint of step 3 resumes in one process and ends with the same adapter."""
    import torch.distributed.checkpoint as dcp
    one = parity / method / "one"
    files = sorted(f.name for f in (one / "adapter").glob("*.safetensors"))
    last = lambda d: {k: v for r in read_rows(d) if r["step"] == 6 for k, v in r.items()}  # noqa: E731
    for s in BOTH:
        par = parity / method / s
        assert_same_losses(one, par)
        assert files and files == sorted(f.name for f in (par / "adapter").glob("*.safetensors"))
        for f in files:
            assert_close_weights(one / "adapter", par / "adapter", f)
        assert [last(par)[k] for k in ("val_loss", "avg_val_loss")] == \
            pytest.approx([last(one)[k] for k in ("val_loss", "avg_val_loss")], rel=RTOL)
        ckpt = par / "checkpoints" / "step_00000003"
        held = {k for k in dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata if k.startswith("model.")}
        trained = {"model." + k for k in load_file(str(par / "model_avg.safetensors"))}
        assert held == trained and not any(".base" in k or "embed" in k for k in held), held
    if method == "lora":
        import shutil
        fsdp, out = parity / method / "fsdp", tmp_path / "resharded"
        shutil.copytree(fsdp / "checkpoints" / "step_00000003", out / "checkpoints" / "step_00000003")
        run(configs["llm"], out, "train.batch_size=8", *PARITY[method][1], nproc=0)
        assert "written by 2 processes, resharded to 1" in (out / "log.txt").read_text()
        assert_same_losses(fsdp, out, steps=[4, 5, 6])
        assert_close_weights(fsdp / "adapter", out / "adapter", files[0])


@pytest.mark.parametrize("task", ["sft", "dpo", "hybrid"])
def test_post_training_under_two_processes_matches_one(parity, task):
    """Chat SFT (the assistant's tokens only: each rank's loss is its share of the global micro-batch's
    mean, as their numbers of targets differ), DPO with LoRA (the reference: the base with adapters
    off) and LoRA chat SFT of a recurrent + attention hybrid (HYBRID_SFT: packed conversations, each recurrent
    layer restarting at every document; FSDP2 shards its layers as any others) under DDP and FSDP2: the losses and
    the trained weights of one process with the same global batch (the hybrid's adapters on the Gated DeltaNet and
    short convolution projections too)."""
    one = parity / task / "one"
    for s in BOTH:
        par = parity / task / s
        assert_same_losses(one, par)
        if task == "sft":
            assert_close_weights(one, par)
        else:
            assert_close_weights(one / "adapter", par / "adapter", "adapter_model.safetensors")
    if task == "hybrid":
        names = load_file(str(one / "adapter" / "adapter_model.safetensors"))
        assert all(any(f"layers.{i}.mixer.{n}.lora_A" in k for k in names)
                   for i, n in ((0, "in_proj_qkv"), (1, "in_proj")))
        assert "within documents" in (one / "log.txt").read_text()


def test_distill_qat_prune_and_adafactor_under_two_processes_match_one(parity):
    """Distillation (the teacher replicated on each rank, each rank distilling its own rows), int8 QAT,
    2:4 pruning (under FSDP2 each mask sharded like its weight) and Adafactor (under FSDP2 each sharded
    parameter stepped whole, so its factored statistics are the one process's) in one run, under DDP and
    FSDP2: the losses, the masks, the sparsity and the quantized model's evaluation of one process with
    the same global batch; the weights within 1e-3: QAT's rounding to int8 is discontinuous in the weights,
    so a round-off-sized difference moves a weight across a rounding boundary, a whole quantization step
    in the forward (without QAT, each of the others is within 1e-6 of one process)."""
    one = parity / "compress" / "one"
    last = lambda d: {k: v for r in read_rows(d) if r["step"] == 6 for k, v in r.items()}  # noqa: E731
    w1 = load_file(str(one / "model.safetensors"))
    for s in BOTH:
        par = parity / "compress" / s
        log = (par / "log.txt").read_text()
        assert all(s in log for s in ("teacher: ", "qat: int8 fake quantization", "prune: 2:4 magnitude pruning"))
        assert_same_losses(one, par)
        assert_close_weights(one, par, atol=1e-3)
        w2 = load_file(str(par / "model.safetensors"))
        pruned = [k for k in w1 if ".mlp." in k or ".attn." in k]
        assert pruned and all(torch.equal(w1[k] == 0, w2[k] == 0) for k in pruned)
        assert last(par)["sparsity"] == last(one)["sparsity"] == 0.5
        for k in ("val_loss", "quant_ref_val_loss", "quant_val_loss"):
            assert last(par)[k] == pytest.approx(last(one)[k], rel=1e-4), k
        assert (par / "quantized").is_dir()


def test_lr_find_under_torchrun_matches_one_process(parity):
    """train.lr_find under FSDP2 (with Lion): each rank runs the range test on its rows of every global
    batch, the ranks agreeing on each step's loss; every rank suggests the same LR, the one one process
    suggests with the same global batch, from the same losses."""
    a, b = (json.loads((parity / "lr_find" / d / "lr_find.json").read_text()) for d in ("one", "fsdp"))
    assert b["ranks"] == [a["suggested_lr"]] * 2 and b["suggested_lr"] == a["suggested_lr"]
    assert len(a["loss"]) == len(b["loss"]) >= 3 and b["loss"] == pytest.approx(a["loss"], rel=RTOL)


@pytest.mark.parametrize("name", list(OPTIM_TOL))
def test_optimizers_under_two_processes_match_one(parity, name):
    """Every optimizer of the registry under DDP and on FSDP2's sharded parameters (Muon orthogonalises each
    whole matrix: DTensor gathers the shards for its matmuls): the losses and weights of one process with the
    same global batch, within what the optimizer's own rounding allows (OPTIM_TOL). (Muon's chained state
    through DCP: the SIGKILL case of test_unfreezing_and_resuming_under_torchrun.)"""
    one, rel, atol = parity / f"optim-{name}" / "one", *OPTIM_TOL[name]
    for s in BOTH:
        par = parity / f"optim-{name}" / s
        ca, cb = dict(curve(one)), dict(curve(par))
        assert len(ca) == 6 and all(cb[i] == pytest.approx(ca[i], rel=rel) for i in ca), (s, ca, cb)
        assert_close_weights(one, par, atol=atol)


MOD_FLIPS = 1e-3  # the losses after step 1 of a Mixture-of-Depths run: a few routing choices flipped by round-off


@pytest.mark.parametrize("family,strategy", [("diffusion", "fsdp"), ("t2i", "ddp"), ("t2i", "fsdp"), ("moe", "fsdp"), ("newer", "ddp"), ("newer", "fsdp"),
                                             ("mod", "ddp"), ("mod", "fsdp"), ("float8", "fsdp"), ("rl", "ddp"), ("rl", "fsdp"),
                                             ("resnet", "ddp"), ("vit", "ddp"), ("vit", "fsdp"), ("vlm", "ddp"),
                                             ("vlm", "fsdp")])
def test_diffusion_moe_and_mod_match_one_process(parity, family, strategy):
    """FSDP2 on the denoiser's blocks (frozen autoencoder kept whole, EMA sharded like the model), DDP and FSDP2 on
    a text-to-image FLUX.2 transformer (its caption dropout drawn for the global batch), and FSDP2 on an MoE LLM's layers, DeepSeek-V3's kind (latent attention, a shared expert, group-limited sigmoid
    routing; expert weights sharded like any other; the router load summed over the ranks for the bias
    balancing): the losses, the weights and the EMA of one process with
    the same global batch; a dense LLM of Gemma 2/3's and GPT-OSS's ideas (local and global layers, sandwich
    norms, per-head q/k norms, GeGLU, scaled embeddings, soft-capped scores, sinks) under DDP and FSDP2: the
    same; DDP and FSDP2 on a Mixture-of-Depths LLM with MoE layers: the losses and the decision thresholds
    (moved by the global batch's top-k boundary, from every rank's decision logits; tolerances below); float8 (emulated) under FSDP2:
    each rank scales its own activations, so the losses agree to float8's round-off; GRPO with a KL term
    (each rank samples its own prompts of the global batch, a generator per row): the rewards, losses and
    weights, and the FSDP2 run resumes; a ResNet with train.sync_bn under DDP normalises with the statistics
    of the global batch: the losses and weights (BatchNorm running statistics included); a ViT with layer-wise LR
    decay under DDP and FSDP2 (its blocks sharded), and a vision-language model's chat SFT on image rows (FSDP2: the
    encoder's blocks and the decoder's layers sharded): the losses and weights."""
    one, par = parity / family / "one", parity / family / strategy
    log = (par / "log.txt").read_text()
    assert f"parallel: {strategy} over 2 processes" in log
    if family == "float8":
        assert "float8: tensorwise scaling on 9 of 9 linears" in log
        ca, cb = dict(curve(one)), dict(curve(par))
        assert len(ca) == 6 and all(cb[s] == pytest.approx(ca[s], rel=1e-2) for s in ca), (ca, cb)
        return
    assert_same_losses(one, par)
    if family == "rl":
        rewards = [[r.get(k) for r in read_rows(d) if "reward_mean" in r] for d in (one, par)
                   for k in ("reward_mean", "completion_len_mean")]
        assert rewards[:2] == rewards[2:] and len(rewards[0]) == 2
        assert max(r["loss"] for r in read_rows(par) if "loss" in r) > 1e-6  # the KL term: not a zero loss
        assert_close_weights(one, par)
        if strategy == "fsdp":  # resumed from its sharded checkpoint of step 3, on to step 6
            resumed = parity / family / "resumed"
            assert "resumed from" in (resumed / "log.txt").read_text() and curve(resumed)[-1][0] == 6
            # step 4, in the middle of a batch (rl.updates_per_batch=2), trains on the rollouts each rank drew at step 3
            assert dict(curve(resumed))[4] == dict(curve(par))[4]
        return
    if family == "resnet":
        assert re.search(r"sync_bn: \d+ BatchNorm layers normalise", log)
    if family == "mod":
        # Step 1 starts from the same weights, so every rank routes its rows as one process does: the loss and the
        # thresholds it moves (toward the top-k boundary of the whole global batch, every rank's decision logits
        # gathered; a mean of the ranks' own boundaries is 2e-2 away, relative) agree to round-off. After it the
        # weights differ by round-off, which Adam's first update lr * g / (|g| + eps) raises to 1e-6 where a
        # gradient is near eps; a top-k choice (of experts, or of the tokens a block takes) whose candidates are
        # that close then falls the other way and moves one token's output, so one of a step's 256 tokens moves
        # its mean loss (7e-5 relative, measured where the kernels round differently: ATEN_CPU_CAPABILITY=default).
        # The weights are not compared: a flipped choice moves the routed block's weights far past round-off.
        assert_same_losses(one, par, steps=[1])
        assert_same_losses(one, par, rtol=MOD_FLIPS)
        first = [checkpoint_weights(d / "checkpoints" / "step_00000001")["layers.1.threshold"] for d in (one, par)]
        torch.testing.assert_close(first[1], first[0], rtol=1e-5, atol=0.0)
        assert first[0].item() != 0.0
        return
    assert_close_weights(one, par)
    if family in ("diffusion", "t2i"):
        assert_close_weights(one, par, "model_ema.safetensors")
        assert (par / "samples.png").is_file()


def test_fp16_and_whole_batch_drop_path_match_one_process(parity):
    """fp16 under DDP and FSDP2 (there the GradScaler's inf/nan check of the sharded DTensor gradients is
    all-reduced over the ranks by DTensor): the steps whose gradients overflow are skipped on every rank,
    those one process skips, with the same loss scales; the losses within 1e-5 relative (measured 1.4e-6
    DDP, 9.5e-8 FSDP2) and the weights within 1e-3 absolute (measured 1.3e-4 both): fp16 gradients carry
    a relative round-off of 2^-11, which Adam's lr * g / (|g| + eps) passes on to weights whose gradients
    are near eps (with the default eps both are 1.8e-3 away). model.drop_path_mode=batch (a ResNet with
    sync_bn) under DDP (find_unused_parameters) and FSDP2: each micro-batch's draws come from a generator
    every rank seeds alike, so the ranks drop the blocks one process drops: the losses and weights
    (measured 1.0e-7 and 6e-7)."""
    one = parity / "fp16" / "one"
    for s in BOTH:
        par = parity / "fp16" / s
        scales = [[r["loss_scale"] for r in read_rows(d) if "loss" in r] for d in (one, par)]
        assert scales[0] == scales[1] and len(scales[0]) == 6, scales
        assert scales[0][0] < FP16_SCALE and scales[0][-1] == scales[0][-2]  # overflows first, then steps applied
        ca, cb = dict(curve(one)), dict(curve(par))
        assert all(cb[i] == pytest.approx(ca[i], rel=RTOL) for i in ca) and ca[6] < ca[1], (ca, cb)
        assert_close_weights(one, par, atol=1e-3)
    one = parity / "drop_path" / "one"
    for s in BOTH:
        assert_same_losses(one, parity / "drop_path" / s)
        assert_close_weights(one, parity / "drop_path" / s)


# ------------------------------------------------------------------------------ gradient compression; ZeRO-2
HOOKS = ["train.parallel=ddp", "train.max_steps=20", "train.checkpoint_every=10", "train.eval_batches=4",
         "train.powersgd_start=5"]
ZERO2 = ["train.parallel=fsdp", "train.fsdp_reshard=false", "train.fsdp_offload=true"]


@pytest.fixture(scope="module")
def hook_runs(configs, tmp_path_factory):
    """In one torchrun launch: plain DDP and each train.grad_compression for 20 steps (PowerSGD of rank 1 from step
    6; plain DDP and PowerSGD also with seeds 1 and 2), the PowerSGD run's step-10 checkpoint resumed (powersgd-resumed); ZeRO-2 FSDP2 (its offload skipped on a
    CPU) and its step-3 checkpoint resumed (zero2-resumed). Beside it one process with batch_size 8 (one)."""
    d, cfg = tmp_path_factory.mktemp("hooks"), configs["llm"]
    one = launch(cfg, d / "one", "train.batch_size=8", nproc=0)
    steps = [case(cfg, d / h, *HOOKS, f"train.grad_compression={h}") for h in ("none", "fp16", "bf16", "powersgd")]
    steps += [case(cfg, d / f"{h}-seed{s}", *HOOKS, f"train.grad_compression={h}", f"train.seed={s}")
              for s in (1, 2) for h in ("none", "powersgd")]
    steps += [copy_step(d / "powersgd", d / "powersgd-resumed", 10),
              case(cfg, d / "powersgd-resumed", *HOOKS, "train.grad_compression=powersgd"),
              case(cfg, d / "zero2", *ZERO2), copy_step(d / "zero2", d / "zero2-resumed"),
              case(cfg, d / "zero2-resumed", *ZERO2)]
    p = launch(None, d / "torchrun", cases=steps)
    assert p.wait(900) == 0, last_stderr(d / "torchrun")[-3000:]
    assert one.wait(300) == 0, last_stderr(d / "one")[-3000:]
    return d


def test_grad_compression_hooks_against_plain_ddp(hook_runs):
    """torch's fp16 and bf16 hooks: the losses of plain DDP within 1e-3 relative over 20 steps (measured 1.3e-6
    fp16, 3.8e-5 bf16). PowerSGD: plain DDP's losses bit for bit up to its start, then its own; the final val loss
    within 2% of plain DDP's for each of 3 seeds (measured +0.8%, +0.6%, +0.6%); its compression logged once at
    start (log and metrics row of step 0); resumed from its step-10 checkpoint (each rank's error feedback and
    factors), the losses and weights of the run that went on, bit for bit."""
    d = hook_runs
    plain = dict(curve(d / "none"))
    val = lambda run: next(r["val_loss"] for r in read_rows(d / run) if "val_loss" in r)  # noqa: E731
    assert len(plain) == 20 and plain[20] < plain[1]
    for h in ("fp16", "bf16"):
        assert f"grad_compression: gradients all-reduced in {h}" in (d / h / "log.txt").read_text()
        assert_same_losses(d / "none", d / h, rtol=1e-3)
    psgd = dict(curve(d / "powersgd"))
    assert all(psgd[s] == plain[s] for s in range(1, 7)) and all(psgd[s] != plain[s] for s in range(7, 21))
    for seed in ("", "-seed1", "-seed2"):
        assert abs(val(f"powersgd{seed}") / val(f"none{seed}") - 1) < 0.02, seed
    ratio = float(re.search(r"grad_compression: powersgd rank 1 from step 6: .* \(([\d.]+)x\)",
                            (d / "powersgd" / "log.txt").read_text()).group(1))
    rows = [r for r in read_rows(d / "powersgd") if "grad_compression_ratio" in r]
    assert len(rows) == 1 and rows[0]["step"] == 0
    assert rows[0]["grad_compression_ratio"] == pytest.approx(ratio, abs=5e-3)
    assert ratio > 10
    resumed = d / "powersgd-resumed"
    assert "resumed from" in (resumed / "log.txt").read_text()
    assert curve(resumed) == curve(d / "powersgd")[10:]
    assert_bitwise(d / "powersgd", resumed)


def test_zero2_matches_one_process_and_resumes(hook_runs):
    """FSDP2 with train.fsdp_reshard=false (ZeRO-2: parameters kept whole from forward to backward, gradients and
    optimizer states sharded): the losses and weights of one process with the same global batch (1e-5); its step-3
    DCP checkpoint resumes to the weights of the run that went on, bit for bit. train.fsdp_offload is skipped on
    a CPU, said in the log (the CUDA run: tests/test_cuda.py)."""
    one, z2 = hook_runs / "one", hook_runs / "zero2"
    log = (z2 / "log.txt").read_text()
    assert "ZeRO-2: gathered parameters kept from forward to backward" in log
    assert "fsdp_offload: skipped on cpu" in log
    assert_same_losses(one, z2)
    assert_close_weights(one, z2)
    resumed = hook_runs / "zero2-resumed"
    assert "resumed from" in (resumed / "log.txt").read_text() and curve(resumed) == curve(z2)[3:]
    assert_bitwise(z2, resumed)
