"""The task seam: one object per task, chosen by one rule from whatever record is at hand, and chosen once for
training from --task and --arch."""

import pytest

from torchship.errors import ConfigError
from torchship.tasks import CLASSIFICATION, DETECTION, TASKS, task_named, task_of
from torchship.train.config import TrainConfig
from torchship.train.tasks import TRAINING, training_for


@pytest.mark.parametrize(
    "record, task",
    [
        ({"arch": "resnet18", "num_classes": 10}, CLASSIFICATION),  # a classifier's checkpoint meta
        ({"task": "detection", "arch": "tiny_fcos"}, DETECTION),  # a detector's
        ({"name": "m", "outputs": [{"name": "logits"}], "task": "classification"}, CLASSIFICATION),  # a manifest
        ({"name": "m", "detection": {"k": 100}}, DETECTION),  # a detector's manifest written before it named its task
        ({"output": [{"name": n} for n in ("boxes", "scores", "labels", "count")]}, DETECTION),  # a served config
        ({"output": [{"name": "logits"}]}, CLASSIFICATION),
    ],
)
def test_one_rule_picks_the_task_from_a_meta_a_manifest_or_a_served_config(record, task):
    assert task_of(record) is task


def test_every_task_answers_the_questions_shared_code_asks():
    for task in TASKS:
        assert task.name and task.short and task.metric and task.gate_setting
        assert task_named(task.name) is task is task_named(task.short)
        assert callable(task.check_sets(False)) and task.pass_rule
    assert set(TRAINING) == {t.name for t in TASKS}


@pytest.mark.parametrize(
    "arch, flag, task",
    [
        ("resnet18", "auto", CLASSIFICATION),
        ("tiny_fcos", "auto", DETECTION),
        ("mypkg.models:make", "detect", DETECTION),
        ("tiny_fcos", "classify", CLASSIFICATION),
    ],
)
def test_training_is_chosen_once_from_task_and_arch(arch, flag, task):
    cfg = TrainConfig(arch=arch, task=flag)
    assert cfg.resolved_task() is task and training_for(cfg).task is task
    assert (cfg.epochs, cfg.batch_size, cfg.lr) == tuple(task.defaults[k] for k in ("epochs", "batch_size", "lr"))


def test_an_unknown_task_is_refused_by_name():
    with pytest.raises(ConfigError, match="--task segment: choose from auto, classify, detect"):
        task_named("segment")


def test_a_detector_refuses_the_formats_it_is_not_exported_to_and_a_classifier_takes_any():
    CLASSIFICATION.check_formats(("onnx_int8", "aoti_buckets"), "bfloat16")
    DETECTION.check_formats(("onnx", "onnx_int8", "aoti_bf16"), "float32")  # gated on mAP@50
    with pytest.raises(ConfigError, match="--formats aoti_buckets: a detector exports to"):
        DETECTION.check_formats(("onnx", "aoti_buckets"), "float32")
    with pytest.raises(ConfigError, match="--dtype float16: a detector exports in float32"):
        DETECTION.check_formats(("onnx",), "float16")
