"""Shared test helpers."""
import os
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"

# Two intra-op threads at most; one per worker when pytest-xdist runs the files in parallel processes
# (the README's command: -n 2), and one in the programs the tests start there, so the workers
# together use the cores without oversubscribing them.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, min(2, torch.get_num_threads())))
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"


# The device the tests run on: ZOO_TEST_DEVICE (default cpu, the suite as CI runs it). Every test that needs a
# device takes it from here: the `device` fixture, TEST_DEVICE in module constants, and CPU / CUDA where a device
# is data (a policy per device) or a test runs on the CPU by design (marked cpu_only, with the reason).
TEST_DEVICE = torch.device(os.environ.get("ZOO_TEST_DEVICE", "cpu"))
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


# The slow tier, by kind (a file, or a file's test function with all its parameters): `python -m pytest -m
# "not slow"` is the quick loop over every module; the README's command runs everything.
SLOW = {
    "torchrun launches": ["test_distributed.py", "test_distributed_cases.py", "test_configs_torchrun.py"],
    "programs run as subprocesses: every shipped config, the README's flows, a fresh install": [
        "test_configs.py", "test_readme_flows.py", "test_base_install.py", "test_eval.py::test_eval_command_prints_a_table_and_writes_json",
        "test_sft.py::test_chat_command_two_turns_through_stdin", "test_plan.py::test_cli_json",
        "test_plan.py::test_a_cuda_plan_from_any_machine_with_pasteable_settings",
        "test_precision.py::test_the_same_answer_in_every_process_beside_a_busy_neighbour",
        "test_tracking.py::test_wandb_offline_logs_metrics_resumes_the_same_run_and_touches_no_network",
        "test_copyable_blocks.py::test_bare_copy_imports_and_runs"],
    "SIGKILL and signal loops": [
        "test_reliability.py::test_sigkill_at_random_moments_then_resume_is_bitwise_identical",
        "test_reliability.py::test_sigterm_and_sigint_checkpoint_exit_75_and_resume_exactly",
        "test_reliability.py::test_a_signals_checkpoint_is_never_averaged",
        "test_recipe.py::test_recipe_draws_survive_a_sigkill_and_resume",
        "test_prepare.py::test_killed_preparation_reruns_to_the_same_shards"],
    "runs long enough to learn or to be measured": [
        "test_classify.py::test_digits_preset_reaches_95_percent", "test_classify.py::test_digits_run_learns",
        "test_classify.py::test_finetune_from_timm_weights_and_export", "test_loop.py::test_short_run_lowers_loss_and_writes_outputs",
        "test_sft.py::test_sft_lowers_the_assistant_loss_and_answers_held_out_prompts",
        "test_adapter_loop.py::test_qlora_run_on_tinyshakespeare_lowers_val_loss",
        "test_report.py::test_tiny_report_rows_come_from_measurements",
        "test_report.py::test_redesigned_rows_measure_their_claims_quantity",
        "test_report.py::test_others_share_counts_other_processes_not_the_report",
        "test_batch_finder.py::test_the_chosen_batch_fits_and_the_next_does_not",
        "test_batch_finder.py::test_precision_auto_plans_the_dtype_the_loop_runs",
        "test_plan.py::test_prediction_is_not_under_a_fresh_measurement",
        "test_plan.py::test_planned_tensors_are_those_of_the_real_step",
        "test_bench.py::test_gate_rehearses_every_eager_check_and_judges_by_its_noise",
        "test_classify.py::test_resume_is_exact_with_stochastic_depth_channels_last_and_bf16",
        "test_numerics.py::test_fp16_run_logs_overflow_steps_and_the_loss_scale"],
    "real pretrained weights (the optional packages' GGUF files: Gemma 3 270M, SmolLM2-135M)": [
        "test_gguf_runs.py", "test_gguf_arch.py::test_gemma3_270m_matches_transformers_gguf_loader",
        "test_gguf.py::test_smollm2_tokenizer_written_from_its_tokenizer_json_is_the_files"],
    "compilations (Inductor) of whole steps and decoding loops": [
        "test_loop.py::test_compile_and_accumulation_run", "test_loop.py::test_mixed_precision_runs",
        "test_llm.py::test_generate_compiled_equals_eager", "test_llm.py::test_compile_path_equals_eager",
        "test_mod.py::test_generate_compiled_equals_eager", "test_mod.py::test_compiled_training_step_equals_eager",
        "test_moe.py::test_generate_compiled_equals_eager", "test_moe.py::test_compiled_training_step_equals_eager",
        "test_doc_masks.py::test_document_masking_compiled_equals_separate_documents",
        "test_arch_adapters.py::test_adapters_step_peft_checkpointing_and_compile"],
}


def pytest_collection_modifyitems(config, items):
    slow = {key for keys in SLOW.values() for key in keys}
    for item in items:
        file = item.nodeid.split("::")[0].rsplit("/", 1)[-1]
        if file in slow or f"{file}::{item.originalname}" in slow:
            item.add_marker(pytest.mark.slow)


def pytest_configure(config):
    config.addinivalue_line("markers", "cpu_only(reason): runs on the CPU under any ZOO_TEST_DEVICE (the reason says "
                                       "why it cannot take another device)")
    if TEST_DEVICE.type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(f"ZOO_TEST_DEVICE={TEST_DEVICE}: torch sees no CUDA device on this machine")


@pytest.fixture
def device() -> torch.device:
    return TEST_DEVICE


@pytest.fixture(autouse=True)
def on_test_device(request):
    """Under ZOO_TEST_DEVICE=cuda the tensors and models a test makes without naming a device are made on the
    GPU (torch's default device), except in cpu_only tests and in modules that name every device they use
    (DEVICES_NAMED = True: torch's own CPU-side code, activation offload's pinned buffers, must stay on the CPU
    there); on the CPU nothing changes."""
    if TEST_DEVICE.type == "cpu" or request.node.get_closest_marker("cpu_only") \
            or getattr(request.module, "DEVICES_NAMED", False):
        yield
        return
    with TEST_DEVICE:
        yield


def shared_file(rel: str) -> Path:
    """A file from ../shared, or skip the test (with the reason) when it is absent."""
    p = SHARED / rel
    if not p.exists():
        pytest.skip(f"{p} is absent (../shared is not beside this checkout)")
    return p


@pytest.fixture(scope="session", autouse=True)
def zoo_cache(tmp_path_factory):
    """Caches (tokenizers, token streams, autoencoders) of the whole test session go to one
    temporary folder, never to the user's ~/.cache/zoo; subprocesses inherit it."""
    path = tmp_path_factory.mktemp("zoo_cache")
    old = os.environ.get("ZOO_CACHE")
    os.environ["ZOO_CACHE"] = str(path)
    yield path
    if old is None:
        os.environ.pop("ZOO_CACHE", None)
    else:
        os.environ["ZOO_CACHE"] = old


@pytest.fixture
def text_corpus(tmp_path) -> Path:
    """A small, always-available text corpus: a slice of the standard library's source."""
    from train.data import stdlib_files
    text = "".join(f.read_text(errors="replace") for f in stdlib_files()[:40])[:300_000]
    p = tmp_path / "corpus.txt"
    p.write_text(text)
    return p


@pytest.fixture
def one_thread():
    """One intra-op thread for the test (restored after): what the subprocess runs use, and much
    faster for tiny models on a busy machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def traced_calls(fn, *args) -> set:
    """The functions called in the graphs torch.compile traces from fn(*args) (no inductor: the
    graphs are only recorded), e.g. to check what a compiled decoding step holds."""
    graphs = []

    def record(gm, inputs):
        graphs.append(gm)
        return gm.forward
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            torch.compile(fn, backend=record)(*args)
    finally:
        torch._dynamo.reset()
    assert graphs, "nothing was traced"
    return {n.target for g in graphs for n in g.graph.nodes if n.op == "call_function"}


def aux_loss(model, aux: dict):
    """The routing losses the LM task adds to an LLM's loss, at train:'s default weights, from its return_aux stats."""
    from train.config import TrainConfig
    from train.tasks.lm import aux_losses
    return aux_losses(aux, TrainConfig(), model.config.moe)["aux_loss"]


def assert_compiled_step_equals_eager(model, ids, tol: float):
    """A torch.compile'd forward + backward of an LLM (LM loss + its auxiliary loss) equals eager:
    the loss within `tol`, the auxiliary loss within 1e-6, every parameter's gradient within `tol`."""
    import copy
    ref = copy.deepcopy(model)
    _, loss, aux = torch.compile(model)(ids, targets=ids, return_aux=True)
    aux = aux_loss(model, aux)
    (loss + aux).backward()
    _, ref_loss, ref_aux = ref(ids, targets=ids, return_aux=True)
    ref_aux = aux_loss(ref, ref_aux)
    (ref_loss + ref_aux).backward()
    assert abs(loss.item() - ref_loss.item()) <= tol
    assert abs(aux.item() - ref_aux.item()) <= 1e-6
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad - q.grad).abs().max() <= tol, name


def assert_channels_last_step_matches(model, x, y, grad_rtol: float):
    """One cross-entropy step of a ConvNet in channels-last equals the contiguous one: the loss within
    1e-5, every gradient within `grad_rtol` of its scale (at least 1)."""
    import copy
    other = copy.deepcopy(model).to(memory_format=torch.channels_last)
    la = torch.nn.functional.cross_entropy(model(x), y)
    lb = torch.nn.functional.cross_entropy(other(x.contiguous(memory_format=torch.channels_last)), y)
    la.backward()
    lb.backward()
    assert abs(la.item() - lb.item()) < 1e-5
    for (n, pa), pb in zip(model.named_parameters(), other.parameters()):
        assert (pa.grad - pb.grad).abs().max().item() <= grad_rtol * max(1.0, pa.grad.abs().max().item()), n


def wait_for(p, done, what: str, timeout=900) -> bool:
    """Poll done() until it holds (True) or subprocess p exits first (False). Moments in a run are defined by
    its own progress, never by wall time: the timeout only ends a run that hangs."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if done():
            return True
        if p.poll() is not None:
            return bool(done())
        time.sleep(0.002)
    raise TimeoutError(f"the run did not reach {what} in {timeout} s")


def wait_for_training(p, out: Path, starts_before: int) -> bool:
    """Wait until the run of subprocess p has entered the training loop (a new 'mfu:' line in
    out/log.txt, written after the metrics of a resumed run are cut back to its checkpoint); False if
    p exited first."""
    return wait_for(p, lambda: starts(out) > starts_before, "its training loop") and p.poll() is None


def wait_for_step(p, out: Path, step: int) -> bool:
    """Wait until the run of subprocess p has logged training step `step`; False if p exited first."""
    return wait_for(p, lambda: logged_step(out) >= step, f"step {step}") and p.poll() is None


def starts(out: Path) -> int:
    """How many times the run in `out` has entered the training loop (its log's 'mfu:' lines)."""
    log = out / "log.txt"
    return log.read_text().count("mfu: ") if log.exists() else 0


def logged_step(out: Path) -> int:
    """The last training step the run in `out` has logged (metrics.jsonl, every step with train.log_every=1);
    0 before the first. A line a killed writer left torn is skipped."""
    import json
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    for line in reversed(lines):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if "loss" in row:
            return row["step"]
    return 0


SLOW_FSYNC = "import os, time\n_fsync = os.fsync\ndef _slow(fd):\n    time.sleep(0.05)\n    return _fsync(fd)\nos.fsync = _slow\n"


def killed_at_checkpoint(tmp_path, step: int) -> dict:
    """The environment of a run that SIGKILLs itself just before its step-`step` checkpoint is renamed into
    place (a sitecustomize on its PYTHONPATH): the run dies mid-write, its previous checkpoint the last whole one."""
    d = tmp_path / "kill_hook"
    d.mkdir()
    (d / "sitecustomize.py").write_text(
        "import os, signal\n_replace = os.replace\n"
        "def _kill(a, b, *args, **kw):\n"
        f"    if os.path.basename(os.fspath(b)) == 'step_{step:08d}':\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "    return _replace(a, b, *args, **kw)\n"
        "os.replace = _kill\n")
    return {"PYTHONPATH": str(d)}


@pytest.fixture
def slow_fsync(tmp_path) -> dict:
    """The environment of a run whose every fsync takes 50 ms more (a sitecustomize on its PYTHONPATH): a
    checkpoint write then lasts long enough for a test to signal the process inside it, on any machine."""
    d = tmp_path / "slow_fsync"
    d.mkdir()
    (d / "sitecustomize.py").write_text(SLOW_FSYNC)
    return {"PYTHONPATH": str(d)}


@pytest.fixture(scope="session")
def photo_tiles(tmp_path_factory) -> Path:
    """A folder of 354 photo tiles (train.data.images.write_photo_tiles: a class folder per photo), written once a session."""
    from train.data.images import write_photo_tiles
    root = tmp_path_factory.mktemp("photo_tiles")
    write_photo_tiles(root)
    return root
