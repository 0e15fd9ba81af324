"""Sequence-length curriculum (data.seq_len_schedule): the windows follow the schedule, in steps
or in tokens, and a run with it resumes exactly."""
import pytest
import torch

from train.config import load_run_config
from train.data import SeqLenSchedule, TextDataConfig
from train.tasks.lm import LMTask
from zoo.config import ConfigError

from tests.test_loop import TINY, check_resume_is_exact
from conftest import TEST_DEVICE


def task_for(corpus, *over):
    cfg = load_run_config(None, [f"data.path={corpus}", *over], base=TINY)
    task = LMTask(cfg, TEST_DEVICE, lambda m: None)
    task.setup()
    return cfg, task


def test_windows_follow_a_schedule_in_steps(text_corpus):
    cfg, task = task_for(text_corpus, "data.seq_len_schedule=[[3, 16], [5, 32]]")
    lengths = [task.train_batch(step, 0)[0].shape[1] for step in range(8)]
    assert lengths == [16, 16, 16, 32, 32, 64, 64, 64]


@pytest.mark.parametrize("accum, warmup", [(1, 0), (3, 2)])
def test_windows_follow_a_schedule_in_tokens(text_corpus, accum, warmup):
    """Reference: the tokens of the batches the task actually made, counted step by step."""
    over = ["data.seq_len_schedule=[[600, 8], [2000, 32]]", "data.seq_len_schedule_unit=tokens",
            "train.batch_size=4", f"train.grad_accum={accum}", f"train.batch_warmup_steps={warmup}"]
    cfg, task = task_for(text_corpus, *over)
    from train.optim import micro_batches
    seen = 0
    for step in range(40):
        expected = 8 if seen < 600 else 32 if seen < 2000 else 64
        for micro in range(micro_batches(step, accum, warmup)):
            x, y = task.train_batch(step, micro)
            assert x.shape[1] == expected, (step, seen)
            seen += y.numel()
    assert seen > 2000


def test_schedule_is_validated_in_one_line():
    for bad, word in (([[5, 16], [3, 32]], "until"), ([[5, 32], [8, 16]], "window lengths"),
                      ([[5, 64]], "< data.seq_len=64"), ([[5]], "pairs")):
        with pytest.raises(ConfigError, match="data.seq_len_schedule") as e:
            load_run_config(None, [f"data.seq_len_schedule={bad}"], base=TINY)
        assert word in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="data.seq_len_schedule_unit"):
        load_run_config(None, ["data.seq_len_schedule_unit=epochs"], base=TINY)


def test_schedule_of_the_config_alone():
    d = TextDataConfig(seq_len=64, seq_len_schedule=[[100, 16]], seq_len_schedule_unit="tokens")
    sched = SeqLenSchedule(d, batch_size=2, micro_batches=lambda s: 1)  # 32 tokens a step: 4 steps to pass 100
    assert [sched(s) for s in range(6)] == [16, 16, 16, 16, 64, 64]


def test_resume_with_the_curriculum_is_exact(tmp_path, text_corpus, one_thread):
    check_resume_is_exact(tmp_path, text_corpus, 20, **{"train.checkpoint_every": 10, "train.keep_checkpoints": 5,
                                                        "train.max_steps": 20,
                                                        "data.seq_len_schedule": "[[6,16],[14,32]]"})
